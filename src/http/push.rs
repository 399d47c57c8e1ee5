//! `PUT|POST /v1/runs/{run}/ranks/{rank}/steps/{step}`: a rank pushes its
//! shard.
//!
//! The handler checks what is cheap first (auth, run, rank, update step,
//! declared length), then receives the body into one buffer under the
//! in-flight byte budget (taken as bytes arrive, never from the declared
//! length: a client that only promises bytes holds nothing), validates it on a blocking thread (safetensors
//! header, chunks, NaN/Inf, digest), and only then queues it on the engine,
//! which checks the step rules and the layout and applies it.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::Json;
use http_body_util::BodyExt;
use serde::Serialize;
use tokio::sync::OwnedSemaphorePermit;
use utoipa::ToSchema;

use super::auth::Caller;
use super::error::{ApiError, ErrorBody};
use super::extract::{rank_of, run_named, step_of};
use crate::engine::rank::PushOutcome;
use crate::state::{counts_of, now_ms, AppState, RunHandle};
use crate::wire::bodies::BodyPool;
use crate::wire::{parse_push, WireLimits};

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

/// Bodies larger than this are not drained before an early error answer
/// (the connection is closed instead).
const DRAIN_LIMIT: u64 = 64 << 20;

/// Push one rank's tensors for one step (body: a safetensors file,
/// optionally `Content-Encoding: zstd` or `polyak-bgz`).
#[utoipa::path(method(put, post), path = "/v1/runs/{run}/ranks/{rank}/steps/{step}", tag = "push",
    params(("run" = String, Path), ("rank" = u32, Path), ("step" = u64, Path),
           ("polyak-prev-step" = Option<u64>, Header, description = "pipelining: the step this client pushed before; the push is applied after that one is answered"),
           ("polyak-encode-seconds" = Option<f64>, Header, description = "seconds the client spent encoding the body (reported in the rank's wire figures)")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = PushResponse),
              (status = 400, body = ErrorBody, description = "malformed safetensors"),
              (status = 404, body = ErrorBody, description = "no such run or rank"),
              (status = 409, body = ErrorBody, description = "step_conflict, layout_mismatch, needs_keyframe, predecessor_timeout"),
              (status = 408, body = ErrorBody, description = "body_timeout: the body arrived too slowly"),
              (status = 413, body = ErrorBody, description = "body or header over the limit"),
              (status = 415, body = ErrorBody, description = "a Content-Encoding other than zstd or polyak-bgz"),
              (status = 422, body = ErrorBody, description = "nonfinite, unsupported_dtype, invalid_shards"),
              (status = 429, body = ErrorBody, description = "busy; see Retry-After")))]
