//! The nodes of the service: every server sharing this catalog.

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use super::auth::Caller;
use super::error::{ApiError, ErrorBody};
use crate::contract::NodeStatus;
use crate::state::AppState;

/// A node as the catalog knows it.
#[derive(Debug, Serialize, ToSchema)]
pub struct NodeView {
    pub node: String,
    /// The URL its ranks' pushes go to (`--advertise-url`).
    pub url: String,
    /// Its engines (`cpu#0`, `cuda:1`, ...).
    pub engines: Vec<String>,
    /// Bytes of EMA state it offers (`--memory-budget`).
    pub memory_budget: u64,
    /// Ranks it holds, and their resident bytes (at its last renewal).
    pub ranks: u64,
    pub resident_bytes: u64,
    pub started_at_ms: i64,
    pub renewed_at_ms: i64,
    /// Seconds since its lease was last renewed, by the catalog's clock.
    pub lease_age_seconds: f64,
    /// How long a lease lasts (`--lease-secs`).
    pub lease_seconds: f64,
    /// `live`, `expired` (lease not renewed in time) or `left` (stopped).
    pub status: NodeStatus,
    /// This is the node answering.
    pub this: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct NodeList {
    pub nodes: Vec<NodeView>,
}

/// Every node of the service (servers sharing this catalog), with its
/// lease. Needs the admin token when auth is on.
#[utoipa::path(get, path = "/v1/nodes", tag = "ops",
    responses((status = 200, body = NodeList), (status = 401, body = ErrorBody),
              (status = 503, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<NodeList>, ApiError> {
    caller.require_admin()?;
    let (this, _) = crate::node::identity(state.args());
    let rows = state.nodes().list().await?;
    Ok(Json(NodeList {
        nodes: rows
            .into_iter()
            .map(|r| NodeView {
                this: r.info.node_id == this,
                node: r.info.node_id,
                url: r.info.url,
                engines: r.info.engines,
                memory_budget: r.info.memory_budget,
                ranks: r.ranks,
                resident_bytes: r.resident_bytes,
                started_at_ms: r.started_at_ms,
                renewed_at_ms: r.renewed_at_ms,
                lease_age_seconds: r.lease_age_ms as f64 / 1000.0,
                lease_seconds: r.info.lease_ms as f64 / 1000.0,
                status: r.status,
            })
            .collect(),
    }))
}
