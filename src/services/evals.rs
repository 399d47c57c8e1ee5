//! Evaluations of candidates: named numbers (a held-out loss, an accuracy)
//! for the weights of one profile of one complete snapshot, stored once per
//! snapshot, profile and evaluator; listed with what the snapshot says of
//! the candidate (step, kind, `sigma_rel`, fit residual); and the best
//! candidate of a metric with a ready download path.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Context, ServiceError};
use crate::clock::now_ms;
use crate::contract::{BestMode, CandidateKind, SnapshotKind, SnapshotStatus};
use crate::events::{EvalRecorded, Event};
use crate::registry::RunHandle;
use crate::run::{ProfileSpec, RunConfig};
use crate::snapshot::format::MIRROR_PART;
use crate::store::evals::{EvalRow, StoredEval};
use crate::store::snapshots::SnapshotRow;

/// Most metrics in one evaluation, and the longest metric and evaluator
/// name.
pub const MAX_METRICS: usize = 64;
pub const MAX_NAME_CHARS: usize = 128;

/// The profile name of a snapshot's online weights (its mirror).
pub const ONLINE: &str = "online";

/// Evaluations in one page of a listing by default, and at most.
pub const DEFAULT_PAGE: u32 = 1000;
pub const MAX_PAGE: u32 = 10_000;

/// Where a page of a listing starts: after the evaluation at this
/// candidate step and id. Clients see it as an opaque string (`next`,
/// given back as `after=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalCursor {
    pub step: u64,
    pub id: i64,
}

impl std::fmt::Display for EvalCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.step, self.id)
    }
}

impl std::str::FromStr for EvalCursor {
    type Err = ServiceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            ServiceError::bad_request(
                "invalid_cursor",
                format!("after: `{s}` is not a cursor this listing gave (its `next`)"),
            )
        };
        let (step, id) = s.split_once('.').ok_or_else(bad)?;
        Ok(EvalCursor {
            step: step.parse().map_err(|_| bad())?,
            id: id.parse().map_err(|_| bad())?,
        })
    }
}

/// One page of a listing.
#[derive(Debug)]
pub struct EvalPage {
    pub evals: Vec<Evaluation>,
    /// Where the next page starts; `None` on the last.
    pub next: Option<EvalCursor>,
}

/// An evaluation as posted.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewEval {
    /// A complete snapshot of the run.
    pub snapshot: String,
    /// A profile the snapshot holds, or `online` for the mirror stored
    /// with a cut.
    pub profile: String,
    /// Metric name (1-128 characters) -> a finite number; 1 to 64 of them.
    #[schema(value_type = Object)]
    pub metrics: BTreeMap<String, serde_json::Value>,
    /// Who measured (a script, a dataset); one evaluation per snapshot,
    /// profile and evaluator. Default: none.
    pub evaluator: Option<String>,
}

/// An evaluation with its candidate.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Evaluation {
    pub id: i64,
    /// The snapshot holding the candidate's weights.
    pub snapshot: String,
    pub profile: String,
    pub evaluator: String,
    pub metrics: BTreeMap<String, f64>,
    pub at_ms: i64,
    /// The candidate's step (its snapshot's).
    pub step: u64,
    pub kind: CandidateKind,
    /// The EMA length: a post-hoc target's, or a live `power` profile's.
    pub sigma_rel: Option<f64>,
    /// A post-hoc target's least-squares fit residual.
    pub residual: Option<f64>,
    /// The snapshots a derived candidate was computed from.
    pub sources: Vec<String>,
}

/// Filters of a listing; `None`: any.
#[derive(Debug, Clone, Default)]
pub struct EvalFilter {
    /// Only evaluations that measured this metric.
    pub metric: Option<String>,
    pub profile: Option<String>,
    pub kind: Option<CandidateKind>,
    pub evaluator: Option<String>,
}

/// What a post found.
#[derive(Debug)]
pub enum Recorded {
    /// Stored now (`201`, and an `eval` event).
    Created(Evaluation),
    /// The same numbers were stored before (`200`).
    Same(Evaluation),
}

/// The best candidate of a metric.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Best {
    pub metric: String,
    pub mode: BestMode,
    pub value: f64,
    pub evaluation: Evaluation,
    /// `GET` this (under the server's URL, with the caller's token) for the
    /// candidate's weights.
    pub download: String,
}

