//! Derived snapshots: weights the server computes from stored snapshots
//! rather than captures.
//!
//! - `posthoc`: EDM2 post-hoc EMA. [`plan`] finds the run's stored power
//!   profiles and solves for the weights ([`posthoc`](crate::snapshot::posthoc)); [`posthoc`]
//!   writes one derived snapshot per requested `sigma_rel`, all in one pass
//!   over the sources.
//! - `merge`: checkpoint averaging of the online weights (the mirror) of
//!   stored snapshots, uniform, linear or exponential in their age.
//!
//! Both are catalog rows inserted `pending`, filled by one background job
//! ([`spawn_job`]) that streams the sources through [`combine`](crate::snapshot::combine) rank
//! by rank and completes every output together. Progress (source bytes read
//! of the total) is kept in memory for `GET .../snapshots/{id}` and sent as
//! transient `snapshot` events.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{disk, record_failure, remove_files, Snaps, SnapshotError};
use crate::clock::now_ms;
use crate::contract::{SnapshotKind, SnapshotStatus};
use crate::engine::snapshot_id;
use crate::events::{Event, SnapshotEvent};
use crate::registry::RunHandle;
use crate::run::{ProfileSpec, RunConfig};
use crate::sigma_rel::{gamma_to_sigma_rel, sigma_rel_to_gamma, MAX_SIGMA_REL};
use crate::snapshot::combine::{self, OutputSpec};
use crate::snapshot::files;
use crate::snapshot::format::{self, MIRROR_PART};
use crate::snapshot::meta;
use crate::snapshot::posthoc::{self, PosthocError, Source};
use crate::snapshot::source::PartLoc;
use crate::store::snapshots::{FileRow, SnapshotRow};
use crate::wire::DType;

/// The most lengths one post-hoc request may ask for.
pub const MAX_SWEEP: usize = 32;
/// The most snapshots one merge may average.
pub const MAX_MERGE: usize = 256;

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

/// The dtype post-hoc sources are rounded to before they are weighted
/// (ema-pytorch's `checkpoint_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SourceDtype {
    Fp16,
    Bf16,
}

impl SourceDtype {
    fn dtype(self) -> DType {
        match self {
            SourceDtype::Fp16 => DType::F16,
            SourceDtype::Bf16 => DType::BF16,
        }
    }
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
    let step = match step {
        None => *usable_steps.last().ok_or_else(|| {
            SnapshotError::NotFound(format!(
                "run `{}` has no complete snapshot of a power profile yet",
                config.name
            ))
        })?,
        Some(s) if usable_steps.binary_search(&s).is_ok() => s,
        // ema-pytorch synthesises at any step up to its newest checkpoint.
        Some(s)
            if method == PosthocMethod::EmaPytorch
                && usable_steps.last().is_some_and(|&newest| s <= newest) =>
        {
            s
        }
        Some(s) if method == PosthocMethod::EmaPytorch => {
            return Err(SnapshotError::Invalid(format!(
                "step: {s} is past the newest snapshot of the power profiles {:?}; usable \
                 steps: {}",
                sorted_names(&gammas),
                steps_text(&usable_steps)
            )))
        }
        Some(s) => {
            return Err(SnapshotError::Invalid(format!(
                "step: {s} has no complete snapshot of the power profiles {:?}; a post-hoc EMA \
                 can only be synthesised at a step where one was stored (EDM2 reconstructs at \
                 an input snapshot's time); usable steps: {}",
                sorted_names(&gammas),
                steps_text(&usable_steps)
            )))
        }
    };
    let sources: Vec<PowerSource> = match method {
        PosthocMethod::Edm2 => all.into_iter().filter(|s| s.step <= step).collect(),
        PosthocMethod::EmaPytorch => all,
    };
    let inputs: Vec<Source> = sources
        .iter()
        .map(|s| Source {
            t: (s.step + 1) as f64,
            gamma: s.gamma,
        })
        .collect();
    let gs = target_gammas.clone();
    let solve = match method {
        PosthocMethod::Edm2 => posthoc::solve,
        PosthocMethod::EmaPytorch => posthoc::solve_ema_pytorch,
    };
    let fits = tokio::task::spawn_blocking(move || solve(&inputs, (step + 1) as f64, &gs))
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
        })?;
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

