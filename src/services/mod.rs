//! Services: the domain work between the HTTP handlers and the layers
//! below (registry, event bus, engine, snapshot format, store). A handler
//! extracts its request, calls one service, and renders the answer or the
//! [`ServiceError`]. Each service is a struct built from the [`Context`]
//! in `state.rs`, keeps what it reaches private, and starts the periodic
//! tasks that touch its state (`spawn`, called from `server.rs`). Handlers
//! reach services only, never the context.
//!
//! - [`ingest`] ([`ingest::Ingest`]): a push from its body to the applied
//!   update and its bookkeeping (metrics, rank summary, catalog, drift,
//!   events); whether pushes are fenced by the lease. Task: trimming idle
//!   receive buffers.
//! - [`pipeline`]: pipelined pushes of a rank (`Polyak-Prev-Step`), held
//!   until their predecessor is answered so they apply in step order.
//! - [`monitor`] ([`monitor::Monitor`]): the series the server records
//!   itself (drift, ingest rate), the trainer's scalars, per-tensor drift
//!   and the event history as stored. Task: sampling the ingest rate, and
//!   pruning all of them to their retention.
//! - [`nodes`] ([`nodes::Nodes`]): this server's registration in the
//!   catalog, and the list of the service's nodes. Task: renewing the
//!   lease.
//! - [`cluster`] ([`cluster::Cluster`]): where a new run's ranks go among
//!   the nodes, and each node keeping up with the runs the others create,
//!   delete and hold. Tasks: the periodic sync, and relaying the other
//!   nodes' events.
//! - [`alerts`] ([`alerts::AlertService`]): per-run alert rules evaluated
//!   from events and a tick; webhooks.
//! - [`runs`] ([`runs::Runs`]): creating, annotating and deleting a run,
//!   exporting its live EMA.
//! - [`ops`] ([`ops::Ops`]): liveness facts, readiness (catalog, engines,
//!   object store), the gauges sampled at a scrape, and verifying every
//!   snapshot part.
//! - [`evals`] ([`evals::Evals`]): evaluations of candidates (a snapshot's
//!   profile or its online weights), and the best candidate of a metric.
//! - [`snapshots`] ([`snapshots::SnapshotService`]): the snapshot
//!   lifecycle (cuts, capture writes, retention, state persistence,
//!   restore and recovery) and derived snapshots (post-hoc, merge). Tasks:
//!   the capture writer and the snapshot ticker.

pub mod alerts;
pub mod cluster;
pub mod error;
pub mod evals;
pub mod ingest;
pub mod monitor;
pub mod nodes;
pub mod ops;
pub mod peer;
pub mod pipeline;
pub mod runs;
pub mod snapshots;

use std::sync::Arc;
use std::time::Instant;

pub use error::{ErrorKind, ServiceError};

use crate::config::ServeArgs;
use crate::engine::rank::RankLayout;
use crate::events::EventBus;
use crate::objstore::ObjectStore;
use crate::registry::{RankSummary, Registry, RunHandle};
use crate::store::writer::{CatalogUpdate, CatalogWriter};
use crate::store::Store;
use crate::telemetry::Metrics;

/// What every service reaches: the configuration, the catalog, the object
/// store, the run registry, the event bus and the metrics. Cheap to clone.
pub type Context = Arc<Shared>;

pub struct Shared {
    pub args: ServeArgs,
    pub store: Store,
    /// Where snapshot parts live (files under the data dir, or S3).
    pub objects: ObjectStore,
    /// Batched catalog writes off the request path.
    pub catalog: CatalogWriter,
    pub registry: Arc<Registry>,
    pub events: Arc<EventBus>,
    pub metrics: Arc<Metrics>,
    pub started: Instant,
    /// This node's lease, which fences its pushes (see [`crate::node::Lease`]).
    pub lease: Arc<crate::node::Lease>,
}

impl Shared {
    pub fn run(&self, name: &str) -> Option<Arc<RunHandle>> {
        self.registry.run(name)
    }

    /// Every run, for the periodic jobs that visit them all.
    pub fn all_runs(&self) -> Vec<Arc<RunHandle>> {
        self.registry.all_runs()
    }

    /// Records a registered layout and the new counters of a rank.
    pub fn record_rank(
        &self,
        run: &RunHandle,
        rank: u32,
        summary: &RankSummary,
        layout: Option<&RankLayout>,
    ) {
        record_rank(&self.catalog, run, rank, summary, layout);
    }
}

/// Records a registered layout and the new counters of a rank.
pub fn record_rank(
    catalog: &CatalogWriter,
    run: &RunHandle,
    rank: u32,
    summary: &RankSummary,
    layout: Option<&RankLayout>,
) {
    let layout_json = layout.map(crate::snapshot::meta::encode_layout);
    catalog.send(CatalogUpdate::Rank {
        run: run.config.name.clone(),
        row: summary.to_row(rank),
        layout_json,
    });
}