pub async fn push(
    State(state): State<AppState>,
    caller: Caller,
    Path((name, rank, step)): Path<(String, String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<PushResponse>, ApiError> {
    let started = Instant::now();
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let early = |err: ApiError, body: Body| async move {
        drain(body, declared).await;
        Err(err)
    };
    let rank = match rank_of(&run, &rank) {
        Ok(r) => r,
        Err(e) => return early(e, body).await,
    };
    let step = match step_of(&step) {
        Ok(s) => s,
        Err(e) => return early(e, body).await,
    };
    let result =
        receive_and_apply(&state, &run, rank, step, &headers, declared, body, started).await;
    // Answered for good, applied or refused: pipelined successors may go
    // on. An answer the client retries (busy, too slow, a server fault) is
    // not: the successor keeps waiting for the retry.
    let final_answer = match &result {
        Ok(_) => true,
        Err(e) => {
            !(e.status == StatusCode::TOO_MANY_REQUESTS
                || e.status == StatusCode::REQUEST_TIMEOUT
                || e.status.is_server_error())
        }
    };
    if final_answer {
        state.pipeline.answered(&run.config.name, rank, step);
    }
    if let Err(e) = &result {
        record_rejection(&state, &run, rank, step, e);
    }
    result.map(Json)
}

#[allow(clippy::too_many_arguments)]
async fn receive_and_apply(
    state: &AppState,
    run: &Arc<RunHandle>,
    rank: u32,
    step: u64,
    headers: &HeaderMap,
    declared: Option<u64>,
    body: Body,
    started: Instant,
) -> Result<PushResponse, ApiError> {
    let config = run.config.clone();
    let limit = state.args.push_body_limit.0;
    if !config.is_update_step(step) {
        drain(body, declared).await;
        state
            .metrics
            .pushes
            .with_label_values(&[&config.name, "not_update_step"])
            .inc();
        let summary = run.rank(rank).unwrap_or_default();
        return Ok(PushResponse {
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
                config.update_every
            )),
        });
    }
    let PushHeaders {
        encoding,
        prev_step,
        encode_seconds,
    } = match PushHeaders::parse(headers, step) {
        Ok(h) => h,
        Err(e) => {
            drain(body, declared).await;
            return Err(e);
        }
    };
    if let Some(len) = declared {
        if len > limit {
            drain(body, declared).await;
            return Err(too_large(len, limit));
        }
    }

    // Receive the body under the in-flight byte budget.
    let mut budget = Budget::new(state);
    let raw = read_body(body, declared, limit, &mut budget, &state.bodies).await?;
    let received = Instant::now();
    state
        .metrics
        .push_seconds
        .with_label_values(&["receive"])
        .observe((received - started).as_secs_f64());
    let wire_len = raw.len() as u64;

    // Validate off the async threads.
    let limits = WireLimits {
        header_limit: state.args.header_limit.0,
    };
    let policy = config.nonfinite;
    let pool = state.bodies.clone();
    let (parsed, decode_seconds, budget) = tokio::task::spawn_blocking(move || {
        decode_and_validate(raw, encoding, limit, limits, policy, &pool, budget)
    })
    .await??;
    state
        .metrics
        .push_seconds
        .with_label_values(&["validate"])
        .observe(received.elapsed().as_secs_f64());

    // A pipelined push waits here, validated, for its predecessor's answer.
    if let Some(prev) = prev_step {
        let applied = || run.rank(rank).and_then(|s| s.last_step);
        state
            .pipeline
            .wait_for(
                &config.name,
                rank,
                step,
                prev,
                applied,
                state.args.retry_after_secs,
            )
            .await?;
    }

    // Apply on the engine. The budget is released when the engine is done
    // with the body.
    let parsed_kind = PushLabels::of(&parsed);
    let run_name = config.name.clone();
    let queued = Instant::now();
    let outcome = run
        .engine
        .try_call(move |engine| {
            let outcome = engine.push(&run_name, rank, step, parsed);
            drop(budget);
            outcome
        })
        .await
        .map_err(|e| match e {
            crate::engine::EngineError::QueueFull => ApiError::too_many(
                "the engine queue is full; retry after the delay",
                state.args.retry_after_secs,
            ),
            other => other.into(),
        })??;
    let metrics = &state.metrics;
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
        .with_label_values(&[&config.name])
        .inc_by(wire_len);
    if !outcome.duplicate {
        note_wire(
            state,
            run,
            rank,
            step,
            &outcome,
            wire_len,
            encoding,
            &parsed_kind,
            encode_seconds,
            decode_seconds,
        );
    }

    let layout = outcome.registered.clone();
    let latency = started.elapsed().as_secs_f64();
    if !outcome.duplicate {
        crate::monitor::note_ingest(run, wire_len, latency);
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
    state.record_rank(run, rank, &summary, layout.as_deref());
    metrics
        .resident_bytes
        .with_label_values(&[&config.name])
        .set(run.resident_bytes() as i64);
    if let Some(drift) = &outcome.drift {
        crate::monitor::record_drift(state, run, rank, step, drift);
    }
    let kind = if outcome.duplicate {
        "duplicate"
    } else {
        "applied"
    };
    metrics
        .pushes
        .with_label_values(&[&config.name, kind])
        .inc();
    if let Some(layout) = &layout {
        let (tensors, numel) = counts_of(layout);
        state.events.emit(
            &config.name,
            "rank_registered",
            Some(rank),
            Some(step),
            serde_json::json!({"tensors": tensors, "numel": numel, "resident_bytes": outcome.resident_bytes}),
        );
    }
    state.events.emit(
        &config.name,
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
    let reason = outcome.duplicate.then(|| "duplicate".to_string());
    Ok(PushResponse {
        outcome,
        rank,
        reason,
    })
}

/// Header in which a client reports the seconds it spent encoding the body
/// (shown with the rank's wire figures; never trusted for anything else).
pub const ENCODE_SECONDS: &str = "polyak-encode-seconds";

/// What a push's headers declare besides its length.
struct PushHeaders {
    encoding: Encoding,
    /// Pipelining: the step the client pushed before this one.
    prev_step: Option<u64>,
    /// Client-reported encoding time.
    encode_seconds: f64,
}

impl PushHeaders {
    fn parse(headers: &HeaderMap, step: u64) -> Result<Self, ApiError> {
        let encoding = match headers
            .get(header::CONTENT_ENCODING)
            .map(|v| v.to_str().unwrap_or("?"))
        {
            None | Some("identity") => Encoding::Identity,
            Some("zstd") => Encoding::Zstd,
            Some(crate::wire::codec::ENCODING) => Encoding::ByteGroup,
            Some(other) => {
                return Err(ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_encoding",
                    format!(
                        "Content-Encoding `{other}`: only zstd, {} (or none) is accepted",
                        crate::wire::codec::ENCODING
                    ),
                ))
            }
        };
        let prev_step = match headers.get(super::pipeline::PREV_STEP) {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .ok()
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .filter(|&p| p < step)
                    .ok_or_else(|| {
                        ApiError::bad_request(
                            "invalid_header",
                            format!(
                                "{}: must be a step below {step}",
                                super::pipeline::PREV_STEP
                            ),
                        )
                    })?,
            ),
        };
        let encode_seconds = headers
            .get(ENCODE_SECONDS)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
            .unwrap_or(0.0);
        Ok(PushHeaders {
            encoding,
            prev_step,
            encode_seconds,
        })
    }
}