fn sorted_names(gammas: &HashMap<String, f64>) -> Vec<&str> {
    let mut names: Vec<&str> = gammas.keys().map(String::as_str).collect();
    names.sort_unstable();
    names
}

/// One part of one stored snapshot that a job reads.
#[derive(Debug, Clone)]
struct JobSource {
    snapshot: String,
    part: String,
}

/// One derived snapshot a job writes.
#[derive(Debug, Clone)]
struct JobOutput {
    id: String,
    /// The profile name it is stored under.
    profile: String,
    weights: Vec<f64>,
}

/// Derived snapshots just recorded, and the source bytes their job reads.
#[derive(Debug)]
pub struct Started {
    /// Pending rows, in request order.
    pub rows: Vec<SnapshotRow>,
    pub total: u64,
}

/// How `POST /posthoc` solves and reads its sources.
#[derive(Debug, Clone, Copy, Default)]
pub struct Synthesis {
    pub method: PosthocMethod,
    /// Round every source value to this dtype before weighting it.
    pub source_dtype: Option<SourceDtype>,
}

/// `POST /posthoc`: one derived snapshot per `sigma_rel` (kind `posthoc`,
/// one profile `name`), written in one pass over the sources.
pub async fn posthoc(
    state: &Snaps,
    run: &RunHandle,
    sigma_rels: &[f64],
    step: Option<u64>,
    name: Option<String>,
    profiles: Option<&[String]>,
    synthesis: Synthesis,
) -> Result<Started, SnapshotError> {
    let name = profile_name(name, SnapshotKind::Posthoc.as_str())?;
    let plan = plan(state, run, sigma_rels, step, profiles, synthesis.method).await?;
    let sweep_ids: Vec<String> = plan
        .targets
        .iter()
        .map(|_| snapshot_id(SnapshotKind::Posthoc, plan.step))
        .collect();
    let mut rows = Vec::with_capacity(plan.targets.len());
    let mut outputs = Vec::with_capacity(plan.targets.len());
    for (target, id) in plan.targets.iter().zip(&sweep_ids) {
        let detail = serde_json::json!({
            "sigma_rel": target.sigma_rel,
            "gamma": target.gamma,
            "residual": target.residual,
            "sources": plan.sources.iter().zip(&target.weights).map(|(s, w)| serde_json::json!({
                "snapshot": s.snapshot, "profile": s.profile, "step": s.step,
                "gamma": s.gamma, "sigma_rel": s.sigma_rel, "weight": w,
            })).collect::<Vec<_>>(),
            "sweep": sweep_ids,
            "method": synthesis.method,
            "source_dtype": synthesis.source_dtype,
        });
        rows.push(derived_row(
            run,
            id,
            SnapshotKind::Posthoc,
            plan.step,
            format!("sigma_rel={}", target.sigma_rel),
            &name,
            detail,
        ));
        outputs.push(JobOutput {
            id: id.clone(),
            profile: name.clone(),
            weights: target.weights.clone(),
        });
    }
    let sources = plan
        .sources
        .iter()
        .map(|s| JobSource {
            snapshot: s.snapshot.clone(),
            part: s.profile.clone(),
        })
        .collect::<Vec<_>>();
    // The newest source carries the copied tensors (EDM2 copies buffers
    // from its inputs in order, so the last one's stay).
    let base = sources.len() - 1;
    let round_to = synthesis.source_dtype.map(SourceDtype::dtype);
    start(state, run, rows, sources, base, outputs, round_to).await
}

