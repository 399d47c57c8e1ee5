//! Requests among the nodes of one service: a push for a rank another node
//! holds is redirected there (`307`, so clients and `curl --location`
//! resend it to the owner), a read of such a rank's live EMA is forwarded
//! to the owner and its answer streamed back, and `POST /v1/internal/sync`
//! is how a node that changed a run tells the others.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::auth::Caller;
use super::error::ApiError;
use super::extract::{run_named, ApiJson};
use crate::registry::Owner;
use crate::services::cluster::{self, Synced, FORWARDED};
use crate::services::snapshots::spread::{self, FinishStep, HeldSteps, PeerCut, PeerFinish};
use crate::services::snapshots::{self as snap, SnapshotError};
use crate::state::AppState;

/// The owner's URL for this request (same path and query), or why there is
/// none: an owner whose URL is unknown (a node not registered any more) is
/// `503 owner_unknown`, to be retried once placement moves on.
fn target(owner: &Owner, uri: &Uri) -> Result<String, ApiError> {
    if owner.url.is_empty() {
        return Err(ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "owner_unknown",
                format!(
                    "the rank is placed on node `{}`, whose URL is not known; retry",
                    owner.node_id
                ),
            )
        });
    }
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    Ok(format!("{}{}", owner.url.trim_end_matches('/'), path))
}

/// `307 Temporary Redirect` to the owner of a rank (the client resends the
/// same request there, body included), with a JSON body saying so.
pub fn redirect(owner: &Owner, uri: &Uri, rank: u32) -> Result<Response, ApiError> {
    let location = target(owner, uri)?;
    let body = serde_json::json!({
        "error": {
            "code": "rank_elsewhere",
            "message": format!(
                "rank {rank} is held by node `{}` (epoch {}): {location}",
                owner.node_id, owner.epoch
            ),
        },
        "node": owner.node_id,
        "url": owner.url,
        "epoch": owner.epoch,
    });
    let mut response = (StatusCode::TEMPORARY_REDIRECT, Json(body)).into_response();
    let value = HeaderValue::from_str(&location).map_err(ApiError::internal)?;
    response.headers_mut().insert(header::LOCATION, value);
    Ok(response)
}

/// A request to `url` on another node on behalf of the caller: marked
/// forwarded (the peer answers for itself and forwards nothing on), with
/// the caller's credentials.
pub fn for_caller(
    method: reqwest::Method,
    url: &str,
    headers: &HeaderMap,
) -> reqwest::RequestBuilder {
    let req = cluster::peer_client()
        .request(method, url)
        .header(FORWARDED, "1");
    match headers.get(header::AUTHORIZATION) {
        Some(auth) => req.header(header::AUTHORIZATION, auth.clone()),
        None => req,
    }
}

/// Forwards a GET to the owner of a rank and streams its answer back. A
/// request that was itself forwarded is not forwarded again (placement
/// moved meanwhile): `503 placement_moved`, to be retried.
pub async fn forward(owner: &Owner, uri: &Uri, headers: &HeaderMap) -> Result<Response, ApiError> {
    if headers.contains_key(FORWARDED) {
        return Err(ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "placement_moved",
                "the rank moved while the request was forwarded; retry",
            )
        });
    }
    let url = target(owner, uri)?;
    let answer = for_caller(reqwest::Method::GET, &url, headers)
        .send()
        .await
        .map_err(|e| ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::BAD_GATEWAY,
                "owner_unreachable",
                format!(
                    "node `{}` holding the rank did not answer: {e}",
                    owner.node_id
                ),
            )
        })?;
    let status = answer.status();
    let mut response = Response::builder().status(status.as_u16());
    for name in [
        header::CONTENT_TYPE,
        header::CONTENT_LENGTH,
        header::RETRY_AFTER,
    ] {
        if let Some(v) = answer.headers().get(&name) {
            response = response.header(name, v.clone());
        }
    }
    response
        .body(Body::from_stream(answer.bytes_stream()))
        .map_err(ApiError::internal)
}

/// Syncs this node with the catalog now (another node created or deleted a
/// run). Admin only.
#[utoipa::path(post, path = "/v1/internal/sync", tag = "nodes",
    responses((status = 200, body = Synced)))]
pub async fn sync(State(state): State<AppState>, caller: Caller) -> Result<Json<Synced>, ApiError> {
    caller.require_admin()?;
    Ok(Json(state.cluster().sync().await?))
}

/// This node's ranks' last steps (for a cut of a run spread over nodes).
/// Admin only.
#[utoipa::path(get, path = "/v1/internal/runs/{run}/steps", tag = "nodes",
    params(("run" = String, Path)),
    responses((status = 200, body = HeldSteps), (status = 400, body = super::error::ErrorBody), (status = 404, body = super::error::ErrorBody)))]
pub async fn held_steps(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<HeldSteps>, ApiError> {
    caller.require_admin()?;
    let run = run_named(&state, &name)?;
    let steps = run
        .engines
        .rank_steps(&name)
        .await
        .map_err(SnapshotError::from)?;
    Ok(Json(HeldSteps { steps }))
}

/// Takes this node's part of a cut another node scheduled (409 when one of
/// its ranks is past the step). Admin only.
#[utoipa::path(post, path = "/v1/internal/runs/{run}/cuts", tag = "nodes",
    params(("run" = String, Path)), request_body = PeerCut,
    responses((status = 204), (status = 400, body = super::error::ErrorBody),
              (status = 404, body = super::error::ErrorBody), (status = 409, body = super::error::ErrorBody),
              (status = 422, body = super::error::ErrorBody), (status = 507, body = super::error::ErrorBody)))]
pub async fn take_cut(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiJson(cut): ApiJson<PeerCut>,
) -> Result<StatusCode, ApiError> {
    caller.require_admin()?;
    let run = run_named(&state, &name)?;
    let (_, indices) = snap::profile_choice(&run.config, Some(cut.profiles))?;
    snap::accept(state.snapshots(), &run, &cut.id, cut.step, &indices).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// This node's part of a finish across nodes (`hold`, `commit` or
/// `release`; see the contract's *Finishing a spread run*). Admin only.
#[utoipa::path(post, path = "/v1/internal/runs/{run}/finish", tag = "nodes",
    params(("run" = String, Path)), request_body = PeerFinish,
    responses((status = 200, body = FinishStep), (status = 400, body = super::error::ErrorBody),
              (status = 404, body = super::error::ErrorBody)))]
pub async fn finish_phase(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiJson(asked): ApiJson<PeerFinish>,
) -> Result<Json<FinishStep>, ApiError> {
    caller.require_admin()?;
    let run = run_named(&state, &name)?;
    Ok(Json(spread::finish_phase(&run, asked.phase, asked.step)))
}

/// Withdraws this node's part of a cut (another node could not take its
/// part). Admin only.
#[utoipa::path(delete, path = "/v1/internal/runs/{run}/cuts/{id}", tag = "nodes",
    params(("run" = String, Path), ("id" = String, Path)),
    responses((status = 204), (status = 400, body = super::error::ErrorBody), (status = 404, body = super::error::ErrorBody)))]
pub async fn withdraw_cut(
    State(state): State<AppState>,
    caller: Caller,
    Path((name, id)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    caller.require_admin()?;
    let run = run_named(&state, &name)?;
    snap::withdraw(state.snapshots(), &run, &id).await;
    Ok(StatusCode::NO_CONTENT)
}
