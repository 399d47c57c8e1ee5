//! What every handler shares: handles to the services, built here from
//! the context (catalog, object store, registry, event bus, metrics,
//! lease) that only the services hold. No tensor and no domain state lives
//! here; each service owns its own, and its periodic tasks (started from
//! `server.rs`).

use std::sync::Arc;
use std::time::Instant;

use crate::config::ServeArgs;
use crate::engine::capture::CaptureEvent;
use crate::events::EventBus;
use crate::objstore::ObjectStore;
use crate::registry::Registry;
use crate::services::alerts::{AlertService, AlertsSvc};
use crate::services::cluster::Cluster;
use crate::services::evals::Evals;
use crate::services::ingest::Ingest;
use crate::services::monitor::Monitor;
use crate::services::nodes::Nodes;
use crate::services::ops::Ops;
use crate::services::runs::Runs;
use crate::services::snapshots::{Snaps, SnapshotService};
use crate::services::{Context, Shared};
use crate::store::writer::CatalogWriter;
use crate::store::{Store, StoreError};
use crate::telemetry::Metrics;

/// Handles shared by every handler.
pub struct AppInner {
    /// For the registry, configuration, event bus and metrics handles
    /// below; never handed out whole.
    shared: Context,
    ingest: Arc<Ingest>,
    snapshots: Snaps,
    alerts: AlertsSvc,
    evals: Arc<Evals>,
    runs: Runs,
    nodes: Nodes,
    cluster: Cluster,
    monitor: Monitor,
    ops: Ops,
}

pub type AppState = Arc<AppInner>;

impl AppInner {
    /// Opens the catalog and loads every run from it. The receiver gets what
    /// the engines capture for snapshots.
    pub async fn open(
        args: ServeArgs,
        default_device: (String, Vec<tch::Device>),
        catalog: CatalogWriter,
        store: Store,
        objects: ObjectStore,
    ) -> Result<(AppState, tokio::sync::mpsc::UnboundedReceiver<CaptureEvent>), StoreError> {
        let event_ids = store
            .reserve_event_ids(crate::events::EVENT_ID_BLOCK)
            .await?;
        let (captures, captures_rx) = tokio::sync::mpsc::unbounded_channel();
        let metrics = Arc::new(Metrics::new());
        if let Err(e) = metrics.register_store(objects.metrics()) {
            tracing::warn!(error = %e, "object store metrics not registered");
        }
        let registry = Registry::new(
            default_device,
            args.cpu_engines(),
            args.queue_depth,
            args.periodic_backlog.0,
            captures,
            metrics.runs.clone(),
            crate::node::identity(&args),
        );
        registry.load(&store).await?;
        let shared = Arc::new(Shared {
            events: Arc::new(EventBus::new(
                event_ids,
                catalog.clone(),
                Some(store.clone()),
                store.kind() == crate::store::CatalogKind::Postgres,
            )),
            catalog,
            store,
            objects,
            registry: Arc::new(registry),
            metrics,
            started: Instant::now(),
            lease: Arc::new(crate::node::Lease::new(args.lease_secs)),
            args,
        });
        let ingest = Arc::new(Ingest::new(shared.clone()));
        let snapshots = SnapshotService::new(&shared);
        let alerts = AlertService::new(&shared);
        let state = Arc::new(AppInner {
            runs: Runs::new(&shared, &snapshots, &alerts, &ingest),
            nodes: Nodes::new(&shared),
            cluster: Cluster::new(&shared),
            monitor: Monitor::new(&shared),
            ops: Ops::new(&shared, &snapshots),
            evals: Arc::new(Evals::new(&shared)),
            ingest,
            snapshots,
            alerts,
            shared,
        });
        Ok((state, captures_rx))
    }

    pub fn registry(&self) -> &Registry {
        &self.shared.registry
    }

    pub fn ingest(&self) -> &Arc<Ingest> {
        &self.ingest
    }

    pub fn snapshots(&self) -> &Snaps {
        &self.snapshots
    }

    pub fn alerts(&self) -> &AlertsSvc {
        &self.alerts
    }

    pub fn evals(&self) -> &Evals {
        &self.evals
    }

    pub fn runs(&self) -> &Runs {
        &self.runs
    }

    pub fn nodes(&self) -> &Nodes {
        &self.nodes
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    pub fn monitor(&self) -> &Monitor {
        &self.monitor
    }

    pub fn ops(&self) -> &Ops {
        &self.ops
    }

    pub fn args(&self) -> &ServeArgs {
        &self.shared.args
    }

    pub fn events(&self) -> &EventBus {
        &self.shared.events
    }

    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    pub fn run(&self, name: &str) -> Option<Arc<crate::registry::RunHandle>> {
        self.shared.registry.run(name)
    }

    pub fn all_runs(&self) -> Vec<Arc<crate::registry::RunHandle>> {
        self.shared.registry.all_runs()
    }
}
