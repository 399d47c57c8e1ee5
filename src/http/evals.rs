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
use crate::services::evals::{
    Best, EvalCursor, EvalFilter, Evaluation, NewEval, Recorded, DEFAULT_PAGE, MAX_PAGE,
};
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
    body: Result<ApiJson<NewEval>, ApiError>,
) -> Result<(StatusCode, Json<Evaluation>), ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    // A metric value no float64 holds (`1e400`), or metrics of the wrong
    // type, are an invalid evaluation, as the service's own checks of the
    // metrics name them; other fields keep the body's `invalid_config`.
    let ApiJson(new) = body.map_err(|e| {
        let metrics = e
            .field
            .as_deref()
            .is_some_and(|f| f == "metrics" || f.starts_with("metrics."));
        if e.code == "invalid_config" && metrics {
            ApiError {
                code: "invalid_eval",
                ..e
            }
        } else {
            e
        }
    })?;
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
    /// Most evaluations in the answer (1 to 10000, default 1000).
    #[param(minimum = 1, maximum = 10000)]
    pub limit: Option<u32>,
    /// Start after this cursor: the `next` of the page before.
    pub after: Option<String>,
}

impl EvalQuery {
    fn filter(&self) -> EvalFilter {
        EvalFilter {
            metric: self.metric.clone(),
            profile: self.profile.clone(),
            kind: self.kind,
            evaluator: self.evaluator.clone(),
        }
    }

    /// The page asked for: where it starts and how many at most.
    fn page(&self) -> Result<(Option<EvalCursor>, u32), ApiError> {
        let limit = self.limit.unwrap_or(DEFAULT_PAGE);
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(ApiError::bad_request(
                "invalid_query",
                format!("limit: {limit} is not between 1 and {MAX_PAGE}"),
            ));
        }
        let after = self.after.as_deref().map(str::parse).transpose()?;
        Ok((after, limit))
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EvalList {
    /// By the candidate's step, then in the order they were stored.
    pub evals: Vec<Evaluation>,
    /// The cursor of the next page (give it as `after=`); null on the last.
    pub next: Option<String>,
}

/// A run's evaluations, each with its candidate's step, kind, `sigma_rel`
/// (post-hoc, or a live power profile's), fit residual and sources; in
/// pages of `limit`, the next one at `after=` the answer's `next`.
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
    let (after, limit) = q.page()?;
    let page = state.evals().list(&run, &q.filter(), after, limit).await?;
    Ok(Json(EvalList {
        evals: page.evals,
        next: page.next.map(|c| c.to_string()),
    }))
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
