//! Decoding (zstd, `polyak-bgz`) and parsing a received body on a blocking
//! thread, and what the push was for the rank's wire figures.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::headers::{Encoding, PushHeaders};
use super::receive::{too_large, Budget, Received};
use super::{Ingest, ValidatedPush};
use crate::registry::RunHandle;
use crate::run::NonfinitePolicy;
use crate::services::ServiceError;
use crate::wire::bodies::BodyPool;
use crate::wire::quant::QuantFormat;
use crate::wire::{codec, parse_push, ParsedPush, PushKind, WireLimits};

/// What a validated push was and how it arrived, for the rank's wire
/// figures.
pub(super) struct WireNote {
    pub(super) encoding: Encoding,
    pub(super) kind: &'static str,
    pub(super) quant: Option<String>,
    /// Client-reported encoding seconds.
    pub(super) encode_seconds: f64,
    /// Seconds the server spent decoding the body.
    pub(super) decode_seconds: f64,
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

impl Ingest {
    /// Decodes (zstd, `polyak-bgz`) and parses the body off the async
    /// threads.
    pub(super) async fn validate(
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
