//! A run's configuration, fixed at creation, and its validation.
//!
//! A request body is parsed into [`RunSpec`] (serde reports the path of a
//! field it cannot read), then [`RunSpec::validate`] checks every value and
//! resolves the defaults into a [`RunConfig`], which is what the catalog
//! stores and the engine uses. Every failure names the field it is about.

pub mod alerts;

use std::sync::OnceLock;

use regex::Regex;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::sigma_rel;

/// `^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`: safe as a path component and a URL
/// segment (no `/`, no `..` on its own, no leading dot).
pub fn valid_name(name: &str) -> bool {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$").expect("static regex"))
        .is_match(name)
}

/// The largest step the service takes: 2^53, the last integer a JSON
/// number is exact at in a browser (and an `f64` in the post-hoc solver).
/// Beyond it steps would wrap or round; every place a step comes in
/// refuses it.
pub const MAX_STEP: u64 = 1 << 53;

/// Profile names a run may not use: `online` names the mirror in downloads
/// and comparisons, `__mirror__` is the mirror's part in a snapshot.
pub const RESERVED_PROFILES: [&str; 2] = ["online", "__mirror__"];

/// Whether `name` is reserved (see [`RESERVED_PROFILES`]).
pub fn reserved_profile(name: &str) -> bool {
    RESERVED_PROFILES.contains(&name)
}

/// A configuration value that is wrong, with the dotted path of its field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

fn field_err(field: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.into(),
        message: message.into(),
    }
}

/// What happens to a pushed tensor holding NaN or Inf.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NonfinitePolicy {
    /// The whole push is rejected with 422 and nothing changes.
    #[default]
    Reject,
    /// The offending tensors keep their previous EMA; the rest is applied.
    SkipTensor,
    /// Averaged as they are.
    Allow,
}

/// Storage dtype of the averaged (floating point) tensors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EmaDtype {
    #[default]
    Float32,
    Float64,
    Bfloat16,
    Float16,
}

impl EmaDtype {
    pub fn kind(self) -> tch::Kind {
        match self {
            EmaDtype::Float32 => tch::Kind::Float,
            EmaDtype::Float64 => tch::Kind::Double,
            EmaDtype::Bfloat16 => tch::Kind::BFloat16,
            EmaDtype::Float16 => tch::Kind::Half,
        }
    }

    pub fn size(self) -> usize {
        match self {
            EmaDtype::Float64 => 8,
            EmaDtype::Float32 => 4,
            EmaDtype::Bfloat16 | EmaDtype::Float16 => 2,
        }
    }
}

/// Snapshot retention of a run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Retention {
    /// Keep the newest N complete snapshots (0 = keep all).
    #[serde(default)]
    pub keep_last: u64,
    /// Also keep every snapshot whose step is a multiple of this (0 = none).
    #[serde(default)]
    pub keep_every: u64,
}