/// How a merge weighs its snapshots, oldest to newest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MergeWeights {
    /// `1/K` each.
    Uniform,
    /// Proportional to `1, 2, ..., K` (the newest counts most).
    Linear,
    /// Proportional to `alpha^age`, `age` = 0 for the newest.
    Exp,
}

impl MergeWeights {
    pub fn name(self) -> &'static str {
        match self {
            MergeWeights::Uniform => "uniform",
            MergeWeights::Linear => "linear",
            MergeWeights::Exp => "exp",
        }
    }
}

/// The normalised weights of `k` snapshots, oldest first.
pub fn merge_weights(scheme: MergeWeights, k: usize, alpha: f64) -> Vec<f64> {
    let raw: Vec<f64> = (0..k)
        .map(|i| match scheme {
            MergeWeights::Uniform => 1.0,
            MergeWeights::Linear => (i + 1) as f64,
            MergeWeights::Exp => alpha.powi((k - 1 - i) as i32),
        })
        .collect();
    let sum: f64 = raw.iter().sum();
    raw.into_iter().map(|w| w / sum).collect()
}

/// Which snapshots a merge averages.
pub enum MergeSelection {
    Ids(Vec<String>),
    Last(usize),
}

/// `POST /merge`: the weighted average of the online weights (mirror) of
/// stored snapshots, as a derived snapshot of kind `merge` holding one
/// profile `name` at the newest source's step.
pub async fn merge(
    state: &Snaps,
    run: &RunHandle,
    selection: MergeSelection,
    scheme: MergeWeights,
    alpha: Option<f64>,
    name: Option<String>,
) -> Result<Started, SnapshotError> {
    let config = &run.config;
    let name = profile_name(name, "merged")?;
    if !config.mirror {
        return Err(SnapshotError::Invalid(format!(
            "run `{}` keeps no online weights (create it with mirror: true to merge checkpoints)",
            config.name
        )));
    }
    let alpha = merge_alpha(scheme, alpha)?;
    let rows = state.store.snapshots(&config.name).await?;
    // A mirror run captures the mirror in every cut; `start` reads each
    // source's files and refuses one without its part.
    let chosen = choose_merged(&config.name, rows, selection)?;
    let weights = merge_weights(scheme, chosen.len(), alpha);
    let newest = chosen.last().map(|r| r.step).unwrap_or(0);
    let id = snapshot_id(SnapshotKind::Merge, newest);
    let detail = serde_json::json!({
        "weights": scheme,
        "alpha": (scheme == MergeWeights::Exp).then_some(alpha),
        "sources": chosen.iter().zip(&weights).map(|(r, w)| serde_json::json!({
            "snapshot": r.id, "step": r.step, "weight": w,
        })).collect::<Vec<_>>(),
    });
    let label = format!("merge of {} ({})", chosen.len(), scheme.name());
    let row = derived_row(run, &id, SnapshotKind::Merge, newest, label, &name, detail);
    let sources: Vec<JobSource> = chosen
        .iter()
        .map(|r| JobSource {
            snapshot: r.id.clone(),
            part: MIRROR_PART.to_string(),
        })
        .collect();
    let base = sources.len() - 1;
    let output = JobOutput {
        id,
        profile: name,
        weights,
    };
    start(state, run, vec![row], sources, base, vec![output], None).await
}

/// `alpha` of the exp weights (default 0.5); the others take none.
fn merge_alpha(scheme: MergeWeights, alpha: Option<f64>) -> Result<f64, SnapshotError> {
    match (scheme, alpha) {
        (MergeWeights::Exp, None) => Ok(0.5),
        (MergeWeights::Exp, Some(a)) if a.is_finite() && a > 0.0 && a <= 1.0 => Ok(a),
        (MergeWeights::Exp, Some(a)) => Err(SnapshotError::Invalid(format!(
            "alpha: {a} is out of range (0, 1]"
        ))),
        (_, Some(_)) => Err(SnapshotError::Invalid(
            "alpha: only the exp weights take an alpha".into(),
        )),
        (_, None) => Ok(1.0),
    }
}

