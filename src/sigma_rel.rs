//! EDM2's length of a power-function EMA: `sigma_rel` (the standard
//! deviation of its averaging profile relative to its time) and the
//! exponent `gamma` it maps to. A leaf: the run configuration validates
//! with it, the schedules and post-hoc synthesis compute with it.

/// EDM2 `exp_to_std`: `sigma_rel = sqrt((gamma + 1) / ((gamma + 2)^2 (gamma + 3)))`.
pub fn gamma_to_sigma_rel(gamma: f64) -> f64 {
    ((gamma + 1.0) / ((gamma + 2.0).powi(2) * (gamma + 3.0))).sqrt()
}

/// The largest `sigma_rel` a power EMA can have: `gamma_to_sigma_rel` peaks
/// at `gamma = (sqrt(5) - 3) / 2`.
pub const MAX_SIGMA_REL: f64 = 0.300_283_106_000_686;

/// EDM2 `std_to_exp`: the largest real root of
/// `gamma^3 + 7 gamma^2 + (16 - s^-2) gamma + (12 - s^-2) = 0` (paper eq. 127,
/// rearranged), or `None` when `sigma_rel` is out of range.
pub fn sigma_rel_to_gamma(sigma_rel: f64) -> Option<f64> {
    if !(sigma_rel.is_finite() && sigma_rel > 0.0 && sigma_rel <= MAX_SIGMA_REL) {
        return None;
    }
    let t = sigma_rel.powi(-2);
    let p = |g: f64| ((g + 7.0) * g + (16.0 - t)) * g + (12.0 - t);
    let dp = |g: f64| (3.0 * g + 14.0) * g + (16.0 - t);
    // Newton from the right of the largest root: the cubic is increasing and
    // convex there, so the iterates fall monotonically onto that root.
    let mut g = 2.0 / sigma_rel + 10.0;
    for _ in 0..200 {
        let step = p(g) / dp(g);
        if !step.is_finite() {
            break;
        }
        g -= step;
        if step.abs() <= 1e-15 * g.abs().max(1.0) {
            break;
        }
    }
    (g.is_finite() && g > -1.0).then_some(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Largest real roots of EDM2's cubic, computed with `np.roots`.
    #[test]
    fn sigma_rel_matches_edm2_std_to_exp() {
        let cases = [
            (0.01, 96.994_897_823_709_86),
            (0.05, 16.972_198_602_303_447),
            (0.1, 6.937_203_937_601_809),
            (0.15, 3.557_868_774_899_464_6),
            (0.2, 1.826_213_779_895_840_4),
            (0.25, 0.719_823_958_000_71),
            (0.28, 0.169_343_993_769_498_66),
        ];
        for (sigma, gamma) in cases {
            let got = sigma_rel_to_gamma(sigma).unwrap();
            assert!(
                (got - gamma).abs() < 1e-9,
                "sigma {sigma}: {got} vs {gamma}"
            );
            assert!((gamma_to_sigma_rel(got) - sigma).abs() < 1e-12);
        }
        assert!(sigma_rel_to_gamma(0.31).is_none());
        assert!(sigma_rel_to_gamma(0.0).is_none());
        assert!(sigma_rel_to_gamma(f64::NAN).is_none());
        let peak = gamma_to_sigma_rel((5f64.sqrt() - 3.0) / 2.0);
        assert!((peak - MAX_SIGMA_REL).abs() < 1e-12);
    }
}
