//! Snapshots over HTTP: create, list, get, delete, download (full,
//! sharded, HF shards, one rank's file; `Range`, `ETag`), compare, resume,
//! and an on-demand state snapshot.

use std::collections::BTreeMap;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::error::{ApiError, ErrorBody};
use super::extract::{bounded_step, run_named, ApiJson, ApiQuery, MaybeJson};
use crate::services::snapshots::{self as snap, comparison, download};
use crate::snapshot::compare::CompareResult;
use crate::state::AppState;
use crate::store::snapshots::{FileRow, SnapshotRow};

/// The body of `POST /v1/runs/{run}/snapshots`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    /// The step; default the ranks' current step when every rank has
    /// applied it (cut at once), else the next update step after the
    /// furthest rank. The answer's `detail.cut` says which (`current`,
    /// `next_update`, or `requested`).
    pub step: Option<u64>,
    /// Profiles to capture; default all.
    pub profiles: Option<Vec<String>>,
    pub label: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SnapshotList {
    pub snapshots: Vec<SnapshotRow>,
}

/// A snapshot with its files.
#[derive(Debug, Serialize, ToSchema)]
pub struct SnapshotView {
    #[serde(flatten)]
    pub snapshot: SnapshotRow,
    pub files: Vec<FileRow>,
    /// While a derived (post-hoc or merged) snapshot is being written:
    /// source bytes read of the total.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<snap::derived::Progress>,
}

/// Schedule a consistent snapshot.
#[utoipa::path(post, path = "/v1/runs/{run}/snapshots", tag = "snapshots",
    params(("run" = String, Path)), request_body = SnapshotRequest,
    responses((status = 202, body = SnapshotRow), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody),
              (status = 507, body = ErrorBody, description = "insufficient_storage: the write would pass --disk-reserve")))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    MaybeJson(req): MaybeJson<SnapshotRequest>,
) -> Result<(StatusCode, Json<SnapshotRow>), ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    let step = req.step.map(|s| bounded_step("step", s)).transpose()?;
    let row = snap::create(state.snapshots(), &run, step, req.profiles, req.label).await?;
    Ok((StatusCode::ACCEPTED, Json(row)))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only this kind (`manual`, `periodic`, `state`, `posthoc`, `merge`).
    pub kind: Option<String>,
    /// Only this status (`pending`, `complete`, `failed`).
    pub status: Option<String>,
}

/// List a run's snapshots, oldest first.
#[utoipa::path(get, path = "/v1/runs/{run}/snapshots", tag = "snapshots",
    params(("run" = String, Path), ListQuery), responses((status = 200, body = SnapshotList)))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<SnapshotList>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let snapshots = download::list(state.snapshots(), &name)
        .await?
        .into_iter()
        .filter(|s| q.kind.as_ref().is_none_or(|k| s.kind.as_str() == k))
        .filter(|s| q.status.as_ref().is_none_or(|k| s.status.as_str() == k))
        .collect();
    Ok(Json(SnapshotList { snapshots }))
}

async fn row_of(state: &AppState, run: &str, id: &str) -> Result<SnapshotRow, ApiError> {
    Ok(download::row(state.snapshots(), run, id).await?)
}

/// One snapshot and its files (sha256, bytes, step per rank).
#[utoipa::path(get, path = "/v1/runs/{run}/snapshots/{id}", tag = "snapshots",
    params(("run" = String, Path), ("id" = String, Path)),
    responses((status = 200, body = SnapshotView), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path((name, id)): Path<(String, String)>,
) -> Result<Json<SnapshotView>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let snapshot = row_of(&state, &name, &id).await?;
    let files = download::files(state.snapshots(), &id).await?;
    let progress = snap::derived::progress_of(state.snapshots(), &id);
    Ok(Json(SnapshotView {
        snapshot,
        files,
        progress,
    }))
}