/// One EMA of the run's push stream. `kind` selects the schedule; see the
/// design document for the exact equations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ProfileSpec {
    /// `AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(beta))`.
    Constant { name: String, beta: f64 },
    /// ema-pytorch `EMA` warm-up schedule.
    Warmup {
        name: String,
        #[serde(default = "defaults::warmup_beta")]
        beta: f64,
        #[serde(default = "defaults::update_after_step")]
        update_after_step: u64,
        #[serde(default = "defaults::inv_gamma")]
        inv_gamma: f64,
        #[serde(default = "defaults::power")]
        power: f64,
        #[serde(default)]
        min_value: f64,
    },
    /// EDM2 power-function EMA, given by `sigma_rel` or `gamma`.
    Power {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sigma_rel: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gamma: Option<f64>,
    },
    /// ema-pytorch `KarrasEMA` (the EMAs of its `PostHocEMA`), given by
    /// `sigma_rel` or `gamma`: the power function at `step + 2`, applied
    /// at steps that are multiples of `update_every`; `frozen` keeps the
    /// first copy.
    Karras {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sigma_rel: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gamma: Option<f64>,
        #[serde(default = "defaults::update_every")]
        update_every: u64,
        #[serde(default)]
        frozen: bool,
    },
    /// `beta = 0.5^(delta/h)`, `h = min(steps, t * rampup_ratio)`.
    HalfLife {
        name: String,
        steps: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rampup_ratio: Option<f64>,
    },
    /// diffusers `EMAModel.get_decay(step)`, the step being diffusers'
    /// `optimization_step` (1 at the first `EMAModel.step`).
    Diffusers {
        name: String,
        #[serde(default = "defaults::warmup_beta")]
        decay: f64,
        #[serde(default)]
        min_decay: f64,
        #[serde(default)]
        update_after_step: u64,
        #[serde(default)]
        use_ema_warmup: bool,
        #[serde(default = "defaults::inv_gamma")]
        inv_gamma: f64,
        #[serde(default = "defaults::power")]
        power: f64,
    },
    /// timm `ModelEmaV3.get_decay(step)`, the step being the one given to
    /// `ModelEmaV3.update(model, step)`.
    Timm {
        name: String,
        #[serde(default = "defaults::warmup_beta")]
        decay: f64,
        #[serde(default)]
        min_decay: f64,
        #[serde(default)]
        update_after_step: u64,
        #[serde(default)]
        use_warmup: bool,
        #[serde(default = "defaults::inv_gamma")]
        warmup_gamma: f64,
        #[serde(default = "defaults::power")]
        warmup_power: f64,
    },
    /// Equal-weight running average from `start_step` on.
    Swa {
        name: String,
        #[serde(default)]
        start_step: u64,
    },
    /// TRL `BEMACallback`: the bias-corrected EMA of Block and Zhang
    /// (arXiv 2508.00180), `served = ema + alpha * (w - w0)`, with `w0` and
    /// the plain EMA kept by the server beside the served weights. The
    /// fields are TRL's, with its defaults.
    Bema {
        name: String,
        /// Update every N steps after `update_after` (TRL `update_freq`).
        #[serde(default = "defaults::bema_update_freq")]
        update_freq: u64,
        /// `kappa`: `beta = (lag + multiplier * step)^(-ema_power)`.
        #[serde(default = "defaults::bema_ema_power")]
        ema_power: f64,
        /// `eta`: `alpha = (lag + multiplier * step)^(-bias_power)`.
        #[serde(default = "defaults::bema_bias_power")]
        bias_power: f64,
        /// `rho`, the schedules' virtual starting age.
        #[serde(default = "defaults::bema_lag")]
        lag: f64,
        /// `tau`: `w0` and the EMA restart from the weights at this step.
        #[serde(default)]
        update_after: u64,
        /// `gamma`, the schedules' step multiplier.
        #[serde(default = "defaults::one")]
        multiplier: f64,
        /// The floor of the EMA's `beta`.
        #[serde(default)]
        min_ema_multiplier: f64,
    },
}

mod defaults {
    pub fn warmup_beta() -> f64 {
        0.9999
    }
    pub fn update_after_step() -> u64 {
        100
    }
    pub fn inv_gamma() -> f64 {
        1.0
    }
    pub fn power() -> f64 {
        2.0 / 3.0
    }
    pub fn update_every() -> u64 {
        1
    }
    pub fn one() -> f64 {
        1.0
    }
    pub fn bema_update_freq() -> u64 {
        400
    }
    pub fn bema_ema_power() -> f64 {
        0.5
    }
    pub fn bema_bias_power() -> f64 {
        0.2
    }
    pub fn bema_lag() -> f64 {
        10.0
    }
    pub fn snapshot_timeout() -> u64 {
        600
    }
    /// Seconds between the end of one `state` write and the next: a crash
    /// loses a few seconds of pushes (see `persist::PERSIST_BUSY_SHARE`
    /// for long writes).
    pub fn persist_every() -> u64 {
        5
    }
    pub fn drift_every() -> u64 {
        10
    }
    pub fn keyframe_every() -> u64 {
        100
    }
}

