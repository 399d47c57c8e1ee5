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
use crate::engine::FinishedAt;
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

/// The path a peer holds, commits or releases a finish on (POST).
pub fn finish_path(run: &str) -> String {
    format!("/v1/internal/runs/{run}/finish")
}

/// How long a node holds a run for a finish across nodes before it lets
/// pushes go on by itself (the node finishing it stopped between phases).
pub const FINISH_HOLD: std::time::Duration = std::time::Duration::from_secs(30);

/// A phase of a finish across nodes, as a peer is asked to take it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishPhase {
    /// Take no push past the node's furthest step; answer that step.
    Hold,
    /// Finish at `step` (the furthest of every node's).
    Commit,
    /// The finish was given up: take pushes again.
    Release,
}

/// What a peer is asked to do for a finish across nodes.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PeerFinish {
    pub phase: FinishPhase,
    /// With `commit`: the step the run finishes at (`null`: before any push).
    #[serde(default)]
    pub step: Option<u64>,
}

/// A peer's answer: its furthest step (`hold`), or the step it finished at.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FinishStep {
    pub step: Option<u64>,
}

/// This node's part of a finish across nodes.
pub fn finish_phase(run: &RunHandle, phase: FinishPhase, step: Option<u64>) -> FinishStep {
    let shared = run.engines.shared();
    match phase {
        FinishPhase::Hold => FinishStep {
            step: shared.hold(FINISH_HOLD).0,
        },
        FinishPhase::Commit => {
            shared.set_finished(Some(FinishedAt(step)));
            FinishStep { step }
        }
        FinishPhase::Release => {
            shared.release();
            FinishStep { step: None }
        }
    }
}

/// Finishes a run whose ranks several nodes hold, in two phases: every
/// node holding ranks stops taking pushes past its furthest step (those
/// are answered `503 run_finishing`, retried by clients) and answers it;
/// then every node finishes at the furthest of them, so a lagging rank
/// still reaches it. A node that does not answer the first phase gives the
/// finish up (released everywhere); one that misses the second learns the
/// step from the catalog.
pub async fn finish_across(state: &Snaps, run: &RunHandle) -> Result<FinishedAt, SnapshotError> {
    let name = &run.config.name;
    let path = finish_path(name);
    let shared = run.engines.shared();
    let mut furthest = shared.hold(FINISH_HOLD).0;
    let peers = peers(state, run);
    let hold = serde_json::json!({ "phase": "hold" });
    let answers = futures::future::join_all(peers.iter().map(|peer| {
        let (path, hold) = (path.clone(), hold.clone());
        async move {
            let answer = call(state, peer, Method::POST, &path, Some(hold)).await?;
            let held: FinishStep = answer.json().await.map_err(|e| unreachable(peer, e))?;
            Ok::<_, SnapshotError>(held.step)
        }
    }))
    .await;
    let mut failed = None;
    for answer in answers {
        match answer {
            Ok(step) => furthest = furthest.max(step),
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    if let Some(e) = failed {
        shared.release();
        let release = serde_json::json!({ "phase": "release" });
        for peer in &peers {
            let _ = call(state, peer, Method::POST, &path, Some(release.clone())).await;
        }
        return Err(e);
    }
    let at = FinishedAt(furthest);
    shared.set_finished(Some(at));
    let commit = serde_json::json!({ "phase": "commit", "step": furthest });
    for peer in &peers {
        if let Err(e) = call(state, peer, Method::POST, &path, Some(commit.clone())).await {
            tracing::warn!(run = %name, peer = %peer.node_id, error = %e,
                "a node missed the finish; it learns it from the catalog");
        }
    }
    Ok(at)
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
