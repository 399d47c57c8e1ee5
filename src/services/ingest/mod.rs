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
//!
//! Layout: `headers` (what a push's headers declare), `receive` (the body
//! read under the byte budget), `validate` (decoding and parsing off the
//! async threads), `pipelined` (a push waiting for its predecessor),
//! `apply` (queued on the engine), `record` (the bookkeeping of an applied
//! or refused push).

mod apply;
mod headers;
mod pipelined;
mod receive;
mod record;
mod validate;

pub use headers::ENCODE_SECONDS;
pub use receive::drain;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body::Body;
use serde::Serialize;
use tokio::sync::Semaphore;
use utoipa::ToSchema;

use super::pipeline::Pipeline;
use super::{Context, ServiceError};
use crate::engine::rank::PushOutcome;
use crate::registry::RunHandle;
use crate::wire::bodies::BodyPool;
use crate::wire::ParsedPush;
use headers::PushHeaders;
use pipelined::awaits_resumption;
use receive::Budget;
use validate::WireNote;

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

/// Idle push receive buffers kept for reuse: bodies being received while
/// another is applied (two with a pipelining client), a decoded body beside
/// its encoded one, one spare.
const BODY_BUFFERS_KEPT: usize = 4;

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
            Err(e) => !e.kind.retried(),
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
}
