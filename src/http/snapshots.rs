//! Snapshots over HTTP: create, list, get, delete, download (full,
//! sharded, HF shards, one rank's file; `Range`, `ETag`), compare, resume,
//! and an on-demand state snapshot.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

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
use crate::engine::rank::RankLayout;
use crate::services::snapshots::{self as snap, SnapshotStatus};
use crate::snapshot::assemble::{self, Layout};
use crate::snapshot::compare::{self, CompareResult, RankTensors};
use crate::snapshot::format::MIRROR_PART;
use crate::state::AppState;
use crate::store::snapshots::{FileRow, SnapshotRow};
use crate::wire::DType;

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
    let snapshots = state
        .store()
        .snapshots(&name)
        .await?
        .into_iter()
        .filter(|s| q.kind.as_ref().is_none_or(|k| s.kind.as_str() == k))
        .filter(|s| q.status.as_ref().is_none_or(|k| s.status.as_str() == k))
        .collect();
    Ok(Json(SnapshotList { snapshots }))
}

async fn row_of(state: &AppState, run: &str, id: &str) -> Result<SnapshotRow, ApiError> {
    state.store().snapshot(run, id).await?.ok_or_else(|| {
        ApiError::not_found(
            "snapshot_not_found",
            format!("no snapshot `{id}` in run `{run}`"),
        )
    })
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
    let files = state.store().snapshot_files(&id).await?;
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
pub struct DownloadQuery {
    /// Profile (default the snapshot's first); `online` = the mirror.
    pub profile: Option<String>,
    /// `full` (default), `sharded`, `hf`, or `rank` (one stored file, as is).
    pub layout: Option<String>,
    /// Cast floating point tensors: `fp32`, `bf16`, `fp16`, `fp64`.
    pub dtype: Option<String>,
    /// With `layout=rank`.
    pub rank: Option<u32>,
    /// HF-style shards of at most this many bytes (`layout=hf`, or
    /// `layout=full` with this set); default 5 GB.
    pub max_shard_size: Option<u64>,
}

fn part_name(row: &SnapshotRow, profile: Option<&str>) -> Result<String, ApiError> {
    match profile {
        None => Ok(row.profiles.first().cloned().unwrap_or_default()),
        Some("online") | Some(MIRROR_PART) => Ok(MIRROR_PART.to_string()),
        Some(p) if row.profiles.iter().any(|q| q == p) => Ok(p.to_string()),
        Some(p) => Err(ApiError::not_found(
            "profile_not_found",
            format!(
                "snapshot `{}` holds no profile `{p}` (it has {:?})",
                row.id, row.profiles
            ),
        )),
    }
}

fn parse_cast(dtype: Option<&str>) -> Result<Option<DType>, ApiError> {
    dtype
        .map(|d| {
            DType::parse_float(d).ok_or_else(|| {
                ApiError::bad_request(
                    "invalid_dtype",
                    format!("dtype `{d}`: expected fp32, bf16, fp16 or fp64"),
                )
            })
        })
        .transpose()
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
    let row = row_of(&state, &name, &id).await?;
    if row.status != SnapshotStatus::Complete {
        return Err(ApiError::conflict(
            "snapshot_not_complete",
            format!(
                "snapshot `{id}` is {}{}",
                row.status,
                row.reason
                    .as_deref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            ),
        ));
    }
    let part = part_name(&row, q.profile.as_deref())?;
    let cast = parse_cast(q.dtype.as_deref())?;
    let layout =
        match (q.layout.as_deref().unwrap_or("full"), q.max_shard_size) {
            ("full", None) => Layout::Full,
            ("full", Some(max)) | ("hf", Some(max)) => Layout::Hf {
                max_shard_size: max.max(1),
            },
            ("hf", None) => Layout::Hf {
                max_shard_size: 5_000_000_000,
            },
            ("sharded", _) => Layout::Sharded,
            ("rank", _) => Layout::Rank(q.rank.ok_or_else(|| {
                ApiError::bad_request("invalid_layout", "layout=rank needs rank=N")
            })?),
            (other, _) => {
                return Err(ApiError::bad_request(
                    "invalid_layout",
                    format!("layout `{other}`: expected full, sharded, hf or rank"),
                ))
            }
        };
    let parts = snap::parts_of(state.snapshots(), &row, &part).await?;
    if parts.is_empty() {
        return Err(ApiError::not_found(
            "not_in_snapshot",
            format!("snapshot `{id}` holds no `{part}` files"),
        ));
    }
    let mut meta = BTreeMap::from([
        ("polyak.run".to_string(), name.clone()),
        ("polyak.snapshot".to_string(), id.clone()),
        ("polyak.step".to_string(), row.step.to_string()),
        ("polyak.profile".to_string(), part.clone()),
    ]);
    let model_config = run.meta.lock().expect("meta lock").model_config.clone();
    if let Some(config) = model_config.and_then(|c| serde_json::to_string_pretty(&c).ok()) {
        meta.insert(assemble::HF_CONFIG_META.to_string(), config);
    }
    let sid = id.clone();
    let mtime = (row.completed_at_ms.unwrap_or(row.created_at_ms).max(0) / 1000) as u64;
    let dl = tokio::task::spawn_blocking(move || {
        assemble::build(&sid, meta, &parts, layout, cast, mtime)
    })
    .await?
    .inspect_err(|e| {
        if let assemble::AssembleError::Io(e) = e {
            report_download_mismatch(&state, e);
        }
    })?;
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
        Some(spec) => match parse_range(spec, len) {
            Ok(r) => r,
            Err(()) => {
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
    // Sizes before the first byte; sha256 while the bytes stream, the last
    // chunk held until every part read has matched.
    let file = Arc::new(dl.file);
    let (sized, checked) = (file.clone(), span.clone());
    tokio::task::spawn_blocking(move || sized.check_sizes(checked))
        .await?
        .map_err(|e| {
            report_download_mismatch(&state, &e);
            snap::SnapshotError::Io(e)
        })?;
    let (events, metrics) = (
        state.shared().events.clone(),
        state.shared().metrics.clone(),
    );
    let stream = file.stream_verified(span.clone(), move |m| {
        snap::verify::report_mismatch(&events, &metrics, m, "download")
    });
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

/// Reports a part a download found other than recorded.
fn report_download_mismatch(state: &AppState, e: &std::io::Error) {
    if let Some(m) = crate::snapshot::source::PartMismatch::of(e) {
        snap::verify::report_mismatch(state.events(), state.metrics(), m, "download");
    }
}

/// `bytes=a-b`, `bytes=a-`, `bytes=-n` (one range; several are answered
/// whole, which RFC 9110 allows). `Err` when unsatisfiable.
fn parse_range(spec: &str, len: u64) -> Result<Option<std::ops::Range<u64>>, ()> {
    let Some(ranges) = spec.trim().strip_prefix("bytes=") else {
        return Ok(None);
    };
    if ranges.contains(',') {
        return Ok(None);
    }
    let (a, b) = ranges.split_once('-').ok_or(())?;
    let (a, b) = (a.trim(), b.trim());
    let range = if a.is_empty() {
        let n: u64 = b.parse().map_err(|_| ())?;
        if n == 0 {
            return Err(());
        }
        len.saturating_sub(n)..len
    } else {
        let start: u64 = a.parse().map_err(|_| ())?;
        let end = if b.is_empty() {
            len
        } else {
            b.parse::<u64>().map_err(|_| ())?.saturating_add(1).min(len)
        };
        if start >= len || start >= end {
            return Err(());
        }
        start..end
    };
    Ok(Some(range))
}

#[derive(Debug, Deserialize, IntoParams)]
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
    let profile = q
        .profile
        .clone()
        .unwrap_or_else(|| run.config.profiles[0].name().to_string());
    let profile_b = q.profile_b.clone().unwrap_or_else(|| profile.clone());
    let key = format!("{name}\n{}\n{}\n{profile}\n{profile_b}", q.a, q.b);
    if q.b != "live" {
        if let Some(hit) = state.snapshots().pending.cached_compare(&key) {
            return Ok(Json(CompareResponse {
                a: q.a,
                b: q.b,
                profile,
                profile_b,
                result: (*hit).clone(),
            }));
        }
    }
    let side_a = side(&state, &name, &q.a, &profile).await?;
    let side_b = side(&state, &name, &q.b, &profile_b).await?;
    let layouts = side_a.layouts();
    let result = tokio::task::spawn_blocking(move || {
        compare::compare(&layouts, |r| side_a.load(r), |r| side_b.load(r))
    })
    .await?
    .map_err(|e| match e {
        CompareFail::NotComparable(m) => ApiError::unprocessable("not_comparable", m),
        CompareFail::Read(e) => {
            report_compare_mismatch(&state, &e);
            snap::SnapshotError::Io(e).into()
        }
    })?;
    let result = Arc::new(result);
    if q.b != "live" {
        state.snapshots().pending.cache_compare(key, result.clone());
    }
    Ok(Json(CompareResponse {
        a: q.a,
        b: q.b,
        profile,
        profile_b,
        result: (*result).clone(),
    }))
}

/// Why one side of a comparison could not be loaded.
enum CompareFail {
    /// The two sides do not line up (422).
    NotComparable(String),
    /// A stored part could not be read, or does not match its record.
    Read(std::io::Error),
}

impl From<String> for CompareFail {
    fn from(m: String) -> Self {
        CompareFail::NotComparable(m)
    }
}

fn report_compare_mismatch(state: &AppState, e: &std::io::Error) {
    if let Some(m) = crate::snapshot::source::PartMismatch::of(e) {
        snap::verify::report_mismatch(state.events(), state.metrics(), m, "compare");
    }
}

/// One side of a comparison.
enum Side {
    Stored(Vec<assemble::StoredPart>),
    Live(HashMap<u32, (Arc<RankLayout>, RankTensors)>),
}

impl Side {
    fn layouts(&self) -> BTreeMap<u32, RankLayout> {
        match self {
            Side::Stored(parts) => parts
                .iter()
                .map(|p| (p.rank, p.meta.layout.clone()))
                .collect(),
            Side::Live(ranks) => ranks
                .iter()
                .map(|(r, (l, _))| (*r, (**l).clone()))
                .collect(),
        }
    }

    fn load(&self, rank: u32) -> Result<RankTensors, CompareFail> {
        match self {
            Side::Stored(parts) => {
                let part = parts
                    .iter()
                    .find(|p| p.rank == rank)
                    .ok_or_else(|| format!("rank {rank} has no file"))?;
                Ok(compare::read_part(part).map_err(CompareFail::Read)??)
            }
            Side::Live(ranks) => Ok(ranks
                .get(&rank)
                .map(|(_, t)| t.clone())
                .ok_or_else(|| format!("rank {rank} holds no live EMA"))?),
        }
    }
}

async fn side(state: &AppState, run: &str, which: &str, profile: &str) -> Result<Side, ApiError> {
    if which == "live" {
        let handle = run_named(state, run)?;
        let live = crate::services::runs::live_tensors(&handle, profile).await?;
        return Ok(Side::Live(live));
    }
    let row = row_of(state, run, which).await?;
    if row.status != SnapshotStatus::Complete {
        return Err(ApiError::conflict(
            "snapshot_not_complete",
            format!("snapshot `{which}` is {}", row.status),
        ));
    }
    let part = part_name(&row, Some(profile))?;
    let parts = snap::parts_of(state.snapshots(), &row, &part).await?;
    // `online` on a snapshot without a mirror: nothing to compare.
    if parts.is_empty() {
        return Err(ApiError::not_found(
            "not_in_snapshot",
            format!("snapshot `{which}` holds no `{profile}` files"),
        ));
    }
    Ok(Side::Stored(parts))
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

#[cfg(test)]
mod tests {
    use super::parse_range;

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-9", 100), Ok(Some(0..10)));
        assert_eq!(parse_range("bytes=90-", 100), Ok(Some(90..100)));
        assert_eq!(parse_range("bytes=-10", 100), Ok(Some(90..100)));
        assert_eq!(parse_range("bytes=95-200", 100), Ok(Some(95..100)));
        assert_eq!(parse_range("bytes=100-", 100), Err(()));
        assert_eq!(parse_range("bytes=5-2", 100), Err(()));
        assert_eq!(parse_range("bytes=0-1,5-6", 100), Ok(None));
        assert_eq!(parse_range("items=0-1", 100), Ok(None));
    }
}