/// The evaluation service: checks, stores and reads evaluations.
pub struct Evals {
    ctx: Context,
}

impl Evals {
    pub fn new(ctx: &Context) -> Self {
        Evals { ctx: ctx.clone() }
    }

    /// Stores an evaluation of a complete snapshot's profile (idempotent per
    /// snapshot, profile and evaluator: the same numbers again are
    /// [`Recorded::Same`], different ones `409 eval_conflict`).
    pub async fn record(&self, run: &RunHandle, new: NewEval) -> Result<Recorded, ServiceError> {
        let name = &run.config.name;
        let metrics = checked_metrics(new.metrics)?;
        let evaluator = new.evaluator.unwrap_or_default();
        if evaluator.chars().count() > MAX_NAME_CHARS || evaluator.chars().any(char::is_control) {
            return Err(invalid(
                "evaluator",
                format!("at most {MAX_NAME_CHARS} printable characters"),
            ));
        }
        let store = &self.ctx.store;
        let snap = store
            .snapshot(name, &new.snapshot)
            .await?
            .ok_or_else(|| snapshot_not_found(name, &new.snapshot))?;
        if snap.status != SnapshotStatus::Complete {
            return Err(ServiceError::conflict(
                "snapshot_not_complete",
                format!("snapshot `{}` is {}", snap.id, snap.status),
            ));
        }
        if snap.kind == SnapshotKind::State {
            return Err(invalid(
                "snapshot",
                format!(
                    "snapshot `{}` is a state snapshot (its ranks may sit at different steps): \
                     evaluate a cut or a derived snapshot",
                    snap.id
                ),
            ));
        }
        self.check_profile(&snap, &new.profile).await?;
        // A repost of a stored evaluation is answered as before; a new one
        // needs room under the run's bound. (Posts racing for the last
        // places may pass it by a few.)
        let stored = store
            .eval_of(name, &snap.id, &new.profile, &evaluator)
            .await?;
        let max = self.ctx.args.max_evals_per_run;
        if stored.is_none() && store.eval_count(name).await? >= max {
            return Err(ServiceError::conflict(
                "too_many_evaluations",
                format!(
                    "run `{name}` holds {max} evaluations, the most a run may hold \
                     (--max-evals-per-run); delete snapshots to drop theirs"
                ),
            ));
        }
        let row = EvalRow {
            snapshot: snap.id.clone(),
            profile: new.profile,
            evaluator,
            metrics,
            at_ms: now_ms(),
        };
        let created = store.insert_eval(name, &row).await?;
        let stored = store
            .eval_of(name, &row.snapshot, &row.profile, &row.evaluator)
            .await?
            // Not stored and none there: the snapshot was deleted meanwhile.
            .ok_or_else(|| snapshot_not_found(name, &row.snapshot))?;
        let eval = evaluation(&run.config, stored);
        if created {
            self.ctx.events.emit(
                name,
                None,
                Some(eval.step),
                Event::Eval(EvalRecorded {
                    snapshot: eval.snapshot.clone(),
                    profile: eval.profile.clone(),
                    evaluator: eval.evaluator.clone(),
                    kind: eval.kind,
                    metrics: eval.metrics.clone(),
                }),
            );
            return Ok(Recorded::Created(eval));
        }
        if eval.metrics != row.metrics {
            return Err(ServiceError::conflict(
                "eval_conflict",
                format!(
                    "snapshot `{}` profile `{}` already has an evaluation by evaluator `{}` \
                     with other numbers; name another evaluator to keep both",
                    row.snapshot, row.profile, row.evaluator
                ),
            ));
        }
        Ok(Recorded::Same(eval))
    }

    /// `online` needs the snapshot's mirror part; a profile, one the
    /// snapshot holds.
    async fn check_profile(&self, snap: &SnapshotRow, profile: &str) -> Result<(), ServiceError> {
        if profile == ONLINE {
            let files = self.ctx.store.snapshot_files(&snap.id).await?;
            if files.iter().any(|f| f.part == MIRROR_PART) {
                return Ok(());
            }
            return Err(ServiceError::not_found(
                "profile_not_found",
                format!(
                    "snapshot `{}` holds no online weights (the run keeps no mirror, or the \
                     snapshot is derived)",
                    snap.id
                ),
            ));
        }
        if snap.profiles.iter().any(|p| p == profile) {
            return Ok(());
        }
        Err(ServiceError::not_found(
            "profile_not_found",
            format!(
                "snapshot `{}` holds no profile `{profile}` (it has {:?}, and `online` with a mirror)",
                snap.id, snap.profiles
            ),
        ))
    }

