//! Runs: create, list, get, delete; ranks and a rank's live EMA.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::error::{ApiError, ErrorBody};
use super::extract::{rank_of, run_named, ApiJson, ApiQuery, MaybeJson};
use crate::clock::now_ms;
use crate::contract::{RankStatus, RunHealth};
use crate::engine::device;
use crate::registry::{RankSummary, RunHandle};
use crate::run::{RunConfig, RunSpec};
use crate::services::runs;
use crate::snapshot::convert::profile_part;
use crate::state::AppState;
use crate::store::snapshots::SnapshotRow;
use crate::store::RunFinish;
use crate::wire::DType;

/// A run as listed.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunView {
    pub name: String,
    pub created_at: String,
    pub created_at_ms: i64,
    pub config: RunConfig,
    /// Highest last step over the ranks.
    pub last_step: Option<u64>,
    /// Lowest last step over the ranks that pushed.
    pub min_step: Option<u64>,
    /// Ranks that pushed at least once.
    pub ranks_seen: u32,
    /// EMA + copied + mirror bytes held on the device.
    pub resident_bytes: u64,
    /// `healthy` (every rank live), `degraded` (some rank stale or not
    /// restored), `waiting` (some ranks never pushed), `idle` (none did) or
    /// `finished` (`POST .../finish`; its ranks show `finished` too).
    pub health: RunHealth,
    /// How the run ended, once finished.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished: Option<RunFinish>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<Vec<RankView>>,
    /// Labels and a free-text note (`PATCH /v1/runs/{run}` edits them).
    pub tags: Vec<String>,
    pub note: String,
    /// Alerts firing now.
    pub alerts_firing: usize,
    /// The ranks' wire figures summed: wire and logical bytes, their
    /// ratio, encode and decode seconds, mirror mismatches.
    pub wire: crate::wire::stats::WireTotals,
}

/// The answer to run creation; tokens only when auth is on.
#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedRun {
    #[serde(flatten)]
    pub run: RunView,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_token: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RunList {
    pub runs: Vec<RunView>,
}

pub fn run_view(run: &RunHandle, with_ranks: bool) -> RunView {
    let summaries: Vec<_> = (0..run.config.world_size)
        .map(|r| run.rank(r).unwrap_or_default())
        .collect();
    let furthest = summaries.iter().filter_map(|s| s.last_step).max();
    let finished = run.finished();
    let owners = run.owners();
    let ranks: Vec<RankView> = summaries
        .iter()
        .enumerate()
        .map(|(r, s)| {
            let mut view = RankView::new(r as u32, s, furthest, false, owners.get(r));
            // A finished run's ranks stopped on purpose: not stale.
            if finished.is_some() && matches!(view.status, RankStatus::Live | RankStatus::Stale) {
                view.status = RankStatus::Finished;
            }
            view
        })
        .collect();
    let seen: Vec<&RankView> = ranks
        .iter()
        .filter(|r| r.status != RankStatus::NeverSeen)
        .collect();
    let losses = run
        .losses_unacknowledged
        .load(std::sync::atomic::Ordering::Relaxed);
    let health = if finished.is_some() {
        RunHealth::Finished
    } else if losses > 0 {
        // What the EMA lost is said until someone acknowledged it.
        RunHealth::Degraded
    } else if seen.is_empty() {
        RunHealth::Idle
    } else if seen.iter().any(|r| r.status != RankStatus::Live) {
        RunHealth::Degraded
    } else if seen.len() < ranks.len() {
        RunHealth::Waiting
    } else {
        RunHealth::Healthy
    };
    let (tags, note) = {
        let meta = run.meta.lock().expect("meta lock");
        (meta.tags.clone(), meta.note.clone())
    };
    RunView {
        name: run.config.name.clone(),
        created_at: rfc3339(run.created_at_ms),
        created_at_ms: run.created_at_ms,
        config: (*run.config).clone(),
        last_step: ranks.iter().filter_map(|r| r.last_step).max(),
        min_step: seen.iter().filter_map(|r| r.last_step).min(),
        ranks_seen: seen.len() as u32,
        resident_bytes: ranks.iter().map(|r| r.resident_bytes).sum(),
        health,
        finished,
        ranks: with_ranks.then_some(ranks),
        tags,
        note,
        alerts_firing: run.alerts_firing.load(std::sync::atomic::Ordering::Relaxed),
        wire: crate::wire::stats::WireTotals::of(summaries.iter().map(|s| &s.wire)),
    }
}

