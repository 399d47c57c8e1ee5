//! Post-hoc EMA (EDM2, Karras et al. 2024, section 3.2 and appendix C):
//! an EMA profile that was never tracked, synthesised as a linear
//! combination of stored snapshots of `power` profiles.
//!
//! Each stored (snapshot, power profile) pair is an EMA of the weights with
//! a known averaging profile `p(t) ∝ t^gamma` up to its step. The weights
//! `x` of the combination minimise the L2 distance between the combined
//! profile and the target one; with the closed-form inner products of
//! power profiles (`p_dot_p`) that is the least-squares problem `A x = b`
//! (EDM2 `solve_posthoc_coefficients`).

use tch::{Device, Kind, Tensor};

use super::SnapshotError;
use crate::engine::schedule::sigma_rel_to_gamma;

/// One stored EMA that takes part: its time (`step + 1`) and exponent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Source {
    pub t: f64,
    pub gamma: f64,
}

/// EDM2 `p_dot_p`: the inner product of two normalised power-function
/// averaging profiles ending at `t_a` and `t_b`.
pub fn p_dot_p(a: Source, b: Source) -> f64 {
    let t_ratio = a.t / b.t;
    let t_exp = if a.t < b.t { b.gamma } else { -a.gamma };
    let t_max = a.t.max(b.t);
    let num = (a.gamma + 1.0) * (b.gamma + 1.0) * t_ratio.powf(t_exp);
    let den = (a.gamma + b.gamma + 1.0) * t_max;
    num / den
}

/// EDM2 `solve_posthoc_coefficients` for one target: the weight of each
/// source in the combination (least squares, SVD-based like `np.linalg.lstsq`).
pub fn coefficients(
    sources: &[Source],
    target_t: f64,
    target_sigma_rel: f64,
) -> Result<Vec<f64>, SnapshotError> {
    let gamma = sigma_rel_to_gamma(target_sigma_rel).ok_or_else(|| {
        SnapshotError::Invalid(format!("sigma_rel {target_sigma_rel} is out of range"))
    })?;
    let target = Source { t: target_t, gamma };
    let n = sources.len();
    if n == 0 {
        return Err(SnapshotError::Invalid(
            "no complete snapshot of a power profile at or before the step".into(),
        ));
    }
    let mut a = Vec::with_capacity(n * n);
    for &si in sources {
        for &sj in sources {
            a.push(p_dot_p(si, sj));
        }
    }
    let b: Vec<f64> = sources.iter().map(|&s| p_dot_p(s, target)).collect();
    let torch_err =
        |e: tch::TchError| SnapshotError::Invalid(format!("solving the post-hoc weights: {e}"));
    let a = Tensor::from_slice(&a)
        .f_reshape([n as i64, n as i64])
        .map_err(torch_err)?;
    let b = Tensor::from_slice(&b)
        .f_reshape([n as i64, 1])
        .map_err(torch_err)?;
    let (x, _, _, _) = a.f_linalg_lstsq(&b, None, "gelsd").map_err(torch_err)?;
    let x = x.f_reshape([n as i64]).map_err(torch_err)?;
    Vec::<f64>::try_from(&x).map_err(torch_err)
}

/// `sum_i w_i * flat_i` accumulated in float64, returned as float32.
pub struct Combination {
    acc: Option<Tensor>,
}

impl Combination {
    pub fn new() -> Self {
        Combination { acc: None }
    }

    pub fn add(&mut self, flat: &Tensor, weight: f64) -> Result<(), SnapshotError> {
        let err = |e: tch::TchError| SnapshotError::Invalid(format!("combining snapshots: {e}"));
        let term = flat
            .f_to_kind(Kind::Double)
            .and_then(|t| t.f_mul_scalar(weight))
            .map_err(err)?;
        match &mut self.acc {
            None => self.acc = Some(term),
            Some(acc) => {
                if acc.size() != term.size() {
                    return Err(SnapshotError::Invalid(
                        "the snapshots combined hold different layouts for a rank".into(),
                    ));
                }
                let _ = acc.f_add_(&term).map_err(err)?;
            }
        }
        Ok(())
    }

    pub fn finish(self, kind: Kind) -> Result<Tensor, SnapshotError> {
        let acc = self
            .acc
            .ok_or_else(|| SnapshotError::Invalid("nothing to combine".into()))?;
        acc.f_to_kind(kind)
            .and_then(|t| t.f_to_device(Device::Cpu))
            .map_err(|e| SnapshotError::Invalid(e.to_string()))
    }
}

impl Default for Combination {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values from EDM2's `p_dot_p` (numpy) for the same arguments.
    #[test]
    fn p_dot_p_matches_edm2() {
        let s = |t, gamma| Source { t, gamma };
        // Same profile, same time: (g+1)^2 / ((2g+1) t).
        let g = 6.94;
        assert!(
            (p_dot_p(s(100.0, g), s(100.0, g)) - (g + 1.0).powi(2) / ((2.0 * g + 1.0) * 100.0))
                .abs()
                < 1e-15
        );
        // Symmetric.
        let (a, b) = (s(50.0, 3.0), s(120.0, 10.0));
        assert!((p_dot_p(a, b) - p_dot_p(b, a)).abs() < 1e-15);
    }

    #[test]
    fn a_stored_profile_is_recovered_exactly() {
        // Asking for a profile that is one of the sources gives weight 1 on
        // it and 0 elsewhere.
        let sigma = 0.1;
        let gamma = sigma_rel_to_gamma(sigma).unwrap();
        let other = sigma_rel_to_gamma(0.05).unwrap();
        let sources = [
            Source { t: 51.0, gamma },
            Source { t: 101.0, gamma },
            Source {
                t: 101.0,
                gamma: other,
            },
        ];
        let x = coefficients(&sources, 101.0, sigma).unwrap();
        assert!((x[1] - 1.0).abs() < 1e-6, "{x:?}");
        assert!(x[0].abs() < 1e-6 && x[2].abs() < 1e-6, "{x:?}");
    }
}
