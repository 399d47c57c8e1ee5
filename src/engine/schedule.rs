//! Decay schedules: pure functions of (profile, step, previous applied step).
//!
//! `step` is the trainer's 0-based count of previous update calls (the value
//! ema-pytorch's `EMA.step` holds when `update()` is entered). Every function
//! here returns what one applied push does to one profile; the engine applies
//! it to the whole shard with one kernel call.

use crate::run::ProfileSpec;

/// What an applied push does to one profile's EMA.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action {
    /// `ema.copy_(w)`.
    Copy,
    /// `ema.lerp_(w, weight)`, i.e. `ema = ema + weight * (w - ema)`, with
    /// `weight = 1 - beta`.
    Lerp { weight: f64 },
    /// Leave the EMA as it is (a frozen ema-pytorch EMA with `beta == 1`).
    Hold,
    /// A `bema` profile's update of its served weights and hidden buffers.
    Bema(BemaStep),
}

/// What a push does to a `bema` profile (TRL `BEMACallback`), whose served
/// buffer holds TRL's `running_model` and whose hidden buffers hold `w0`
/// and the plain EMA.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BemaStep {
    /// The rank's first push: `w0 = ema = served = w` (TRL clones all three
    /// from the weights at `on_train_begin`).
    Start,
    /// `step == update_after`: `w0 = ema = w`; the served weights stay.
    Restart,
    /// `ema = (1 - beta) * ema + beta * w`, then
    /// `served = ema + alpha * (w - w0)` (TRL `_update_bema_weights`).
    Update { beta: f64, alpha: f64 },
}

/// The action and the profile's SWA count after it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    pub action: Action,
    /// Number of pushes averaged so far (only `swa` uses it).
    pub swa_n: u64,
}

/// Decides what the push at `step` does to `profile`, given the rank's
/// previous applied step (`None`: this is the first applied push) and the
/// profile's SWA count.
pub fn decide(profile: &ProfileSpec, step: u64, prev: Option<u64>, swa_n: u64) -> Decision {
    let keep = |action| Decision { action, swa_n };
    // Every lerp here is by `1 - beta`.
    let lerp = |beta: f64| keep(Action::Lerp { weight: 1.0 - beta });
    let Some(prev) = prev else {
        return first_decision(profile, step);
    };
    debug_assert!(step > prev);
    let delta = (step - prev) as f64;
    let t = (step + 1) as f64;
    match profile {
        ProfileSpec::Constant { beta, .. } => lerp(*beta),
        ProfileSpec::Warmup {
            beta,
            update_after_step,
            inv_gamma,
            power,
            min_value,
            ..
        } => keep(warmup_action(
            step,
            *update_after_step,
            *inv_gamma,
            *power,
            *min_value,
            *beta,
        )),
        ProfileSpec::Power { gamma, .. } => lerp(power_beta(
            gamma.expect("validated power profile has gamma"),
            t,
            delta,
        )),
        ProfileSpec::Karras {
            gamma,
            update_every,
            frozen,
            ..
        } => {
            let gamma = gamma.expect("validated karras profile has gamma");
            keep(karras_action(gamma, *update_every, *frozen, step))
        }
        ProfileSpec::HalfLife {
            steps,
            rampup_ratio,
            ..
        } => lerp(half_life_beta(*steps, *rampup_ratio, t, delta)),
        ProfileSpec::Diffusers {
            decay,
            min_decay,
            update_after_step,
            use_ema_warmup,
            inv_gamma,
            power,
            ..
        } => keep(step_decay_action(diffusers_decay(
            step,
            *decay,
            *min_decay,
            *update_after_step,
            use_ema_warmup.then_some((*inv_gamma, *power)),
        ))),
        ProfileSpec::Timm {
            decay,
            min_decay,
            update_after_step,
            use_warmup,
            warmup_gamma,
            warmup_power,
            ..
        } => keep(step_decay_action(timm_decay(
            step,
            *decay,
            *min_decay,
            *update_after_step,
            use_warmup.then_some((*warmup_gamma, *warmup_power)),
        ))),
        ProfileSpec::Swa { start_step, .. } => swa_decision(*start_step, step, swa_n),
        ProfileSpec::Bema {
            update_freq,
            ema_power,
            bias_power,
            lag,
            update_after,
            multiplier,
            min_ema_multiplier,
            ..
        } => keep(bema_action(
            step,
            *update_freq,
            *update_after,
            BemaPowers {
                lag: *lag,
                multiplier: *multiplier,
                ema_power: *ema_power,
                bias_power: *bias_power,
                min_ema_multiplier: *min_ema_multiplier,
            },
        )),
    }
}