    /// One page of a run's evaluations that pass `filter`, by step: at
    /// most `limit`, starting after `after`, with where the next starts.
    pub async fn list(
        &self,
        run: &RunHandle,
        filter: &EvalFilter,
        after: Option<EvalCursor>,
        limit: u32,
    ) -> Result<EvalPage, ServiceError> {
        // Read in batches until one more than the page passed the filter
        // (it says there is a next page) or the run has no more.
        let batch = limit.saturating_add(1).max(256);
        let mut at = after.map(|c| (c.step, c.id));
        let mut evals = Vec::new();
        loop {
            let rows = self
                .ctx
                .store
                .evals_page(&run.config.name, at, batch)
                .await?;
            let done = (rows.len() as u64) < u64::from(batch);
            for row in rows {
                at = Some((row.step, row.id));
                let e = evaluation(&run.config, row);
                if filter.admits(&e) {
                    evals.push(e);
                    if evals.len() > limit as usize {
                        evals.truncate(limit as usize);
                        let last = evals.last().map(|e| EvalCursor {
                            step: e.step,
                            id: e.id,
                        });
                        return Ok(EvalPage { evals, next: last });
                    }
                }
            }
            if done {
                return Ok(EvalPage { evals, next: None });
            }
        }
    }

    /// Every evaluation of a run that passes `filter`, by step.
    async fn all(
        &self,
        run: &RunHandle,
        filter: &EvalFilter,
    ) -> Result<Vec<Evaluation>, ServiceError> {
        let rows = self.ctx.store.evals(&run.config.name).await?;
        Ok(rows
            .into_iter()
            .map(|r| evaluation(&run.config, r))
            .filter(|e| filter.admits(e))
            .collect())
    }

    /// The evaluated candidate with the lowest (`min`) or highest (`max`)
    /// value of `metric` among those `filter` admits; ties go to the
    /// earliest step.
    pub async fn best(
        &self,
        run: &RunHandle,
        metric: &str,
        mode: BestMode,
        filter: &EvalFilter,
    ) -> Result<Best, ServiceError> {
        let filter = EvalFilter {
            metric: Some(metric.to_string()),
            ..filter.clone()
        };
        let evals = self.all(run, &filter).await?;
        let best = pick_best(evals, metric, mode).ok_or_else(|| {
            ServiceError::not_found(
                "no_evaluations",
                format!(
                    "run `{}` has no evaluation of `{metric}` that matches",
                    run.config.name
                ),
            )
        })?;
        let value = best.metrics[metric];
        Ok(Best {
            metric: metric.to_string(),
            mode,
            value,
            download: download_path(&run.config.name, &best.snapshot, &best.profile),
            evaluation: best,
        })
    }
}

impl EvalFilter {
    fn admits(&self, e: &Evaluation) -> bool {
        self.metric
            .as_ref()
            .is_none_or(|m| e.metrics.contains_key(m))
            && self.profile.as_ref().is_none_or(|p| &e.profile == p)
            && self.kind.is_none_or(|k| e.kind == k)
            && self.evaluator.as_ref().is_none_or(|v| &e.evaluator == v)
    }
}

/// The best of `evals` by `metric` (each has it); ties keep the first
/// (the earliest step, as listed).
fn pick_best(evals: Vec<Evaluation>, metric: &str, mode: BestMode) -> Option<Evaluation> {
    let mut best: Option<Evaluation> = None;
    for e in evals {
        let better = match &best {
            None => true,
            Some(b) => match mode {
                BestMode::Min => e.metrics[metric] < b.metrics[metric],
                BestMode::Max => e.metrics[metric] > b.metrics[metric],
            },
        };
        if better {
            best = Some(e);
        }
    }
    best
}

/// The download path of a candidate's weights.
pub fn download_path(run: &str, snapshot: &str, profile: &str) -> String {
    format!("/v1/runs/{run}/snapshots/{snapshot}/download?profile={profile}")
}

