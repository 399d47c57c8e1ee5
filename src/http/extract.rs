//! Request extraction that answers in the API's error shape: JSON bodies
//! whose failures name the field, and path segments parsed by hand.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::error::ApiError;
use crate::registry::RunHandle;
use crate::run::{valid_name, MAX_STEP};
use crate::state::AppState;
use std::sync::Arc;

/// A JSON body; errors are 400 (not JSON) or 422 naming the field.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(e.status(), "body_too_large", e.body_text())
            } else if super::conn::is_body_timeout(&e) {
                ApiError::new(
                    axum::http::StatusCode::REQUEST_TIMEOUT,
                    "body_timeout",
                    e.body_text(),
                )
            } else {
                ApiError::bad_request("invalid_body", e.body_text())
            }
        })?;
        let de = &mut serde_json::Deserializer::from_slice(&bytes);
        serde_path_to_error::deserialize(de)
            .map(ApiJson)
            .map_err(|e| {
                let field = e.path().to_string();
                let inner = e.into_inner();
                if inner.is_syntax() || inner.is_eof() {
                    ApiError::bad_request(
                        "invalid_json",
                        format!("the body is not valid JSON: {inner}"),
                    )
                } else {
                    ApiError {
                        field: (field != ".").then(|| field.clone()),
                        ..ApiError::unprocessable("invalid_config", format!("{field}: {inner}"))
                    }
                }
            })
    }
}

/// A query string; a malformed one is 400 `invalid_query` in the API's
/// error shape (axum's own rejection is plain text).
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let query = parts.uri.query().unwrap_or_default();
        serde_urlencoded::from_str(query)
            .map(ApiQuery)
            .map_err(|e| ApiError::bad_request("invalid_query", format!("query: {e}")))
    }
}

/// Like [`ApiJson`], but an empty body means `T::default()`.
pub struct MaybeJson<T>(pub T);

impl<T: DeserializeOwned + Default> FromRequest<AppState> for MaybeJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let empty = req
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() == b"0");
        if empty {
            return Ok(MaybeJson(T::default()));
        }
        let ApiJson(value) = ApiJson::<T>::from_request(req, state).await?;
        Ok(MaybeJson(value))
    }
}

/// Looks up a run by a path segment: 400 for a name that can never be a
/// run, 404 for one that is not.
pub fn run_named(state: &AppState, name: &str) -> Result<Arc<RunHandle>, ApiError> {
    if !valid_name(name) {
        return Err(ApiError::bad_request(
            "invalid_run_name",
            "run names match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        ));
    }
    let run = state
        .run(name)
        .ok_or_else(|| ApiError::not_found("run_not_found", format!("no run `{name}`")))?;
    super::vanished::note_run(&run);
    Ok(run)
}

/// Parses a rank segment and checks it against the world size.
pub fn rank_of(run: &RunHandle, segment: &str) -> Result<u32, ApiError> {
    let rank: u32 = segment.parse().map_err(|_| {
        ApiError::bad_request("invalid_rank", format!("rank `{segment}` is not a number"))
    })?;
    if rank >= run.config.world_size {
        return Err(ApiError::not_found(
            "rank_not_found",
            format!(
                "rank {rank} is out of range: run `{}` has world_size {}",
                run.config.name, run.config.world_size
            ),
        ));
    }
    Ok(rank)
}

/// Parses a step segment (at most [`MAX_STEP`]).
pub fn step_of(segment: &str) -> Result<u64, ApiError> {
    let step = segment.parse().map_err(|_| {
        ApiError::bad_request(
            "invalid_step",
            format!("step `{segment}` is not a non-negative integer"),
        )
    })?;
    bounded_step("step", step)
}

/// A step taken from a body or a query, named `what` in the error: `400
/// invalid_step` past [`MAX_STEP`] (beyond it a step would wrap or round).
pub fn bounded_step(what: &str, step: u64) -> Result<u64, ApiError> {
    if step > MAX_STEP {
        return Err(ApiError::bad_request(
            "invalid_step",
            format!("{what}: {step} is past the largest step, 2^53 = {MAX_STEP}"),
        ));
    }
    Ok(step)
}