/// The reals of a `bema` profile's two schedules.
#[derive(Debug, Clone, Copy)]
pub struct BemaPowers {
    pub lag: f64,
    pub multiplier: f64,
    pub ema_power: f64,
    pub bias_power: f64,
    pub min_ema_multiplier: f64,
}

impl BemaPowers {
    /// TRL `_ema_beta`: `max((lag + multiplier * step)^(-ema_power),
    /// min_ema_multiplier)`, `step` being the trainer's `global_step` (not
    /// counted from `update_after`).
    pub fn beta(&self, step: u64) -> f64 {
        (self.lag + self.multiplier * step as f64)
            .powf(-self.ema_power)
            .max(self.min_ema_multiplier)
    }

    /// TRL `_bema_alpha`: `(lag + multiplier * step)^(-bias_power)`.
    pub fn alpha(&self, step: u64) -> f64 {
        (self.lag + self.multiplier * step as f64).powf(-self.bias_power)
    }
}

/// TRL `BEMACallback.on_step_end` at `global_step == step` (after the
/// rank's first push): nothing before `update_after`, a restart of `w0` and
/// the EMA at it, an update every `update_freq` steps after it.
fn bema_action(step: u64, update_freq: u64, update_after: u64, powers: BemaPowers) -> Action {
    if step < update_after {
        Action::Hold
    } else if step == update_after {
        Action::Bema(BemaStep::Restart)
    } else if (step - update_after) % update_freq == 0 {
        Action::Bema(BemaStep::Update {
            beta: powers.beta(step),
            alpha: powers.alpha(step),
        })
    } else {
        Action::Hold
    }
}

/// The first applied push initialises every profile by copy (an SWA
/// profile counts it when its window has begun).
fn first_decision(profile: &ProfileSpec, step: u64) -> Decision {
    let swa_n = match profile {
        ProfileSpec::Swa { start_step, .. } if step >= *start_step => 1,
        _ => 0,
    };
    let action = match profile {
        ProfileSpec::Bema { .. } => Action::Bema(BemaStep::Start),
        _ => Action::Copy,
    };
    Decision { action, swa_n }
}

/// ema-pytorch `EMA.update`: copy while step <= update_after_step, hold
/// a frozen EMA, else lerp by the warmup decay.
fn warmup_action(
    step: u64,
    update_after_step: u64,
    inv_gamma: f64,
    power: f64,
    min_value: f64,
    beta: f64,
) -> Action {
    if step <= update_after_step {
        Action::Copy
    } else if beta == 1.0 {
        // ema-pytorch `is_frozen`.
        Action::Hold
    } else {
        let decay = warmup_decay(step, update_after_step, inv_gamma, power, min_value, beta);
        Action::Lerp {
            weight: 1.0 - decay,
        }
    }
}

/// ema-pytorch `KarrasEMA.update` returns on steps off its `update_every`
/// grid; a frozen one keeps its first copy.
fn karras_action(gamma: f64, update_every: u64, frozen: bool, step: u64) -> Action {
    if frozen || step % update_every != 0 {
        Action::Hold
    } else {
        Action::Lerp {
            weight: 1.0 - karras_beta(gamma, step),
        }
    }
}

/// SWA: the profile follows the weights before its averaging window, then
/// averages every push equally.
fn swa_decision(start_step: u64, step: u64, swa_n: u64) -> Decision {
    if step < start_step {
        // Before the averaging window the profile follows the weights.
        Decision {
            action: Action::Copy,
            swa_n: 0,
        }
    } else if swa_n == 0 {
        Decision {
            action: Action::Copy,
            swa_n: 1,
        }
    } else {
        // AveragedModel's default: p + (w - p) / (n + 1).
        Decision {
            action: Action::Lerp {
                weight: 1.0 / (swa_n as f64 + 1.0),
            },
            swa_n: swa_n + 1,
        }
    }
}