/// Delete a snapshot and free its files.
#[utoipa::path(delete, path = "/v1/runs/{run}/snapshots/{id}", tag = "snapshots",
    params(("run" = String, Path), ("id" = String, Path)),
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path((name, id)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    row_of(&state, &name, &id).await?;
    snap::delete(state.snapshots(), &name, &id, None).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DownloadQuery {
    /// Profile (default the snapshot's first); `online` = the mirror.
    pub profile: Option<String>,
    /// `full` (default), `sharded`, `hf`, or `rank` (one stored file, as is).
    #[param(value_type = Option<crate::contract::DownloadLayout>)]
    pub layout: Option<String>,
    /// Cast floating point tensors: `fp32`, `bf16`, `fp16`, `fp64`.
    pub dtype: Option<String>,
    /// With `layout=rank`.
    pub rank: Option<u32>,
    /// HF-style shards of at most this many bytes (`layout=hf`, or
    /// `layout=full` with this set); default 5 GB.
    pub max_shard_size: Option<u64>,
}

/// Download a complete snapshot, streamed (`Range` and `ETag` supported).
#[utoipa::path(get, path = "/v1/runs/{run}/snapshots/{id}/download", tag = "snapshots",
    params(("run" = String, Path), ("id" = String, Path), DownloadQuery),
    responses((status = 200, content_type = "application/octet-stream", body = Vec<u8>),
              (status = 206, description = "a byte range"), (status = 304, description = "ETag matched"),
              (status = 409, body = ErrorBody, description = "the snapshot is not complete"),
              (status = 416, body = ErrorBody)))]
pub async fn download(
    State(state): State<AppState>,
    caller: Caller,
    Path((name, id)): Path<(String, String)>,
    ApiQuery(q): ApiQuery<DownloadQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let asked = download::Asked {
        profile: q.profile.as_deref(),
        layout: q.layout.as_deref(),
        dtype: q.dtype.as_deref(),
        rank: q.rank,
        max_shard_size: q.max_shard_size,
    };
    let dl = download::prepare(state.snapshots(), &run, &id, &asked).await?;
    let etag = HeaderValue::from_str(&dl.etag).map_err(ApiError::internal)?;
    if super::conditional::none_match(&headers, &dl.etag) {
        return Ok((StatusCode::NOT_MODIFIED, [(header::ETAG, etag)]).into_response());
    }
    let len = dl.file.len();
    // A `Range` under an `If-Range` that does not match is ignored.
    let range_spec = headers
        .get(header::RANGE)
        .filter(|_| super::conditional::range_allowed(&headers, &dl.etag))
        .and_then(|v| v.to_str().ok());
    let range = match range_spec {
        None => None,
        Some(spec) => match download::byte_range(spec, len) {
            Ok(r) => r,
            Err(download::Unsatisfiable) => {
                let mut resp = ApiError::new(
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    "range_not_satisfiable",
                    format!("range `{spec}` is outside the {len}-byte file"),
                )
                .into_response();
                if let Ok(v) = HeaderValue::from_str(&format!("bytes */{len}")) {
                    resp.headers_mut().insert(header::CONTENT_RANGE, v);
                }
                return Ok(resp);
            }
        },
    };
    let (status, span) = match range {
        Some(r) => (StatusCode::PARTIAL_CONTENT, r),
        None => (StatusCode::OK, 0..len),
    };
    let stream = download::open(state.snapshots(), dl.file, span.clone()).await?;
    let mut resp = Response::new(Body::from_stream(stream));
    resp.extensions_mut().insert(super::conn::Download);
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(dl.content_type),
    );
    h.insert(
        header::CONTENT_LENGTH,
        HeaderValue::from(span.end - span.start),
    );
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    h.insert(header::ETAG, etag);
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{}\"", dl.file_name)) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    if status == StatusCode::PARTIAL_CONTENT {
        if let Ok(v) =
            HeaderValue::from_str(&format!("bytes {}-{}/{len}", span.start, span.end - 1))
        {
            h.insert(header::CONTENT_RANGE, v);
        }
    }
    Ok(resp)
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct CompareQuery {
    /// A snapshot id.
    pub a: String,
    /// A snapshot id, or `live` for the current EMA.
    pub b: String,
    /// Profile of side A (default the run's first profile).
    pub profile: Option<String>,
    /// Profile of side B (default: `profile`).
    pub profile_b: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CompareResponse {
    pub a: String,
    pub b: String,
    pub profile: String,
    pub profile_b: String,
    #[serde(flatten)]
    pub result: CompareResult,
}

/// Per-tensor statistics between two snapshots, or a snapshot and the live
/// EMA, over whole tensors.
#[utoipa::path(get, path = "/v1/runs/{run}/compare", tag = "snapshots",
    params(("run" = String, Path), CompareQuery),
    responses((status = 200, body = CompareResponse), (status = 404, body = ErrorBody)))]
