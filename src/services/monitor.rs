//! Monitoring series the server records itself, next to the trainer's own
//! metrics: the EMA drift per profile (sampled by the engine during the
//! update) and the ingest rate of each run.
//!
//! Series names: `ema_drift/<profile>` (per rank, and run-level combining
//! the ranks' latest samples by sums of squares), `ingest/bytes_per_second`,
//! `ingest/pushes_per_second`, `ingest/push_seconds` (run-level, sampled
//! while pushes arrive), `ingest/rank_step` (per rank, the step each rank
//! had reached at the same moments). Per-tensor drift goes to its own table
//! (one row per rank, profile and sample).
//!
//! [`Monitor`] is the service: it stores the trainer's scalars, reads the
//! stored series, per-tensor drift and event history back, and owns the
//! task that samples the ingest series and keeps everything stored within
//! its retention. Ingest records drift and ingest samples through the
//! helpers here.

use std::sync::Arc;
use std::time::Instant;

use crate::engine::rank::DriftSample;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{Context, ServiceError, Shared};
use crate::clock::now_ms;
use crate::events::Event;
use crate::registry::RunHandle;
use crate::store::meta::TensorDriftRow;
use crate::store::{EventCursor, EventPlace, MetricPoint, StoredEvent};

/// One step's scalars from the trainer: name -> value, of one rank or
/// (`rank: None`) of the run.
pub struct Scalars {
    pub step: u64,
    pub rank: Option<u32>,
    pub values: std::collections::BTreeMap<String, f64>,
}

/// The stored series (the trainer's and the server's own), per-tensor
/// drift and events: reads, writes, and their retention.
pub struct Monitor {
    ctx: Context,
}

impl Monitor {
    pub fn new(ctx: &Context) -> Self {
        Monitor { ctx: ctx.clone() }
    }

    /// Stores a run's trainer scalars (checked by the caller: finite
    /// values, metric names, steps and ranks in range), counts them, and
    /// tells each post as a `metrics` event. Returns the points stored.
    pub async fn record_metrics(
        &self,
        run: &str,
        posts: &[Scalars],
    ) -> Result<usize, ServiceError> {
        let at_ms = now_ms();
        let points: Vec<MetricPoint> = posts
            .iter()
            .flat_map(|p| {
                p.values.iter().map(move |(name, &value)| MetricPoint {
                    name: name.clone(),
                    step: p.step,
                    rank: p.rank,
                    value,
                    at_ms,
                })
            })
            .collect();
        self.ctx.store.insert_metrics(run, &points).await?;
        self.ctx
            .metrics
            .metric_points
            .with_label_values(&[run])
            .inc_by(points.len() as u64);
        for p in posts {
            self.ctx.events.emit(
                run,
                p.rank,
                Some(p.step),
                Event::Metrics(crate::events::Metrics {
                    values: p.values.clone(),
                }),
            );
        }
        Ok(points.len())
    }

    /// A run's stored points (`names`, from `since_step`, of one rank or
    /// the run level), the newest `limit` per series, and every series
    /// name it has.
    pub async fn series(
        &self,
        run: &str,
        names: Option<&[String]>,
        since_step: Option<u64>,
        rank: Option<Option<u32>>,
        limit: i64,
    ) -> Result<(Vec<MetricPoint>, Vec<String>), ServiceError> {
        let store = &self.ctx.store;
        let points = store.metrics(run, names, since_step, rank, limit).await?;
        Ok((points, store.metric_names(run).await?))
    }

    /// The per-tensor drift rows of a profile's newest `limit` samples.
    pub async fn tensor_drift(
        &self,
        run: &str,
        profile: &str,
        limit: i64,
    ) -> Result<Vec<TensorDriftRow>, ServiceError> {
        Ok(self.ctx.store.tensor_drift(run, profile, limit).await?)
    }

    /// Where event `id` of a run sits in the catalog's order.
    pub async fn event_place(&self, run: &str, id: i64) -> Result<EventPlace, ServiceError> {
        Ok(self.ctx.store.event_place(run, id).await?)
    }

    /// A page of a run's stored events after `after` (see
    /// [`crate::store::Store::events`]).
    pub async fn stored_events(
        &self,
        run: &str,
        after: EventCursor,
        kinds: Option<&[String]>,
        limit: i64,
        newest: bool,
    ) -> Result<Vec<StoredEvent>, ServiceError> {
        Ok(self
            .ctx
            .store
            .events(run, after, kinds, limit, newest)
            .await?)
    }

    /// Starts the task that samples the ingest series and prunes.
    pub fn spawn(&self, stop: watch::Receiver<bool>) -> JoinHandle<()> {
        spawn(self.ctx.clone(), stop)
    }
}