impl ProfileSpec {
    pub fn name(&self) -> &str {
        match self {
            ProfileSpec::Constant { name, .. }
            | ProfileSpec::Warmup { name, .. }
            | ProfileSpec::Power { name, .. }
            | ProfileSpec::Karras { name, .. }
            | ProfileSpec::HalfLife { name, .. }
            | ProfileSpec::Diffusers { name, .. }
            | ProfileSpec::Timm { name, .. }
            | ProfileSpec::Swa { name, .. }
            | ProfileSpec::Bema { name, .. } => name,
        }
    }

    pub fn kind_name(&self) -> &'static str {
        match self {
            ProfileSpec::Constant { .. } => "constant",
            ProfileSpec::Warmup { .. } => "warmup",
            ProfileSpec::Power { .. } => "power",
            ProfileSpec::Karras { .. } => "karras",
            ProfileSpec::HalfLife { .. } => "half_life",
            ProfileSpec::Diffusers { .. } => "diffusers",
            ProfileSpec::Timm { .. } => "timm",
            ProfileSpec::Swa { .. } => "swa",
            ProfileSpec::Bema { .. } => "bema",
        }
    }

    /// Checks the values and fills the derived ones (a power profile gets
    /// both `sigma_rel` and `gamma`).
    fn validate(&mut self, at: &str) -> Result<(), FieldError> {
        check_profile_name(at, self.name())?;
        let unit_open = |field: &str, v: f64| -> Result<(), FieldError> {
            if v.is_finite() && (0.0..1.0).contains(&v) {
                Ok(())
            } else {
                Err(field_err(format!("{at}.{field}"), "must be in [0, 1)"))
            }
        };
        match self {
            ProfileSpec::Constant { beta, .. } => unit_open("beta", *beta)?,
            ProfileSpec::Warmup {
                beta,
                inv_gamma,
                power,
                min_value,
                update_after_step,
                ..
            } => {
                check_warmup(at, *beta, *inv_gamma, *power, *min_value)?;
                at_most_max_step(at, "update_after_step", *update_after_step)?;
            }
            ProfileSpec::Power {
                sigma_rel, gamma, ..
            } => power_exponents(at, sigma_rel, gamma)?,
            ProfileSpec::Karras {
                sigma_rel,
                gamma,
                update_every,
                ..
            } => {
                power_exponents(at, sigma_rel, gamma)?;
                if !(1..=MAX_STEP).contains(update_every) {
                    return Err(field_err(
                        format!("{at}.update_every"),
                        "must be between 1 and 2^53",
                    ));
                }
            }
            ProfileSpec::HalfLife {
                steps,
                rampup_ratio,
                ..
            } => check_half_life(at, *steps, *rampup_ratio)?,
            ProfileSpec::Diffusers {
                decay,
                min_decay,
                inv_gamma,
                power,
                update_after_step,
                ..
            } => check_step_decay(
                at,
                *update_after_step,
                [("decay", *decay), ("min_decay", *min_decay)],
                [("inv_gamma", *inv_gamma), ("power", *power)],
            )?,
            ProfileSpec::Timm {
                decay,
                min_decay,
                warmup_gamma,
                warmup_power,
                update_after_step,
                ..
            } => check_step_decay(
                at,
                *update_after_step,
                [("decay", *decay), ("min_decay", *min_decay)],
                [
                    ("warmup_gamma", *warmup_gamma),
                    ("warmup_power", *warmup_power),
                ],
            )?,
            ProfileSpec::Swa { start_step, .. } => at_most_max_step(at, "start_step", *start_step)?,
            ProfileSpec::Bema {
                update_freq,
                ema_power,
                bias_power,
                lag,
                update_after,
                multiplier,
                min_ema_multiplier,
                ..
            } => {
                if !(1..=MAX_STEP).contains(update_freq) {
                    return Err(field_err(
                        format!("{at}.update_freq"),
                        "must be between 1 and 2^53",
                    ));
                }
                at_most_max_step(at, "update_after", *update_after)?;
                check_bema(
                    at,
                    [
                        ("ema_power", *ema_power),
                        ("bias_power", *bias_power),
                        ("lag", *lag),
                        ("multiplier", *multiplier),
                    ],
                    *min_ema_multiplier,
                )?;
            }
        }
        Ok(())
    }

    /// Whether the profile keeps hidden buffers beside its served weights
    /// (BEMA's `w0` and plain EMA).
    pub fn is_bema(&self) -> bool {
        matches!(self, ProfileSpec::Bema { .. })
    }
}

