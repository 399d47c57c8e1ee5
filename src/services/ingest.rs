//! The ingest service: a push from its body to the applied update.
//!
//! [`Ingest::push`] runs the stages in order: [`Ingest::receive`] takes the
//! body into one pooled buffer under the in-flight byte budget,
//! [`Ingest::validate`] parses and scans it on a blocking thread and yields
//! a [`ValidatedPush`] — a body that passed every check and waits to be
//! applied — and [`Ingest::apply`] queues that on the run's engine. The
//! bookkeeping that follows (metrics, rank summary, catalog, drift series,
//! events) and that of a refused push is done here too, so the handler only
//! extracts the request and renders the answer.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body::Body;
use http_body_util::BodyExt;
use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use utoipa::ToSchema;

use super::{Context, ServiceError};
use crate::clock::now_ms;
use crate::engine::rank::PushOutcome;
use crate::engine::EngineError;
use crate::registry::{counts_of, RunHandle};
use crate::wire::bodies::BodyPool;
use crate::wire::{parse_push, ParsedPush, WireLimits};

/// The answer to a push.
#[derive(Debug, Serialize, ToSchema)]
pub struct PushResponse {
    #[serde(flatten)]
    pub outcome: PushOutcome,
    pub rank: u32,
    /// Set when nothing was applied: `not_update_step` or `duplicate`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Why reading a body failed, as the transport tells it.
#[derive(Debug)]
pub enum BodyFault {
    /// The client sent too slowly (the connection's body-rate timeout).
    Timeout(String),
    /// Any other failure of the connection.
    Read(String),
}

/// One push as the handler extracted it: the run, rank and step are
/// checked, the body not yet read.
pub struct PushRequest<B> {
    pub run: Arc<RunHandle>,
    pub rank: u32,
    pub step: u64,
    /// The `Content-Encoding` header, if any.
    pub encoding: Option<String>,
    /// The `Content-Length` header, if any.
    pub declared: Option<u64>,
    pub body: B,
    /// When the request arrived (for the push latency).
    pub started: Instant,
}

/// A push whose body passed every check (safetensors, chunks, NaN/Inf,
/// digest) and waits to be applied. It holds its share of the in-flight
/// byte budget until the engine is done with it.
pub struct ValidatedPush {
    pub run: Arc<RunHandle>,
    pub rank: u32,
    pub step: u64,
    pub parsed: ParsedPush,
    /// Bytes as they came over the wire (before zstd).
    pub wire_len: u64,
    pub started: Instant,
    budget: Budget,
}

/// A body received in full, not yet parsed.
struct Received {
    raw: Bytes,
    zstd: bool,
    budget: Budget,
}

/// Idle push receive buffers kept for reuse: one for the body being
/// received while another is applied, one spare.
const BODY_BUFFERS_KEPT: usize = 2;

/// Bodies larger than this are not drained before an early error answer
/// (the connection is closed instead).
const DRAIN_LIMIT: u64 = 64 << 20;

/// The ingest service.
pub struct Ingest {
    ctx: Context,
    /// Push bytes that may be held in memory at once, in KiB permits.
    inflight: Arc<Semaphore>,
    inflight_kib: usize,
    /// Reused receive buffers for push bodies.
    bodies: Arc<BodyPool>,
}

/// Body buffers idle this long are released (the ingest task trims them).
pub const BODY_BUFFER_IDLE: std::time::Duration = std::time::Duration::from_secs(120);

impl Ingest {
    pub fn new(ctx: Context) -> Self {
        let inflight_kib = (ctx.args.inflight_bytes.0 / 1024).max(1) as usize;
        Ingest {
            inflight: Arc::new(Semaphore::new(inflight_kib)),
            inflight_kib,
            bodies: BodyPool::new(BODY_BUFFERS_KEPT),
            ctx,
        }
    }