/// ema-pytorch `EMA.get_current_decay`, evaluated in float32 as torch does
/// there (`self.step` is an int tensor, the clamp promotes it to float32,
/// and `.item()` returns the float32 value):
/// `e = step - update_after_step`;
/// `decay = clamp(1 - (1 + e / inv_gamma)^(-power), min_value, beta)`, 0 when `e <= 0`.
pub fn warmup_decay(
    step: u64,
    update_after_step: u64,
    inv_gamma: f64,
    power: f64,
    min_value: f64,
    beta: f64,
) -> f64 {
    let epoch = step as i128 - update_after_step as i128;
    if epoch <= 0 {
        return 0.0;
    }
    let epoch = epoch as f32;
    let value = 1.0f32 - (1.0f32 + epoch / inv_gamma as f32).powf(-(power as f32));
    // torch.clamp(min, max) = min(max(x, min), max)
    f64::from(value.max(min_value as f32).min(beta as f32))
}

/// A decay of 0 copies exactly (diffusers and timm before
/// `update_after_step`); 1 leaves the EMA as it is.
fn step_decay_action(decay: f64) -> Action {
    if decay <= 0.0 {
        Action::Copy
    } else if decay >= 1.0 {
        Action::Hold
    } else {
        Action::Lerp {
            weight: 1.0 - decay,
        }
    }
}

/// The warmup both diffusers and timm share (@crowsonkb's):
/// `1 - (1 + e / inv_gamma)^(-power)`, in float64 as they compute it.
fn crowson_warmup(e: f64, inv_gamma: f64, power: f64) -> f64 {
    1.0 - (1.0 + e / inv_gamma).powf(-power)
}

/// diffusers `EMAModel.get_decay(optimization_step)`:
/// `e = max(0, step - update_after_step - 1)`, 0 when `e <= 0`; else the
/// warmup (`warmup = (inv_gamma, power)`) or `(1 + e) / (10 + e)`, then
/// `max(min(value, decay), min_decay)`.
pub fn diffusers_decay(
    step: u64,
    decay: f64,
    min_decay: f64,
    update_after_step: u64,
    warmup: Option<(f64, f64)>,
) -> f64 {
    let e = step.saturating_sub(update_after_step.saturating_add(1)) as f64;
    if e <= 0.0 {
        return 0.0;
    }
    let value = match warmup {
        Some((inv_gamma, power)) => crowson_warmup(e, inv_gamma, power),
        None => (1.0 + e) / (10.0 + e),
    };
    value.min(decay).max(min_decay)
}

/// timm `ModelEmaV3.get_decay(step)`: 0 while
/// `step - update_after_step - 1 <= 0`; then with warmup
/// `max(min(warmup, decay), min_decay)`, without it `decay` as is (timm
/// applies `min_decay` only to the warmup).
pub fn timm_decay(
    step: u64,
    decay: f64,
    min_decay: f64,
    update_after_step: u64,
    warmup: Option<(f64, f64)>,
) -> f64 {
    let e = step.saturating_sub(update_after_step.saturating_add(1)) as f64;
    if e <= 0.0 {
        return 0.0;
    }
    match warmup {
        Some((gamma, power)) => crowson_warmup(e, gamma, power).min(decay).max(min_decay),
        None => decay,
    }
}

/// EDM2 power-function EMA (`phema.power_function_beta`, paper eq. 3 with
/// the interval-correct exponent): `beta = (1 - delta / t)^(gamma + 1)`.
pub fn power_beta(gamma: f64, t: f64, delta: f64) -> f64 {
    (1.0 - delta / t).powf(gamma + 1.0)
}

/// ema-pytorch `KarrasEMA.beta` for the update entered at `step`:
/// `(1 - 1 / (step + 2))^(gamma + 1)`. Its `step` buffer is incremented
/// before the decay is read, and the decay adds one more (EDM2's
/// `1 - 1/t` at `t = step + 1` is `1 - 1/(step + 1)`); whatever the
/// interval since the previous update, as it ignores `update_every`.
pub fn karras_beta(gamma: f64, step: u64) -> f64 {
    (1.0 - 1.0 / (step as f64 + 2.0)).powf(1.0 + gamma)
}