/// A BEMA profile's reals: the powers, `lag` and `multiplier` finite and
/// non-negative with `lag + multiplier > 0` (so `lag + multiplier * step`,
/// the base of both powers, is positive at every step an update happens,
/// all at least 1), and `min_ema_multiplier` in [0, 1].
fn check_bema(
    at: &str,
    non_negative: [(&str, f64); 4],
    min_ema_multiplier: f64,
) -> Result<(), FieldError> {
    for (field, v) in non_negative {
        if !(v.is_finite() && v >= 0.0) {
            return Err(field_err(format!("{at}.{field}"), "must be >= 0"));
        }
    }
    let (lag, multiplier) = (non_negative[2].1, non_negative[3].1);
    if lag + multiplier <= 0.0 {
        return Err(field_err(
            format!("{at}.lag"),
            "lag + multiplier must be > 0 (the base of the powers at step 1)",
        ));
    }
    if !(min_ema_multiplier.is_finite() && (0.0..=1.0).contains(&min_ema_multiplier)) {
        return Err(field_err(
            format!("{at}.min_ema_multiplier"),
            "must be in [0, 1]",
        ));
    }
    Ok(())
}

/// A profile's name: valid, and not the mirror's.
fn check_profile_name(at: &str, name: &str) -> Result<(), FieldError> {
    if !valid_name(name) {
        return Err(field_err(
            format!("{at}.name"),
            "must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        ));
    }
    if reserved_profile(name) {
        return Err(field_err(
            format!("{at}.name"),
            "is reserved (`online` names the mirror in downloads and comparisons)",
        ));
    }
    Ok(())
}

/// A step field (`update_after_step`, `start_step`) within what a float
/// holds exactly.
fn at_most_max_step(at: &str, field: &str, step: u64) -> Result<(), FieldError> {
    if step > MAX_STEP {
        return Err(field_err(format!("{at}.{field}"), "must be <= 2^53"));
    }
    Ok(())
}

/// A half-life profile's length and ramp-up ratio, both positive.
fn check_half_life(at: &str, steps: f64, rampup_ratio: Option<f64>) -> Result<(), FieldError> {
    if !(steps.is_finite() && steps > 0.0) {
        return Err(field_err(format!("{at}.steps"), "must be > 0"));
    }
    if let Some(r) = rampup_ratio {
        if !(r.is_finite() && r > 0.0) {
            return Err(field_err(format!("{at}.rampup_ratio"), "must be > 0"));
        }
    }
    Ok(())
}

/// The body of `POST /v1/runs`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunSpec {
    /// Run name, `^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`.
    pub name: String,
    /// Number of training ranks pushing shards.
    pub world_size: u32,
    /// A push is applied when `step % update_every == 0`.
    #[serde(default = "defaults::update_every")]
    pub update_every: u64,
    /// The EMA profiles; default one `constant` profile `ema` with beta 0.999.
    #[serde(default)]
    pub profiles: Option<Vec<ProfileSpec>>,
    /// `cpu`, `cuda` or `cuda:N`; default: the server's device.
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub ema_dtype: EmaDtype,
    /// Keep the latest online weights (needed for delta pushes and drift).
    #[serde(default)]
    pub mirror: bool,
    /// Take a periodic snapshot every N steps (0 = off).
    #[serde(default)]
    pub snapshot_every: u64,
    #[serde(default)]
    pub retention: Retention,
    /// Globs of tensor names that are copied, never averaged.
    #[serde(default)]
    pub copy_patterns: Vec<String>,
    #[serde(default)]
    pub nonfinite: NonfinitePolicy,
    /// Seconds a pending snapshot waits for every rank to reach its step.
    #[serde(default = "defaults::snapshot_timeout")]
    pub snapshot_timeout_secs: u64,
    /// Seconds between crash-recovery state snapshots (0 = only on shutdown).
    #[serde(default = "defaults::persist_every")]
    pub persist_every_secs: u64,
    /// Sample the EMA drift `||EMA - online|| / ||online||` every N applied
    /// pushes of a rank (0 = never).
    #[serde(default = "defaults::drift_every")]
    pub drift_every: u64,
    /// Delta pushes (`delta`, `xor`): clients send a keyframe (a full push,
    /// which also checks the mirror's checksum) every N pushes.
    #[serde(default = "defaults::keyframe_every")]
    pub keyframe_every: u64,
    /// Labels to find the run by; editable later (`PATCH /v1/runs/{run}`).
    #[serde(default)]
    pub tags: Vec<String>,
    /// A free-text note; editable later.
    #[serde(default)]
    pub note: String,
    /// Alert rules (defaults apply when absent); editable later.
    #[serde(default)]
    pub alerts: Option<alerts::AlertRules>,
}

/// A validated run configuration, as stored in the catalog.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunConfig {
    pub name: String,
    pub world_size: u32,
    pub update_every: u64,
    pub profiles: Vec<ProfileSpec>,
    pub device: String,
    pub ema_dtype: EmaDtype,
    pub mirror: bool,
    pub snapshot_every: u64,
    pub retention: Retention,
    pub copy_patterns: Vec<String>,
    pub nonfinite: NonfinitePolicy,
    pub snapshot_timeout_secs: u64,
    pub persist_every_secs: u64,
    #[serde(default = "defaults::drift_every")]
    pub drift_every: u64,
    /// Clients of delta pushes send a keyframe every N pushes.
    #[serde(default = "defaults::keyframe_every")]
    pub keyframe_every: u64,
}

