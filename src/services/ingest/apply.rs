//! A validated push queued on the run's engine, its outcome recorded.

use std::time::Instant;

use super::{Ingest, PushResponse, ValidatedPush};
use crate::engine::EngineError;
use crate::services::ServiceError;

/// How long a push that opened a periodic cut waits for the cut to be
/// recorded in the catalog before it is answered anyway (a catalog that
/// hangs delays such a push this much at most).
const CUT_LISTED_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

impl Ingest {
    /// Applies a validated push on the run's engine and records the outcome.
    /// The budget is released when the engine is done with the body.
    pub async fn apply(&self, push: ValidatedPush) -> Result<PushResponse, ServiceError> {
        let ValidatedPush {
            run,
            rank,
            step,
            parsed,
            wire_len,
            started,
            wire,
            budget,
        } = push;
        let queued = Instant::now();
        let retry_after = self.ctx.args.retry_after_secs;
        let Some(engine) = run.engines.of(rank) else {
            return Err(EngineError::NotHere {
                run: run.config.name.clone(),
                rank,
            }
            .into());
        };
        let outcome = engine
            .push(&run.config.name, rank, step, parsed, Box::new(budget))
            .await
            .map_err(|e| match e {
                EngineError::QueueFull => ServiceError::busy(
                    "the engine queue is full; retry after the delay",
                    retry_after,
                ),
                other => other.into(),
            })??;
        let metrics = &self.ctx.metrics;
        metrics
            .push_seconds
            .with_label_values(&["queue_and_apply"])
            .observe(queued.elapsed().as_secs_f64());
        metrics
            .push_seconds
            .with_label_values(&["apply"])
            .observe(outcome.apply_seconds);
        metrics
            .push_bytes
            .with_label_values(&[&run.config.name])
            .inc_by(wire_len);
        if !outcome.duplicate {
            self.record_wire(&run, rank, step, &outcome, wire_len, &wire);
        }
        self.record_applied(&run, rank, step, &outcome, wire_len, started);
        let every = run.config.snapshot_every;
        if outcome.applied && every > 0 && step % every == 0 {
            let shared = run.engines.shared();
            if shared.opened_cut(step) && !shared.wait_cut_recorded(step, CUT_LISTED_WITHIN).await {
                tracing::warn!(run = %run.config.name, step,
                    "the periodic cut of this step was not recorded in time; answering the push");
            }
        }
        let reason = outcome.duplicate.then(|| "duplicate".to_string());
        Ok(PushResponse {
            outcome,
            rank,
            reason,
        })
    }
}