    /// Starts the task that frees receive buffers idle for
    /// [`BODY_BUFFER_IDLE`] (a trainer that pushes less often than that pays
    /// a fresh allocation per push).
    pub fn spawn_trim(
        self: &Arc<Self>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let bodies = self.bodies.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(10));
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        let freed = bodies.trim(BODY_BUFFER_IDLE);
                        if freed > 0 {
                            tracing::debug!(bytes = freed, "freed idle push receive buffers");
                        }
                    }
                    _ = stop.changed() => break,
                }
            }
        })
    }

    /// Receives, validates and applies one push, and records its outcome or
    /// its rejection.
    pub async fn push<B>(&self, req: PushRequest<B>) -> Result<PushResponse, ServiceError>
    where
        B: Body<Data = Bytes, Error = BodyFault> + Unpin,
    {
        let (run, rank, step) = (req.run.clone(), req.rank, req.step);
        let result = self.receive_and_apply(req).await;
        if let Err(e) = &result {
            self.record_rejection(&run, rank, step, e);
        }
        result
    }

    async fn receive_and_apply<B>(&self, req: PushRequest<B>) -> Result<PushResponse, ServiceError>
    where
        B: Body<Data = Bytes, Error = BodyFault> + Unpin,
    {
        if !req.run.config.is_update_step(req.step) {
            drain(req.body, req.declared).await;
            return Ok(self.not_update_step(&req.run, req.rank, req.step));
        }
        let PushRequest {
            run,
            rank,
            step,
            encoding,
            declared,
            body,
            started,
        } = req;
        let received = self.receive(body, encoding.as_deref(), declared).await?;
        let received_at = Instant::now();
        self.ctx
            .metrics
            .push_seconds
            .with_label_values(&["receive"])
            .observe((received_at - started).as_secs_f64());
        let validated = self.validate(run, rank, step, received, started).await?;
        self.ctx
            .metrics
            .push_seconds
            .with_label_values(&["validate"])
            .observe(received_at.elapsed().as_secs_f64());
        self.apply(validated).await
    }

    /// The answer to a push at a step the run does not apply.
    fn not_update_step(&self, run: &RunHandle, rank: u32, step: u64) -> PushResponse {
        self.ctx
            .metrics
            .pushes
            .with_label_values(&[&run.config.name, "not_update_step"])
            .inc();
        let summary = run.rank(rank).unwrap_or_default();
        PushResponse {
            outcome: PushOutcome {
                applied: false,
                duplicate: false,
                step,
                last_step: summary.last_step,
                skipped: Vec::new(),
                registered: None,
                resident_bytes: summary.resident_bytes,
                apply_seconds: 0.0,
                drift: None,
            },
            rank,
            reason: Some(format!(
                "not_update_step: the run applies steps that are multiples of {}",
                run.config.update_every
            )),
        }
    }

    /// Checks the encoding and the declared length, then takes the body
    /// into one buffer under the in-flight byte budget.
    async fn receive<B>(
        &self,
        body: B,
        encoding: Option<&str>,
        declared: Option<u64>,
    ) -> Result<Received, ServiceError>
    where
        B: Body<Data = Bytes, Error = BodyFault> + Unpin,
    {
        let limit = self.ctx.args.push_body_limit.0;
        let zstd = match encoding {
            None | Some("identity") => false,
            Some("zstd") => true,
            Some(other) => {
                drain(body, declared).await;
                return Err(ServiceError::new(
                    415,
                    "unsupported_encoding",
                    format!("Content-Encoding `{other}`: only zstd (or none) is accepted"),
                ));
            }
        };
        if let Some(len) = declared {
            if len > limit {
                drain(body, declared).await;
                return Err(too_large(len, limit));
            }
        }
        let mut budget = Budget::new(self);
        let raw = read_body(body, declared, limit, &mut budget, &self.bodies).await?;
        Ok(Received { raw, zstd, budget })
    }

    /// Decompresses (zstd) and parses the body off the async threads.
    async fn validate(
        &self,
        run: Arc<RunHandle>,
        rank: u32,
        step: u64,
        received: Received,
        started: Instant,
    ) -> Result<ValidatedPush, ServiceError> {
        let limits = WireLimits {
            header_limit: self.ctx.args.header_limit.0,
        };
        let limit = self.ctx.args.push_body_limit.0;
        let policy = run.config.nonfinite;
        let Received {
            raw,
            zstd,
            mut budget,
        } = received;
        let wire_len = raw.len() as u64;
        let parsed = if zstd {
            let (bytes, budget_after) = tokio::task::spawn_blocking(move || {
                let out = decompress(&raw, limit)?;
                budget.reserve(out.len() as u64)?;
                Ok::<_, ServiceError>((out, budget))
            })
            .await??;
            budget = budget_after;
            tokio::task::spawn_blocking(move || parse_push(bytes, limits, policy)).await??
        } else {
            tokio::task::spawn_blocking(move || parse_push(raw, limits, policy)).await??
        };
        Ok(ValidatedPush {
            run,
            rank,
            step,
            parsed,
            wire_len,
            started,
            budget,
        })
    }

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
            budget,
        } = push;
        let run_name = run.config.name.clone();
        let queued = Instant::now();
        let retry_after = self.ctx.args.retry_after_secs;
        let outcome = run
            .engine
            .try_call(move |engine| {
                let outcome = engine.push(&run_name, rank, step, parsed);
                drop(budget);
                outcome
            })
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
        self.record_applied(&run, rank, step, &outcome, wire_len, started);
        let reason = outcome.duplicate.then(|| "duplicate".to_string());
        Ok(PushResponse {
            outcome,
            rank,
            reason,
        })
    }

    /// The bookkeeping of an applied (or duplicate) push: the rank summary
    /// and its catalog row, the ingest and drift series, metrics, events.
    fn record_applied(
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
            super::monitor::note_ingest(run, wire_len, latency);
        }
        let summary = run.update_rank(rank, |s| {
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
            if let Some(layout) = &layout {
                let (tensors, numel) = counts_of(layout);
                s.tensors = tensors;
                s.numel = numel;
                s.layout = serde_json::to_value(&**layout).ok().map(Arc::new);
            }
        });
        let ctx = &self.ctx;
        ctx.record_rank(run, rank, &summary, layout.as_deref());
        let name = &run.config.name;
        ctx.metrics
            .resident_bytes
            .with_label_values(&[name])
            .set(run.resident_bytes() as i64);
        if let Some(drift) = &outcome.drift {
            super::monitor::record_drift(ctx, run, rank, step, drift);
        }
        let kind = if outcome.duplicate {
            "duplicate"
        } else {
            "applied"
        };
        ctx.metrics.pushes.with_label_values(&[name, kind]).inc();
        if let Some(layout) = &layout {
            let (tensors, numel) = counts_of(layout);
            ctx.events.emit(
                name,
                "rank_registered",
                Some(rank),
                Some(step),
                serde_json::json!({"tensors": tensors, "numel": numel, "resident_bytes": outcome.resident_bytes}),
            );
        }
        ctx.events.emit(
            name,
            "push",
            Some(rank),
            Some(step),
            serde_json::json!({
                "applied": outcome.applied,
                "duplicate": outcome.duplicate,
                "bytes": wire_len,
                "apply_seconds": outcome.apply_seconds,
                "seconds": started.elapsed().as_secs_f64(),
                "skipped": outcome.skipped,
            }),
        );
    }

    /// The bookkeeping of a refused push (not of a busy answer: the client
    /// retries those).
    fn record_rejection(&self, run: &RunHandle, rank: u32, step: u64, err: &ServiceError) {
        if err.status == 429 {
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
            "rejection",
            Some(rank),
            Some(step),
            serde_json::json!({"status": err.status, "code": err.code, "message": err.message}),
        );
        tracing::info!(run = %name, rank, step, code = err.code, "push rejected: {}", err.message);
    }
}