/// Largest world size a run may declare.
pub const MAX_WORLD_SIZE: u32 = 65_536;
/// Most profiles one run may keep.
pub const MAX_PROFILES: usize = 32;

impl RunSpec {
    /// Checks every field; `default_device` is the server's device and
    /// `device_ok` says whether a device string can be used on this server.
    pub fn validate(
        self,
        default_device: &str,
        device_ok: impl Fn(&str) -> Result<String, String>,
    ) -> Result<RunConfig, FieldError> {
        if !valid_name(&self.name) {
            return Err(field_err(
                "name",
                "must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
            ));
        }
        if self.world_size == 0 || self.world_size > MAX_WORLD_SIZE {
            return Err(field_err(
                "world_size",
                format!("must be in 1..={MAX_WORLD_SIZE}"),
            ));
        }
        if self.update_every == 0 {
            return Err(field_err("update_every", "must be >= 1"));
        }
        if self.update_every > MAX_STEP {
            return Err(field_err("update_every", "must be <= 2^53"));
        }
        if self.keyframe_every == 0 {
            return Err(field_err("keyframe_every", "must be >= 1"));
        }
        let profiles = checked_profiles(self.profiles)?;
        let device = device_ok(self.device.as_deref().unwrap_or(default_device))
            .map_err(|m| field_err("device", m))?;
        for (i, pattern) in self.copy_patterns.iter().enumerate() {
            globset::Glob::new(pattern)
                .map_err(|e| field_err(format!("copy_patterns[{i}]"), e.to_string()))?;
        }
        Ok(RunConfig {
            name: self.name,
            world_size: self.world_size,
            update_every: self.update_every,
            profiles,
            device,
            ema_dtype: self.ema_dtype,
            mirror: self.mirror,
            snapshot_every: self.snapshot_every,
            retention: self.retention,
            copy_patterns: self.copy_patterns,
            nonfinite: self.nonfinite,
            snapshot_timeout_secs: self.snapshot_timeout_secs,
            persist_every_secs: self.persist_every_secs,
            drift_every: self.drift_every,
            keyframe_every: self.keyframe_every,
        })
    }
}

