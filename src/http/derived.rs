//! Derived snapshots over HTTP: post-hoc EMA (a plan to preview the
//! weights, one length or a sweep) and checkpoint merging.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::error::{ApiError, ErrorBody};
use super::extract::{bounded_step, run_named, ApiJson, ApiQuery};
use crate::services::snapshots::derived::{self, MergeSelection, MergeWeights, Plan};
use crate::state::AppState;
use crate::store::snapshots::SnapshotRow;

/// One target length, or a list of them (a sweep).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum SigmaRel {
    One(f64),
    Many(Vec<f64>),
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PosthocRequest {
    /// The target EMA length (EDM2 `sigma_rel`), or a list of up to 32
    /// (one derived snapshot each, written in one pass over the sources).
    pub sigma_rel: SigmaRel,
    /// The step to synthesise at: a step with a complete snapshot of the
    /// chosen power profiles (default: the newest such step).
    pub step: Option<u64>,
    /// The profile name the result is stored under (default `posthoc`).
    pub name: Option<String>,
    /// The power profiles to combine (default: every power profile).
    pub profiles: Option<Vec<String>>,
    /// `edm2` (default) or `ema_pytorch` (as ema-pytorch's
    /// `PostHocEMA.synthesize_ema_model` solves).
    #[serde(default)]
    pub method: derived::PosthocMethod,
    /// `fp16` or `bf16`: each source rounded to it before weighting (as a
    /// checkpoint stored in that dtype).
    pub source_dtype: Option<derived::SourceDtype>,
}

/// A derived snapshot as first answered: pending, with the job's progress.
#[derive(Debug, Serialize, ToSchema)]
pub struct DerivedRow {
    #[serde(flatten)]
    pub snapshot: SnapshotRow,
    /// Source bytes read of the total, when the job started.
    pub progress: derived::Progress,
}

fn derived_rows(started: derived::Started) -> Vec<DerivedRow> {
    let progress = derived::Progress {
        done: 0,
        total: started.total,
    };
    started
        .rows
        .into_iter()
        .map(|snapshot| DerivedRow { snapshot, progress })
        .collect()
}

/// The derived snapshots of a sweep, in request order.
#[derive(Debug, Serialize, ToSchema)]
pub struct PosthocSweep {
    pub snapshots: Vec<DerivedRow>,
}

/// Synthesise a post-hoc EMA (EDM2) from the complete snapshots of the
/// run's `power` profiles. A single `sigma_rel` answers the pending derived
/// snapshot; a list answers `{snapshots: [...]}`, one per value. Each
/// records its sources, their weights (summing to 1) and the fit residual
/// in `detail`.
#[utoipa::path(post, path = "/v1/runs/{run}/posthoc", tag = "snapshots",
    params(("run" = String, Path)), request_body = PosthocRequest,
    responses((status = 202, body = DerivedRow, description = "one length (a list: PosthocSweep)"),
        (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn posthoc(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<PosthocRequest>,
) -> Result<Response, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    let (sigmas, sweep) = match req.sigma_rel {
        SigmaRel::One(s) => (vec![s], false),
        SigmaRel::Many(list) => (list, true),
    };
    let step = req.step.map(|s| bounded_step("step", s)).transpose()?;
    let started = derived::posthoc(
        state.snapshots(),
        &run,
        &sigmas,
        step,
        req.name,
        req.profiles.as_deref(),
        derived::Synthesis {
            method: req.method,
            source_dtype: req.source_dtype,
        },
    )
    .await?;
    let mut rows = derived_rows(started);
    Ok(if sweep {
        (StatusCode::ACCEPTED, Json(PosthocSweep { snapshots: rows })).into_response()
    } else {
        (StatusCode::ACCEPTED, Json(rows.remove(0))).into_response()
    })
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PlanQuery {
    /// One `sigma_rel`, or several separated by commas.
    pub sigma_rel: String,
    /// The target step (default: the newest usable step).
    pub step: Option<u64>,
    /// Power profiles to combine, separated by commas (default: all).
    pub profiles: Option<String>,
    /// `edm2` (default) or `ema_pytorch`.
    pub method: Option<derived::PosthocMethod>,
}

/// The weights a post-hoc synthesis would use, without writing anything:
/// the usable steps, the sources, and per `sigma_rel` the weights and the
/// fit residual.
#[utoipa::path(get, path = "/v1/runs/{run}/posthoc/plan", tag = "snapshots",
    params(("run" = String, Path), PlanQuery),
    responses((status = 200, body = Plan), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn plan(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<PlanQuery>,
) -> Result<Json<Plan>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let mut sigmas = Vec::new();
    for part in q.sigma_rel.split(',').map(str::trim) {
        sigmas.push(part.parse::<f64>().map_err(|_| {
            ApiError::unprocessable(
                "invalid_request",
                format!("sigma_rel: `{part}` is not a number"),
            )
        })?);
    }
    let profiles: Option<Vec<String>> = q.profiles.as_deref().map(|p| {
        p.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    });
    let step = q.step.map(|s| bounded_step("step", s)).transpose()?;
    let plan = derived::plan(
        state.snapshots(),
        &run,
        &sigmas,
        step,
        profiles.as_deref(),
        q.method.unwrap_or_default(),
    )
    .await?;
    Ok(Json(plan))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MergeRequest {
    /// The snapshots to average (any order; weighed by step).
    pub snapshots: Option<Vec<String>>,
    /// Or: the newest `last` complete snapshots (one per step).
    pub last: Option<usize>,
    /// `uniform` (default), `linear` (newest weighs most) or `exp`.
    pub weights: Option<MergeWeights>,
    /// For `exp`: the weight ratio between a snapshot and the next newer
    /// one, in (0, 1] (default 0.5).
    pub alpha: Option<f64>,
    /// The profile name the result is stored under (default `merged`).
    pub name: Option<String>,
}

/// Average the online weights (the run's mirror) of stored snapshots
/// (checkpoint merging) into a derived snapshot of kind `merge`.
#[utoipa::path(post, path = "/v1/runs/{run}/merge", tag = "snapshots",
    params(("run" = String, Path)), request_body = MergeRequest,
    responses((status = 202, body = DerivedRow), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn merge(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<MergeRequest>,
) -> Result<(StatusCode, Json<DerivedRow>), ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    let selection = match (req.snapshots, req.last) {
        (Some(ids), None) => MergeSelection::Ids(ids),
        (None, Some(k)) => MergeSelection::Last(k),
        _ => {
            return Err(ApiError::unprocessable(
                "invalid_request",
                "give either `snapshots` (a list of ids) or `last` (a count)",
            ))
        }
    };
    let started = derived::merge(
        state.snapshots(),
        &run,
        selection,
        req.weights.unwrap_or(MergeWeights::Uniform),
        req.alpha,
        req.name,
    )
    .await?;
    Ok((StatusCode::ACCEPTED, Json(derived_rows(started).remove(0))))
}
