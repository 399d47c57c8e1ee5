//! Post-hoc EMA (EDM2, Karras et al. 2024, section 3.2 and appendix C.3):
//! an EMA profile that was never tracked, synthesised as a linear
//! combination of stored snapshots of `power` profiles.
//!
//! A power EMA with exponent `gamma` stored at time `t` (`step + 1`) is the
//! average of the weights under the averaging profile
//! `p(tau) = (gamma + 1) tau^gamma / t^(gamma + 1)` on `[0, t]` (paper
//! eq. 126). The combination `sum_i x_i p_i` that is nearest the target
//! profile in L2 solves `A x = b` with the closed-form inner products
//! `A_ij = <p_i, p_j>`, `b_i = <p_i, p_target>` (`p_dot_p`, eq. 128);
//! EDM2's `solve_posthoc_coefficients` then scales `x` to sum to 1, so a
//! constant weight stays that constant whatever the fit. The target time
//! must be one of the sources' times (`reconstruct_phema.py` refuses any
//! other): past the newest source, no combination of the stored profiles
//! can put weight there, and the fit degenerates.

use tch::{Kind, Tensor};

/// One stored EMA that takes part: its time (`step + 1`) and exponent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Source {
    pub t: f64,
    pub gamma: f64,
}

/// The synthesis of one target profile.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// The weight of each source, summing to 1 (EDM2's normalised `X`).
    pub weights: Vec<f64>,
    /// `|sum_i x_i p_i - p_target| / |p_target|` (L2 over `[0, t]`), from
    /// the closed-form inner products: how far the synthesised averaging
    /// profile is from the one asked for. Near 0 when the sources are dense
    /// enough for that length; large when they are too sparse.
    pub residual: f64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PosthocError {
    #[error("no source snapshot to combine")]
    NoSources,
    #[error("solving for the post-hoc weights failed: {0}")]
    Solve(String),
    #[error(
        "the post-hoc weights sum to {0:e}: the snapshots cannot express this length at this step"
    )]
    Degenerate(f64),
}

/// EDM2 `p_dot_p` (paper eq. 128): the inner product of two power-function
/// averaging profiles ending at `t_a` and `t_b`.
pub fn p_dot_p(a: Source, b: Source) -> f64 {
    let t_ratio = a.t / b.t;
    let t_exp = if a.t < b.t { b.gamma } else { -a.gamma };
    let t_max = a.t.max(b.t);
    let num = (a.gamma + 1.0) * (b.gamma + 1.0) * t_ratio.powf(t_exp);
    let den = (a.gamma + b.gamma + 1.0) * t_max;
    num / den
}

/// EDM2 `solve_posthoc_coefficients` for several target exponents at one
/// time `target_t`: `A X = B` solved by LU with partial pivoting (LAPACK
/// `gesv`, as `np.linalg.solve`), each column of `X` scaled to sum to 1,
/// and each fit's residual. Sources must be distinct (same `t` and `gamma`
/// twice makes `A` singular); a numerically singular `A` falls back to the
/// minimum-norm least-squares solution before the scaling.
pub fn solve(
    sources: &[Source],
    target_t: f64,
    target_gammas: &[f64],
) -> Result<Vec<Fit>, PosthocError> {
    solve_scaled(sources, target_t, target_gammas, true)
}

/// ema-pytorch `PostHocEMA.synthesize_ema_model`'s weights: its
/// `solve_weights` is EDM2's `A X = B` with the exponents held in float32
/// (`torch.tensor` of Python floats, widened to float64 for the solve) and
/// `X` used as solved, not scaled to sum to 1.
pub fn solve_ema_pytorch(
    sources: &[Source],
    target_t: f64,
    target_gammas: &[f64],
) -> Result<Vec<Fit>, PosthocError> {
    let f32_gamma = |g: f64| f64::from(g as f32);
    let sources: Vec<Source> = sources
        .iter()
        .map(|s| Source {
            t: s.t,
            gamma: f32_gamma(s.gamma),
        })
        .collect();
    let targets: Vec<f64> = target_gammas.iter().map(|&g| f32_gamma(g)).collect();
    solve_scaled(&sources, target_t, &targets, false)
}