pub async fn compare(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<CompareQuery>,
) -> Result<Json<CompareResponse>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let done =
        comparison::compare(state.snapshots(), &run, &q.a, &q.b, q.profile, q.profile_b).await?;
    Ok(Json(CompareResponse {
        a: q.a,
        b: q.b,
        profile: done.profile,
        profile_b: done.profile_b,
        result: (*done.result).clone(),
    }))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResumeRequest {
    /// The last step the trainer's checkpoint pushed (optimizer steps
    /// taken minus one): restore from the newest complete snapshot at or
    /// before it.
    pub step: u64,
    /// Restore even when that snapshot is older than `step`'s last update
    /// step (the EMA then misses those updates); refused (409
    /// `snapshot_older`) otherwise.
    #[serde(default)]
    pub allow_older: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ResumeResponse {
    pub snapshot: String,
    pub step: u64,
    /// Per rank, the step it now continues from. JSON object keys are
    /// strings: the rank number written in decimal.
    #[schema(value_type = BTreeMap<String, u64>)]
    pub rank_steps: BTreeMap<u32, u64>,
    /// The step asked for.
    pub requested_step: u64,
    /// The snapshot is older than the step asked for (`allow_older`).
    pub older: bool,
}

/// Restore every rank's EMA (and mirror) from the newest complete snapshot
/// at or before `step`; pushes continue from there.
#[utoipa::path(post, path = "/v1/runs/{run}/resume", tag = "snapshots",
    params(("run" = String, Path)), request_body = ResumeRequest,
    responses((status = 200, body = ResumeResponse), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody, description = "snapshot_older: the newest snapshot misses updates before `step`")))]
pub async fn resume(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<ResumeRequest>,
) -> Result<Json<ResumeResponse>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    bounded_step("step", req.step)?;
    let resumed = snap::resume(state.snapshots(), &run, req.step, req.allow_older).await?;
    // The ranks' steps went back: pipelined pushes start a new order.
    state.ingest().forget_run(&name);
    let row = resumed.row;
    tracing::info!(run = %name, snapshot = %row.id, step = row.step, "resumed");
    Ok(Json(ResumeResponse {
        snapshot: row.id,
        step: row.step,
        rank_steps: resumed.rank_steps,
        requested_step: req.step,
        older: resumed.older,
    }))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PersistResponse {
    /// The state snapshot taken, or null when nothing changed.
    pub snapshot: Option<String>,
}

/// Take a crash-recovery `state` snapshot now.
#[utoipa::path(post, path = "/v1/runs/{run}/persist", tag = "snapshots",
    params(("run" = String, Path)), responses((status = 200, body = PersistResponse),
        (status = 500, body = ErrorBody, description = "snapshot_write_failed: writing the state failed (the run stays due and is retried)"),
        (status = 507, body = ErrorBody, description = "insufficient_storage: the write would pass --disk-reserve")))]
pub async fn persist(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<PersistResponse>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    let snapshot = snap::persist_state(state.snapshots(), &run, true).await?;
    Ok(Json(PersistResponse { snapshot }))
}
