//! What every handler shares: handles to the services and to the layers
//! they are built on. No tensor and no domain state lives here; each
//! service owns its own.

use std::ops::Deref;
use std::sync::Arc;
use std::time::Instant;

use crate::config::ServeArgs;
use crate::engine::capture::CaptureEvent;
use crate::events::EventBus;
use crate::registry::Registry;
use crate::services::ingest::Ingest;
use crate::services::{Context, Shared};
use crate::snapshot::Snapshots;
use crate::store::writer::CatalogWriter;
use crate::store::{Store, StoreError};
use crate::telemetry::Metrics;

/// Handles shared by every handler.
pub struct AppInner {
    shared: Context,
    ingest: Arc<Ingest>,
    pub snapshots: Snapshots,
    /// Alert rules' state and the webhook sender.
    pub alerts: crate::alerts::Alerts,
}

pub type AppState = Arc<AppInner>;

impl Deref for AppInner {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.shared
    }
}

impl AppInner {
    /// Opens the catalog and loads every run from it. The receiver gets what
    /// the engines capture for snapshots.
    pub async fn open(
        args: ServeArgs,
        default_device: tch::Device,
        catalog: CatalogWriter,
        store: Store,
    ) -> Result<(AppState, tokio::sync::mpsc::UnboundedReceiver<CaptureEvent>), StoreError> {
        let last_event = store.max_event_id().await?;
        let (captures, captures_rx) = tokio::sync::mpsc::unbounded_channel();
        let metrics = Arc::new(Metrics::new());
        let registry = Registry::new(
            default_device,
            args.queue_depth,
            args.periodic_backlog.0,
            captures,
            metrics.runs.clone(),
        );
        registry.load(&store).await?;
        let shared = Arc::new(Shared {
            events: EventBus::new(last_event, catalog.clone()),
            catalog,
            store,
            registry,
            metrics,
            started: Instant::now(),
            args,
        });
        let state = Arc::new(AppInner {
            ingest: Arc::new(Ingest::new(shared.clone())),
            snapshots: Snapshots::new(shared.args.data_dir.clone()),
            alerts: crate::alerts::Alerts::new(),
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
}
