//! One service over many nodes: where a new run's ranks go, and how every
//! node keeps up with the runs the others create, delete and hold.
//!
//! Every node knows every run (reads work anywhere) but holds only the
//! ranks placed on it. The catalog is the truth; a node learns of changes
//! by [`Cluster::sync`]: at once when the node that made the change tells it
//! (`POST /v1/internal/sync`, see `tell_peers`), else within a second
//! (the periodic task, which runs only while the service has other nodes).
//! The ranks another node holds are shown from the catalog's rank rows.
//!
//! [`Cluster`] is the service: it owns the lock that keeps syncs one at a
//! time, the periodic sync and, on PostgreSQL, the relay of the other
//! nodes' events. Creating and deleting runs (`super::runs`) and the
//! lease's renewal (`super::nodes`) reach the helpers here.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use super::peer::{peer_client, peer_request, FORWARDED};
use super::{Context, ServiceError};
use crate::clock::now_ms;
use crate::contract::NodeStatus;
use crate::events::Event;
use crate::node::{assign, Candidate, Owner};
use crate::registry::{Failover, RankSummary, RunHandle};
use crate::store::nodes::NodeRow;
use crate::store::placement::Placed;
use crate::store::writer::EVENTS_CHANNEL;
use crate::store::CatalogKind;
use sqlx::postgres::PgListener;

/// How often a node of a service with several nodes looks at the catalog.
const SYNC_EVERY: Duration = Duration::from_secs(1);

/// The path a node asks a peer to sync on.
pub const SYNC_PATH: &str = "/v1/internal/sync";

/// This node among the others: syncing with the catalog, the live peers,
/// and the tasks that keep up with them.
pub struct Cluster {
    ctx: Context,
    /// Syncs are one at a time (a told sync and the periodic one must not
    /// interleave: one could drop a run the other just installed).
    syncing: Arc<tokio::sync::Mutex<()>>,
}