/// Complete manual and periodic snapshots hold a consistent cut of the
/// online weights; the others do not.
fn mergeable(r: &SnapshotRow) -> bool {
    r.status == SnapshotStatus::Complete && r.kind.is_cut()
}

/// The snapshots a merge averages, oldest first.
fn choose_merged(
    run: &str,
    rows: Vec<SnapshotRow>,
    selection: MergeSelection,
) -> Result<Vec<SnapshotRow>, SnapshotError> {
    let mut chosen = match selection {
        MergeSelection::Last(k) => {
            if k == 0 || k > MAX_MERGE {
                return Err(SnapshotError::Invalid(format!(
                    "last: between 1 and {MAX_MERGE} snapshots"
                )));
            }
            let mut all: Vec<SnapshotRow> = rows.into_iter().filter(mergeable).collect();
            all.sort_by_key(|r| (r.step, r.created_at_ms));
            // One snapshot per step: the online weights of a step are the same.
            all.dedup_by_key(|r| r.step);
            if all.len() < k {
                return Err(SnapshotError::Invalid(format!(
                    "last: {k} snapshots asked for, the run has {} complete ones",
                    all.len()
                )));
            }
            all.split_off(all.len() - k)
        }
        MergeSelection::Ids(ids) => {
            if ids.is_empty() || ids.len() > MAX_MERGE {
                return Err(SnapshotError::Invalid(format!(
                    "snapshots: between 1 and {MAX_MERGE} ids"
                )));
            }
            let mut seen = HashSet::new();
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                if !seen.insert(id.clone()) {
                    return Err(SnapshotError::Invalid(format!(
                        "snapshots: `{id}` is listed twice"
                    )));
                }
                let row = rows.iter().find(|r| r.id == id).ok_or_else(|| {
                    SnapshotError::NotFound(format!("no snapshot `{id}` in run `{run}`"))
                })?;
                if !mergeable(row) {
                    return Err(SnapshotError::Invalid(format!(
                        "snapshots: `{id}` is a {} snapshot that is {}; only complete manual or \
                         periodic snapshots hold a consistent cut of the online weights",
                        row.kind, row.status
                    )));
                }
                out.push(row.clone());
            }
            out
        }
    };
    chosen.sort_by_key(|r| (r.step, r.created_at_ms));
    Ok(chosen)
}

fn profile_name(name: Option<String>, default: &str) -> Result<String, SnapshotError> {
    let name = name.unwrap_or_else(|| default.to_string());
    if !crate::run::valid_name(&name) || name == MIRROR_PART {
        return Err(SnapshotError::Invalid(format!(
            "name: `{name}` is not a valid profile name"
        )));
    }
    if crate::run::reserved_profile(&name) {
        return Err(SnapshotError::Invalid(format!(
            "name: `{name}` is reserved (`online` names the mirror in downloads and comparisons)"
        )));
    }
    Ok(name)
}

fn derived_row(
    run: &RunHandle,
    id: &str,
    kind: SnapshotKind,
    step: u64,
    label: String,
    profile: &str,
    detail: serde_json::Value,
) -> SnapshotRow {
    SnapshotRow {
        label: Some(label),
        detail,
        ..SnapshotRow::pending(id, &run.config.name, step, kind, vec![profile.to_string()])
    }
}

/// Progress of a derived snapshot being written.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct Progress {
    /// Source bytes read so far.
    pub done: u64,
    /// Source bytes to read in all.
    pub total: u64,
}