fn solve_scaled(
    sources: &[Source],
    target_t: f64,
    target_gammas: &[f64],
    scale: bool,
) -> Result<Vec<Fit>, PosthocError> {
    let n = sources.len();
    if n == 0 {
        return Err(PosthocError::NoSources);
    }
    let m = target_gammas.len();
    let targets: Vec<Source> = target_gammas
        .iter()
        .map(|&gamma| Source { t: target_t, gamma })
        .collect();
    let mut a = Vec::with_capacity(n * n);
    for &si in sources {
        for &sj in sources {
            a.push(p_dot_p(si, sj));
        }
    }
    let mut b = Vec::with_capacity(n * m);
    for &si in sources {
        for &tj in &targets {
            b.push(p_dot_p(si, tj));
        }
    }
    // Inputs LAPACK would choke on (and print about) are refused before it.
    if !a.iter().chain(&b).all(|v| v.is_finite()) {
        return Err(PosthocError::Solve(
            "the profiles' inner products are not finite".into(),
        ));
    }
    let x = lapack_solve(&a, &b, n, m)?;
    let mut fits = Vec::with_capacity(m);
    for (j, &target) in targets.iter().enumerate() {
        let raw: Vec<f64> = (0..n).map(|i| x[i * m + j]).collect();
        let sum: f64 = raw.iter().sum();
        if !(sum.is_finite() && sum.abs() > 1e-300) {
            return Err(PosthocError::Degenerate(sum));
        }
        let weights: Vec<f64> = if scale {
            raw.iter().map(|v| v / sum).collect()
        } else {
            raw
        };
        let b_j: Vec<f64> = (0..n).map(|i| b[i * m + j]).collect();
        fits.push(Fit {
            residual: residual(&a, &b_j, p_dot_p(target, target), &weights),
            weights,
        });
    }
    Ok(fits)
}

/// `|sum_i w_i p_i - p_T| / |p_T|` expanded as
/// `sqrt(w'Aw - 2 w'b + <p_T, p_T>) / sqrt(<p_T, p_T>)`.
fn residual(a: &[f64], b: &[f64], target_sq: f64, w: &[f64]) -> f64 {
    let n = w.len();
    let mut quad = 0.0;
    for i in 0..n {
        let row: f64 = (0..n).map(|j| a[i * n + j] * w[j]).sum();
        quad += w[i] * row;
    }
    let cross: f64 = w.iter().zip(b).map(|(wi, bi)| wi * bi).sum();
    let sq = (quad - 2.0 * cross + target_sq).max(0.0);
    (sq / target_sq).sqrt()
}

/// `A X = B` (`A` n×n, `B` n×m, row-major) in float64 on libtorch's LAPACK.
fn lapack_solve(a: &[f64], b: &[f64], n: usize, m: usize) -> Result<Vec<f64>, PosthocError> {
    let err = |e: tch::TchError| PosthocError::Solve(e.to_string());
    let (n, m) = (n as i64, m as i64);
    let at = Tensor::from_slice(a).f_reshape([n, n]).map_err(err)?;
    let bt = Tensor::from_slice(b).f_reshape([n, m]).map_err(err)?;
    let solved = Tensor::f_linalg_solve(&at, &bt, true)
        .ok()
        .filter(all_finite);
    let x = match solved {
        Some(x) => x,
        None => {
            let (x, _, _, _) = at.f_linalg_lstsq(&bt, None, "gelsd").map_err(err)?;
            x
        }
    };
    let x = x
        .f_to_kind(Kind::Double)
        .and_then(|x| x.f_contiguous())
        .and_then(|x| x.f_reshape([n * m]))
        .map_err(err)?;
    Vec::<f64>::try_from(&x).map_err(err)
}

