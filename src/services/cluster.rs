//! One service over many nodes: where a new run's ranks go, and how every
//! node keeps up with the runs the others create, delete and hold.
//!
//! Every node knows every run (reads work anywhere) but holds only the
//! ranks placed on it. The catalog is the truth; a node learns of changes
//! by [`sync`]: at once when the node that made the change tells it
//! (`POST /v1/internal/sync`, see [`tell_peers`]), else within a second
//! (the periodic task, which runs only while the service has other nodes).
//! The ranks another node holds are shown from the catalog's rank rows.

use std::collections::HashSet;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{Context, ServiceError};
use crate::node::{assign, Candidate, Owner};
use crate::registry::{RankSummary, RunHandle};
use crate::store::nodes::NodeRow;

/// How often a node of a service with several nodes looks at the catalog.
const SYNC_EVERY: Duration = Duration::from_secs(1);

/// How long a node waits for a peer it tells of a change.
const PEER_TIMEOUT: Duration = Duration::from_secs(3);

/// The path a node asks a peer to sync on.
pub const SYNC_PATH: &str = "/v1/internal/sync";

/// Header set on a request one node forwards to another (a forwarded
/// request is never forwarded again).
pub const FORWARDED: &str = "polyak-forwarded";

/// Where the ranks of a new run go: over the live nodes, balanced by the
/// ranks each holds and its memory budget (see [`assign`]); this node
/// first, so a node alone in its service holds every rank.
pub async fn place_new_run(ctx: &Context, world_size: u32) -> Result<Vec<Owner>, ServiceError> {
    let nodes = ctx.store.list_nodes().await?;
    let held = ctx.store.ranks_per_node().await?;
    let me = ctx.registry.node_id().to_string();
    let mut candidates: Vec<Candidate> = nodes
        .iter()
        .filter(|n| n.status == "live" && n.info.node_id != me)
        .map(|n| Candidate {
            node_id: n.info.node_id.clone(),
            budget: n.info.memory_budget,
            held: held.get(&n.info.node_id).copied().unwrap_or(0),
        })
        .collect();
    let my_budget = nodes
        .iter()
        .find(|n| n.info.node_id == me)
        .map_or(0, |n| n.info.memory_budget);
    candidates.insert(
        0,
        Candidate {
            node_id: me.clone(),
            budget: my_budget,
            held: held.get(&me).copied().unwrap_or(0),
        },
    );
    Ok(assign(world_size, &candidates)
        .into_iter()
        .map(|id| owner(ctx, &nodes, &id, 1))
        .collect())
}

/// A node as the owner of a rank at `epoch`, with the URL it registered.
fn owner(ctx: &Context, nodes: &[NodeRow], id: &str, epoch: u64) -> Owner {
    if id == ctx.registry.node_id() {
        return ctx.registry.me(epoch);
    }
    Owner {
        node_id: id.to_string(),
        url: nodes
            .iter()
            .find(|n| n.info.node_id == id)
            .map(|n| n.info.url.clone())
            .unwrap_or_default(),
        epoch,
        engine: None,
    }
}

/// What one [`sync`] changed.
#[derive(Debug, Default, serde::Serialize, utoipa::ToSchema)]
pub struct Synced {
    /// Runs installed (created on another node, or before this one started).
    pub added: Vec<String>,
    /// Runs dropped (deleted on another node).
    pub removed: Vec<String>,
    /// Runs whose ranks held elsewhere were refreshed from the catalog.
    pub refreshed: usize,
}

/// Syncs are one at a time (a told sync and the periodic one must not
/// interleave: one could drop a run the other just installed).
static SYNC_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Brings this node's registry up to the catalog: installs the runs it does
/// not know (with the ranks placed on it), drops the runs deleted
/// elsewhere, and refreshes the owners and summaries of the ranks other
/// nodes hold.
pub async fn sync(ctx: &Context) -> Result<Synced, ServiceError> {
    let _one = SYNC_LOCK.lock().await;
    let nodes = ctx.store.list_nodes().await?;
    let stored = ctx.store.list_runs().await?;
    let mut out = Synced::default();
    let names: HashSet<String> = stored.iter().map(|s| s.config.name.clone()).collect();
    for run in ctx.registry.all_runs() {
        if !names.contains(&run.config.name) {
            forget(ctx, &run).await;
            out.removed.push(run.config.name.clone());
        }
    }
    for s in stored {
        let known = ctx.registry.run(&s.config.name);
        match known {
            Some(run) if run.created_at_ms == s.created_at_ms => continue,
            // Deleted and created again under the same name.
            Some(run) => {
                forget(ctx, &run).await;
            }
            None => {}
        }
        let name = s.config.name.clone();
        if ctx
            .registry
            .load_run(&ctx.store, &nodes, s)
            .await?
            .is_some()
        {
            out.added.push(name);
        }
    }
    if !out.added.is_empty() {
        for (name, meta) in ctx.store.run_metas().await? {
            if out.added.contains(&name) {
                if let Some(run) = ctx.registry.run(&name) {
                    *run.meta.lock().expect("meta lock") = meta;
                }
            }
        }
        for name in &out.added {
            tracing::info!(run = %name, "run learnt from the catalog");
        }
    }
    for run in ctx.registry.all_runs() {
        if run.is_spread() {
            refresh(ctx, &nodes, &run).await?;
            out.refreshed += 1;
        }
    }
    Ok(out)
}