/// Inserts the pending rows and starts the job that fills them.
async fn start(
    state: &Snaps,
    run: &RunHandle,
    rows: Vec<SnapshotRow>,
    sources: Vec<JobSource>,
    base: usize,
    outputs: Vec<JobOutput>,
    round_to: Option<DType>,
) -> Result<Started, SnapshotError> {
    let Some(kind) = rows.first().map(|r| r.kind) else {
        return Err(SnapshotError::Internal(
            "no derived snapshot to write".into(),
        ));
    };
    // Every source's files are looked up before anything is recorded, so a
    // request that cannot run changes nothing.
    let mut files = Vec::with_capacity(sources.len());
    for s in &sources {
        let rows: Vec<FileRow> = state
            .store
            .snapshot_files(&s.snapshot)
            .await?
            .into_iter()
            .filter(|f| f.part == s.part)
            .collect();
        if rows.is_empty() {
            return Err(SnapshotError::Internal(format!(
                "complete snapshot `{}` holds no `{}` part",
                s.snapshot, s.part
            )));
        }
        files.push(rows);
    }
    // Every source part is reread and held to its recorded size and
    // sha256 before anything is recorded: a corrupt source refuses the
    // request (500 snapshot_corrupt) instead of being averaged in.
    let sources_read: Vec<std::sync::Arc<PartLoc>> = files
        .iter()
        .flatten()
        .map(|f| PartLoc::recorded(&state.objects, &f.path, f.bytes, &f.sha256))
        .collect();
    let checked = tokio::task::spawn_blocking(move || {
        let cancel = std::sync::atomic::AtomicBool::new(false);
        sources_read.iter().try_for_each(|p| p.verify(&cancel))
    })
    .await
    .map_err(|e| SnapshotError::Worker(e.to_string()))?;
    let during = if kind == SnapshotKind::Merge {
        "merge"
    } else {
        "posthoc"
    };
    super::verify::noted(
        &state.events,
        &state.metrics,
        during,
        checked.map_err(SnapshotError::Io),
    )?;
    let total: u64 = files.iter().flatten().map(|f| f.bytes).sum();
    // Each output is about the size of one source: refuse early rather than
    // fail on a full disk halfway.
    let per_output = total / files.len().max(1) as u64;
    disk::check(state, per_output * outputs.len() as u64)?;
    for row in &rows {
        state.store.insert_snapshot(row).await?;
    }
    state
        .pending
        .progress_start(outputs.iter().map(|o| o.id.as_str()), total);
    for row in &rows {
        state.events.emit(
            &run.config.name,
            None,
            Some(row.step),
            Event::Snapshot(SnapshotEvent::Pending {
                id: row.id.clone(),
                kind: row.kind,
                cut: None,
            }),
        );
    }
    let job = Job {
        run: run.config.name.clone(),
        kind,
        step: rows.first().map(|r| r.step).unwrap_or(0),
        out_dtype: if run.config.ema_dtype.kind() == tch::Kind::Double {
            DType::F64
        } else {
            DType::F32
        },
        files,
        base,
        outputs,
        total,
        round_to,
    };
    spawn_job(state.clone(), job);
    Ok(Started { rows, total })
}

struct Job {
    run: String,
    kind: SnapshotKind,
    step: u64,
    out_dtype: DType,
    /// Per source: its files of the part read (one per rank).
    files: Vec<Vec<FileRow>>,
    base: usize,
    outputs: Vec<JobOutput>,
    total: u64,
    /// Sources rounded to this dtype before they are weighted.
    round_to: Option<DType>,
}

