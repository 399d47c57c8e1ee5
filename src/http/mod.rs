//! The HTTP surface (v1): routes, handlers, auth, the error type, OpenAPI.
//!
//! - [`error`]: `ApiError`, the one place failures become statuses.
//! - [`auth`]: bearer tokens (admin, per-run write and read).
//! - [`conn`]: the accept loop; timeouts and caps per connection.
//! - [`extract`]: JSON bodies and path segments that fail in the API's shape.
//! - [`runs`]: runs and ranks, a rank's live EMA.
//! - [`push`]: the push endpoint.
//! - [`snapshots`]: snapshots, downloads, compare, resume.
//! - [`conditional`]: `If-None-Match`, `If-Range` and coding lists as the
//!   RFCs read them; unknown transfer codings refused.
//! - [`vanished`]: a request whose run was deleted under it answers 404.
//! - [`derived`]: post-hoc EMA (plan, sweep) and checkpoint merging.
//! - [`evals`]: evaluations of candidates, the best candidate of a metric.
//! - [`metrics`]: trainer scalars and the server's own series.
//! - [`events`]: Server-Sent Events.
//! - [`insight`]: tags, notes, alert rules and alerts, per-tensor drift,
//!   effective averaging windows.
//! - [`ops`]: health, metrics, OpenAPI, docs and dashboard files.
//! - [`openapi`]: what the document says of every operation (auth, errors).

pub mod auth;
pub mod conditional;
pub mod conn;
pub mod derived;
pub mod error;
pub mod evals;
pub mod events;
pub mod extract;
pub mod insight;
pub mod metrics;
pub mod nodes;
pub mod openapi;
pub mod ops;
pub mod push;
pub mod route;
pub mod runs;
pub mod snapshots;
pub mod vanished;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, put};
use axum::Router;
use tower_http::trace::TraceLayer;
use utoipa::OpenApi;

use crate::state::AppState;
use openapi::Contract;

