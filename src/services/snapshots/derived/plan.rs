//! Post-hoc planning: the run's stored power-profile EMAs, and the weights
//! that synthesise each requested length from them (EDM2 or ema-pytorch).

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::mergeable;
use crate::registry::RunHandle;
use crate::run::{ProfileSpec, RunConfig};
use crate::services::snapshots::{Snaps, SnapshotError};
use crate::sigma_rel::{gamma_to_sigma_rel, sigma_rel_to_gamma, MAX_SIGMA_REL};
use crate::snapshot::posthoc::{self, PosthocError, Source};
use crate::store::snapshots::SnapshotRow;

/// The most lengths one post-hoc request may ask for.
pub const MAX_SWEEP: usize = 32;

/// A stored power-profile EMA that can take part in a synthesis.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PowerSource {
    pub snapshot: String,
    pub profile: String,
    pub step: u64,
    pub gamma: f64,
    pub sigma_rel: f64,
}

/// The synthesis of one length.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PlannedTarget {
    pub sigma_rel: f64,
    pub gamma: f64,
    /// The weight of each source (in `sources` order); they sum to 1.
    pub weights: Vec<f64>,
    /// L2 distance between the synthesised and the requested averaging
    /// profile, relative to the requested one's norm.
    pub residual: f64,
}

/// What a post-hoc request would compute (`GET .../posthoc/plan`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Plan {
    /// The target step (a step with a stored power-profile snapshot).
    pub step: u64,
    /// Every step a synthesis can target (with the chosen profiles).
    pub usable_steps: Vec<u64>,
    /// The stored EMAs combined, oldest first.
    pub sources: Vec<PowerSource>,
    /// One per requested `sigma_rel`, in request order.
    pub targets: Vec<PlannedTarget>,
}

/// How a post-hoc synthesis solves for its weights.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PosthocMethod {
    /// EDM2's `solve_posthoc_coefficients`: the sources at or before the
    /// target step (one of theirs), weights scaled to sum to 1.
    #[default]
    Edm2,
    /// ema-pytorch `PostHocEMA.synthesize_ema_model`: every source, also
    /// those after the target step (any step up to the newest source's),
    /// exponents in float32, weights as solved.
    EmaPytorch,
}

/// The power profiles of a run (`name -> gamma`), restricted to `only`.
fn power_profiles(
    config: &RunConfig,
    only: Option<&[String]>,
) -> Result<HashMap<String, f64>, SnapshotError> {
    let all: HashMap<String, f64> = config
        .profiles
        .iter()
        .filter_map(|p| match p {
            ProfileSpec::Power { name, gamma, .. } | ProfileSpec::Karras { name, gamma, .. } => {
                gamma.map(|g| (name.clone(), g))
            }
            _ => None,
        })
        .collect();
    match only {
        None => {
            if all.is_empty() {
                return Err(SnapshotError::Invalid(format!(
                    "run `{}` has no power profile to synthesise from",
                    config.name
                )));
            }
            Ok(all)
        }
        Some([]) => Err(SnapshotError::Invalid(
            "profiles: give at least one power profile".into(),
        )),
        Some(list) => list
            .iter()
            .map(|p| {
                all.get(p).map(|g| (p.clone(), *g)).ok_or_else(|| {
                    SnapshotError::Invalid(format!(
                        "profiles: `{p}` is not a power profile of this run"
                    ))
                })
            })
            .collect(),
    }
}

/// Every complete captured snapshot's EMA of a chosen power profile, one
/// per (step, profile) (the newest when several snapshots share a step),
/// oldest first.
async fn power_sources(
    state: &Snaps,
    config: &RunConfig,
    gammas: &HashMap<String, f64>,
) -> Result<Vec<PowerSource>, SnapshotError> {
    let rows = state.store.snapshots(&config.name).await?;
    let mut best: BTreeMap<(u64, String), (&SnapshotRow, f64)> = BTreeMap::new();
    for row in rows.iter().filter(|r| mergeable(r)) {
        for profile in &row.profiles {
            let Some(&gamma) = gammas.get(profile) else {
                continue;
            };
            let key = (row.step, profile.clone());
            let newer = best
                .get(&key)
                .is_none_or(|(b, _)| row.completed_at_ms > b.completed_at_ms);
            if newer {
                best.insert(key, (row, gamma));
            }
        }
    }
    Ok(best
        .into_iter()
        .map(|((step, profile), (row, gamma))| PowerSource {
            snapshot: row.id.clone(),
            profile,
            step,
            gamma,
            sigma_rel: gamma_to_sigma_rel(gamma),
        })
        .collect())
}

fn check_sigmas(sigma_rels: &[f64]) -> Result<Vec<f64>, SnapshotError> {
    if sigma_rels.is_empty() {
        return Err(SnapshotError::Invalid(
            "sigma_rel: give at least one value".into(),
        ));
    }
    if sigma_rels.len() > MAX_SWEEP {
        return Err(SnapshotError::Invalid(format!(
            "sigma_rel: at most {MAX_SWEEP} values in one request, got {}",
            sigma_rels.len()
        )));
    }
    sigma_rels
        .iter()
        .map(|&s| {
            sigma_rel_to_gamma(s).ok_or_else(|| {
                SnapshotError::Invalid(format!(
                    "sigma_rel: {s} is out of range (0, {MAX_SIGMA_REL:.4}]"
                ))
            })
        })
        .collect()
}