/// Runs a job on a blocking thread and records how it ended.
fn spawn_job(state: Snaps, job: Job) {
    tokio::spawn(async move {
        let started = Instant::now();
        let ids: Vec<String> = job.outputs.iter().map(|o| o.id.clone()).collect();
        let (run, kind, step) = (job.run.clone(), job.kind, job.step);
        let staging = staging_dir(&state);
        let (st, objects, at) = (state.clone(), state.objects.clone(), staging.clone());
        let written = tokio::task::spawn_blocking(move || {
            write_outputs(&at, &objects, &job, &mut |done| report(&st, &job, done))
        })
        .await;
        let written = match written {
            Ok(Ok(per_output)) => publish(&state, &staging, &ids, per_output)
                .await
                .map_err(|e| e.to_string()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(format!("the job panicked: {e}")),
        };
        let result = match written {
            Ok(per_output) => complete(&state, &ids, step, per_output).await,
            Err(e) => Err(e),
        };
        state.pending.progress_end(ids.iter().map(String::as_str));
        match result {
            Ok(bytes) => {
                tracing::info!(run = %run, kind = %kind, snapshots = ?ids, secs = started.elapsed().as_secs_f64(), "derived snapshots written");
                for (id, b) in ids.iter().zip(bytes) {
                    state.events.emit(
                        &run,
                        None,
                        Some(step),
                        Event::Snapshot(SnapshotEvent::Complete {
                            id: id.clone(),
                            kind,
                            bytes: b,
                        }),
                    );
                }
            }
            Err(reason) => {
                tracing::warn!(run = %run, kind = %kind, snapshots = ?ids, "derived snapshots failed: {reason}");
                for id in &ids {
                    // Files first: on a full disk the catalog needs the room.
                    remove_files(&state, &run, id).await;
                    record_failure(&state, id, &reason).await;
                    state.events.emit(
                        &run,
                        None,
                        Some(step),
                        Event::Snapshot(SnapshotEvent::Failed {
                            id: id.clone(),
                            kind: Some(kind),
                            reason: reason.to_string(),
                        }),
                    );
                }
            }
        }
    });
}

/// Records progress (at most a few times a second) and tells SSE readers.
fn report(state: &Snaps, job: &Job, done: u64) {
    state
        .pending
        .progress_set(job.outputs.iter().map(|o| o.id.as_str()), done);
    state.events.emit(
        &job.run,
        None,
        Some(job.step),
        Event::Snapshot(SnapshotEvent::Running {
            ids: job.outputs.iter().map(|o| o.id.clone()).collect(),
            kind: job.kind,
            done,
            total: job.total,
        }),
    );
}

/// Marks every output complete; returns their sizes.
async fn complete(
    state: &Snaps,
    ids: &[String],
    step: u64,
    per_output: Vec<Vec<FileRow>>,
) -> Result<Vec<u64>, String> {
    let mut sizes = Vec::with_capacity(ids.len());
    for (id, files) in ids.iter().zip(per_output) {
        sizes.push(files.iter().map(|f| f.bytes).sum());
        let recorded = state
            .store
            .complete_snapshot(id, step, &files, now_ms())
            .await
            .map_err(|e| e.to_string())?;
        if !recorded {
            return Err(format!("snapshot `{id}` was deleted while it was written"));
        }
    }
    Ok(sizes)
}

/// How often progress is reported, at most.
const REPORT_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// Where derived parts are written before they are stored: the store's
/// own directory when it is one (storing is then a rename in place), else
/// `<data-dir>/staging` (storing uploads each part, then removes it).
fn staging_dir(state: &Snaps) -> std::path::PathBuf {
    state
        .objects
        .local_path("")
        .unwrap_or_else(|| state.pending.data_dir().join("staging"))
}

/// Stores the parts written under `staging`; their rows keep their keys.
async fn publish(
    state: &Snaps,
    staging: &std::path::Path,
    ids: &[String],
    per_output: Vec<Vec<FileRow>>,
) -> Result<Vec<Vec<FileRow>>, SnapshotError> {
    for (rows, id) in per_output.iter().zip(ids) {
        for row in rows {
            let record = async |upload_id: &str| {
                let open = crate::store::uploads::OpenUpload {
                    upload_id: upload_id.to_string(),
                    key: row.path.clone(),
                    snapshot: id.clone(),
                };
                state
                    .store
                    .record_upload(&open, now_ms())
                    .await
                    .map_err(|e| crate::objstore::StoreError::Io(std::io::Error::other(e)))
            };
            let stored = state
                .objects
                .put_file(
                    &row.path,
                    &staging.join(&row.path),
                    Some(&row.sha256),
                    record,
                )
                .await;
            if state.objects.local_path("").is_none() {
                // The upload's id, recorded when it opened, is done with.
                let _ = state.store.forget_uploads_of(&row.path).await;
            }
            stored?;
        }
    }
    Ok(per_output)
}

/// Writes every output, rank by rank, under `data_dir`; returns each
/// output's file rows (keys in the store).
fn write_outputs(
    data_dir: &std::path::Path,
    objects: &crate::objstore::ObjectStore,
    job: &Job,
    report: &mut dyn FnMut(u64),
) -> Result<Vec<Vec<FileRow>>, SnapshotError> {
    let ranks: Vec<u32> = {
        let mut r: Vec<u32> = job.files[job.base].iter().map(|f| f.rank).collect();
        r.sort_unstable();
        r
    };
    let mut out: Vec<Vec<FileRow>> = vec![Vec::new(); job.outputs.len()];
    let mut done = 0u64;
    let mut last_report = Instant::now();
    for rank in ranks {
        let mut paths = Vec::with_capacity(job.files.len());
        for files in &job.files {
            let f = files.iter().find(|f| f.rank == rank).ok_or_else(|| {
                SnapshotError::Internal(format!("rank {rank} is missing from a source snapshot"))
            })?;
            paths.push(PartLoc::recorded(objects, &f.path, f.bytes, &f.sha256));
        }
        let base_file = job.files[job.base]
            .iter()
            .find(|f| f.rank == rank)
            .expect("ranks come from the base");
        let meta = meta::decode_rank_meta(&base_file.state)?;
        let specs = job
            .outputs
            .iter()
            .map(|o| OutputSpec {
                rel: files::snapshot_rel_dir(&job.run, &o.id)
                    .join(files::part_file_name(rank, &o.profile)),
                weights: o.weights.clone(),
                meta: format::part_metadata(&job.run, &o.id, rank, job.step, &o.profile),
            })
            .collect();
        let written = combine::combine_rank(
            data_dir,
            &meta.layout,
            &paths,
            job.base,
            job.out_dtype,
            job.round_to,
            specs,
            &mut |bytes| {
                done += bytes;
                if last_report.elapsed() >= REPORT_EVERY {
                    last_report = Instant::now();
                    report(done);
                }
            },
        )
        .map_err(|e| match e {
            combine::CombineError::Io(e) => SnapshotError::Io(e),
            combine::CombineError::Format(format::FormatError::Meta(m)) => SnapshotError::Meta(m),
            other => SnapshotError::Internal(other.to_string()),
        })?;
        let state_json = meta::encode_rank_meta(&meta);
        for ((o, w), rows) in job.outputs.iter().zip(written).zip(out.iter_mut()) {
            rows.push(FileRow {
                rank,
                part: o.profile.clone(),
                path: w.path,
                sha256: w.sha256,
                bytes: w.bytes,
                step: job.step,
                state: state_json.clone(),
                // Weights no rank ever held: nothing to fence.
                fence: None,
            });
        }
    }
    for o in &job.outputs {
        let dir = data_dir.join(files::snapshot_rel_dir(&job.run, &o.id));
        if dir.exists() {
            files::sync_dir(&dir)?;
        }
    }
    report(done);
    Ok(out)
}

/// The progress of a derived snapshot still being written.
pub fn progress_of(state: &Snaps, id: &str) -> Option<Progress> {
    state.pending.progress_of(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_weights_are_normalised_and_ordered() {
        assert_eq!(merge_weights(MergeWeights::Uniform, 4, 1.0), vec![0.25; 4]);
        let lin = merge_weights(MergeWeights::Linear, 3, 1.0);
        assert!((lin[0] - 1.0 / 6.0).abs() < 1e-15 && (lin[2] - 0.5).abs() < 1e-15);
        let exp = merge_weights(MergeWeights::Exp, 3, 0.5);
        // 0.25 : 0.5 : 1, oldest first.
        assert!((exp[0] - 0.25 / 1.75).abs() < 1e-15 && (exp[2] - 1.0 / 1.75).abs() < 1e-15);
    }

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