/// The metrics of a post: 1 to [`MAX_METRICS`] names of 1 to
/// [`MAX_NAME_CHARS`] printable characters, each a finite number.
pub fn checked_metrics(
    metrics: BTreeMap<String, serde_json::Value>,
) -> Result<BTreeMap<String, f64>, ServiceError> {
    if metrics.is_empty() {
        return Err(invalid("metrics", "give at least one metric".into()));
    }
    if metrics.len() > MAX_METRICS {
        return Err(invalid(
            "metrics",
            format!("at most {MAX_METRICS} metrics, got {}", metrics.len()),
        ));
    }
    let mut out = BTreeMap::new();
    for (name, value) in metrics {
        let chars = name.chars().count();
        if chars == 0 || chars > MAX_NAME_CHARS || name.chars().any(char::is_control) {
            return Err(invalid(
                "metrics",
                format!("a metric name is 1-{MAX_NAME_CHARS} printable characters"),
            ));
        }
        match value.as_f64() {
            Some(v) if v.is_finite() => {
                out.insert(name, v);
            }
            _ => {
                return Err(invalid(
                    &format!("metrics.{name}"),
                    format!("must be a finite number, got {value}"),
                ))
            }
        }
    }
    Ok(out)
}

fn invalid(field: &str, message: String) -> ServiceError {
    ServiceError {
        field: Some(field.to_string()),
        ..ServiceError::unprocessable("invalid_eval", format!("{field}: {message}"))
    }
}

fn snapshot_not_found(run: &str, id: &str) -> ServiceError {
    ServiceError::not_found(
        "snapshot_not_found",
        format!("run `{run}` has no snapshot `{id}`"),
    )
}

/// A stored evaluation with what its snapshot says of the candidate.
fn evaluation(config: &RunConfig, s: StoredEval) -> Evaluation {
    let kind = candidate_kind(s.kind, &s.row.profile);
    let number = |key: &str| s.detail.get(key).and_then(serde_json::Value::as_f64);
    let (sigma_rel, residual) = match kind {
        CandidateKind::Posthoc => (number("sigma_rel"), number("residual")),
        CandidateKind::Ema => (live_sigma_rel(config, &s.row.profile), None),
        CandidateKind::Online | CandidateKind::Merge => (None, None),
    };
    let mut sources: Vec<String> = s
        .detail
        .get("sources")
        .and_then(serde_json::Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|src| src.get("snapshot").and_then(serde_json::Value::as_str))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    sources.dedup();
    Evaluation {
        id: s.id,
        snapshot: s.row.snapshot,
        profile: s.row.profile,
        evaluator: s.row.evaluator,
        metrics: s.row.metrics,
        at_ms: s.row.at_ms,
        step: s.step,
        kind,
        sigma_rel,
        residual,
        sources,
    }
}

fn candidate_kind(snapshot: SnapshotKind, profile: &str) -> CandidateKind {
    match snapshot {
        SnapshotKind::Posthoc => CandidateKind::Posthoc,
        SnapshotKind::Merge => CandidateKind::Merge,
        _ if profile == ONLINE => CandidateKind::Online,
        _ => CandidateKind::Ema,
    }
}

