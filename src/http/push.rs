//! `PUT|POST /v1/runs/{run}/ranks/{rank}/steps/{step}`: a rank pushes its
//! shard.
//!
//! The handler checks what is cheap first (auth, run, rank, step), then
//! hands the request to the ingest service (`services/ingest/`), which
//! receives the body under the in-flight byte budget, validates it on a
//! blocking thread and applies it on the engine.

use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http_body_util::BodyExt;

use super::auth::Caller;
use super::error::{ApiError, ErrorBody};
use super::extract::{rank_of, run_named, step_of};
use crate::services::ingest::{drain, BodyFault, PushRequest, PushResponse, ENCODE_SECONDS};
use crate::services::pipeline::PREV_STEP;
use crate::state::AppState;

/// Push one rank's tensors for one step (body: a safetensors file,
/// optionally `Content-Encoding: zstd` or `polyak-bgz`).
#[utoipa::path(method(put, post), path = "/v1/runs/{run}/ranks/{rank}/steps/{step}", tag = "push",
    params(("run" = String, Path), ("rank" = u32, Path), ("step" = u64, Path),
           ("polyak-prev-step" = Option<u64>, Header, description = "pipelining: the step this client pushed before; the push is applied after that one is answered"),
           ("polyak-encode-seconds" = Option<f64>, Header, description = "seconds the client spent encoding the body (reported in the rank's wire figures)")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = PushResponse),
              (status = 307, description = "rank_elsewhere: another node of the service holds this rank; `Location` is the same request on that node"),
              (status = 400, body = ErrorBody, description = "malformed safetensors"),
              (status = 404, body = ErrorBody, description = "no such run or rank"),
              (status = 409, body = ErrorBody, description = "step_conflict, layout_mismatch, needs_keyframe, predecessor_timeout, pipeline_reset (the run was deleted or resumed while the push waited for its predecessor)"),
              (status = 408, body = ErrorBody, description = "body_timeout: the body arrived too slowly"),
              (status = 413, body = ErrorBody, description = "body or header over the limit"),
              (status = 415, body = ErrorBody, description = "a Content-Encoding other than zstd or polyak-bgz"),
              (status = 422, body = ErrorBody, description = "nonfinite, unsupported_dtype, invalid_shards"),
              (status = 503, body = ErrorBody, description = "lease_lost: this node could not renew its lease in time and another node may hold the rank; see Retry-After"),
              (status = 429, body = ErrorBody, description = "busy, or predecessor_retry (the predecessor step was answered with a retry; send this one again after it); see Retry-After")))]
pub async fn push(
    State(state): State<AppState>,
    caller: Caller,
    Path((name, rank, step)): Path<(String, String, String)>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    // Catalog queries made while answering are counted apart (there are
    // none: `polyak_catalog_queries_total{path="push"}` stays 0).
    crate::store::on_push_path(answer(
        state,
        caller,
        (name, rank, step),
        uri,
        headers,
        body,
        started,
    ))
    .await
}

async fn answer(
    state: AppState,
    caller: Caller,
    (name, rank, step): (String, String, String),
    uri: Uri,
    headers: HeaderMap,
    body: Body,
    started: Instant,
) -> Result<Response, ApiError> {
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
    let text_of = |name| {
        headers
            .get(name)
            .map(|v: &header::HeaderValue| v.to_str().unwrap_or("?").to_string())
    };
    // Several lines are one list (RFC 9110 §5.3), read as the service reads
    // a single line.
    let codings = super::conditional::list_members(&headers, &header::CONTENT_ENCODING);
    let encoding = (!codings.is_empty()).then(|| codings.join(", "));
    let prev_step = text_of(PREV_STEP);
    let encode_seconds = text_of(ENCODE_SECONDS);
    let rank = match rank_of(&run, &rank) {
        Ok(r) => r,
        Err(e) => return early(e, body).await,
    };
    // Another node holds this rank: the client resends it there.
    if !run.holds(rank) {
        let owner = run.owner(rank).unwrap_or_else(|| state.registry().me(0));
        let answer = if owner.node_id == state.registry().node_id() {
            // Placed here but not held (being taken over, or just let go
            // and the new owner not known yet): never a redirect to itself.
            Err(ApiError {
                retry_after: Some(1),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "placement_moved",
                    format!("rank {rank} is changing hands; retry"),
                )
            })
        } else {
            super::route::redirect(&owner, &uri, rank)
        };
        drain(body, declared).await;
        return answer;
    }
    if let Err(e) = fence(&state) {
        return early(e, body).await;
    }
    let step = match step_of(&step) {
        Ok(s) => s,
        Err(e) => return early(e, body).await,
    };
    let request = PushRequest {
        run,
        rank,
        step,
        encoding,
        prev_step,
        encode_seconds,
        declared,
        body: body.map_err(body_fault),
        started,
    };
    let answer = state.ingest().push(request).await?;
    // Not acknowledged when the lease may have run out meanwhile: another
    // node may hold the rank now, and the client resends it there.
    fence(&state)?;
    Ok(Json(answer).into_response())
}

/// `503 lease_lost` while this node cannot be sure it still holds its
/// ranks: its lease was not renewed for most of its length and another
/// node could take them (see [`crate::node::Lease`]).
fn fence(state: &AppState) -> Result<(), ApiError> {
    match state.ingest().fenced() {
        None => Ok(()),
        Some((age, length)) => Err(ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "lease_lost",
                format!(
                    "this node's lease was last renewed {:.1} s ago (lease {:.1} s): it may no \
                     longer hold the rank and acknowledges no push until it renews; retry, or \
                     read the placement again",
                    age.as_secs_f64(),
                    length.as_secs_f64()
                ),
            )
        }),
    }
}

/// How the connection tells a body that came too slowly.
fn body_fault(e: axum::Error) -> BodyFault {
    if super::conn::is_body_timeout(&e) {
        BodyFault::Timeout(e.to_string())
    } else {
        BodyFault::Read(e.to_string())
    }
}
