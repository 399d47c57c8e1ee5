//! The bookkeeping of a push: an applied one's rank summary, catalog row,
//! ingest and drift series, metrics and events; a refused one's rejection.

use std::sync::Arc;
use std::time::Instant;

use super::validate::WireNote;
use super::Ingest;
use crate::clock::now_ms;
use crate::engine::rank::PushOutcome;
use crate::events::{self, Event, PushApplied, RankRegistered, Rejection};
use crate::registry::{counts_of, Failover, RankSummary, RunHandle};
use crate::services::{monitor, Context, ServiceError};

impl Ingest {
    /// The bookkeeping of an applied (or duplicate) push: the rank summary
    /// and its catalog row, the ingest and drift series, metrics, events.
    pub(super) fn record_applied(
        &self,
        run: &Arc<RunHandle>,
        rank: u32,
        step: u64,
        outcome: &PushOutcome,
        wire_len: u64,
        started: Instant,
    ) {
        let layout = outcome.registered.clone();
        let latency = started.elapsed().as_secs_f64();
        if !outcome.duplicate {
            monitor::note_ingest(run, wire_len, latency);
        }
        let (summary, resumed) = note_applied(run, rank, step, outcome, wire_len, latency);
        let ctx = &self.ctx;
        ctx.record_rank(run, rank, &summary, layout.as_deref());
        let name = &run.config.name;
        if let Some(failover) = resumed {
            report_resumed(ctx, name, rank, failover);
        }
        ctx.metrics
            .resident_bytes
            .with_label_values(&[name])
            .set(run.resident_bytes() as i64);
        if let Some(drift) = &outcome.drift {
            monitor::record_drift(ctx, run, rank, step, drift);
        }
        let kind = if outcome.duplicate {
            "duplicate"
        } else {
            "applied"
        };
        ctx.metrics.pushes.with_label_values(&[name, kind]).inc();
        emit_applied(ctx, name, rank, step, outcome, wire_len, started);
    }

    /// Records an applied push's wire figures (rank view, Prometheus) and a
    /// keyframe's mirror mismatch (event, counter).
    pub(super) fn record_wire(
        &self,
        run: &RunHandle,
        rank: u32,
        step: u64,
        outcome: &PushOutcome,
        wire_len: u64,
        wire: &WireNote,
    ) {
        let name = &run.config.name;
        let m = &self.ctx.metrics;
        m.push_wire_bytes
            .with_label_values(&[name])
            .inc_by(wire_len);
        m.push_logical_bytes
            .with_label_values(&[name])
            .inc_by(outcome.logical_bytes);
        m.codec_seconds
            .with_label_values(&[name, "encode"])
            .inc_by(wire.encode_seconds);
        m.codec_seconds
            .with_label_values(&[name, "decode"])
            .inc_by(wire.decode_seconds);
        if let Some(mismatch) = &outcome.mirror_mismatch {
            m.mirror_mismatches.with_label_values(&[name]).inc();
            self.ctx.events.emit(
                name,
                Some(rank),
                Some(step),
                Event::MirrorMismatch(events::MirrorMismatch {
                    client_crc32: mismatch.client_crc32.clone(),
                    server_crc32: mismatch.server_crc32.clone(),
                    repaired: true,
                }),
            );
            tracing::warn!(run = %name, rank, step, "keyframe found the mirror diverged from the client's copy; repaired");
        }
        run.update_rank(rank, |s| {
            s.wire.note(
                wire_len,
                outcome.logical_bytes,
                wire.encode_seconds,
                wire.decode_seconds,
            );
            s.wire.last_kind = Some(wire.kind.to_string());
            s.wire.last_encoding = Some(wire.encoding.name().to_string());
            s.wire.last_quant = wire.quant.clone();
            if outcome.mirror_mismatch.is_some() {
                s.wire.mirror_mismatches += 1;
            }
        });
    }