/// A live `power` or `karras` profile's `sigma_rel` (filled in from its
/// gamma when the run was created; a karras EMA is the power function of
/// the same gamma, one step later).
fn live_sigma_rel(config: &RunConfig, profile: &str) -> Option<f64> {
    config.profiles.iter().find_map(|p| match p {
        ProfileSpec::Power {
            name, sigma_rel, ..
        }
        | ProfileSpec::Karras {
            name, sigma_rel, ..
        } if name == profile => *sigma_rel,
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn metrics(pairs: &[(&str, serde_json::Value)]) -> BTreeMap<String, serde_json::Value> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    #[test]
    fn metrics_are_named_finite_numbers_within_the_limits() {
        let ok = checked_metrics(metrics(&[("val_loss", json!(0.25)), ("acc", json!(3))])).unwrap();
        assert_eq!(ok["val_loss"], 0.25);
        assert_eq!(ok["acc"], 3.0);
        let err = checked_metrics(BTreeMap::new()).unwrap_err();
        assert_eq!((err.status(), err.code), (422, "invalid_eval"));
        let long = "m".repeat(MAX_NAME_CHARS + 1);
        let err = checked_metrics(metrics(&[(&long, json!(1.0))])).unwrap_err();
        assert_eq!(err.field.as_deref(), Some("metrics"));
        assert!(checked_metrics(metrics(&[(&"m".repeat(MAX_NAME_CHARS), json!(1.0))])).is_ok());
        let err = checked_metrics(metrics(&[("loss", json!("nan"))])).unwrap_err();
        assert_eq!(err.field.as_deref(), Some("metrics.loss"));
        assert!(checked_metrics(metrics(&[("loss", json!(null))])).is_err());
        let many: BTreeMap<String, serde_json::Value> = (0..=MAX_METRICS)
            .map(|i| (format!("m{i}"), json!(i)))
            .collect();
        assert!(checked_metrics(many.clone()).is_err());
        let fits: BTreeMap<_, _> = many.into_iter().take(MAX_METRICS).collect();
        assert_eq!(checked_metrics(fits).unwrap().len(), MAX_METRICS);
    }

    fn eval_at(step: u64, loss: f64) -> Evaluation {
        Evaluation {
            id: step as i64,
            snapshot: format!("s{step}"),
            profile: "a".into(),
            evaluator: String::new(),
            metrics: BTreeMap::from([("loss".to_string(), loss)]),
            at_ms: 0,
            step,
            kind: CandidateKind::Ema,
            sigma_rel: None,
            residual: None,
            sources: Vec::new(),
        }
    }

    #[test]
    fn cursors_read_back_what_they_write() {
        let c = EvalCursor { step: 9, id: 42 };
        assert_eq!(c.to_string().parse::<EvalCursor>().unwrap(), c);
        for bad in ["", "9", "9.", ".4", "x.4", "9.4.1", "-1.4"] {
            let err = bad.parse::<EvalCursor>().unwrap_err();
            assert_eq!((err.status(), err.code), (400, "invalid_cursor"), "{bad}");
        }
    }

    #[test]
    fn the_best_is_the_extreme_and_ties_keep_the_earliest() {
        let evals = vec![
            eval_at(1, 0.5),
            eval_at(2, 0.2),
            eval_at(3, 0.2),
            eval_at(4, 0.9),
        ];
        assert_eq!(
            pick_best(evals.clone(), "loss", BestMode::Min)
                .unwrap()
                .step,
            2
        );
        assert_eq!(pick_best(evals, "loss", BestMode::Max).unwrap().step, 4);
        assert!(pick_best(Vec::new(), "loss", BestMode::Min).is_none());
    }

    #[test]
    fn candidates_are_told_by_their_snapshot_and_profile() {
        assert_eq!(
            candidate_kind(SnapshotKind::Periodic, "a"),
            CandidateKind::Ema
        );
        assert_eq!(
            candidate_kind(SnapshotKind::Manual, ONLINE),
            CandidateKind::Online
        );
        assert_eq!(
            candidate_kind(SnapshotKind::Posthoc, "posthoc"),
            CandidateKind::Posthoc
        );
        assert_eq!(
            candidate_kind(SnapshotKind::Merge, "merged"),
            CandidateKind::Merge
        );
    }

    #[test]
    fn live_power_and_karras_profiles_carry_their_sigma_rel() {
        let spec: crate::run::RunSpec = serde_json::from_value(json!({
            "name": "r", "world_size": 1,
            "profiles": [
                {"name": "p", "kind": "power", "gamma": 6.94},
                {"name": "k", "kind": "karras", "gamma": 6.94, "update_every": 4},
                {"name": "k2", "kind": "karras", "sigma_rel": 0.15},
                {"name": "c", "kind": "constant", "beta": 0.99},
            ]
        }))
        .unwrap();
        let config = spec.validate("cpu", |d| Ok(d.to_string())).unwrap();
        // EDM2 exp_to_std(6.94) = 0.1000...
        let power = live_sigma_rel(&config, "p").unwrap();
        assert!((power - 0.1).abs() < 1e-3, "{power}");
        assert_eq!(live_sigma_rel(&config, "k"), Some(power));
        let given = live_sigma_rel(&config, "k2").unwrap();
        assert!((given - 0.15).abs() < 1e-12, "{given}");
        assert_eq!(live_sigma_rel(&config, "c"), None);
        assert_eq!(live_sigma_rel(&config, "missing"), None);
    }
}