/// EDM2 traditional EMA (`phema.TraditionalEMA`): half-life `h` steps,
/// ramped up as `min(h, t * rampup_ratio)`; `beta = 0.5^(delta / h)`.
pub fn half_life_beta(steps: f64, rampup_ratio: Option<f64>, t: f64, delta: f64) -> f64 {
    let mut h = steps;
    if let Some(ratio) = rampup_ratio {
        h = h.min(t * ratio);
    }
    0.5f64.powf(delta / h.max(1e-8))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warmup(uas: u64, inv_gamma: f64, power: f64, min_value: f64, beta: f64) -> ProfileSpec {
        ProfileSpec::Warmup {
            name: "w".into(),
            beta,
            update_after_step: uas,
            inv_gamma,
            power,
            min_value,
        }
    }

    /// Values printed by ema-pytorch 0.8.3's `get_current_decay()` with
    /// `EMA.step` set to `step + 1`.
    #[test]
    fn warmup_matches_ema_pytorch() {
        let cases = [
            (0, 0.0),
            (20, 0.0),
            (21, 0.300_000_011_920_928_96),
            (22, 0.405_396_461_486_816_4),
            (50, 0.875),
            (1000, 0.990_412_890_911_102_3),
            (1_000_000, 0.999_000_012_874_603_3),
        ];
        for (step, expected) in cases {
            let got = warmup_decay(step, 20, 2.0, 0.75, 0.3, 0.999);
            assert_eq!(got, expected, "step {step}");
        }
        let defaults = [
            (101, 0.370_039_463_043_212_9),
            (150, 0.927_285_671_234_130_9),
            (5000, 0.996_534_168_720_245_4),
            (31623, 0.998_997_926_712_036_1),
        ];
        for (step, expected) in defaults {
            let got = warmup_decay(step, 100, 1.0, 2.0 / 3.0, 0.0, 0.9999);
            assert!(
                (got - expected).abs() <= 1e-7,
                "step {step}: {got} vs {expected}"
            );
        }
    }

    #[test]
    fn warmup_copies_until_update_after_step() {
        let p = warmup(20, 1.0, 0.75, 0.0, 0.999);
        assert_eq!(decide(&p, 0, None, 0).action, Action::Copy);
        assert_eq!(decide(&p, 20, Some(10), 0).action, Action::Copy);
        match decide(&p, 30, Some(20), 0).action {
            Action::Lerp { weight } => {
                assert!(
                    (weight - (1.0 - warmup_decay(30, 20, 1.0, 0.75, 0.0, 0.999))).abs() < 1e-15
                )
            }
            other => panic!("{other:?}"),
        }
        let frozen = warmup(0, 1.0, 0.75, 0.0, 1.0);
        assert_eq!(decide(&frozen, 5, Some(4), 0).action, Action::Hold);
    }

    #[test]
    fn power_beta_is_interval_correct() {
        // Ten single steps compose to one ten-step interval exactly.
        let gamma = 6.94;
        let mut prod = 1.0;
        for s in 11..=20 {
            prod *= power_beta(gamma, (s + 1) as f64, 1.0);
        }
        assert!((prod - power_beta(gamma, 21.0, 10.0)).abs() < 1e-12);
        // The first real update after the copy: t = 1 gives beta = 0.
        assert_eq!(power_beta(gamma, 1.0, 1.0), 0.0);
    }

    /// Values printed by ema-pytorch 0.8.3's `KarrasEMA(gamma=6.94).beta`
    /// inside `update()` entered at `step` (its buffer then reads `step + 1`).
    #[test]
    fn karras_matches_ema_pytorch() {
        for (step, expected) in [
            (0, 0.004_072_131_878_285_63),
            (1, 0.039_979_320_007_194_556),
            (9, 0.469_182_796_889_280_8),
            (99, 0.924_034_724_910_943),
            (999, 0.992_095_374_524_695_4),
        ] {
            let got = karras_beta(6.94, step);
            assert!(
                (got - expected).abs() <= 1e-15,
                "step {step}: {got} vs {expected}"
            );
        }
    }

    #[test]
    fn karras_updates_every_k_steps_and_differs_from_power() {
        let p = |update_every, frozen| ProfileSpec::Karras {
            name: "k".into(),
            sigma_rel: None,
            gamma: Some(6.94),
            update_every,
            frozen,
        };
        assert_eq!(decide(&p(10, false), 0, None, 0).action, Action::Copy);
        // Steps between updates (a push for a checkpoint) leave the EMA.
        assert_eq!(decide(&p(10, false), 9, Some(0), 0).action, Action::Hold);
        let weight = 1.0 - karras_beta(6.94, 10);
        assert_eq!(
            decide(&p(10, false), 10, Some(9), 0).action,
            Action::Lerp { weight }
        );
        assert_eq!(decide(&p(1, true), 1, Some(0), 0).action, Action::Hold);
        // EDM2's power profile decays by (1 - 1/(step + 1)): one step
        // behind ema-pytorch's, so the two EMAs differ.
        let power = ProfileSpec::Power {
            name: "p".into(),
            sigma_rel: None,
            gamma: Some(6.94),
        };
        let Action::Lerp { weight: edm2 } = decide(&power, 5, Some(4), 0).action else {
            panic!("power lerps");
        };
        let Action::Lerp { weight: karras } = decide(&p(1, false), 5, Some(4), 0).action else {
            panic!("karras lerps");
        };
        assert!((edm2 - (1.0 - power_beta(6.94, 6.0, 1.0))).abs() < 1e-15);
        assert!((karras - (1.0 - (6.0f64 / 7.0).powf(7.94))).abs() < 1e-15);
    }

    #[test]
    fn half_life_beta_halves_and_ramps() {
        assert!((half_life_beta(100.0, None, 1000.0, 100.0) - 0.5).abs() < 1e-15);
        // Ramp-up: at t = 100 with ratio 0.1 the half-life is 10 steps.
        assert!((half_life_beta(500.0, Some(0.1), 100.0, 10.0) - 0.5).abs() < 1e-15);
        // Ten single steps compose to one ten-step interval.
        let one = half_life_beta(50.0, None, 200.0, 1.0);
        assert!((one.powi(10) - half_life_beta(50.0, None, 200.0, 10.0)).abs() < 1e-14);
    }

    #[test]
    fn swa_counts_from_start_step() {
        let p = ProfileSpec::Swa {
            name: "s".into(),
            start_step: 10,
        };
        let d = decide(&p, 0, None, 0);
        assert_eq!((d.action, d.swa_n), (Action::Copy, 0));
        let d = decide(&p, 5, Some(0), 0);
        assert_eq!((d.action, d.swa_n), (Action::Copy, 0));
        let d = decide(&p, 10, Some(5), 0);
        assert_eq!((d.action, d.swa_n), (Action::Copy, 1));
        let d = decide(&p, 11, Some(10), 1);
        assert_eq!((d.action, d.swa_n), (Action::Lerp { weight: 0.5 }, 2));
        let d = decide(&p, 12, Some(11), 2);
        assert_eq!(d.swa_n, 3);
        match d.action {
            Action::Lerp { weight } => assert!((weight - 1.0 / 3.0).abs() < 1e-16),
            other => panic!("{other:?}"),
        }
    }

    /// `(decay, min_decay, update_after_step, warmup, decay at STEPS)`.
    type StepDecayCase = (f64, f64, u64, Option<(f64, f64)>, [f64; 7]);
    const STEPS: [u64; 7] = [0, 1, 2, 3, 7, 50, 1000];

    /// `diffusers_decay` or `timm_decay`.
    type StepDecayFn = fn(u64, f64, f64, u64, Option<(f64, f64)>) -> f64;

    fn check_step_decay(f: StepDecayFn, cases: &[StepDecayCase]) {
        for &(decay, min_decay, uas, warmup, expected) in cases {
            for (step, want) in STEPS.iter().zip(expected) {
                let got = f(*step, decay, min_decay, uas, warmup);
                assert!((got - want).abs() <= 1e-15, "step {step}: {got} vs {want}");
            }
        }
    }

    /// Values printed by diffusers 0.42.1's `EMAModel.get_decay(step)`.
    #[test]
    fn diffusers_matches_get_decay() {
        let cases: [StepDecayCase; 3] = [
            (
                0.9999,
                0.0,
                0,
                None,
                [
                    0.0,
                    0.0,
                    0.181_818_181_818_181_82,
                    0.25,
                    0.4375,
                    0.847_457_627_118_644,
                    0.991_080_277_502_477_7,
                ],
            ),
            (
                0.9999,
                0.5,
                5,
                None,
                [
                    0.0,
                    0.0,
                    0.0,
                    0.0,
                    0.5,
                    0.833_333_333_333_333_4,
                    0.991_035_856_573_705_2,
                ],
            ),
            (
                0.999,
                0.0,
                0,
                Some((2.0, 0.75)),
                [
                    0.0,
                    0.0,
                    0.262_212_053_533_118_94,
                    0.405_396_442_498_639_5,
                    0.646_446_609_406_726_3,
                    0.911_875_865_495_484_2,
                    0.990_549_670_771_290_3,
                ],
            ),
        ];
        check_step_decay(diffusers_decay, &cases);
    }

    /// Values printed by timm 1.0.31's `ModelEmaV3.get_decay(step)`.
    #[test]
    fn timm_matches_get_decay() {
        let cases: [StepDecayCase; 3] = [
            (
                0.9999,
                0.0,
                0,
                None,
                [0.0, 0.0, 0.9999, 0.9999, 0.9999, 0.9999, 0.9999],
            ),
            (0.99, 0.5, 5, None, [0.0, 0.0, 0.0, 0.0, 0.99, 0.99, 0.99]),
            (
                0.999,
                0.1,
                0,
                Some((2.0, 0.75)),
                [
                    0.0,
                    0.0,
                    0.262_212_053_533_118_94,
                    0.405_396_442_498_639_5,
                    0.646_446_609_406_726_3,
                    0.911_875_865_495_484_2,
                    0.990_549_670_771_290_3,
                ],
            ),
        ];
        check_step_decay(timm_decay, &cases);
        // A decay of 0 is an exact copy, not a lerp of weight 1.
        let p = ProfileSpec::Timm {
            name: "t".into(),
            decay: 0.9,
            min_decay: 0.0,
            update_after_step: 3,
            use_warmup: false,
            warmup_gamma: 1.0,
            warmup_power: 2.0 / 3.0,
        };
        assert_eq!(decide(&p, 4, Some(1), 0).action, Action::Copy);
        assert_eq!(
            decide(&p, 5, Some(4), 0).action,
            Action::Lerp { weight: 1.0 - 0.9 }
        );
    }

    fn bema(update_freq: u64, update_after: u64) -> ProfileSpec {
        ProfileSpec::Bema {
            name: "b".into(),
            update_freq,
            ema_power: 0.5,
            bias_power: 0.2,
            lag: 10.0,
            update_after,
            multiplier: 1.0,
            min_ema_multiplier: 0.0,
        }
    }

    /// `(beta, alpha)` printed by trl 1.16.0's `BEMACallback()._ema_beta(step)`
    /// and `_bema_alpha(step)` (defaults: lag 10, multiplier 1, ema_power
    /// 0.5, bias_power 0.2), and with `lag=3, multiplier=2.5,
    /// ema_power=0.7, bias_power=0.35, min_ema_multiplier=0.12`.
    #[test]
    fn bema_powers_match_trl() {
        let defaults = BemaPowers {
            lag: 10.0,
            multiplier: 1.0,
            ema_power: 0.5,
            bias_power: 0.2,
            min_ema_multiplier: 0.0,
        };
        let other = BemaPowers {
            lag: 3.0,
            multiplier: 2.5,
            ema_power: 0.7,
            bias_power: 0.35,
            min_ema_multiplier: 0.12,
        };
        for (powers, cases) in [(defaults, TRL_DEFAULTS), (other, TRL_OTHER)] {
            for &(step, beta, alpha) in cases {
                let (b, a) = (powers.beta(step), powers.alpha(step));
                assert!((b - beta).abs() <= 1e-15, "step {step}: beta {b} vs {beta}");
                assert!(
                    (a - alpha).abs() <= 1e-15,
                    "step {step}: alpha {a} vs {alpha}"
                );
            }
        }
    }

    /// What a push at `step` does: TRL's `on_step_end` with `global_step ==
    /// step` (its `step` is the global step, not counted from
    /// `update_after`).
    #[test]
    fn bema_follows_trl_on_step_end() {
        let p = bema(3, 0);
        assert_eq!(decide(&p, 0, None, 0).action, Action::Bema(BemaStep::Start));
        assert_eq!(decide(&p, 1, Some(0), 0).action, Action::Hold);
        assert_eq!(decide(&p, 2, Some(1), 0).action, Action::Hold);
        let powers = BemaPowers {
            lag: 10.0,
            multiplier: 1.0,
            ema_power: 0.5,
            bias_power: 0.2,
            min_ema_multiplier: 0.0,
        };
        assert_eq!(
            decide(&p, 3, Some(2), 0).action,
            Action::Bema(BemaStep::Update {
                beta: powers.beta(3),
                alpha: powers.alpha(3)
            })
        );
        // A push skipped in between changes nothing: the step decides.
        assert_eq!(
            decide(&p, 6, Some(3), 0).action,
            decide(&p, 6, Some(5), 0).action
        );
        assert_eq!(decide(&p, 7, Some(6), 0).action, Action::Hold);
        let late = bema(3, 5);
        assert_eq!(
            decide(&late, 0, None, 0).action,
            Action::Bema(BemaStep::Start)
        );
        for step in 1..5 {
            assert_eq!(decide(&late, step, Some(step - 1), 0).action, Action::Hold);
        }
        assert_eq!(
            decide(&late, 5, Some(4), 0).action,
            Action::Bema(BemaStep::Restart)
        );
        assert_eq!(decide(&late, 6, Some(5), 0).action, Action::Hold);
        // The first update is at update_after + update_freq, with beta and
        // alpha at the global step 8.
        assert_eq!(
            decide(&late, 8, Some(7), 0).action,
            Action::Bema(BemaStep::Update {
                beta: powers.beta(8),
                alpha: powers.alpha(8)
            })
        );
        assert!((powers.beta(8) - (18.0f64).powf(-0.5)).abs() < 1e-16);
    }

    #[test]
    fn constant_weight() {
        let p = ProfileSpec::Constant {
            name: "c".into(),
            beta: 0.999,
        };
        assert_eq!(decide(&p, 0, None, 0).action, Action::Copy);
        assert_eq!(
            decide(&p, 1, Some(0), 0).action,
            Action::Lerp {
                weight: 1.0 - 0.999
            }
        );
    }

    /// `(step, beta, alpha)` of trl 1.16.0's defaults.
    const TRL_DEFAULTS: &[(u64, f64, f64)] = &[
        (1, 0.30151134457776363, 0.6190439206838455),
        (3, 0.2773500981126146, 0.5987028555414977),
        (6, 0.25, 0.5743491774985174),
        (8, 0.23570226039551584, 0.5609775727230997),
        (12, 0.21320071635561044, 0.5389090338563629),
        (100, 0.09534625892455924, 0.39059030831128655),
        (400, 0.04938647983247948, 0.3002224941812098),
        (10000, 0.009995003746877732, 0.15845764038704452),
    ];
    /// `(step, beta, alpha)` of `lag=3, multiplier=2.5, ema_power=0.7,
    /// bias_power=0.35, min_ema_multiplier=0.12`.
    const TRL_OTHER: &[(u64, f64, f64)] = &[
        (1, 0.3032118130982988, 0.5506467225892648),
        (3, 0.19282684286579993, 0.4391205334140046),
        (6, 0.1322236819220245, 0.3636257443059065),
        (8, 0.12, 0.333730006868727),
        (12, 0.12, 0.29411699562097077),
        (100, 0.12, 0.1441809283709545),
        (400, 0.12, 0.08903170152288699),
        (10000, 0.12, 0.028887021036331655),
    ];
}