pub fn rfc3339(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct CreateQuery {
    /// An existing run of the same name with the same configuration (every
    /// field, defaults resolved) is answered `200` instead of `409`; one
    /// with another configuration is refused with the differences.
    #[serde(default)]
    pub exist_ok: bool,
}

/// Create a run.
#[utoipa::path(post, path = "/v1/runs", tag = "runs", request_body = RunSpec, params(CreateQuery),
    responses((status = 201, body = CreatedRun),
              (status = 200, body = CreatedRun, description = "exist_ok: the run exists with this configuration"),
              (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn create_run(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<CreateQuery>,
    ApiJson(spec): ApiJson<RunSpec>,
) -> Result<(StatusCode, Json<CreatedRun>), ApiError> {
    caller.require_admin()?;
    let meta = super::insight::meta_of_spec(&spec)?;
    super::insight::check_webhook(&state, &meta.alerts)?;
    let registry = state.registry();
    let config = spec.validate(registry.default_device(), |d| registry.device_for(d))?;
    Ok(match state.runs().create(config, meta, q.exist_ok).await? {
        runs::Created::Existing(run) => (
            StatusCode::OK,
            Json(CreatedRun {
                run: run_view(&run, true),
                write_token: None,
                read_token: None,
            }),
        ),
        runs::Created::New { run, tokens } => {
            let (write_token, read_token) = tokens.unzip();
            (
                StatusCode::CREATED,
                Json(CreatedRun {
                    run: run_view(&run, true),
                    write_token,
                    read_token,
                }),
            )
        }
    })
}

/// The body of `POST /v1/runs/{run}/finish`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FinishRequest {
    /// Label of the final snapshot (default `final`).
    pub label: Option<String>,
}

/// The answer to `POST /v1/runs/{run}/finish`.
#[derive(Debug, Serialize, ToSchema)]
pub struct FinishResponse {
    pub run: RunView,
    /// The final snapshot, cut at the furthest rank's last step (pending
    /// until every rank has applied that step); `null` when nothing was
    /// pushed.
    pub snapshot: Option<SnapshotRow>,
}

/// Finish a run: take its final snapshot and refuse later pushes. Health
/// and ranks then say `finished`. Finishing a finished run answers how it
/// ended.
#[utoipa::path(post, path = "/v1/runs/{run}/finish", tag = "runs",
    params(("run" = String, Path, description = "run name")), request_body = FinishRequest,
    responses((status = 200, body = FinishResponse), (status = 404, body = ErrorBody)))]
pub async fn finish_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    MaybeJson(req): MaybeJson<FinishRequest>,
) -> Result<Json<FinishResponse>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    let (_, snapshot) =
        crate::services::snapshots::finish(state.snapshots(), &run, req.label).await?;
    Ok(Json(FinishResponse {
        run: run_view(&run, true),
        snapshot,
    }))
}

/// List runs (those the caller may read).
#[utoipa::path(get, path = "/v1/runs", tag = "runs", responses((status = 200, body = RunList)))]
pub async fn list_runs(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<RunList>, ApiError> {
    if matches!(caller, Caller::Anonymous | Caller::Unknown) {
        caller.require_admin()?;
    }
    let runs: Vec<Arc<RunHandle>> = state.all_runs();
    Ok(Json(RunList {
        runs: runs
            .iter()
            .filter(|r| caller.can_read(r))
            .map(|r| run_view(r, false))
            .collect(),
    }))
}

/// One run, with its ranks.
#[utoipa::path(get, path = "/v1/runs/{run}", tag = "runs",
    params(("run" = String, Path, description = "run name")),
    responses((status = 200, body = RunView), (status = 404, body = ErrorBody)))]
pub async fn get_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: axum::http::HeaderMap,
) -> Result<Json<RunView>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let mut view = run_view(&run, true);
    // A loss another node reported (it took a rank over) shows here too.
    if matches!(
        view.health,
        RunHealth::Healthy | RunHealth::Waiting | RunHealth::Idle
    ) && super::insight::losses_elsewhere(&state, &name, &headers).await
    {
        view.health = RunHealth::Degraded;
    }
    Ok(Json(view))
}

/// Delete a run: its EMA is freed, its catalog rows and its files on disk
/// (snapshots) removed.
#[utoipa::path(delete, path = "/v1/runs/{run}", tag = "runs",
    params(("run" = String, Path, description = "run name")),
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn delete_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    run_named(&state, &name)?;
    caller.require_admin()?;
    state.runs().delete(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RankQuery {
    /// Include the registered layout.
    #[serde(default)]
    pub layout: bool,
}

/// The ranks of a run.
#[utoipa::path(get, path = "/v1/runs/{run}/ranks", tag = "ranks",
    params(("run" = String, Path, description = "run name")),
    responses((status = 200, body = Vec<RankView>)))]
