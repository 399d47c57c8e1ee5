//! A cut of a run whose ranks several nodes hold. The node asked for it
//! reads every rank's step (its own, and each peer's over
//! `GET /v1/internal/runs/{run}/steps`), records the pending row, takes
//! its own part, and asks each peer to take theirs
//! (`POST /v1/internal/runs/{run}/cuts`). When one cannot (a rank already
//! past the step, a node that does not answer), the cut is withdrawn from
//! every node that took it (`DELETE /v1/internal/runs/{run}/cuts/{id}`)
//! and its row deleted. Each node then writes its ranks and records them
//! with the catalog; the transaction that records the last rank marks the
//! snapshot complete (see `Store::add_snapshot_part`).

use reqwest::Method;
use serde::{Deserialize, Serialize};

#[allow(unused_imports)]
use super::*;
use crate::node::Owner;
use crate::services::peer::peer_request;

/// The path a peer answers its ranks' steps on.
pub fn steps_path(run: &str) -> String {
    format!("/v1/internal/runs/{run}/steps")
}

/// The path a peer takes (POST) or withdraws (DELETE `/{id}`) a cut on.
pub fn cuts_path(run: &str) -> String {
    format!("/v1/internal/runs/{run}/cuts")
}

/// A node's ranks' last steps (`None`: not held here, or no data).
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HeldSteps {
    pub steps: Vec<Option<u64>>,
}

/// A cut a peer is asked to take its part of.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PeerCut {
    pub id: String,
    pub step: u64,
    pub profiles: Vec<String>,
}

/// The other nodes holding ranks of `run`, one entry a node.
pub fn peers(state: &Snaps, run: &RunHandle) -> Vec<Owner> {
    let me = state.registry.node_id();
    let mut seen = BTreeSet::new();
    run.owners()
        .into_iter()
        .filter(|o| o.node_id != me && seen.insert(o.node_id.clone()))
        .collect()
}

/// Every rank's last step: this node's ranks from its engines, the others
/// from the nodes holding them.
pub async fn all_steps(state: &Snaps, run: &RunHandle) -> Result<Vec<Option<u64>>, SnapshotError> {
    let name = &run.config.name;
    let mut steps = run.engines.rank_steps(name).await?;
    let peers = peers(state, run);
    let answers = futures::future::join_all(peers.iter().map(|peer| async move {
        let answer = call(state, peer, Method::GET, &steps_path(name), None).await?;
        answer
            .json::<HeldSteps>()
            .await
            .map_err(|e| unreachable(peer, e))
    }))
    .await;
    for answer in answers {
        for (slot, step) in steps.iter_mut().zip(answer?.steps) {
            *slot = (*slot).or(step);
        }
    }
    Ok(steps)
}

/// Asks every peer holding ranks of the run to take its part of cut `id`;
/// when one cannot, withdraws it from those that took it and answers why.
pub async fn schedule_on_peers(
    state: &Snaps,
    run: &RunHandle,
    id: &str,
    step: u64,
    profiles: &[String],
) -> Result<(), SnapshotError> {
    let name = &run.config.name;
    let peers = peers(state, run);
    if peers.is_empty() {
        return Ok(());
    }
    let body = serde_json::to_value(PeerCut {
        id: id.to_string(),
        step,
        profiles: profiles.to_vec(),
    })
    .map_err(|e| SnapshotError::Internal(e.to_string()))?;
    let path = cuts_path(name);
    let answers = futures::future::join_all(
        peers
            .iter()
            .map(|peer| call(state, peer, Method::POST, &path, Some(body.clone()))),
    )
    .await;
    let mut refused = None;
    let mut took = Vec::new();
    for (peer, answer) in peers.iter().zip(answers) {
        match answer {
            Ok(_) => took.push(peer),
            Err(e) => refused = refused.or(Some(e)),
        }
    }
    let Some(refused) = refused else {
        return Ok(());
    };
    let path = format!("{path}/{id}");
    for peer in took {
        if let Err(e) = call(state, peer, Method::DELETE, &path, None).await {
            // Its part times out and fails the (deleted) snapshot there.
            tracing::warn!(run = %name, snapshot = %id, peer = %peer.node_id, error = %e,
                "withdrawing a cut from a node failed");
        }
    }
    Err(refused)
}

fn unreachable(peer: &Owner, e: impl std::fmt::Display) -> SnapshotError {
    SnapshotError::Peer(format!(
        "node `{}` ({}) holding ranks of the run did not answer: {e}",
        peer.node_id, peer.url
    ))
}

/// One internal request to a peer. A 409 is the peer's refusal (a rank
/// past the step), kept as a conflict; anything else that is not a
/// success, or no answer, is `node_unreachable`.
async fn call(
    state: &Snaps,
    peer: &Owner,
    method: Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> Result<reqwest::Response, SnapshotError> {
    if peer.url.is_empty() {
        return Err(unreachable(peer, "its URL is not known"));
    }
    let url = format!("{}{path}", peer.url.trim_end_matches('/'));
    let mut req = peer_request(state.args.token.as_deref(), method, &url);
    if let Some(body) = body {
        req = req.json(&body);
    }
    let answer = req.send().await.map_err(|e| unreachable(peer, e))?;
    let status = answer.status();
    if status.is_success() {
        return Ok(answer);
    }
    let text = answer.text().await.unwrap_or_default();
    let message = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or(text);
    if status == reqwest::StatusCode::CONFLICT {
        return Err(SnapshotError::Conflict(format!(
            "node `{}`: {message}",
            peer.node_id
        )));
    }
    Err(unreachable(peer, format!("{status}: {message}")))
}