fn too_large(len: u64, limit: u64) -> ServiceError {
    ServiceError::too_large(
        "body_too_large",
        format!("push body of {len} bytes is over the limit of {limit} bytes"),
    )
}

/// Reads and discards a body that is not too large, so that the client
/// sees the answer instead of a reset connection.
pub async fn drain<B>(body: B, declared: Option<u64>)
where
    B: Body + Unpin,
{
    if declared.is_some_and(|len| len > DRAIN_LIMIT) {
        return;
    }
    let mut body = body;
    let mut seen = 0u64;
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(data) = frame.data_ref() {
            seen += bytes::Buf::remaining(data) as u64;
            if seen > DRAIN_LIMIT {
                return;
            }
        }
    }
}

/// Push bytes held in memory, counted against the server's budget.
struct Budget {
    inflight: Arc<Semaphore>,
    inflight_kib: usize,
    retry_after: u64,
    gauge: prometheus::IntGauge,
    permit: Option<OwnedSemaphorePermit>,
    held_kib: usize,
}

impl Budget {
    fn new(ingest: &Ingest) -> Self {
        Budget {
            inflight: ingest.inflight.clone(),
            inflight_kib: ingest.inflight_kib,
            retry_after: ingest.ctx.args.retry_after_secs,
            gauge: ingest.ctx.metrics.inflight_bytes.clone(),
            permit: None,
            held_kib: 0,
        }
    }

