//! What every handler shares: handles to the services and to the layers
//! they are built on. No tensor and no domain state lives here; each
//! service owns its own.

use std::sync::Arc;
use std::time::Instant;

use crate::config::ServeArgs;
use crate::engine::capture::CaptureEvent;
use crate::events::EventBus;
use crate::objstore::ObjectStore;
use crate::registry::Registry;
use crate::services::alerts::{AlertService, AlertsSvc};
use crate::services::evals::Evals;
use crate::services::ingest::Ingest;
use crate::services::snapshots::{Snaps, SnapshotService};
use crate::services::{Context, Shared};
use crate::store::writer::CatalogWriter;
use crate::store::{Store, StoreError};
use crate::telemetry::Metrics;

/// Handles shared by every handler.
pub struct AppInner {
    shared: Context,
    ingest: Arc<Ingest>,
    snapshots: Snaps,
    alerts: AlertsSvc,
    evals: Arc<Evals>,
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
        let state = Arc::new(AppInner {
            ingest: Arc::new(Ingest::new(shared.clone())),
            snapshots: SnapshotService::new(&shared),
            alerts: AlertService::new(&shared),
            evals: Arc::new(Evals::new(&shared)),
            shared,
        });
        Ok((state, captures_rx))
    }

    /// The context every service is built on.
    pub fn shared(&self) -> &Context {
        &self.shared
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

    pub fn args(&self) -> &ServeArgs {
        &self.shared.args
    }

    pub fn store(&self) -> &Store {
        &self.shared.store
    }

    pub fn events(&self) -> &EventBus {
        &self.shared.events
    }

    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// When the server started.
    pub fn started(&self) -> Instant {
        self.shared.started
    }

    pub fn run(&self, name: &str) -> Option<Arc<crate::registry::RunHandle>> {
        self.shared.registry.run(name)
    }

    pub fn all_runs(&self) -> Vec<Arc<crate::registry::RunHandle>> {
        self.shared.registry.all_runs()
    }
}
