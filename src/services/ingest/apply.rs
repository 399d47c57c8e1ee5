//! A validated push queued on the run's engine, its outcome recorded.

use std::time::Instant;

use super::{Ingest, PushResponse, ValidatedPush};
use crate::engine::EngineError;
use crate::services::ServiceError;

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
        let reason = outcome.duplicate.then(|| "duplicate".to_string());
        Ok(PushResponse {
            outcome,
            rank,
            reason,
        })
    }
}