/// The validation pass, on a blocking thread: an encoded body is decoded
/// first (written once, into a pooled buffer) and validated from there.
/// Returns the push, the decoding seconds and the budget, which now covers
/// the decoded body.
fn decode_and_validate(
    raw: bytes::Bytes,
    encoding: Encoding,
    limit: u64,
    limits: WireLimits,
    policy: crate::run::NonfinitePolicy,
    pool: &Arc<BodyPool>,
    mut budget: Budget,
) -> Result<(crate::wire::ParsedPush, f64, Budget), ApiError> {
    let decoding = Instant::now();
    let bytes = match encoding {
        Encoding::Identity => raw,
        Encoding::Zstd => decompress(&raw, limit)?,
        Encoding::ByteGroup => crate::wire::codec::decode(&raw, limit, pool)?,
    };
    let decode_seconds = match encoding {
        Encoding::Identity => 0.0,
        _ => decoding.elapsed().as_secs_f64(),
    };
    budget.reserve(bytes.len() as u64)?;
    let parsed = parse_push(bytes, limits, policy)?;
    Ok((parsed, decode_seconds, budget))
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
            Encoding::ByteGroup => crate::wire::codec::ENCODING,
        }
    }
}

/// What a push was, for the rank's wire figures.
struct PushLabels {
    kind: &'static str,
    quant: Option<String>,
}

impl PushLabels {
    fn of(push: &crate::wire::ParsedPush) -> Self {
        use crate::wire::quant::QuantFormat;
        PushLabels {
            kind: match push.kind {
                crate::wire::PushKind::Full => "full",
                crate::wire::PushKind::Delta => "delta",
                crate::wire::PushKind::Xor => "xor",
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
        }
    }
}

/// Records an applied push's wire figures (rank view, Prometheus) and a
/// keyframe's mirror mismatch (event, counter).
#[allow(clippy::too_many_arguments)]
fn note_wire(
    state: &AppState,
    run: &Arc<RunHandle>,
    rank: u32,
    step: u64,
    outcome: &PushOutcome,
    wire_len: u64,
    encoding: Encoding,
    labels: &PushLabels,
    encode_seconds: f64,
    decode_seconds: f64,
) {
    let name = &run.config.name;
    let m = &state.metrics;
    m.push_logical_bytes
        .with_label_values(&[name])
        .inc_by(outcome.logical_bytes);
    m.codec_seconds
        .with_label_values(&[name, "encode"])
        .inc_by(encode_seconds);
    m.codec_seconds
        .with_label_values(&[name, "decode"])
        .inc_by(decode_seconds);
    if let Some(mismatch) = &outcome.mirror_mismatch {
        m.mirror_mismatches.with_label_values(&[name]).inc();
        state.events.emit(
            name,
            "mirror_mismatch",
            Some(rank),
            Some(step),
            serde_json::json!({
                "client_crc32": mismatch.client_crc32,
                "server_crc32": mismatch.server_crc32,
                "repaired": true,
            }),
        );
        tracing::warn!(run = %name, rank, step, "keyframe found the mirror diverged from the client's copy; repaired");
    }
    run.update_rank(rank, |s| {
        s.wire.note(
            wire_len,
            outcome.logical_bytes,
            encode_seconds,
            decode_seconds,
        );
        s.wire.last_kind = Some(labels.kind.to_string());
        s.wire.last_encoding = Some(encoding.name().to_string());
        s.wire.last_quant = labels.quant.clone();
        if outcome.mirror_mismatch.is_some() {
            s.wire.mirror_mismatches += 1;
        }
    });
}

fn too_large(len: u64, limit: u64) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("push body of {len} bytes is over the limit of {limit} bytes"),
    )
}