#[derive(OpenApi)]
#[openapi(
    info(title = "polyak", description = "A network-served EMA service for PyTorch training (API v1)."),
    modifiers(&Contract),
    paths(
        ops::livez, ops::readyz, ops::metrics, ops::verify, nodes::list, route::sync, route::held_steps, route::take_cut, route::withdraw_cut, route::finish_phase,
        runs::create_run, runs::list_runs, runs::get_run, runs::delete_run,
        runs::list_ranks, runs::get_rank, runs::get_rank_ema, runs::finish_run, runs::placement,
        push::push,
        snapshots::create, snapshots::list, snapshots::get, snapshots::delete,
        snapshots::download, snapshots::download_digests, snapshots::compare, snapshots::resume, snapshots::persist,
        derived::posthoc, derived::plan, derived::merge,
        events::events, metrics::post, metrics::get,
        insight::patch_run, insight::list_alerts, insight::ack_alert,
        insight::tensor_drift, insight::window,
        evals::post, evals::list, evals::best,
    ),
    components(schemas(
        error::ErrorBody, error::ErrorDetail,
        crate::run::RunSpec, crate::run::RunConfig, crate::run::ProfileSpec,
        crate::run::EmaDtype, crate::run::NonfinitePolicy, crate::run::Retention,
        runs::RunView, runs::CreatedRun, runs::RunList, runs::FinishRequest,
        runs::FinishResponse, crate::store::RunFinish,
        runs::RankView, runs::RankPlacement, nodes::NodeView, nodes::NodeList, crate::services::cluster::Synced, crate::services::ingest::PushResponse, crate::engine::rank::PushOutcome,
        crate::store::StoredEvent, ops::Health, crate::services::snapshots::verify::VerifyReport,
        crate::services::snapshots::verify::BadPart,
        metrics::MetricsPost, metrics::MetricsBody, metrics::MetricsAccepted,
        metrics::Series, metrics::MetricsResponse, crate::engine::rank::DriftSample,
        snapshots::SnapshotRequest, snapshots::SnapshotList, snapshots::SnapshotView,
        snapshots::CompareResponse, snapshots::DownloadDigests, snapshots::ResumeRequest, snapshots::ResumeResponse,
        snapshots::PersistResponse, derived::PosthocRequest, derived::SigmaRel,
        derived::PosthocSweep, derived::DerivedRow, derived::MergeRequest, crate::services::snapshots::derived::Plan,
        crate::services::snapshots::derived::PlannedTarget, crate::services::snapshots::derived::PowerSource,
        crate::services::snapshots::derived::MergeWeights, crate::services::snapshots::derived::Progress,
        crate::services::snapshots::derived::PosthocMethod, crate::services::snapshots::derived::SourceDtype,
        crate::store::snapshots::SnapshotRow, crate::contract::SnapshotKind,
        crate::contract::SnapshotStatus, crate::contract::SnapshotEventStatus,
        crate::contract::CutKind, crate::contract::EventKind,
        crate::store::snapshots::FileRow, crate::snapshot::compare::TensorStats,
        crate::snapshot::compare::CompareSummary, crate::snapshot::compare::CompareResult,
        insight::MetaPatch, insight::AlertList, insight::TensorDrift, insight::ProfileWindow,
        insight::WindowResponse, crate::store::meta::RunMeta, crate::run::alerts::AlertRules,
        crate::run::alerts::MetricRule, crate::run::alerts::Goal, crate::services::alerts::Alert,
        crate::services::evals::NewEval, crate::services::evals::Evaluation, crate::services::evals::Best,
        evals::EvalList, crate::contract::CandidateKind, crate::contract::BestMode,
        crate::contract::RunHealth, crate::contract::RankStatus, crate::contract::NodeStatus,
        crate::contract::AlertKind, crate::contract::AlertState, crate::contract::DownloadLayout,
    )),
    tags(
        (name = "runs", description = "Create, list and delete runs"),
        (name = "ranks", description = "Ranks and their live EMA"),
        (name = "push", description = "Push parameter shards"),
        (name = "snapshots", description = "Consistent snapshots, downloads, compare, resume"),
        (name = "monitoring", description = "Events and metrics"),
        (name = "evals", description = "Evaluations of EMA candidates, and the best one"),
        (name = "ops", description = "Health and metrics"),
    )
)]
pub struct ApiDoc;

