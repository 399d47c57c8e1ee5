//! Evaluations over HTTP: post one for a candidate, list them, and ask for
//! the best candidate of a metric.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::error::{ApiError, ErrorBody};
use super::extract::{run_named, ApiJson, ApiQuery};
use crate::contract::{BestMode, CandidateKind};
use crate::services::evals::{Best, EvalFilter, Evaluation, NewEval, Recorded};
use crate::state::AppState;

/// Store an evaluation of a candidate: a profile of a complete snapshot,
/// or `online` (the mirror stored with a cut). One per snapshot, profile
/// and evaluator: the same numbers again answer `200`, others `409
/// eval_conflict`.
#[utoipa::path(post, path = "/v1/runs/{run}/evals", tag = "evals",
    params(("run" = String, Path)), request_body = NewEval,
    responses((status = 201, body = Evaluation, description = "stored"),
        (status = 200, body = Evaluation, description = "the same evaluation was stored before"),
        (status = 404, body = ErrorBody, description = "no such run, snapshot or profile"),
        (status = 409, body = ErrorBody, description = "eval_conflict, snapshot_not_complete"),
        (status = 422, body = ErrorBody)))]
pub async fn post(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiJson(new): ApiJson<NewEval>,
) -> Result<(StatusCode, Json<Evaluation>), ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    Ok(match state.evals().record(&run, new).await? {
        Recorded::Created(e) => (StatusCode::CREATED, Json(e)),
        Recorded::Same(e) => (StatusCode::OK, Json(e)),
    })
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EvalQuery {
    /// Only evaluations that measured this metric.
    pub metric: Option<String>,
    /// Only this profile (`online`: the online weights).
    pub profile: Option<String>,
    /// Only this kind of candidate.
    #[param(value_type = Option<CandidateKind>)]
    pub kind: Option<CandidateKind>,
    pub evaluator: Option<String>,
}

impl EvalQuery {
    fn filter(self) -> EvalFilter {
        EvalFilter {
            metric: self.metric,
            profile: self.profile,
            kind: self.kind,
            evaluator: self.evaluator,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EvalList {
    /// By the candidate's step, then in the order they were stored.
    pub evals: Vec<Evaluation>,
}

/// A run's evaluations, each with its candidate's step, kind, `sigma_rel`
/// (post-hoc, or a live power profile's), fit residual and sources.
#[utoipa::path(get, path = "/v1/runs/{run}/evals", tag = "evals",
    params(("run" = String, Path), EvalQuery), responses((status = 200, body = EvalList)))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<EvalQuery>,
) -> Result<Json<EvalList>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let evals = state.evals().list(&run, &q.filter()).await?;
    Ok(Json(EvalList { evals }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct BestQuery {
    pub metric: String,
    /// `min` (default) or `max`.
    #[param(value_type = Option<BestMode>)]
    pub mode: Option<BestMode>,
    #[param(value_type = Option<CandidateKind>)]
    pub kind: Option<CandidateKind>,
    pub profile: Option<String>,
    pub evaluator: Option<String>,
}

/// The evaluated candidate with the lowest (`mode=min`) or highest
/// (`mode=max`) value of `metric`, with the path of its download.
#[utoipa::path(get, path = "/v1/runs/{run}/best", tag = "evals",
    params(("run" = String, Path), BestQuery),
    responses((status = 200, body = Best),
        (status = 404, body = ErrorBody, description = "no_evaluations: none of the metric matches")))]
pub async fn best(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<BestQuery>,
) -> Result<Json<Best>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let filter = EvalFilter {
        metric: None,
        profile: q.profile,
        kind: q.kind,
        evaluator: q.evaluator,
    };
    let best = state
        .evals()
        .best(&run, &q.metric, q.mode.unwrap_or(BestMode::Min), &filter)
        .await?;
    Ok(Json(best))
}
