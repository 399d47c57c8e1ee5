//! The ingest service: a push from its body to the applied update.
//!
//! [`Ingest::push`] runs the stages in order: [`Ingest::receive`] takes the
//! body into one pooled buffer under the in-flight byte budget,
//! [`Ingest::validate`] decodes (zstd, `polyak-bgz`), parses and scans it on
//! a blocking thread and yields a [`ValidatedPush`] — a body that passed
//! every check and waits to be applied —, a pipelined push
//! (`Polyak-Prev-Step`) then waits in the [`Pipeline`] for its predecessor's
//! answer, and [`Ingest::apply`] queues it on the run's engine. The
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

use super::pipeline::{Pipeline, PREV_STEP};
use super::{Context, ServiceError};
use crate::clock::now_ms;
use crate::engine::rank::PushOutcome;
use crate::engine::EngineError;
use crate::events::{self, Event, PushApplied, RankRegistered, Rejection};
use crate::registry::{counts_of, RunHandle};
use crate::run::NonfinitePolicy;
use crate::wire::bodies::BodyPool;
use crate::wire::quant::QuantFormat;
use crate::wire::{codec, parse_push, ParsedPush, PushKind, WireLimits};

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
    /// The `Polyak-Prev-Step` header (pipelining), if any.
    pub prev_step: Option<String>,
    /// The [`ENCODE_SECONDS`] header, if any.
    pub encode_seconds: Option<String>,
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
    /// Bytes as they came over the wire (before decoding).
    pub wire_len: u64,
    pub started: Instant,
    /// How the body arrived and what it was, for the rank's wire figures.
    wire: WireNote,
    budget: Budget,
}

/// A body received in full, not yet parsed.
struct Received {
    raw: Bytes,
    headers: PushHeaders,
    budget: Budget,
}

/// Header in which a client reports the seconds it spent encoding the body
/// (shown with the rank's wire figures; never trusted for anything else).
pub const ENCODE_SECONDS: &str = "polyak-encode-seconds";

/// What a push's headers declare besides its length.
#[derive(Debug, Clone, Copy)]
struct PushHeaders {
    encoding: Encoding,
    /// Pipelining: the step the client pushed before this one.
    prev_step: Option<u64>,
    /// Client-reported encoding time.
    encode_seconds: f64,
}

impl PushHeaders {
    fn parse(
        step: u64,
        encoding: Option<&str>,
        prev_step: Option<&str>,
        encode_seconds: Option<&str>,
    ) -> Result<Self, ServiceError> {
        // The codings in the order they were applied (RFC 9110 §8.4);
        // `identity` applies nothing. One real coding at most is accepted.
        let applied: Vec<String> = encoding
            .unwrap_or("")
            .split(',')
            .map(|c| c.trim().to_ascii_lowercase())
            .filter(|c| !c.is_empty() && c != "identity")
            .collect();
        let encoding = match applied.as_slice() {
            [] => Encoding::Identity,
            [c] if c == "zstd" => Encoding::Zstd,
            [c] if c == codec::ENCODING => Encoding::ByteGroup,
            _ => {
                let other = encoding.unwrap_or("");
                return Err(ServiceError::new(
                    415,
                    "unsupported_encoding",
                    format!(
                        "Content-Encoding `{other}`: only zstd, {} (or none) is accepted",
                        codec::ENCODING
                    ),
                ));
            }
        };
        let prev_step = match prev_step {
            None => None,
            Some(v) => Some(
                v.trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|&p| p < step)
                    .ok_or_else(|| {
                        ServiceError::bad_request(
                            "invalid_header",
                            format!("{PREV_STEP}: must be a step below {step}"),
                        )
                    })?,
            ),
        };
        let encode_seconds = encode_seconds
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
            .unwrap_or(0.0);
        Ok(PushHeaders {
            encoding,
            prev_step,
            encode_seconds,
        })
    }
}

/// How the body arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Identity,
    Zstd,
    ByteGroup,
}

impl Encoding {
    fn name(self) -> &'static str {
        match self {
            Encoding::Identity => "identity",
            Encoding::Zstd => "zstd",
            Encoding::ByteGroup => codec::ENCODING,
        }
    }
}

/// What a validated push was and how it arrived, for the rank's wire
/// figures.
struct WireNote {
    encoding: Encoding,
    kind: &'static str,
    quant: Option<String>,
    /// Client-reported encoding seconds.
    encode_seconds: f64,
    /// Seconds the server spent decoding the body.
    decode_seconds: f64,
}

