//! Operations endpoints: liveness, readiness, Prometheus metrics, the
//! OpenAPI document, and the static pages (docs, dashboard) embedded in the
//! binary.

use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use rust_embed::RustEmbed;
use serde::Serialize;
use utoipa::{OpenApi, ToSchema};

use super::auth::Caller;
use super::error::{ApiError, ErrorBody};
use crate::services::ops::Readiness;
use crate::state::AppState;

/// Files under `static/`: embedded in release builds, read from disk in
/// debug builds (so pages can be edited without rebuilding).
#[derive(RustEmbed)]
#[folder = "static/"]
struct Assets;

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    pub status: String,
    pub version: String,
    pub uptime_seconds: f64,
    pub runs: usize,
    /// Free bytes on the data dir's filesystem (absent when it cannot be
    /// asked).
    pub disk_free_bytes: Option<u64>,
    /// `--disk-reserve`: snapshot and state writes keep this much free.
    pub disk_reserve_bytes: u64,
    /// The catalog database: `sqlite` or `postgres`.
    pub catalog: String,
    /// The object store of snapshot parts: `file` or `s3`.
    pub store: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

fn health(state: &AppState, status: &str, detail: Option<String>) -> Health {
    let facts = state.ops().facts();
    Health {
        status: status.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        uptime_seconds: facts.uptime_seconds,
        runs: facts.runs,
        disk_free_bytes: facts.disk_free_bytes,
        disk_reserve_bytes: facts.disk_reserve_bytes,
        catalog: facts.catalog.into(),
        store: facts.store.into(),
        detail,
    }
}

/// The process is up.
#[utoipa::path(get, path = "/livez", tag = "ops", responses((status = 200, body = Health)))]
pub async fn livez(State(state): State<AppState>) -> Json<Health> {
    Json(health(&state, "ok", None))
}

/// The catalog answers and every engine takes work: 200 `ok`. A catalog
/// that cannot be reached or a stopped engine: 503 `unavailable`. An object
/// store that cannot be reached, a data dir's disk under `--disk-reserve`,
/// or a catalog whose disk is full: 200 `degraded` with the reason (pushes
/// and reads of live EMA go on; snapshots wait or fail with the reason).
#[utoipa::path(get, path = "/readyz", tag = "ops",
    responses((status = 200, body = Health), (status = 503, body = Health)))]
pub async fn readyz(State(state): State<AppState>) -> Response {
    match state.ops().readiness().await {
        Readiness::Ready => Json(health(&state, "ok", None)).into_response(),
        Readiness::Unavailable(detail) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(health(&state, "unavailable", Some(detail))),
        )
            .into_response(),
        Readiness::Degraded(detail) => {
            Json(health(&state, "degraded", Some(detail))).into_response()
        }
    }
}

/// Prometheus text exposition. With auth on it needs the admin token: the
/// series name every run. (`--metrics-bind` serves it without one on a
/// separate, loopback address, for scrapers.)
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct VerifyQuery {
    /// Only this run's snapshots (default every run's).
    pub run: Option<String>,
}

/// Reread every part of every complete snapshot and report those whose
/// size or sha256 is not the recorded one (admin token). Each one found
/// is also a `snapshot_corrupt` event of its run.
#[utoipa::path(post, path = "/v1/admin/verify", tag = "ops", params(VerifyQuery),
    responses((status = 200, body = crate::services::snapshots::verify::VerifyReport),
              (status = 403, body = ErrorBody, description = "this needs the admin token")))]
pub async fn verify(
    State(state): State<AppState>,
    caller: Caller,
    super::extract::ApiQuery(q): super::extract::ApiQuery<VerifyQuery>,
) -> Result<Json<crate::services::snapshots::verify::VerifyReport>, ApiError> {
    caller.require_admin()?;
    Ok(Json(state.ops().verify(q.run.as_deref()).await?))
}

#[utoipa::path(get, path = "/metrics", tag = "ops",
    responses((status = 200, content_type = "text/plain", body = String),
              (status = 401, body = ErrorBody, description = "auth is on and no valid token was given"),
              (status = 403, body = ErrorBody, description = "a run's token: this needs the admin token")))]
pub async fn metrics(State(state): State<AppState>, caller: Caller) -> Result<Response, ApiError> {
    caller.require_admin()?;
    Ok(exposition(&state).await)
}

/// `/metrics` on the `--metrics-bind` address: no token.
pub async fn metrics_open(State(state): State<AppState>) -> Response {
    exposition(&state).await
}

async fn exposition(state: &AppState) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.ops().exposition(),
    )
        .into_response()
}

/// The OpenAPI 3.1 document, generated from the code.
pub async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(super::ApiDoc::openapi())
}

/// The API reference page (renders `/openapi.json`; no network needed).
pub async fn docs() -> Response {
    asset("docs.html")
}

/// The dashboard's entry page.
pub async fn index() -> Response {
    asset("index.html")
}

/// Any other file under `static/`.
pub async fn static_file(Path(path): Path<String>) -> Response {
    asset(&path)
}

fn asset(path: &str) -> Response {
    match Assets::get(path) {
        Some(file) => {
            let mime = mime_for(path);
            let mut response = file.data.into_owned().into_response();
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(mime));
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            response
        }
        None => ApiError::not_found("not_found", format!("no file `{path}`")).into_response(),
    }
}

fn mime_for(path: &str) -> &'static str {
    match path.rsplit('.').next() {
        Some("html") => "text/html; charset=utf-8",
        Some("js") | Some("mjs") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("json") => "application/json",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("txt") | Some("md") => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}