/// Prefix of the drift series.
pub const DRIFT_PREFIX: &str = "ema_drift/";

/// `||EMA - online|| / ||online||` from sums of squares.
pub fn drift_ratio(diff_sq: f64, online_sq: f64) -> f64 {
    if online_sq > 0.0 {
        (diff_sq / online_sq).sqrt()
    } else {
        diff_sq.sqrt()
    }
}

/// Records a rank's drift sample: the rank's point, and, once every rank
/// holding data has sampled this step, the run-level point combining them.
pub(super) fn record_drift(
    state: &Shared,
    run: &Arc<RunHandle>,
    rank: u32,
    step: u64,
    samples: &[DriftSample],
) {
    run.update_rank(rank, |s| {
        for d in samples {
            s.drift.insert(d.profile.clone(), (d.diff_sq, d.online_sq));
        }
        s.drift_step = Some(step);
    });
    let complete = (0..run.config.world_size).all(|r| {
        run.rank(r)
            .is_none_or(|s| !s.live || s.drift_step == Some(step))
    });
    let at_ms = now_ms();
    let mut points = Vec::with_capacity(samples.len() * 2);
    for d in samples {
        let (mut diff, mut online) = (0.0, 0.0);
        for r in 0..run.config.world_size {
            if let Some((a, b)) = run.rank(r).and_then(|s| s.drift.get(&d.profile).copied()) {
                diff += a;
                online += b;
            }
        }
        let combined = drift_ratio(diff, online);
        state
            .metrics
            .drift
            .with_label_values(&[&run.config.name, &d.profile])
            .set(combined);
        let name = format!("{DRIFT_PREFIX}{}", d.profile);
        points.push(MetricPoint {
            name: name.clone(),
            step,
            rank: Some(rank),
            value: drift_ratio(d.diff_sq, d.online_sq),
            at_ms,
        });
        if complete {
            points.push(MetricPoint {
                name,
                step,
                rank: None,
                value: combined,
                at_ms,
            });
        }
    }
    store_points(state, &run.config.name, points);
    record_tensor_drift(state, &run.config.name, rank, step, samples);
}

/// Writes points in the background (the push answer does not wait).
fn store_points(state: &Shared, run: &str, points: Vec<MetricPoint>) {
    if points.is_empty() {
        return;
    }
    let store = state.store.clone();
    let run = run.to_string();
    tokio::spawn(async move {
        if let Err(e) = store.insert_metrics(&run, &points).await {
            tracing::warn!(run = %run, error = %e, "storing metric points failed");
        }
    });
}

/// Counts an applied push into the run's ingest window.
pub(super) fn note_ingest(run: &RunHandle, bytes: u64, seconds: f64) {
    let mut w = run.ingest.lock().expect("ingest lock");
    w.pushes += 1;
    w.bytes += bytes;
    w.seconds += seconds;
}

/// Turns each run's ingest window into points (called every few seconds).
fn sample_ingest(state: &Shared, since: Instant) {
    let elapsed = since.elapsed().as_secs_f64().max(1e-3);
    let runs = state.all_runs();
    let at_ms = now_ms();
    for run in runs {
        let w = std::mem::take(&mut *run.ingest.lock().expect("ingest lock"));
        if w.pushes == 0 {
            continue;
        }
        // Each rank's step at this moment: drawn over wall time, a rank
        // that falls behind stands out as the lower line.
        let rank_steps: Vec<MetricPoint> = (0..run.config.world_size)
            .filter_map(|r| {
                let s = run.rank(r)?;
                Some(MetricPoint {
                    name: "ingest/rank_step".into(),
                    step: s.last_step?,
                    rank: Some(r),
                    value: s.last_step? as f64,
                    at_ms,
                })
            })
            .collect();
        store_points(state, &run.config.name, rank_steps);
        let step = (0..run.config.world_size)
            .filter_map(|r| run.rank(r).and_then(|s| s.last_step))
            .max()
            .unwrap_or(0);
        let point = |name: &str, value: f64| MetricPoint {
            name: name.into(),
            step,
            rank: None,
            value,
            at_ms,
        };
        store_points(
            state,
            &run.config.name,
            vec![
                point("ingest/bytes_per_second", w.bytes as f64 / elapsed),
                point("ingest/pushes_per_second", w.pushes as f64 / elapsed),
                point("ingest/push_seconds", w.seconds / w.pushes as f64),
            ],
        );
    }
}