pub async fn list_ranks(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<Vec<RankView>>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    Ok(Json(run_view(&run, true).ranks.unwrap_or_default()))
}

/// One rank: last step, layout, bytes, status.
#[utoipa::path(get, path = "/v1/runs/{run}/ranks/{rank}", tag = "ranks",
    params(("run" = String, Path), ("rank" = u32, Path), RankQuery),
    responses((status = 200, body = RankView), (status = 404, body = ErrorBody)))]
pub async fn get_rank(
    State(state): State<AppState>,
    caller: Caller,
    Path((name, rank)): Path<(String, String)>,
    ApiQuery(q): ApiQuery<RankQuery>,
) -> Result<Json<RankView>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let rank = rank_of(&run, &rank)?;
    let summary = run.rank(rank).unwrap_or_default();
    let furthest = (0..run.config.world_size)
        .filter_map(|r| run.rank(r).and_then(|s| s.last_step))
        .max();
    Ok(Json(RankView::new(
        rank,
        &summary,
        furthest,
        q.layout,
        run.owner(rank).as_ref(),
    )))
}

/// Where a rank lives: the node (its id and URL), the device and engine,
/// and the placement's epoch.
#[derive(Debug, Serialize, ToSchema)]
pub struct RankPlacement {
    pub node: String,
    /// The URL pushes of this rank go to.
    pub url: String,
    /// `cpu` or `cuda:N`.
    pub device: String,
    /// The engine on that device (`cpu#1` with several CPU engines); empty
    /// until the owner installed the run.
    pub engine: String,
    /// Incremented each time the rank moves to another node.
    pub epoch: u64,
}

/// Where each rank of the run is held, by rank (`{"0": {...}, ...}`). A
/// client pushes each rank to its `url`; a push sent elsewhere is answered
/// `307` to it. On one server every rank names this node, at epoch 1.
#[utoipa::path(get, path = "/v1/runs/{run}/placement", tag = "runs",
    params(("run" = String, Path)),
    responses((status = 200, body = BTreeMap<String, RankPlacement>), (status = 404, body = ErrorBody)))]
pub async fn placement(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<BTreeMap<String, RankPlacement>>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let out = run
        .owners()
        .into_iter()
        .enumerate()
        .map(|(rank, owner)| {
            let device = match run.engines.of(rank as u32) {
                Some(engine) => device::name(engine.device()),
                None => run.config.device.clone(),
            };
            let place = RankPlacement {
                node: owner.node_id,
                url: owner.url,
                device,
                engine: owner.engine.unwrap_or_default(),
                epoch: owner.epoch,
            };
            (rank.to_string(), place)
        })
        .collect();
    Ok(Json(out))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EmaQuery {
    /// Profile name; default the run's first profile.
    pub profile: Option<String>,
    /// Cast the averaged tensors: `float32`, `bfloat16`, `float16`, `float64`.
    pub dtype: Option<String>,
}

/// This rank's live EMA as a safetensors file: the names, shapes and chunk
/// metadata it pushed; averaged tensors in the run's `ema_dtype`.
#[utoipa::path(get, path = "/v1/runs/{run}/ranks/{rank}/ema", tag = "ranks",
    params(("run" = String, Path), ("rank" = u32, Path), EmaQuery),
    responses((status = 200, content_type = "application/octet-stream", body = Vec<u8>),
              (status = 404, body = ErrorBody)))]
pub async fn get_rank_ema(
    State(state): State<AppState>,
    caller: Caller,
    Path((name, rank)): Path<(String, String)>,
    ApiQuery(q): ApiQuery<EmaQuery>,
    uri: axum::http::Uri,
    headers: axum::http::HeaderMap,
) -> Result<Response, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let rank = rank_of(&run, &rank)?;
    if !run.holds(rank) {
        let owner = run.owner(rank).unwrap_or_else(|| state.registry().me(0));
        return super::route::forward(&owner, &uri, &headers).await;
    }
    let profile = q
        .profile
        .unwrap_or_else(|| run.config.profiles[0].name().to_string());
    let cast = match q.dtype.as_deref() {
        None => None,
        Some(d) => Some(DType::parse_float(d).ok_or_else(|| {
            ApiError::bad_request(
                "invalid_dtype",
                format!("dtype `{d}`: expected float32, bfloat16, float16 or float64"),
            )
        })?),
    };
    let host = state.runs().rank_ema(&run, rank, &profile, cast).await?;
    let mut meta = BTreeMap::new();
    meta.insert("polyak.run".to_string(), run.config.name.clone());
    meta.insert("polyak.rank".to_string(), rank.to_string());
    meta.insert("polyak.profile".to_string(), profile);
    if let Some(step) = host.last_step {
        meta.insert("polyak.step".to_string(), step.to_string());
    }
    let file = profile_part(&host.layout, host.ema, host.copied, meta);
    let len = file.len();
    let mut parts = vec![bytes::Bytes::from(file.header.into_bytes())];
    parts.extend(file.blocks);
    let stream = futures::stream::iter(parts.into_iter().map(Ok::<_, std::io::Error>));
    let mut response = Body::from_stream(stream).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    Ok(response)
}