/// A warmup profile's values.
fn check_warmup(
    at: &str,
    beta: f64,
    inv_gamma: f64,
    power: f64,
    min_value: f64,
) -> Result<(), FieldError> {
    if !(beta.is_finite() && (0.0..=1.0).contains(&beta)) {
        return Err(field_err(format!("{at}.beta"), "must be in [0, 1]"));
    }
    if !(inv_gamma.is_finite() && inv_gamma > 0.0) {
        return Err(field_err(format!("{at}.inv_gamma"), "must be > 0"));
    }
    if !(power.is_finite() && power > 0.0) {
        return Err(field_err(format!("{at}.power"), "must be > 0"));
    }
    if !(min_value.is_finite() && min_value >= 0.0 && min_value <= beta) {
        return Err(field_err(format!("{at}.min_value"), "must be in [0, beta]"));
    }
    Ok(())
}

/// A `diffusers` or `timm` profile's values: decays in [0, 1], warmup
/// parameters > 0.
fn check_step_decay(
    at: &str,
    update_after_step: u64,
    unit: [(&str, f64); 2],
    positive: [(&str, f64); 2],
) -> Result<(), FieldError> {
    if update_after_step > MAX_STEP {
        return Err(field_err(
            format!("{at}.update_after_step"),
            "must be <= 2^53",
        ));
    }
    for (field, v) in unit {
        if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
            return Err(field_err(format!("{at}.{field}"), "must be in [0, 1]"));
        }
    }
    for (field, v) in positive {
        if !(v.is_finite() && v > 0.0) {
            return Err(field_err(format!("{at}.{field}"), "must be > 0"));
        }
    }
    Ok(())
}

/// A power profile gives `sigma_rel` or `gamma`; the other is derived.
fn power_exponents(
    at: &str,
    sigma_rel: &mut Option<f64>,
    gamma: &mut Option<f64>,
) -> Result<(), FieldError> {
    match (*sigma_rel, *gamma) {
        (Some(_), Some(_)) => Err(field_err(
            format!("{at}.gamma"),
            "give sigma_rel or gamma, not both",
        )),
        (None, None) => Err(field_err(
            format!("{at}.sigma_rel"),
            "a power profile needs sigma_rel or gamma",
        )),
        (Some(s), None) => {
            let g = sigma_rel::sigma_rel_to_gamma(s).ok_or_else(|| {
                field_err(
                    format!("{at}.sigma_rel"),
                    format!(
                        "must be in (0, {:.4}] (EDM2 power EMA)",
                        sigma_rel::MAX_SIGMA_REL
                    ),
                )
            })?;
            *gamma = Some(g);
            Ok(())
        }
        (None, Some(g)) => {
            if !(g.is_finite() && g > -1.0) {
                return Err(field_err(format!("{at}.gamma"), "must be > -1"));
            }
            *sigma_rel = Some(sigma_rel::gamma_to_sigma_rel(g));
            Ok(())
        }
    }
}

/// The run's profiles (default one `constant` profile `ema` with beta
/// 0.999), each validated, their names unique.
fn checked_profiles(profiles: Option<Vec<ProfileSpec>>) -> Result<Vec<ProfileSpec>, FieldError> {
    let mut profiles = profiles.unwrap_or_else(|| {
        vec![ProfileSpec::Constant {
            name: "ema".into(),
            beta: 0.999,
        }]
    });
    if profiles.is_empty() {
        return Err(field_err("profiles", "at least one profile is needed"));
    }
    if profiles.len() > MAX_PROFILES {
        return Err(field_err(
            "profiles",
            format!("at most {MAX_PROFILES} profiles"),
        ));
    }
    for (i, p) in profiles.iter_mut().enumerate() {
        p.validate(&format!("profiles[{i}]"))?;
    }
    for (i, p) in profiles.iter().enumerate() {
        if profiles[..i].iter().any(|q| q.name() == p.name()) {
            return Err(field_err(
                format!("profiles[{i}].name"),
                format!("duplicate profile name `{}`", p.name()),
            ));
        }
    }
    Ok(profiles)
}