/// Lists steps for a message: all of them when few, else the ends.
fn steps_text(steps: &[u64]) -> String {
    const SHOWN: usize = 40;
    if steps.len() <= SHOWN {
        return format!("{steps:?}");
    }
    let head: Vec<String> = steps[..SHOWN / 2].iter().map(u64::to_string).collect();
    let tail: Vec<String> = steps[steps.len() - SHOWN / 2..]
        .iter()
        .map(u64::to_string)
        .collect();
    format!(
        "[{}, ... ({} more) ..., {}]",
        head.join(", "),
        steps.len() - SHOWN,
        tail.join(", ")
    )
}

/// Solves for the weights of each `sigma_rel` at `step` (default: the
/// newest usable step), from the stored snapshots of `profiles` (default:
/// every power profile) at or before it (`ema_pytorch`: all of them).
pub async fn plan(
    state: &Snaps,
    run: &RunHandle,
    sigma_rels: &[f64],
    step: Option<u64>,
    profiles: Option<&[String]>,
    method: PosthocMethod,
) -> Result<Plan, SnapshotError> {
    let config = &run.config;
    let target_gammas = check_sigmas(sigma_rels)?;
    let gammas = power_profiles(config, profiles)?;
    let all = power_sources(state, config, &gammas).await?;
    let mut usable_steps: Vec<u64> = all.iter().map(|s| s.step).collect();
    usable_steps.dedup();
    let step = target_step(config, &gammas, &usable_steps, step, method)?;
    let sources: Vec<PowerSource> = match method {
        PosthocMethod::Edm2 => all.into_iter().filter(|s| s.step <= step).collect(),
        PosthocMethod::EmaPytorch => all,
    };
    let fits = solve_weights(config, &sources, step, &target_gammas, method).await?;
    let targets = sigma_rels
        .iter()
        .zip(target_gammas)
        .zip(fits)
        .map(|((&sigma_rel, gamma), fit)| PlannedTarget {
            sigma_rel,
            gamma,
            weights: fit.weights,
            residual: fit.residual,
        })
        .collect();
    Ok(Plan {
        step,
        usable_steps,
        sources,
        targets,
    })
}

/// The step a synthesis targets: the one asked for when a stored snapshot
/// allows it, else the newest usable step.
fn target_step(
    config: &RunConfig,
    gammas: &HashMap<String, f64>,
    usable_steps: &[u64],
    step: Option<u64>,
    method: PosthocMethod,
) -> Result<u64, SnapshotError> {
    match step {
        None => usable_steps.last().copied().ok_or_else(|| {
            SnapshotError::NotFound(format!(
                "run `{}` has no complete snapshot of a power profile yet",
                config.name
            ))
        }),
        Some(s) if usable_steps.binary_search(&s).is_ok() => Ok(s),
        // ema-pytorch synthesises at any step up to its newest checkpoint.
        Some(s)
            if method == PosthocMethod::EmaPytorch
                && usable_steps.last().is_some_and(|&newest| s <= newest) =>
        {
            Ok(s)
        }
        Some(s) if method == PosthocMethod::EmaPytorch => Err(SnapshotError::Invalid(format!(
            "step: {s} is past the newest snapshot of the power profiles {:?}; usable \
             steps: {}",
            sorted_names(gammas),
            steps_text(usable_steps)
        ))),
        Some(s) => Err(SnapshotError::Invalid(format!(
            "step: {s} has no complete snapshot of the power profiles {:?}; a post-hoc EMA \
             can only be synthesised at a step where one was stored (EDM2 reconstructs at \
             an input snapshot's time); usable steps: {}",
            sorted_names(gammas),
            steps_text(usable_steps)
        ))),
    }
}

/// Solves (on a blocking thread) for the weights of each target gamma at
/// `step` from `sources`.
async fn solve_weights(
    config: &RunConfig,
    sources: &[PowerSource],
    step: u64,
    target_gammas: &[f64],
    method: PosthocMethod,
) -> Result<Vec<posthoc::Fit>, SnapshotError> {
    let inputs: Vec<Source> = sources
        .iter()
        .map(|s| Source {
            t: (s.step + 1) as f64,
            gamma: s.gamma,
        })
        .collect();
    let gs = target_gammas.to_vec();
    let solve = match method {
        PosthocMethod::Edm2 => posthoc::solve,
        PosthocMethod::EmaPytorch => posthoc::solve_ema_pytorch,
    };
    tokio::task::spawn_blocking(move || solve(&inputs, (step + 1) as f64, &gs))
        .await
        .map_err(|e| SnapshotError::Worker(format!("solving the post-hoc weights: {e}")))?
        .map_err(|e| match e {
            // The solver's own words (LAPACK, torch assertions) are ours
            // to read, not the caller's.
            PosthocError::Solve(m) => {
                tracing::warn!(run = %config.name, step, error = %m, "post-hoc solve failed");
                SnapshotError::Invalid(format!(
                    "the post-hoc weights at step {step} cannot be solved from these snapshots \
                     (their averaging profiles are too alike or too far apart)"
                ))
            }
            other => SnapshotError::Invalid(other.to_string()),
        })
}

fn sorted_names(gammas: &HashMap<String, f64>) -> Vec<&str> {
    let mut names: Vec<&str> = gammas.keys().map(String::as_str).collect();
    names.sort_unstable();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_step_lists_are_shortened() {
        let few: Vec<u64> = (0..5).collect();
        assert_eq!(steps_text(&few), "[0, 1, 2, 3, 4]");
        let many: Vec<u64> = (0..100).map(|s| s * 10).collect();
        let text = steps_text(&many);
        assert!(
            text.starts_with("[0, 10,") && text.ends_with("980, 990]"),
            "{text}"
        );
        assert!(text.contains("(60 more)"), "{text}");
    }
}