    /// The bookkeeping of a refused push (not of a busy answer: the client
    /// retries those).
    pub(super) fn record_rejection(
        &self,
        run: &RunHandle,
        rank: u32,
        step: u64,
        err: &ServiceError,
    ) {
        if err.kind == crate::services::ErrorKind::Busy {
            return;
        }
        let ctx = &self.ctx;
        let name = &run.config.name;
        ctx.metrics
            .rejections
            .with_label_values(&[name, err.code])
            .inc();
        ctx.metrics
            .pushes
            .with_label_values(&[name, "rejected"])
            .inc();
        let summary = run.update_rank(rank, |s| s.rejections += 1);
        ctx.record_rank(run, rank, &summary, None);
        ctx.events.emit(
            name,
            Some(rank),
            Some(step),
            Event::Rejection(Rejection {
                status: err.status(),
                code: err.code,
                message: err.message.clone(),
            }),
        );
        tracing::info!(run = %name, rank, step, code = err.code, "push rejected: {}", err.message);
    }
}

/// The rank's summary after an applied (or duplicate) push, and the rank's
/// failover when this push is the first since it (the steps lost are
/// known now).
fn note_applied(
    run: &RunHandle,
    rank: u32,
    step: u64,
    outcome: &PushOutcome,
    wire_len: u64,
    latency: f64,
) -> (RankSummary, Option<Failover>) {
    let layout = outcome.registered.as_ref();
    let mut resumed = None;
    let summary = run.update_rank(rank, |s| {
        if let Some(f) = s.failover.as_mut().filter(|f| f.resumed_step.is_none()) {
            if !outcome.duplicate {
                f.resumed_at(step, run.config.update_every);
                resumed = Some(f.clone());
            }
        }
        s.bytes_received += wire_len;
        s.last_push_at_ms = Some(now_ms());
        s.resident_bytes = outcome.resident_bytes;
        s.live = true;
        if outcome.duplicate {
            s.duplicates += 1;
        } else {
            s.pushes += 1;
            s.last_step = outcome.last_step;
            s.last_apply_seconds = Some(outcome.apply_seconds);
            s.note_push(wire_len, latency);
        }
        if let Some(layout) = layout {
            let (tensors, numel) = counts_of(layout);
            s.tensors = tensors;
            s.numel = numel;
            s.layout = serde_json::to_value(&**layout).ok().map(Arc::new);
        }
    });
    (summary, resumed)
}

/// The events of an applied push: the rank's layout when it registered
/// one, then the push itself.
fn emit_applied(
    ctx: &Context,
    name: &str,
    rank: u32,
    step: u64,
    outcome: &PushOutcome,
    wire_len: u64,
    started: Instant,
) {
    if let Some(layout) = &outcome.registered {
        let (tensors, numel) = counts_of(layout);
        ctx.events.emit(
            name,
            Some(rank),
            Some(step),
            Event::RankRegistered(RankRegistered {
                tensors,
                numel,
                resident_bytes: outcome.resident_bytes,
            }),
        );
    }
    ctx.events.emit(
        name,
        Some(rank),
        Some(step),
        Event::Push(PushApplied {
            applied: outcome.applied,
            duplicate: outcome.duplicate,
            bytes: wire_len,
            apply_seconds: outcome.apply_seconds,
            seconds: started.elapsed().as_secs_f64(),
            skipped: outcome.skipped.clone(),
        }),
    );
}

/// The first push to a rank after its failover: the steps its EMA lost
/// are known now; reported (event, metric) and recorded in the catalog.
fn report_resumed(ctx: &Context, run: &str, rank: u32, failover: Failover) {
    let lost = failover.lost_steps.unwrap_or(0);
    ctx.metrics
        .failover_steps_lost
        .with_label_values(&[run])
        .inc_by(lost);
    tracing::warn!(run, rank, restored_step = ?failover.restored_step,
        resumed_step = ?failover.resumed_step, lost_steps = lost, "rank pushed again after its failover");
    ctx.events.emit(
        run,
        Some(rank),
        failover.resumed_step,
        Event::Failover(failover.clone()),
    );
    let (ctx, run) = (ctx.clone(), run.to_string());
    tokio::spawn(async move { ctx.store.note_rank_failover(&run, rank, &failover).await });
}