/// Drops a run this node learnt was deleted.
async fn forget(ctx: &Context, run: &RunHandle) {
    let name = &run.config.name;
    ctx.registry.remove_run(name);
    run.engines.drop_run(name).await;
    ctx.metrics.forget_run(name);
    tracing::info!(run = %name, "run deleted on another node; dropped");
}

/// Refreshes who holds the ranks of `run` that this node does not hold,
/// and their summaries, from the catalog.
async fn refresh(ctx: &Context, nodes: &[NodeRow], run: &RunHandle) -> Result<(), ServiceError> {
    let placed = ctx.store.placement(&run.config.name).await?;
    {
        let mut owners = run.placement.write().expect("placement lock");
        for p in placed {
            if run.holds(p.rank) {
                continue;
            }
            if let Some(slot) = owners.get_mut(p.rank as usize) {
                let mut o = owner(ctx, nodes, &p.node_id, p.epoch);
                o.engine = p.engine;
                *slot = o;
            }
        }
    }
    for row in ctx.store.list_ranks(&run.config.name).await? {
        let rank = row.rank;
        if rank >= run.config.world_size || run.holds(rank) {
            continue;
        }
        let resident = row.resident_bytes;
        let mut summary = RankSummary::from_stored(row);
        summary.live = summary.last_step.is_some();
        summary.resident_bytes = resident;
        run.update_rank(rank, |s| *s = summary);
    }
    Ok(())
}

/// Tells every other live node to sync now (after this node created or
/// deleted a run), so a client that goes straight to them finds it. A peer
/// that does not answer learns it from its periodic sync.
pub async fn tell_peers(ctx: &Context) {
    let nodes = match ctx.store.list_nodes().await {
        Ok(nodes) => nodes,
        Err(e) => {
            tracing::warn!(error = %e, "listing the nodes to tell of a change failed");
            return;
        }
    };
    let me = ctx.registry.node_id();
    let peers: Vec<String> = nodes
        .into_iter()
        .filter(|n| n.status == "live" && n.info.node_id != me && !n.info.url.is_empty())
        .map(|n| n.info.url)
        .collect();
    if peers.is_empty() {
        return;
    }
    let calls = peers.iter().map(|url| {
        let req = peer_request(
            ctx.args.token.as_deref(),
            reqwest::Method::POST,
            &format!("{url}{SYNC_PATH}"),
        );
        async move { (url, req.send().await) }
    });
    for (url, answer) in futures::future::join_all(calls).await {
        match answer {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => tracing::warn!(peer = %url, status = %r.status(), "a node refused to sync"),
            Err(e) => {
                tracing::warn!(peer = %url, error = %e, "a node did not answer; it syncs on its own")
            }
        }
    }
}

/// A request from this node to a peer: marked forwarded (never forwarded
/// again), with the service's admin token when it has one.
pub fn peer_request(
    token: Option<&str>,
    method: reqwest::Method,
    url: &str,
) -> reqwest::RequestBuilder {
    let req = peer_client().request(method, url).header(FORWARDED, "1");
    match token {
        Some(token) => req.bearer_auth(token),
        None => req,
    }
}

/// The HTTP client nodes reach each other with.
pub fn peer_client() -> reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            reqwest::Client::builder()
                .connect_timeout(PEER_TIMEOUT)
                .timeout(Duration::from_secs(300))
                .build()
                .expect("an HTTP client")
        })
        .clone()
}

/// Syncs every second while the service has other live nodes, or this
/// node knows runs with ranks elsewhere.
pub fn spawn(ctx: Context, mut stop: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SYNC_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if needs_sync(&ctx).await {
                        if let Err(e) = sync(&ctx).await {
                            tracing::warn!(error = %e, "syncing with the catalog failed");
                        }
                    }
                }
                _ = stop.changed() => break,
            }
        }
    })
}

/// Whether another node may have changed something this node shows.
async fn needs_sync(ctx: &Context) -> bool {
    let spread = ctx.registry.all_runs().iter().any(|r| r.is_spread());
    if spread {
        return true;
    }
    let me = ctx.registry.node_id();
    match ctx.store.list_nodes().await {
        Ok(nodes) => nodes
            .iter()
            .any(|n| n.status == "live" && n.info.node_id != me),
        Err(_) => false,
    }
}
