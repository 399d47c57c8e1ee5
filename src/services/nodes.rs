//! This server as a node of the service: it registers itself in the
//! catalog at start (id, URL, engines, memory budget), renews its lease
//! three times per `--lease-secs` with the ranks and bytes it holds, and
//! gives the lease up on a graceful stop. Every node sharing the catalog
//! lists the others (`GET /v1/nodes`, the dashboard's Nodes page).
//!
//! [`Nodes`] is the service: handlers list the nodes through it, and it
//! owns the task that renews the lease.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{Context, ServiceError};
use crate::contract::NodeStatus;
use crate::store::nodes::{NodeInfo, NodeRow};

/// This server as a node: its registration, its lease's renewal task,
/// and the list of the service's nodes.
pub struct Nodes {
    ctx: Context,
}

impl Nodes {
    pub fn new(ctx: &Context) -> Self {
        Nodes { ctx: ctx.clone() }
    }

    /// Registers this node (at start, before it serves).
    pub async fn register(&self) -> Result<(), ServiceError> {
        self.ctx.store.register_node(&info(&self.ctx)).await?;
        Ok(())
    }

    /// Every node of the service, as the catalog knows them.
    pub async fn list(&self) -> Result<Vec<NodeRow>, ServiceError> {
        Ok(self.ctx.store.list_nodes().await?)
    }

    /// Starts the task that renews the lease until `stop`, then gives it up.
    pub fn spawn(&self, stop: watch::Receiver<bool>) -> JoinHandle<()> {
        spawn_renewal(self.ctx.clone(), stop)
    }
}

/// This node as it registers.
fn info(ctx: &Context) -> NodeInfo {
    let args = &ctx.args;
    let (node_id, url) = crate::node::identity(args);
    NodeInfo {
        node_id,
        url,
        engines: ctx.registry.engine_labels(),
        memory_budget: args
            .memory_budget
            .map(|b| b.0)
            .unwrap_or_else(system_memory),
        lease_ms: (args.lease_secs * 1000.0).round() as i64,
    }
}

/// The machine's memory in bytes (`MemTotal`), 0 when unknown.
fn system_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(0)
}

/// Renews the lease until `stop`, then gives it up.
fn spawn_renewal(ctx: Context, mut stop: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let node = info(&ctx).node_id;
        let every = Duration::from_secs_f64(ctx.args.lease_secs / 3.0);
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => renew(&ctx, &node).await,
                _ = stop.changed() => break,
            }
        }
        if let Err(e) = ctx.store.leave_node(&node).await {
            tracing::warn!(error = %e, "giving up the node lease failed");
        }
    })
}

async fn renew(ctx: &Context, node: &str) {
    let runs = ctx.registry.all_runs();
    let ranks = runs.iter().map(|r| r.held_ranks().len() as u64).sum();
    let resident = runs.iter().map(|r| r.resident_bytes()).sum();
    let sent = std::time::Instant::now();
    let lapsed = ctx.lease.lapsed();
    if let Err(e) = ctx.store.renew_node(node, ranks, resident).await {
        let age = ctx.lease.age().as_secs_f64();
        tracing::warn!(error = %e, lease_age_secs = age, "renewing the node lease failed");
        return;
    }
    // After a lapse another node may have taken ranks over: they are let
    // go before this node acknowledges pushes again.
    if lapsed {
        if let Err(e) = super::cluster::release_taken(ctx).await {
            tracing::warn!(error = %e, "checking for ranks taken over failed; still fenced");
            return;
        }
    }
    // Whether another node could take this one's ranks when its lease
    // runs out: only then are pushes fenced by the lease.
    let others = match ctx.store.list_nodes().await {
        Ok(nodes) => nodes
            .iter()
            .any(|n| n.status == NodeStatus::Live && n.info.node_id != node),
        Err(_) => true,
    };
    ctx.lease.renewed(sent, others);
}
