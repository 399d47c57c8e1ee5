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
    /// HF-style shards of at most this size (`layout=hf`, or `layout=full`
    /// with this set); default 5 GB. Bytes (`500000`) or transformers'
    /// forms (`500KB`, `5GB`, `5GiB`; `5Gb` is in bits).
    #[serde(default, deserialize_with = "shard_size_param")]
    #[param(value_type = Option<String>)]
    pub max_shard_size: Option<u64>,
}

/// `max_shard_size` as the query spells it (see [`shard_size`]).
fn shard_size_param<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let text = String::deserialize(d)?;
    shard_size(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// A size in bytes as `transformers.utils.convert_file_size_to_int` reads
/// it, so that a `max_shard_size` that works in `save_pretrained` works
/// here: `GiB`/`MiB`/`KiB` are powers of 1024, `GB`/`MB`/`KB` powers of
/// 1000 (units in any case), and a decimal unit ending in a lowercase `b`
/// counts bits (`5Gb` = 625000000 bytes, rounded down). The number is read
/// as Python's `int()` reads one (surrounding whitespace, a sign, `_`
/// between digits; ASCII digits). A bare number, which transformers takes
/// only as an `int`, is bytes. Negative sizes and sizes past `u64` are
/// refused.
fn shard_size(text: &str) -> Result<u64, &'static str> {
    let upper = text.to_ascii_uppercase();
    // transformers' order of checks: the binary units before the decimal.
    let units: [(&str, u64, bool); 6] = [
        ("GIB", 1 << 30, false),
        ("MIB", 1 << 20, false),
        ("KIB", 1 << 10, false),
        ("GB", 1_000_000_000, true),
        ("MB", 1_000_000, true),
        ("KB", 1_000, true),
    ];
    let (number, scale, bits) = units
        .iter()
        .find(|(unit, _, _)| upper.ends_with(unit))
        .map(|&(unit, scale, decimal)| {
            let number = &text[..text.len() - unit.len()];
            (number, scale, decimal && text.ends_with('b'))
        })
        .unwrap_or((text, 1, false));
    let n = python_int(number).ok_or(
        "not a size: bytes, or an integer and a unit (500KB, 5GB, 5GiB; as transformers reads them)",
    )?;
    let n = u64::try_from(n).map_err(|_| "a size is at least 0 and at most 2^64 - 1 bytes")?;
    let bytes = n
        .checked_mul(scale)
        .ok_or("a size is at most 2^64 - 1 bytes")?;
    Ok(if bits { bytes / 8 } else { bytes })
}

/// An integer as Python's `int(str)` parses it, for ASCII digits:
/// surrounding whitespace, an optional sign, and single underscores
/// between digits. `None` when it is not one or does not fit an `i128`.
fn python_int(text: &str) -> Option<i128> {
    // str.strip()'s whitespace: Unicode's, and the ASCII separators 0x1c-0x1f.
    let text = text.trim_matches(|c: char| c.is_whitespace() || ('\x1c'..='\x1f').contains(&c));
    let (negative, digits) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    let bytes = digits.as_bytes();
    let well_formed = !bytes.is_empty()
        && bytes[0].is_ascii_digit()
        && bytes[bytes.len() - 1].is_ascii_digit()
        && bytes.iter().all(|b| b.is_ascii_digit() || *b == b'_')
        && !digits.contains("__");
    if !well_formed {
        return None;
    }
    let value: i128 = digits.replace('_', "").parse().ok()?;
    Some(if negative { -value } else { value })
}

impl DownloadQuery {
    fn asked(&self) -> download::Asked<'_> {
        download::Asked {
            profile: self.profile.as_deref(),
            layout: self.layout.as_deref(),
            dtype: self.dtype.as_deref(),
            rank: self.rank,
            max_shard_size: self.max_shard_size,
        }
    }
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
    let asked = q.asked();
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
    let stream = download::open(state.snapshots(), dl.file, &dl.etag, span.clone()).await?;
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