/// The application router.
pub fn router(state: AppState) -> Router {
    let body_limit = state.args().body_limit.0 as usize;
    let push_routes = Router::new()
        .route(
            "/v1/runs/{run}/ranks/{rank}/steps/{step}",
            put(push::push).post(push::push),
        )
        // The push handler enforces its own (much larger) limit while reading.
        .layer(DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            vanished::run_vanished,
        ));
    let api = Router::new()
        .route("/v1/runs", get(runs::list_runs).post(runs::create_run))
        .route("/v1/nodes", get(nodes::list))
        .route(
            crate::services::cluster::SYNC_PATH,
            axum::routing::post(route::sync),
        )
        .route("/v1/internal/runs/{run}/steps", get(route::held_steps))
        .route(
            "/v1/internal/runs/{run}/cuts",
            axum::routing::post(route::take_cut),
        )
        .route(
            "/v1/internal/runs/{run}/cuts/{id}",
            axum::routing::delete(route::withdraw_cut),
        )
        .route(
            "/v1/internal/runs/{run}/finish",
            axum::routing::post(route::finish_phase),
        )
        .route(
            "/v1/runs/{run}",
            get(runs::get_run)
                .delete(runs::delete_run)
                .patch(insight::patch_run),
        )
        .route("/v1/runs/{run}/alerts", get(insight::list_alerts))
        .route(
            "/v1/runs/{run}/alerts/{id}/ack",
            axum::routing::post(insight::ack_alert),
        )
        .route("/v1/runs/{run}/drift/tensors", get(insight::tensor_drift))
        .route("/v1/runs/{run}/window", get(insight::window))
        .route(
            "/v1/runs/{run}/finish",
            axum::routing::post(runs::finish_run),
        )
        .route("/v1/runs/{run}/ranks", get(runs::list_ranks))
        .route("/v1/runs/{run}/placement", get(runs::placement))
        .route("/v1/runs/{run}/ranks/{rank}", get(runs::get_rank))
        .route("/v1/runs/{run}/ranks/{rank}/ema", get(runs::get_rank_ema))
        .route("/v1/runs/{run}/events", get(events::events))
        .route(
            "/v1/runs/{run}/metrics",
            get(metrics::get).post(metrics::post),
        )
        .route(
            "/v1/runs/{run}/snapshots",
            get(snapshots::list).post(snapshots::create),
        )
        .route(
            "/v1/runs/{run}/snapshots/{id}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route(
            "/v1/runs/{run}/snapshots/{id}/download",
            get(snapshots::download),
        )
        .route(
            "/v1/runs/{run}/snapshots/{id}/download/digests",
            get(snapshots::download_digests),
        )
        .route("/v1/runs/{run}/compare", get(snapshots::compare))
        .route(
            "/v1/runs/{run}/resume",
            axum::routing::post(snapshots::resume),
        )
        .route(
            "/v1/runs/{run}/persist",
            axum::routing::post(snapshots::persist),
        )
        .route(
            "/v1/runs/{run}/posthoc",
            axum::routing::post(derived::posthoc),
        )
        .route("/v1/runs/{run}/posthoc/plan", get(derived::plan))
        .route("/v1/runs/{run}/merge", axum::routing::post(derived::merge))
        .route("/v1/runs/{run}/evals", get(evals::list).post(evals::post))
        .route("/v1/runs/{run}/best", get(evals::best))
        .route_layer(axum::middleware::from_fn(extract::printable_params))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            vanished::run_vanished,
        ));
    Router::new()
        .route("/livez", get(ops::livez))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/v1/admin/verify", axum::routing::post(ops::verify))
        .route("/openapi.json", get(ops::openapi_json))
        .route("/docs", get(ops::docs))
        .route("/", get(ops::index))
        .route("/static/{*path}", get(ops::static_file))
        .merge(push_routes)
        .merge(api)
        .fallback(|| async { error::ApiError::not_found("not_found", "no such endpoint") })
        .layer(axum::middleware::from_fn(conditional::transfer_codings))
        .layer(TraceLayer::new_for_http().make_span_with(request_span))
        .with_state(state)
}

/// The router of `--metrics-bind`: `/metrics` alone, without a token.
pub fn metrics_router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(ops::metrics_open))
        .fallback(|| async { error::ApiError::not_found("not_found", "no such endpoint") })
        .with_state(state)
}

/// The span of a request, as tower-http's default but with tokens in the
/// query replaced: the URI is logged at debug level.
fn request_span(req: &axum::http::Request<axum::body::Body>) -> tracing::Span {
    tracing::debug_span!(
        "request",
        method = %req.method(),
        uri = %redact_uri(req.uri()),
        version = ?req.version(),
    )
}

/// The URI with the value of every `access_token` query parameter replaced.
pub fn redact_uri(uri: &axum::http::Uri) -> String {
    let Some(query) = uri.query() else {
        return uri.to_string();
    };
    let redacted: Vec<String> = query
        .split('&')
        .map(|kv| match kv.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("access_token") => format!("{k}=REDACTED"),
            _ => kv.to_string(),
        })
        .collect();
    format!("{}?{}", uri.path(), redacted.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_redacted_from_logged_uris() {
        let uri: axum::http::Uri = "/v1/runs/r/events?since=3&access_token=s3cret-token&kinds=push"
            .parse()
            .unwrap();
        let shown = redact_uri(&uri);
        assert_eq!(
            shown,
            "/v1/runs/r/events?since=3&access_token=REDACTED&kinds=push"
        );
        let plain: axum::http::Uri = "/v1/runs?x=1".parse().unwrap();
        assert_eq!(redact_uri(&plain), "/v1/runs?x=1");
    }
}