/// JSON view of a rank.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RankView {
    pub rank: u32,
    /// The node holding the rank.
    pub node: String,
    /// The engine holding the rank: its device, with an index when several
    /// engines share it (`cpu#1`, `cuda:0`).
    pub engine: String,
    /// `live` (pushing recently), `stale` (no push for a while),
    /// `never_seen`, or `not_restored` (known from the catalog, EMA not in
    /// memory since a restart).
    pub status: RankStatus,
    pub last_step: Option<u64>,
    pub pushes: u64,
    pub duplicates: u64,
    pub bytes_received: u64,
    pub rejections: u64,
    pub resident_bytes: u64,
    pub last_push_at_ms: Option<i64>,
    pub last_apply_seconds: Option<f64>,
    pub tensors: usize,
    pub numel: u64,
    /// Steps behind the furthest rank of the run.
    pub lag: Option<u64>,
    /// Seconds since the last push.
    pub age_seconds: Option<f64>,
    /// Seconds without a push after which the rank counts as stale: 60, or
    /// three times its usual interval between pushes when that is longer.
    pub stale_after_seconds: f64,
    /// Mean push latency (exponentially weighted), seconds.
    pub push_seconds: Option<f64>,
    /// Throughput over the last pushes.
    pub bytes_per_second: Option<f64>,
    /// Latest `||EMA - online|| / ||online||` per profile.
    pub drift: BTreeMap<String, f64>,
    /// Wire bytes against logical bytes, and codec time.
    pub wire: crate::wire::stats::WireStats,
    /// The rank's last failover: taken over from a node that was gone,
    /// restored from a snapshot, and (after its next push) the update
    /// steps its EMA lost. `null` when its node never failed.
    pub failover: Option<crate::registry::Failover>,
    /// The registered layout (with `?layout=true`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub layout: Option<serde_json::Value>,
}

impl RankView {
    /// `furthest`: the highest last step over the run's ranks.
    pub fn new(
        rank: u32,
        s: &RankSummary,
        furthest: Option<u64>,
        with_layout: bool,
        owner: Option<&crate::registry::Owner>,
    ) -> Self {
        let status = if s.pushes == 0 && s.last_step.is_none() {
            RankStatus::NeverSeen
        } else if !s.live {
            RankStatus::NotRestored
        } else if s
            .last_push_at_ms
            .is_some_and(|t| now_ms() - t > s.stale_after_ms())
        {
            RankStatus::Stale
        } else {
            RankStatus::Live
        };
        RankView {
            rank,
            node: owner.map(|o| o.node_id.clone()).unwrap_or_default(),
            engine: owner.and_then(|o| o.engine.clone()).unwrap_or_default(),
            status,
            last_step: s.last_step,
            pushes: s.pushes,
            duplicates: s.duplicates,
            bytes_received: s.bytes_received,
            rejections: s.rejections,
            resident_bytes: s.resident_bytes,
            last_push_at_ms: s.last_push_at_ms,
            last_apply_seconds: s.last_apply_seconds,
            tensors: s.tensors,
            numel: s.numel,
            lag: furthest.zip(s.last_step).map(|(f, l)| f.saturating_sub(l)),
            age_seconds: s
                .last_push_at_ms
                .map(|t| (now_ms() - t).max(0) as f64 / 1000.0),
            stale_after_seconds: s.stale_after_ms() as f64 / 1000.0,
            push_seconds: s.push_seconds_ewma,
            bytes_per_second: s.bytes_per_second(),
            drift: s
                .drift
                .iter()
                .map(|(p, (d, o))| (p.clone(), if *o > 0.0 { (d / o).sqrt() } else { d.sqrt() }))
                .collect(),
            wire: s.wire.clone(),
            failover: s.failover.clone(),
            layout: if with_layout {
                s.layout.as_deref().cloned()
            } else {
                None
            },
        }
    }
}