/// What a download states of the file it serves, for the client's check.
#[derive(Debug, Serialize, ToSchema)]
pub struct DownloadDigests {
    /// The download's ETag (the same query's `ETag` header).
    pub etag: String,
    /// The served file's length.
    pub bytes: u64,
    /// Bytes per digest (8 MiB); the last block may be shorter.
    pub block_bytes: u64,
    /// `crc32` (CRC-32/ISO-HDLC, as zlib's `crc32`).
    pub algorithm: &'static str,
    /// The CRC-32 of each block, in order.
    pub crc32: Vec<u32>,
}

/// The digests of what a download serves (the same query as `download`):
/// the CRC-32 of every 8 MiB block of the served file, any layout.
#[utoipa::path(get, path = "/v1/runs/{run}/snapshots/{id}/download/digests", tag = "snapshots",
    params(("run" = String, Path), ("id" = String, Path), DownloadQuery),
    responses((status = 200, body = DownloadDigests),
              (status = 409, body = ErrorBody, description = "the snapshot is not complete"),
              (status = 500, body = ErrorBody, description = "a stored block did not match (`snapshot_corrupt`)")))]
pub async fn download_digests(
    State(state): State<AppState>,
    caller: Caller,
    Path((name, id)): Path<(String, String)>,
    ApiQuery(q): ApiQuery<DownloadQuery>,
) -> Result<Json<DownloadDigests>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let asked = q.asked();
    let dl = download::prepare(state.snapshots(), &run, &id, &asked).await?;
    let crc32 = download::digests(state.snapshots(), &dl).await?;
    Ok(Json(DownloadDigests {
        bytes: dl.file.len(),
        etag: dl.etag,
        block_bytes: crate::snapshot::digests::DIGEST_BLOCK,
        algorithm: "crc32",
        crc32,
    }))
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
    let snapshot = snap::persist_bounded(state.snapshots(), &run).await?;
    Ok(Json(PersistResponse { snapshot }))
}

#[cfg(test)]
mod tests {
    use super::shard_size;

    /// Values and answers of `transformers.utils.convert_file_size_to_int`
    /// (transformers 5.24), computed with it.
    #[test]
    fn shard_size_reads_what_transformers_reads() {
        for (text, bytes) in [
            ("500KB", 500_000),
            ("5GB", 5_000_000_000),
            ("5GiB", 5 * (1 << 30)),
            ("5gib", 5 * (1 << 30)),
            ("5GIB", 5 * (1 << 30)),
            ("1MiB", 1_048_576),
            ("3KiB", 3072),
            ("200MB", 200_000_000),
            ("5Gb", 625_000_000),
            ("5gb", 625_000_000),
            ("5gB", 5_000_000_000),
            ("1Kb", 125),
            ("3kb", 375),
            ("7Mb", 875_000),
            ("1_000KB", 1_000_000),
            (" 5 GB", 5_000_000_000),
            ("+2MB", 2_000_000),
            ("007KB", 7_000),
            ("0GB", 0),
            // A bare number (an int in transformers) is bytes.
            ("500000", 500_000),
            ("1_024", 1024),
        ] {
            assert_eq!(shard_size(text), Ok(bytes), "{text}");
        }
    }

    /// Strings transformers refuses (ValueError), and sizes it would take
    /// but no shard can have: negative, or past u64.
    #[test]
    fn shard_size_refuses_what_transformers_refuses() {
        for text in [
            "",
            "GB",
            "5 GB ",
            "5GBs",
            "5B",
            "5b",
            "five",
            "5.5GB",
            "1e3KB",
            "_1KB",
            "1_KB",
            "1__0KB",
            "5TB",
            "0x10KB",
            "-5GB",
            "-1",
            "99999999999999999999GB",
        ] {
            assert!(
                shard_size(text).is_err(),
                "{text} -> {:?}",
                shard_size(text)
            );
        }
        assert!(shard_size("abc").unwrap_err().starts_with("not a size"));
        assert!(shard_size("-5GB").unwrap_err().contains("at least 0"));
    }
}