fn record_rejection(state: &AppState, run: &RunHandle, rank: u32, step: u64, err: &ApiError) {
    if err.status == StatusCode::TOO_MANY_REQUESTS {
        return;
    }
    state
        .metrics
        .rejections
        .with_label_values(&[&run.config.name, err.code])
        .inc();
    state
        .metrics
        .pushes
        .with_label_values(&[&run.config.name, "rejected"])
        .inc();
    let summary = run.update_rank(rank, |s| s.rejections += 1);
    state.record_rank(run, rank, &summary, None);
    state.events.emit(
        &run.config.name,
        "rejection",
        Some(rank),
        Some(step),
        serde_json::json!({"status": err.status.as_u16(), "code": err.code, "message": err.message}),
    );
    tracing::info!(run = %run.config.name, rank, step, code = err.code, "push rejected: {}", err.message);
}

/// Reads and discards a body that is not too large, so that the client
/// sees the answer instead of a reset connection.
async fn drain(body: Body, declared: Option<u64>) {
    if declared.is_some_and(|len| len > DRAIN_LIMIT) {
        return;
    }
    let mut body = body;
    let mut seen = 0u64;
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(data) = frame.data_ref() {
            seen += data.len() as u64;
            if seen > DRAIN_LIMIT {
                return;
            }
        }
    }
}

/// Push bytes held in memory, counted against the server's budget.
struct Budget {
    state: AppState,
    permit: Option<OwnedSemaphorePermit>,
    held_kib: usize,
}

impl Budget {
    fn new(state: &AppState) -> Self {
        Budget {
            state: state.clone(),
            permit: None,
            held_kib: 0,
        }
    }

    /// Makes sure `bytes` are covered; a body larger than the whole budget
    /// may still pass alone.
    fn reserve(&mut self, bytes: u64) -> Result<(), ApiError> {
        let want = (bytes.div_ceil(1024) as usize).min(self.state.inflight_kib);
        if want <= self.held_kib {
            return Ok(());
        }
        let more = (want - self.held_kib) as u32;
        let permit = self
            .state
            .inflight
            .clone()
            .try_acquire_many_owned(more)
            .map_err(|_| {
                ApiError::too_many(
                    "too many push bytes in flight; retry after the delay",
                    self.state.args.retry_after_secs,
                )
            })?;
        match &mut self.permit {
            Some(held) => held.merge(permit),
            None => self.permit = Some(permit),
        }
        self.held_kib += more as usize;
        self.state.metrics.inflight_bytes.add(more as i64 * 1024);
        Ok(())
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        self.state
            .metrics
            .inflight_bytes
            .sub(self.held_kib as i64 * 1024);
    }
}

/// Collects the body into one (reused) buffer that grows with the data,
/// refusing to grow past `limit` and taking the budget for each byte as it
/// arrives. (Digesting each frame here, while it is in cache, measured
/// slower: this loop is what bounds the receive rate, and the digest runs
/// beside the NaN/Inf scan later.)
async fn read_body(
    mut body: Body,
    declared: Option<u64>,
    limit: u64,
    budget: &mut Budget,
    pool: &Arc<BodyPool>,
) -> Result<bytes::Bytes, ApiError> {
    let hint = usize::try_from(declared.unwrap_or(0).min(limit)).unwrap_or(usize::MAX);
    let mut buf = pool.take(hint);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(body_read_error)?;
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
            return Err(ApiError::bad_request(
                "invalid_safetensors",
                format!("the body ended after {} of {len} declared bytes", buf.len()),
            ));
        }
    }
    Ok(buf.freeze())
}

/// A failed body read: 408 when the client was too slow, else 400.
pub fn body_read_error(e: axum::Error) -> ApiError {
    if super::conn::is_body_timeout(&e) {
        ApiError::new(StatusCode::REQUEST_TIMEOUT, "body_timeout", e.to_string())
    } else {
        ApiError::bad_request("body_read_failed", format!("reading the body failed: {e}"))
    }
}

/// zstd, refusing output past `limit`.
fn decompress(raw: &[u8], limit: u64) -> Result<bytes::Bytes, ApiError> {
    use std::io::Read;
    let decoder = zstd::stream::read::Decoder::new(raw)
        .map_err(|e| ApiError::bad_request("invalid_encoding", format!("zstd: {e}")))?;
    let mut out = Vec::new();
    let read = decoder
        .take(limit + 1)
        .read_to_end(&mut out)
        .map_err(|e| ApiError::bad_request("invalid_encoding", format!("zstd: {e}")))?;
    if read as u64 > limit {
        return Err(too_large(read as u64, limit));
    }
    Ok(bytes::Bytes::from(out))
}