/// Starts the monitoring task: every two seconds it samples each run's
/// ingest series; every `--prune-interval-secs` it drops the oldest stored
/// metric points, per-tensor drift rows and events past their retention.
fn spawn(ctx: Context, mut stop: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        let mut ingest_since = Instant::now();
        let mut ticks = 0u64;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    ticks += 1;
                    if ticks % 2 == 0 {
                        sample_ingest(&ctx, ingest_since);
                        ingest_since = Instant::now();
                    }
                    if ticks % ctx.args.prune_interval_secs.max(1) == 0 {
                        prune(&ctx).await;
                    }
                }
                _ = stop.changed() => break,
            }
        }
    })
}

/// Keeps the stored series and events within their retention.
async fn prune(ctx: &Shared) {
    let store = &ctx.store;
    if let Err(e) = store.prune_metrics(ctx.args.metrics_retained).await {
        tracing::warn!(error = %e, "pruning metrics failed");
    }
    if let Err(e) = store.prune_tensor_drift(ctx.args.metrics_retained).await {
        tracing::warn!(error = %e, "pruning tensor drift failed");
    }
    if let Err(e) = store.prune_events(ctx.args.events_retained).await {
        tracing::warn!(error = %e, "pruning events failed");
    }
}

/// The averaging window a profile applies at `step` when pushes come every
/// `update_every` steps: its `beta` for that update and the implied
/// half-life in steps, `delta * ln(1/2) / ln(beta)` (the number of steps
/// after which a weight's share has halved). `None` for the half-life of a
/// frozen EMA (`beta == 1`).
pub fn effective_window(
    profile: &crate::run::ProfileSpec,
    step: u64,
    update_every: u64,
) -> (f64, Option<f64>) {
    use crate::engine::schedule::{decide, Action, BemaStep};
    use crate::run::ProfileSpec;
    let u = update_every.max(1);
    let prev = step.checked_sub(u);
    let swa_n = match (profile, prev) {
        (ProfileSpec::Swa { start_step, .. }, Some(p)) if p >= *start_step => {
            p / u - start_step.div_ceil(u) + 1
        }
        _ => 0,
    };
    let beta = match decide(profile, step, prev, swa_n).action {
        Action::Copy => 0.0,
        Action::Lerp { weight } => 1.0 - weight,
        Action::Hold => 1.0,
        // BEMA's plain EMA: a restart copies, an update keeps 1 - beta.
        Action::Bema(BemaStep::Start | BemaStep::Restart) => 0.0,
        Action::Bema(BemaStep::Update { beta, .. }) => 1.0 - beta,
    };
    let half_life = if beta <= 0.0 {
        Some(0.0)
    } else if beta >= 1.0 {
        None
    } else {
        Some(u as f64 * 0.5f64.ln() / beta.ln())
    };
    (beta, half_life)
}

/// Records the per-tensor sums of a drift sample (one row per profile).
fn record_tensor_drift(state: &Shared, run: &str, rank: u32, step: u64, samples: &[DriftSample]) {
    let rows: Vec<(String, crate::store::meta::TensorDriftRow)> = samples
        .iter()
        .filter(|d| !d.tensors.is_empty())
        .map(|d| {
            (
                d.profile.clone(),
                crate::store::meta::TensorDriftRow {
                    rank,
                    step,
                    names: d.tensor_names.as_ref().clone(),
                    diff_sq: d.tensors.iter().map(|t| t.0).collect(),
                    online_sq: d.tensors.iter().map(|t| t.1).collect(),
                },
            )
        })
        .collect();
    if rows.is_empty() {
        return;
    }
    let store = state.store.clone();
    let run = run.to_string();
    tokio::spawn(async move {
        for (profile, row) in rows {
            if let Err(e) = store.insert_tensor_drift(&run, &profile, &row).await {
                tracing::warn!(run = %run, error = %e, "storing tensor drift failed");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effective_window_matches_the_schedules() {
        use crate::run::ProfileSpec;
        let constant = ProfileSpec::Constant {
            name: "ema".into(),
            beta: 0.5,
        };
        // beta 0.5 per update of 2 steps: a weight's share halves in 2 steps.
        assert_eq!(effective_window(&constant, 0, 2), (0.0, Some(0.0)));
        let (beta, h) = effective_window(&constant, 10, 2);
        assert_eq!(beta, 0.5);
        assert!((h.unwrap() - 2.0).abs() < 1e-12);
        let swa = ProfileSpec::Swa {
            name: "swa".into(),
            start_step: 0,
        };
        // The fifth applied push (step 4) averages with weight 1/5.
        let (beta, _) = effective_window(&swa, 4, 1);
        assert!((beta - 0.8).abs() < 1e-12);
    }

    #[test]
    fn drift_ratio_is_relative_norm() {
        assert!((drift_ratio(1.0, 4.0) - 0.5).abs() < 1e-15);
        assert_eq!(drift_ratio(0.0, 0.0), 0.0);
    }
}