impl Cluster {
    pub fn new(ctx: &Context) -> Self {
        Cluster {
            ctx: ctx.clone(),
            syncing: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// Brings this node's registry up to the catalog now: installs the runs
    /// it does not know, drops those deleted elsewhere, takes over the
    /// ranks of nodes that are gone, refreshes the ranks others hold.
    pub async fn sync(&self) -> Result<Synced, ServiceError> {
        sync(&self.ctx, &self.syncing).await
    }

    /// The other live nodes of the service that have a URL: `(node id, URL)`.
    pub async fn live_peers(&self) -> Result<Vec<(String, String)>, ServiceError> {
        Ok(live_peers(&self.ctx).await?)
    }

    /// Starts the periodic sync and the relay of the other nodes' events.
    pub fn spawn(&self, stop: watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
        vec![
            spawn_sync(self.ctx.clone(), self.syncing.clone(), stop.clone()),
            spawn_event_relay(self.ctx.clone(), stop),
        ]
    }
}

/// Where the ranks of a new run go: over the live nodes, balanced by the
/// ranks each holds and its memory budget (see [`assign`]); this node
/// first, so a node alone in its service holds every rank.
pub(super) async fn place_new_run(
    ctx: &Context,
    world_size: u32,
) -> Result<Vec<Owner>, ServiceError> {
    let nodes = ctx.store.list_nodes().await?;
    let held = ctx.store.ranks_per_node().await?;
    let me = ctx.registry.node_id().to_string();
    let mut candidates: Vec<Candidate> = nodes
        .iter()
        .filter(|n| n.status == NodeStatus::Live && n.info.node_id != me)
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

/// What one [`Cluster::sync`] changed.
#[derive(Debug, Default, serde::Serialize, utoipa::ToSchema)]
pub struct Synced {
    /// Runs installed (created on another node, or before this one started).
    pub added: Vec<String>,
    /// Runs dropped (deleted on another node).
    pub removed: Vec<String>,
    /// Runs whose ranks held elsewhere were refreshed from the catalog.
    pub refreshed: usize,
    /// Ranks this node took over from nodes that are gone.
    pub taken_over: usize,
}

/// Brings this node's registry up to the catalog: installs the runs it does
/// not know (with the ranks placed on it), drops the runs deleted
/// elsewhere, and refreshes the owners and summaries of the ranks other
/// nodes hold. Under `syncing`, one at a time.
async fn sync(ctx: &Context, syncing: &tokio::sync::Mutex<()>) -> Result<Synced, ServiceError> {
    let _one = syncing.lock().await;
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
            Some(run) if run.created_at_ms == s.created_at_ms => {
                // A finish another node recorded (a finish across nodes
                // this node missed the commit of, or the final mark).
                if let (Some(finish), None) = (&s.finished, run.finished()) {
                    let at = crate::engine::FinishedAt(finish.step);
                    run.engines.shared().set_finished(Some(at));
                    *run.finished.lock().expect("run finish lock") = Some(finish.clone());
                }
                continue;
            }
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
    out.taken_over = take_over(ctx, &nodes).await?;
    for run in ctx.registry.all_runs() {
        if run.is_spread() {
            refresh(ctx, &nodes, &run).await?;
            out.refreshed += 1;
        }
    }
    Ok(out)
}

/// Failover. For every run: frees the ranks this node holds that the
/// catalog says another node took (this node was cut off long enough for
/// its lease to expire); claims, at their epoch plus one, its share of the
/// ranks whose node is gone (lease expired, or left), balanced over the
/// live nodes like a new run's; and installs every rank the catalog
/// places here that no engine holds yet, restored from the newest
/// snapshot holding it. Returns the ranks installed.
async fn take_over(ctx: &Context, nodes: &[NodeRow]) -> Result<usize, ServiceError> {
    let me = ctx.registry.node_id().to_string();
    let live = |id: &str| {
        id == me
            || nodes
                .iter()
                .any(|n| n.info.node_id == id && n.status == NodeStatus::Live)
    };
    let mut candidates: Vec<Candidate> = Vec::new();
    let mut installed = 0;
    for run in ctx.registry.all_runs() {
        let name = run.config.name.clone();
        let placed = ctx.store.placement(&name).await?;
        release_lost(ctx, &run, &placed).await;
        let orphans: Vec<(u32, u64)> = placed
            .iter()
            .filter(|p| !live(&p.node_id))
            .map(|p| (p.rank, p.epoch))
            .collect();
        // A node whose own lease is in doubt takes nothing.
        let mut claimed = false;
        if !orphans.is_empty() && ctx.lease.fenced().is_none() {
            if candidates.is_empty() {
                candidates = live_candidates(ctx, nodes).await?;
            }
            let shares = assign(orphans.len() as u32, &candidates);
            let mine: Vec<(u32, Option<u64>)> = orphans
                .iter()
                .zip(&shares)
                .filter(|(_, node)| **node == me)
                .map(|(&(rank, epoch), _)| (rank, Some(epoch)))
                .collect();
            // The next run's orphans are balanced with these counted.
            for c in candidates.iter_mut() {
                c.held += shares.iter().filter(|n| **n == c.node_id).count() as u64;
            }
            if !mine.is_empty() {
                claimed = true;
                let won = ctx.store.claim_ranks(&name, &me, &mine, now_ms()).await?;
                if !won.is_empty() {
                    tracing::warn!(run = %name, ranks = ?won.iter().map(|p| p.rank).collect::<Vec<_>>(),
                        "took over the ranks of a node whose lease expired");
                }
            }
        }
        // Read again only when this node claimed something just now.
        let placed = if claimed {
            ctx.store.placement(&name).await?
        } else {
            placed
        };
        let to_install: Vec<(u32, u64)> = placed
            .iter()
            .filter(|p| p.node_id == me && !run.holds(p.rank))
            .map(|p| (p.rank, p.epoch))
            .collect();
        if !to_install.is_empty() {
            install_taken(ctx, &run, &to_install).await?;
            installed += to_install.len();
        }
    }
    if installed > 0 {
        // Off the sync's lock: a peer that cannot answer delays nothing.
        let ctx = ctx.clone();
        tokio::spawn(async move { tell_peers(&ctx).await });
    }
    Ok(installed)
}

/// Frees the ranks this node holds of `run` that `placed` (the catalog)
/// says another node holds now.
async fn release_lost(ctx: &Context, run: &RunHandle, placed: &[Placed]) {
    let me = ctx.registry.node_id();
    let lost: Vec<u32> = placed
        .iter()
        .filter(|p| p.node_id != me && run.holds(p.rank))
        .map(|p| p.rank)
        .collect();
    if lost.is_empty() {
        return;
    }
    ctx.registry.release_ranks(run, &lost).await;
    tracing::warn!(run = %run.config.name, ranks = ?lost,
        "another node took these ranks while this one could not renew its lease; released");
    // Their pushes go to the new owners from now (not back here, as the
    // owners this node knew would say until its next sync).
    let nodes = match ctx.store.list_nodes().await {
        Ok(nodes) => nodes,
        Err(e) => {
            tracing::warn!(error = %e, "listing the nodes for released ranks failed; the next sync names their owners");
            return;
        }
    };
    let mut owners = run.placement.write().expect("placement lock");
    for p in placed.iter().filter(|p| lost.contains(&p.rank)) {
        if let Some(slot) = owners.get_mut(p.rank as usize) {
            *slot = owner(ctx, &nodes, &p.node_id, p.epoch);
        }
    }
}

/// Frees every rank another node took over from this one. Called after a
/// renewal that followed a lapse, before pushes are acknowledged again:
/// a claim either committed before that renewal (and is seen here) or
/// found the lease live and failed (see [`crate::store::Store::claim_ranks`]).
pub(super) async fn release_taken(ctx: &Context) -> Result<(), ServiceError> {
    for run in ctx.registry.all_runs() {
        if run.held_ranks().is_empty() {
            continue;
        }
        let placed = ctx.store.placement(&run.config.name).await?;
        release_lost(ctx, &run, &placed).await;
    }
    Ok(())
}

/// The live nodes as placement candidates, sorted by id so every node
/// shares the same view of who takes which orphaned rank.
async fn live_candidates(ctx: &Context, nodes: &[NodeRow]) -> Result<Vec<Candidate>, ServiceError> {
    let held = ctx.store.ranks_per_node().await?;
    let mut out: Vec<Candidate> = nodes
        .iter()
        .filter(|n| n.status == NodeStatus::Live || n.info.node_id == ctx.registry.node_id())
        .map(|n| Candidate {
            node_id: n.info.node_id.clone(),
            budget: n.info.memory_budget,
            held: held.get(&n.info.node_id).copied().unwrap_or(0),
        })
        .collect();
    out.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    Ok(out)
}

/// Installs ranks the catalog placed on this node at `(rank, epoch)`,
/// taken from a node that is gone: each restored from the newest snapshot
/// holding it, reported (event, metric, rank view) with the steps it may
/// have lost.
async fn install_taken(
    ctx: &Context,
    run: &RunHandle,
    ranks: &[(u32, u64)],
) -> Result<(), ServiceError> {
    let name = &run.config.name;
    let wanted: Vec<u32> = ranks.iter().map(|(r, _)| *r).collect();
    let (events, metrics) = (ctx.events.clone(), ctx.metrics.clone());
    let report = move |e: &crate::services::snapshots::SnapshotError| {
        if let Some(m) = e.mismatch() {
            crate::services::snapshots::verify::report_mismatch(&events, &metrics, m, "failover");
        }
    };
    let newest = crate::services::snapshots::newest_states(
        &ctx.store,
        &ctx.objects,
        &run.config,
        &wanted,
        &report,
    )
    .await?;
    let history = ctx.store.placement_log(name).await?;
    let seen: std::collections::HashMap<u32, Option<u64>> = ctx
        .store
        .list_ranks(name)
        .await?
        .into_iter()
        .map(|r| (r.rank, r.last_step))
        .collect();
    let epochs: std::collections::BTreeMap<u32, u64> = ranks.iter().copied().collect();
    let at_ms = now_ms();
    let mut reports = Vec::new();
    let mut states = Vec::new();
    for (rank, found) in newest {
        let epoch = epochs[&rank];
        let from_node = history
            .iter()
            .find(|h| h.rank == rank && h.epoch + 1 == epoch)
            .map(|h| h.node_id.clone())
            .unwrap_or_default();
        let (snapshot, restored_step, state) = match found {
            Some(f) => (Some(f.snapshot), Some(f.step), Some(f.state)),
            None => (None, None, None),
        };
        reports.push((
            rank,
            Failover {
                from_node,
                restart: false,
                epoch,
                at_ms,
                snapshot,
                restored_step,
                last_seen_step: seen.get(&rank).copied().flatten(),
                resumed_step: None,
                lost_steps: None,
            },
        ));
        states.push((rank, state));
    }
    ctx.registry.adopt_ranks(run, states, &epochs).await?;
    ctx.registry.record_engines(&ctx.store, run).await;
    for (rank, failover) in reports {
        let summary = run.update_rank(rank, |s| {
            s.last_step = failover.restored_step;
            s.live = failover.restored_step.is_some();
            s.failover = Some(failover.clone());
        });
        ctx.record_rank(run, rank, &summary, None);
        ctx.store.note_rank_failover(name, rank, &failover).await;
        ctx.metrics.failover_ranks.with_label_values(&[name]).inc();
        tracing::warn!(run = %name, rank, from = %failover.from_node, epoch = failover.epoch,
            snapshot = ?failover.snapshot, restored_step = ?failover.restored_step,
            last_seen_step = ?failover.last_seen_step, "rank taken over");
        ctx.events.emit(
            name,
            Some(rank),
            failover.restored_step,
            Event::Failover(failover),
        );
    }
    Ok(())
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
            // This node's own ranks, and those placed here but not yet
            // installed (see [`take_over`]).
            if run.holds(p.rank) || p.node_id == ctx.registry.node_id() {
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
pub(super) async fn tell_peers(ctx: &Context) {
    let peers = match live_peers(ctx).await {
        Ok(peers) => peers,
        Err(e) => {
            tracing::warn!(error = %e, "listing the nodes to tell of a change failed");
            return;
        }
    };
    if peers.is_empty() {
        return;
    }
    let calls = peers.iter().map(|(_, url)| {
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

/// The other live nodes of the service that have a URL: `(node id, URL)`.
async fn live_peers(ctx: &Context) -> Result<Vec<(String, String)>, crate::store::StoreError> {
    let me = ctx.registry.node_id();
    Ok(ctx
        .store
        .list_nodes()
        .await?
        .into_iter()
        .filter(|n| n.status == NodeStatus::Live && n.info.node_id != me && !n.info.url.is_empty())
        .map(|n| (n.info.node_id, n.info.url))
        .collect())
}

/// Syncs every second while the service has other live nodes, or this
/// node knows runs with ranks elsewhere.
fn spawn_sync(
    ctx: Context,
    syncing: Arc<tokio::sync::Mutex<()>>,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SYNC_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if needs_sync(&ctx).await {
                        if let Err(e) = sync(&ctx, &syncing).await {
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
            .any(|n| n.status == NodeStatus::Live && n.info.node_id != me),
        Err(_) => false,
    }
}

/// How often a node reads the catalog for other nodes' events when no
/// notification came (a lost notification, or a listener reconnecting).
const RELAY_POLL: Duration = Duration::from_secs(1);

/// Events read from the catalog per query.
const RELAY_BATCH: i64 = 1000;

/// On a PostgreSQL catalog: relays the events every other node stores to
/// this node's live subscribers, in the catalog's order (`seq`), so an
/// event stream on any node shows every node's events. Woken by the
/// writers' `NOTIFY` (LISTEN on [`EVENTS_CHANNEL`]), and every
/// [`RELAY_POLL`] in case one is missed. Nothing on SQLite (one node).
fn spawn_event_relay(ctx: Context, mut stop: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        if ctx.store.kind() != CatalogKind::Postgres {
            return;
        }
        let Some(url) = ctx.args.catalog.clone() else {
            return;
        };
        let me = ctx.registry.node_id().to_string();
        let mut last = match ctx.store.last_event_seq().await {
            Ok(seq) => seq,
            Err(e) => {
                tracing::warn!(error = %e, "reading the events' order failed; relaying from the start");
                0
            }
        };
        let mut listener: Option<PgListener> = None;
        loop {
            if listener.is_none() {
                listener = listen(&url).await;
            }
            let woken = async {
                match listener.as_mut() {
                    // A notification, or the poll's time: read. The
                    // connection failed: read, and listen again.
                    Some(l) => {
                        !matches!(tokio::time::timeout(RELAY_POLL, l.recv()).await, Ok(Err(_)))
                    }
                    None => {
                        tokio::time::sleep(RELAY_POLL).await;
                        true
                    }
                }
            };
            tokio::select! {
                ok = woken => if !ok { listener = None; },
                _ = stop.changed() => break,
            }
            loop {
                match ctx.store.events_after_seq(last, &me, RELAY_BATCH).await {
                    Ok((events, read_to)) => {
                        let more = read_to - last >= RELAY_BATCH;
                        last = read_to;
                        for e in events {
                            ctx.events.relay(std::sync::Arc::new(e));
                        }
                        if !more {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "reading other nodes' events failed");
                        break;
                    }
                }
            }
        }
    })
}

/// A listener on the events channel, or `None` (logged) when the catalog
/// cannot be reached now.
async fn listen(url: &str) -> Option<PgListener> {
    let mut l = match PgListener::connect(url).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "listening for other nodes' events failed; polling");
            return None;
        }
    };
    match l.listen(EVENTS_CHANNEL).await {
        Ok(()) => Some(l),
        Err(e) => {
            tracing::warn!(error = %e, "listening for other nodes' events failed; polling");
            None
        }
    }
}