fn all_finite(x: &Tensor) -> bool {
    x.f_isfinite()
        .and_then(|f| f.f_all())
        .ok()
        .and_then(|t| bool::try_from(&t).ok())
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sigma_rel::sigma_rel_to_gamma;

    fn s(t: f64, gamma: f64) -> Source {
        Source { t, gamma }
    }

    /// `<p_a, p_b>` by numerical quadrature of the profiles themselves
    /// (eq. 126), independent of the closed form.
    fn quad_dot(a: Source, b: Source) -> f64 {
        let p = |x: Source, tau: f64| {
            if tau > x.t {
                0.0
            } else {
                (x.gamma + 1.0) * tau.powf(x.gamma) / x.t.powf(x.gamma + 1.0)
            }
        };
        // Midpoint rule on a fine grid of [0, min t] (the product is 0
        // past the shorter profile's end, and its kink there would cost
        // the rule its accuracy).
        let n = 400_000;
        let top = a.t.min(b.t);
        let h = top / n as f64;
        (0..n)
            .map(|k| {
                let tau = (k as f64 + 0.5) * h;
                p(a, tau) * p(b, tau)
            })
            .sum::<f64>()
            * h
    }

    #[test]
    fn p_dot_p_is_the_inner_product_of_the_profiles() {
        for (a, b) in [
            (s(100.0, 6.94), s(100.0, 6.94)),
            (s(50.0, 3.0), s(120.0, 10.0)),
            (s(120.0, 10.0), s(50.0, 3.0)),
            (s(11.0, 16.97), s(61.0, 6.94)),
        ] {
            let closed = p_dot_p(a, b);
            let numeric = quad_dot(a, b);
            assert!(
                (closed - numeric).abs() <= 1e-6 * closed,
                "{a:?} {b:?}: {closed} vs {numeric}"
            );
        }
    }

    #[test]
    fn weights_sum_to_one_and_a_source_is_recovered() {
        let g10 = sigma_rel_to_gamma(0.10).unwrap();
        let g05 = sigma_rel_to_gamma(0.05).unwrap();
        let sources = [s(51.0, g10), s(101.0, g10), s(101.0, g05)];
        let fits = solve(&sources, 101.0, &[g10, g05]).unwrap();
        for fit in &fits {
            assert!((fit.weights.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        }
        assert!((fits[0].weights[1] - 1.0).abs() < 1e-9, "{fits:?}");
        assert!(fits[0].residual < 1e-6, "{fits:?}");
        assert!((fits[1].weights[2] - 1.0).abs() < 1e-9, "{fits:?}");
    }

    #[test]
    fn the_residual_is_the_distance_of_the_profiles() {
        // One source: the synthesis is that source, so the residual is
        // |p_s - p_T| / |p_T|, checked by quadrature.
        let src = s(61.0, 6.94);
        let target = s(61.0, 16.97);
        let fit = &solve(&[src], 61.0, &[target.gamma]).unwrap()[0];
        assert_eq!(fit.weights, vec![1.0]);
        let d2 = quad_dot(src, src) - 2.0 * quad_dot(src, target) + quad_dot(target, target);
        let want = (d2 / quad_dot(target, target)).sqrt();
        assert!(
            (fit.residual - want).abs() < 1e-4,
            "{} {want}",
            fit.residual
        );
        // Denser sources fit better.
        let g05 = sigma_rel_to_gamma(0.05).unwrap();
        let g10 = sigma_rel_to_gamma(0.10).unwrap();
        let g07 = sigma_rel_to_gamma(0.07).unwrap();
        let every = |k: usize| -> Vec<Source> {
            (0..=60)
                .step_by(k)
                .flat_map(|st| [s(st as f64 + 1.0, g05), s(st as f64 + 1.0, g10)])
                .collect()
        };
        let sparse = solve(&every(30), 61.0, &[g07]).unwrap()[0].residual;
        let dense = solve(&every(5), 61.0, &[g07]).unwrap()[0].residual;
        assert!(dense < sparse, "{dense} {sparse}");
    }

    /// Values printed by ema-pytorch 0.8.3's `solve_weights` for
    /// checkpoints at `t` = 20, 40, 60, 80 of `sigma_rel` 0.10 and 0.28
    /// (`sigma_rel_to_gamma`), target `sigma_rel` 0.15 at `t` = 50; they
    /// sum to 1.0008, not 1. The checkpoints after the target take part.
    #[test]
    fn ema_pytorch_weights_match_solve_weights() {
        let (g10, g28, g15) = (
            6.937_203_937_601_809,
            0.169_343_993_769_498_66,
            3.557_868_774_899_464_6,
        );
        let sources: Vec<Source> = [20.0, 40.0, 60.0, 80.0]
            .into_iter()
            .flat_map(|t| [s(t, g10), s(t, g28)])
            .collect();
        let want = [
            0.009_004_218_236_690_889,
            -0.117_104_222_850_555_29,
            0.223_406_594_245_151_58,
            -1.934_041_595_809_164_8,
            -0.732_420_970_838_821_1,
            3.551_968_826_813_691_7,
            0.0,
            0.0,
        ];
        let got = &solve_ema_pytorch(&sources, 50.0, &[g15]).unwrap()[0].weights;
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-12, "{got:?}");
        }
        // EDM2's solve (float64 exponents, scaled) differs.
        let edm2 = &solve(&sources, 50.0, &[g15]).unwrap()[0].weights;
        assert!((edm2[5] - want[5]).abs() > 1e-4, "{edm2:?}");
    }

    #[test]
    fn no_sources_is_an_error() {
        assert_eq!(solve(&[], 10.0, &[6.94]), Err(PosthocError::NoSources));
    }
}