impl WireNote {
    fn of(push: &ParsedPush, headers: &PushHeaders, decode_seconds: f64) -> Self {
        WireNote {
            encoding: headers.encoding,
            kind: match push.kind {
                PushKind::Full => "full",
                PushKind::Delta => "delta",
                PushKind::Xor => "xor",
            },
            quant: push
                .tensors
                .iter()
                .find_map(|t| t.quant.as_ref())
                .map(|q| match q.format {
                    QuantFormat::Bf16 => "bf16".to_string(),
                    QuantFormat::Fp8E4m3 => format!("fp8_e4m3/{}", q.block),
                    QuantFormat::Int8 => format!("int8/{}", q.block),
                }),
            encode_seconds: headers.encode_seconds,
            decode_seconds,
        }
    }
}

/// Idle push receive buffers kept for reuse: bodies being received while
/// another is applied (two with a pipelining client), a decoded body beside
/// its encoded one, one spare.
const BODY_BUFFERS_KEPT: usize = 4;

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
    /// Pipelined pushes waiting for their predecessors.
    pipeline: Pipeline,
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
            pipeline: Pipeline::new(
                std::time::Duration::from_secs_f64(ctx.args.pipeline_timeout_secs.max(0.0)),
                ctx.args.pipeline_depth,
            ),
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

    /// Whether pushes are fenced now: this node's lease was not renewed for
    /// most of its length and another node could take its ranks (see
    /// [`crate::node::Lease`]). `(age, length)` of the lease when they are,
    /// counted as a fenced push.
    pub fn fenced(&self) -> Option<(std::time::Duration, std::time::Duration)> {
        let lease = &self.ctx.lease;
        let age = lease.fenced()?;
        self.ctx.metrics.pushes_fenced.inc();
        Some((age, lease.length()))
    }

    /// Receives, validates and applies one push, and records its outcome or
    /// its rejection.
    pub async fn push<B>(&self, req: PushRequest<B>) -> Result<PushResponse, ServiceError>
    where
        B: Body<Data = Bytes, Error = BodyFault> + Unpin,
    {
        let (run, rank, step) = (req.run.clone(), req.rank, req.step);
        let result = self.receive_and_apply(req).await;
        // Answered for good, applied or refused: pipelined successors may go
        // on. An answer the client retries (busy, too slow, a server fault) is
        // not: the successors waiting for it are refused at once (429) rather
        // than left holding their bodies, and with them the in-flight budget
        // the retry needs; the client sends them again after the retry.
        let final_answer = match &result {
            Ok(_) => true,
            Err(e) => !(e.status == 429 || e.status == 408 || e.status >= 500),
        };
        let id = (run.config.name.as_str(), run.created_at_ms);
        if final_answer {
            self.pipeline.answered(id, rank, step);
        } else {
            self.pipeline.retry_later(id, rank, step);
        }
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
            prev_step,
            encode_seconds,
            declared,
            body,
            started,
        } = req;
        let headers = PushHeaders::parse(
            step,
            encoding.as_deref(),
            prev_step.as_deref(),
            encode_seconds.as_deref(),
        );
        let headers = match headers {
            Ok(h) => h,
            Err(e) => {
                drain(body, declared).await;
                return Err(e);
            }
        };
        // A rank just taken over: this push is on its way from now, so a
        // successor resent beside it waits for it rather than taking it as
        // lost with the old node (see `wait_for_predecessor`).
        if run.rank_with(rank, awaits_resumption) == Some(true) {
            self.pipeline
                .arrive((run.config.name.as_str(), run.created_at_ms), rank, step);
        }
        let received = self.receive(body, headers, declared).await?;
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
        if let Some(prev) = headers.prev_step {
            self.wait_for_predecessor(&validated, prev).await?;
        }
        self.apply(validated).await
    }

    /// Forgets the pipelining order of a run's ranks (the run was deleted
    /// or resumed): pushes waiting for a predecessor are refused.
    pub fn forget_run(&self, run: &str) {
        self.pipeline.forget(run);
    }

    /// A pipelined push waits here, validated, until its predecessor step
    /// was answered (or the rank applied a step at or past it).
    async fn wait_for_predecessor(
        &self,
        push: &ValidatedPush,
        prev: u64,
    ) -> Result<(), ServiceError> {
        let (run, rank) = (&push.run, push.rank);
        // A rank taken over from a lost node, until its first push after
        // the failover applies: the predecessor may have been applied on
        // the lost node only. One the catalog saw applied there never comes
        // here, so the push goes on at once; another is given a moment to
        // begin here (pushes resent side by side), else taken as lost. The
        // steps lost are reported.
        let last_seen = run.rank_with(rank, |s| {
            awaits_resumption(s).then(|| s.failover.as_ref().and_then(|f| f.last_seen_step))
        });
        let lost_after = match last_seen.flatten() {
            Some(seen) if seen.is_some_and(|s| prev <= s) => return Ok(()),
            Some(_) => Some(FAILOVER_GRACE),
            None => None,
        };
        let applied = || run.rank_with(rank, |s| s.last_step).flatten();
        self.pipeline
            .wait_for(
                (run.config.name.as_str(), run.created_at_ms),
                rank,
                push.step,
                prev,
                applied,
                self.ctx.args.retry_after_secs,
                lost_after,
            )
            .await
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
                logical_bytes: 0,
                mirror_mismatch: None,
            },
            rank,
            reason: Some(format!(
                "not_update_step: the run applies steps that are multiples of {}",
                run.config.update_every
            )),
        }
    }

    /// Checks the declared length, then takes the body into one buffer
    /// under the in-flight byte budget.
    async fn receive<B>(
        &self,
        body: B,
        headers: PushHeaders,
        declared: Option<u64>,
    ) -> Result<Received, ServiceError>
    where
        B: Body<Data = Bytes, Error = BodyFault> + Unpin,
    {
        let limit = self.ctx.args.push_body_limit.0;
        if let Some(len) = declared {
            if len > limit {
                drain(body, declared).await;
                return Err(too_large(len, limit));
            }
        }
        let mut budget = Budget::new(self);
        let raw = read_body(body, declared, limit, &mut budget, &self.bodies).await?;
        Ok(Received {
            raw,
            headers,
            budget,
        })
    }

    /// Decodes (zstd, `polyak-bgz`) and parses the body off the async
    /// threads.
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
            headers,
            budget,
        } = received;
        let wire_len = raw.len() as u64;
        let pool = self.bodies.clone();
        let encoding = headers.encoding;
        let (parsed, decode_seconds, budget) = tokio::task::spawn_blocking(move || {
            decode_and_validate(raw, encoding, limit, limits, policy, &pool, budget)
        })
        .await??;
        let wire = WireNote::of(&parsed, &headers, decode_seconds);
        Ok(ValidatedPush {
            run,
            rank,
            step,
            parsed,
            wire_len,
            started,
            wire,
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
        if let Some(failover) = resumed {
            report_resumed(ctx, name, rank, failover);
        }
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

    /// Records an applied push's wire figures (rank view, Prometheus) and a
    /// keyframe's mirror mismatch (event, counter).
    fn record_wire(
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
            Some(rank),
            Some(step),
            Event::Rejection(Rejection {
                status: err.status,
                code: err.code,
                message: err.message.clone(),
            }),
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

/// The validation pass, on a blocking thread: an encoded body is decoded
/// first (written once, into a pooled buffer) and validated from there.
/// Returns the push, the decoding seconds and the budget, which now covers
/// the decoded body.
fn decode_and_validate(
    raw: Bytes,
    encoding: Encoding,
    limit: u64,
    limits: WireLimits,
    policy: NonfinitePolicy,
    pool: &Arc<BodyPool>,
    mut budget: Budget,
) -> Result<(ParsedPush, f64, Budget), ServiceError> {
    let decoding = Instant::now();
    let bytes = match encoding {
        Encoding::Identity => raw,
        Encoding::Zstd => decompress(&raw, limit)?,
        Encoding::ByteGroup => codec::decode(&raw, limit, pool)?,
    };
    let decode_seconds = match encoding {
        Encoding::Identity => 0.0,
        _ => decoding.elapsed().as_secs_f64(),
    };
    budget.reserve(bytes.len() as u64)?;
    let parsed = parse_push(bytes, limits, policy)?;
    Ok((parsed, decode_seconds, budget))
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

/// Whether a rank was taken over from a lost node and has not applied a
/// push since.
fn awaits_resumption(s: &crate::registry::RankSummary) -> bool {
    s.failover
        .as_ref()
        .is_some_and(|f| f.resumed_step.is_none())
}

/// How long a push to a rank just taken over waits for its predecessor to
/// begin here before taking it as lost with the node (see
/// [`Ingest::wait_for_predecessor`]).
const FAILOVER_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// The first push to a rank after its failover: the steps its EMA lost
/// are known now; reported (event, metric) and recorded in the catalog.
fn report_resumed(ctx: &Context, run: &str, rank: u32, failover: crate::registry::Failover) {
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
    tokio::spawn(async move {
        let json = serde_json::to_value(&failover).unwrap_or_default();
        if let Err(e) = ctx.store.set_rank_failover(&run, rank, &json).await {
            tracing::warn!(run = %run, rank, error = %e, "recording a failover failed");
        }
    });
}
