//! A push body taken into one pooled buffer under the in-flight byte
//! budget; a body refused early is drained so the client sees the answer.

use std::sync::Arc;

use bytes::Bytes;
use http_body::Body;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::headers::PushHeaders;
use super::{BodyFault, Ingest};
use crate::services::ServiceError;
use crate::wire::bodies::BodyPool;

/// A body received in full, not yet parsed.
pub(super) struct Received {
    pub(super) raw: Bytes,
    pub(super) headers: PushHeaders,
    pub(super) budget: Budget,
}

/// Bodies larger than this are not drained before an early error answer
/// (the connection is closed instead).
const DRAIN_LIMIT: u64 = 64 << 20;

impl Ingest {
    /// Checks the declared length, then takes the body into one buffer
    /// under the in-flight byte budget.
    pub(super) async fn receive<B>(
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
}

pub(super) fn too_large(len: u64, limit: u64) -> ServiceError {
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
pub(super) struct Budget {
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
    pub(super) fn reserve(&mut self, bytes: u64) -> Result<(), ServiceError> {
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
        BodyFault::Timeout(m) => {
            ServiceError::new(crate::services::ErrorKind::Timeout, "body_timeout", m)
        }
        BodyFault::Read(m) => {
            ServiceError::bad_request("body_read_failed", format!("reading the body failed: {m}"))
        }
    }
}