    /// Makes sure `bytes` are covered; a body larger than the whole budget
    /// may still pass alone.
    fn reserve(&mut self, bytes: u64) -> Result<(), ServiceError> {
        let want = (bytes.div_ceil(1024) as usize).min(self.inflight_kib);
        if want <= self.held_kib {
            return Ok(());
        }
        let more = (want - self.held_kib) as u32;
        let permit = self
            .inflight
            .clone()
            .try_acquire_many_owned(more)
            .map_err(|_| {
                ServiceError::busy(
                    "too many push bytes in flight; retry after the delay",
                    self.retry_after,
                )
            })?;
        match &mut self.permit {
            Some(held) => held.merge(permit),
            None => self.permit = Some(permit),
        }
        self.held_kib += more as usize;
        self.gauge.add(more as i64 * 1024);
        Ok(())
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        self.gauge.sub(self.held_kib as i64 * 1024);
    }
}

/// Collects the body into one (reused) buffer that grows with the data,
/// refusing to grow past `limit` and taking the budget for each byte as it
/// arrives. (Digesting each frame here, while it is in cache, measured
/// slower: this loop is what bounds the receive rate, and the digest runs
/// beside the NaN/Inf scan later.)
async fn read_body<B>(
    mut body: B,
    declared: Option<u64>,
    limit: u64,
    budget: &mut Budget,
    pool: &Arc<BodyPool>,
) -> Result<Bytes, ServiceError>
where
    B: Body<Data = Bytes, Error = BodyFault> + Unpin,
{
    let hint = usize::try_from(declared.unwrap_or(0).min(limit)).unwrap_or(usize::MAX);
    let mut buf = pool.take(hint);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(body_fault)?;
        if let Some(data) = frame.data_ref() {
            let len = buf.len() as u64 + data.len() as u64;
            if len > limit {
                return Err(too_large(len, limit));
            }
            budget.reserve(len)?;
            buf.extend_from_slice(data);
        }
    }
    if let Some(len) = declared {
        if buf.len() as u64 != len {
            return Err(ServiceError::bad_request(
                "invalid_safetensors",
                format!("the body ended after {} of {len} declared bytes", buf.len()),
            ));
        }
    }
    Ok(buf.freeze())
}

/// A failed body read: 408 when the client was too slow, else 400.
fn body_fault(e: BodyFault) -> ServiceError {
    match e {
        BodyFault::Timeout(m) => ServiceError::new(408, "body_timeout", m),
        BodyFault::Read(m) => {
            ServiceError::bad_request("body_read_failed", format!("reading the body failed: {m}"))
        }
    }
}

/// zstd, refusing output past `limit`.
fn decompress(raw: &[u8], limit: u64) -> Result<Bytes, ServiceError> {
    use std::io::Read;
    let decoder = zstd::stream::read::Decoder::new(raw)
        .map_err(|e| ServiceError::bad_request("invalid_encoding", format!("zstd: {e}")))?;
    let mut out = Vec::new();
    let read = decoder
        .take(limit + 1)
        .read_to_end(&mut out)
        .map_err(|e| ServiceError::bad_request("invalid_encoding", format!("zstd: {e}")))?;
    if read as u64 > limit {
        return Err(too_large(read as u64, limit));
    }
    Ok(Bytes::from(out))
}