impl RunConfig {
    /// The run's copy patterns as one matcher.
    pub fn copy_matcher(&self) -> globset::GlobSet {
        let mut builder = globset::GlobSetBuilder::new();
        for pattern in &self.copy_patterns {
            // Validated at creation.
            if let Ok(glob) = globset::Glob::new(pattern) {
                builder.add(glob);
            }
        }
        builder
            .build()
            .unwrap_or_else(|_| globset::GlobSet::empty())
    }

    pub fn profile_index(&self, name: &str) -> Option<usize> {
        self.profiles.iter().position(|p| p.name() == name)
    }

    /// Whether a push at `step` is an update step.
    pub fn is_update_step(&self, step: u64) -> bool {
        step % self.update_every == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> RunSpec {
        serde_json::from_value(json).unwrap()
    }

    fn ok_device(d: &str) -> Result<String, String> {
        match d {
            "cpu" => Ok("cpu".into()),
            other => Err(format!("device `{other}` is not available")),
        }
    }

    #[test]
    fn names() {
        assert!(valid_name("exp1"));
        assert!(valid_name("a.b-c_d"));
        assert!(!valid_name(""));
        assert!(!valid_name("a/b"));
        assert!(!valid_name(".."));
        assert!(!valid_name(".hidden"));
        assert!(!valid_name(&"x".repeat(200)));
        assert!(valid_name(&"x".repeat(128)));
        assert!(!valid_name(&"x".repeat(129)));
    }

    #[test]
    fn defaults_resolve() {
        let cfg = spec(serde_json::json!({"name": "r", "world_size": 2}))
            .validate("cpu", ok_device)
            .unwrap();
        assert_eq!(cfg.update_every, 1);
        assert_eq!(cfg.device, "cpu");
        assert_eq!(cfg.profiles.len(), 1);
        assert_eq!(cfg.profiles[0].name(), "ema");
        assert_eq!(cfg.nonfinite, NonfinitePolicy::Reject);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (serde_json::json!({"name": "a/b", "world_size": 1}), "name"),
            (
                serde_json::json!({"name": "r", "world_size": 0}),
                "world_size",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1, "update_every": 0}),
                "update_every",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "e", "kind": "constant", "beta": 1.5}]}),
                "profiles[0].beta",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "e", "kind": "power"}]}),
                "profiles[0].sigma_rel",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "e", "kind": "power", "sigma_rel": 0.9}]}),
                "profiles[0].sigma_rel",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "e", "kind": "swa"}, {"name": "e", "kind": "swa"}]}),
                "profiles[1].name",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1, "device": "cuda"}),
                "device",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1, "copy_patterns": ["a[" ]}),
                "copy_patterns[0]",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "w", "kind": "warmup", "min_value": 0.5, "beta": 0.4}]}),
                "profiles[0].min_value",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "d", "kind": "diffusers", "decay": 1.5}]}),
                "profiles[0].decay",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "d", "kind": "diffusers", "inv_gamma": 0.0}]}),
                "profiles[0].inv_gamma",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "t", "kind": "timm", "min_decay": -0.1}]}),
                "profiles[0].min_decay",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "t", "kind": "timm", "warmup_power": 0.0}]}),
                "profiles[0].warmup_power",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "d", "kind": "diffusers", "update_after_step": MAX_STEP + 1}]}),
                "profiles[0].update_after_step",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "t", "kind": "timm", "update_after_step": MAX_STEP + 1}]}),
                "profiles[0].update_after_step",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "k", "kind": "karras", "gamma": 5.0, "update_every": 0}]}),
                "profiles[0].update_every",
            ),
            (
                serde_json::json!({"name": "r", "world_size": 1,
                    "profiles": [{"name": "k", "kind": "karras"}]}),
                "profiles[0].sigma_rel",
            ),
        ];
        for (json, field) in cases {
            let err = spec(json.clone()).validate("cpu", ok_device).unwrap_err();
            assert_eq!(err.field, field, "{json}: {err}");
        }
    }

    #[test]
    fn karras_profile_gets_gamma_and_defaults() {
        let cfg = spec(serde_json::json!({"name": "r", "world_size": 1,
            "profiles": [{"name": "k", "kind": "karras", "sigma_rel": 0.05}]}))
        .validate("cpu", ok_device)
        .unwrap();
        match &cfg.profiles[0] {
            ProfileSpec::Karras {
                gamma,
                update_every,
                frozen,
                ..
            } => {
                assert!((gamma.unwrap() - 16.9722).abs() < 1e-3, "{gamma:?}");
                assert_eq!((*update_every, *frozen), (1, false));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn power_profile_gets_gamma() {
        let cfg = spec(serde_json::json!({"name": "r", "world_size": 1,
            "profiles": [{"name": "p", "kind": "power", "sigma_rel": 0.05}]}))
        .validate("cpu", ok_device)
        .unwrap();
        match &cfg.profiles[0] {
            ProfileSpec::Power { gamma, .. } => {
                // EDM2 std_to_exp(0.05) = 16.972...
                assert!((gamma.unwrap() - 16.9722).abs() < 1e-3, "{gamma:?}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// TRL `BEMACallback`'s defaults, and a 422 naming the field for each
    /// bad value.
    #[test]
    fn bema_profile_defaults_and_errors() {
        let cfg = spec(serde_json::json!({"name": "r", "world_size": 1,
            "profiles": [{"name": "b", "kind": "bema"}]}))
        .validate("cpu", ok_device)
        .unwrap();
        assert_eq!(
            cfg.profiles[0],
            ProfileSpec::Bema {
                name: "b".into(),
                update_freq: 400,
                ema_power: 0.5,
                bias_power: 0.2,
                lag: 10.0,
                update_after: 0,
                multiplier: 1.0,
                min_ema_multiplier: 0.0,
            }
        );
        assert!(cfg.profiles[0].is_bema() && cfg.profiles[0].kind_name() == "bema");
        let bad = [
            (serde_json::json!({"update_freq": 0}), "update_freq"),
            (
                serde_json::json!({"update_after": MAX_STEP + 1}),
                "update_after",
            ),
            (serde_json::json!({"ema_power": -0.5}), "ema_power"),
            (serde_json::json!({"bias_power": -1.0}), "bias_power"),
            (serde_json::json!({"lag": -1.0}), "lag"),
            (serde_json::json!({"lag": 0.0, "multiplier": 0.0}), "lag"),
            (serde_json::json!({"multiplier": -2.0}), "multiplier"),
            (
                serde_json::json!({"min_ema_multiplier": 1.5}),
                "min_ema_multiplier",
            ),
            (
                serde_json::json!({"min_ema_multiplier": -0.1}),
                "min_ema_multiplier",
            ),
        ];
        for (fields, field) in bad {
            let mut profile = serde_json::json!({"name": "b", "kind": "bema"});
            for (k, v) in fields.as_object().unwrap() {
                profile[k] = v.clone();
            }
            let err =
                spec(serde_json::json!({"name": "r", "world_size": 1, "profiles": [profile]}))
                    .validate("cpu", ok_device)
                    .unwrap_err();
            assert_eq!(err.field, format!("profiles[0].{field}"), "{fields}: {err}");
        }
        // TRL's `lag` is an int; 0 with a multiplier is fine (base >= 1 at step 1).
        spec(serde_json::json!({"name": "r", "world_size": 1,
            "profiles": [{"name": "b", "kind": "bema", "lag": 0, "update_freq": 1}]}))
        .validate("cpu", ok_device)
        .unwrap();
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = serde_json::from_value::<RunSpec>(serde_json::json!({
            "name": "r", "world_size": 1,
            "profiles": [{"name": "e", "kind": "constant", "beta": 0.9, "bta": 1}]
        }))
        .unwrap_err();
        assert!(err.to_string().contains("bta"), "{err}");
    }
}
