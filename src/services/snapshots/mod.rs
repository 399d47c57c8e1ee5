//! The snapshot service: consistent cuts captured by the engine, persisted
//! durably, listed in the catalog, retained, resumed from, and used for
//! crash recovery; and the derived snapshots built from stored ones. The
//! on-disk format and the readers over it are in `crate::snapshot`.
//!
//! - `pending`: the snapshot registry (what is being written, who waits).
//! - `cuts`: manual cuts and the final snapshot of a finished run.
//! - `capture`: the capture writer; completion and failure.
//! - `retention`: deletion and the run's retention.
//! - [`spread`]: a cut of a run whose ranks other nodes hold too.
//! - `persist`: `state` snapshots, when due and at shutdown.
//! - `restore`: resume and recovery at start.
//! - [`disk`]: free space, checked before every snapshot or state write.
//! - [`derived`]: post-hoc and merged-checkpoint snapshots (plan, catalog,
//!   background job, progress).
//! - [`verify`]: parts held to their recorded sha256: reports, and the
//!   store-wide check.
//!
//! Life of a snapshot: a catalog row is inserted `pending`; the engine
//! captures each rank right after it applies the step (a device-side copy)
//! and sends the copy here; each rank's parts are serialised and written on
//! a blocking thread; when every rank is on disk the catalog marks the
//! snapshot `complete` with its files' sha256 in one transaction. A rank
//! that does not arrive before the deadline fails it.

mod capture;
pub mod comparison;
mod cuts;
pub mod derived;
pub mod disk;
pub mod download;
mod pending;
mod persist;
mod restore;
mod retention;
pub mod spread;
pub mod verify;

use capture::*;
pub use capture::{fail, record_failure};
pub use cuts::{accept, create, cut_now, finish, next_step, profile_choice, withdraw};
pub use pending::Snapshots;
use pending::*;
use persist::*;
pub use persist::{persist_all, persist_all_until, persist_bounded, persist_state};
pub use restore::{newest_states, parts_of, recover, restore_from, resume, NewestState, Resumed};
use retention::*;
pub use retention::{delete, remove_run_files};

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::clock::now_ms;
use crate::config::ServeArgs;
pub use crate::contract::{CutKind, SnapshotKind, SnapshotStatus};
use crate::engine::capture::{Backlog, CaptureEvent, RankCapture, RestoredRank};
use crate::engine::snapshot_id;
use crate::events::EventBus;
use crate::events::{self, Event, Restored, SnapshotEvent};
use crate::objstore::ObjectStore;
use crate::registry::Registry;
use crate::registry::RunHandle;
use crate::run::RunConfig;
pub use crate::services::error::SnapshotError;
use crate::services::Context;
use crate::snapshot::meta::{self, MetaError};
use crate::snapshot::{assemble, compare, convert, files, format};
use crate::store::snapshots::{Fence, FileRow, SnapshotRow};
use crate::store::writer::CatalogWriter;
use crate::store::RunFinish;
use crate::store::Store;
use crate::telemetry::Metrics;
use compare::CompareResult;
use format::MIRROR_PART;

/// State snapshots kept per run (older ones are deleted).
const STATE_KEEP: usize = 2;

/// How a snapshot ended, for those waiting on it.
#[derive(Debug, Clone)]
pub enum Finished {
    Complete,
    Failed(String),
}

/// The snapshot service: what it reaches of the layers below (the catalog,
/// the runs, the event bus, the metrics, the settings it reads), and the
/// snapshot registry.
pub struct SnapshotService {
    pub(crate) args: ServeArgs,
    pub(crate) store: Store,
    /// Where snapshot parts live.
    pub(crate) objects: ObjectStore,
    catalog: CatalogWriter,
    registry: Arc<Registry>,
    pub(crate) events: Arc<EventBus>,
    pub(crate) metrics: Arc<Metrics>,
    /// Snapshots being written, compare results, progress of derived jobs.
    pub pending: Snapshots,
    /// This node's lease: a node whose lease lapsed writes no state for
    /// ranks it may have lost.
    lease: Arc<crate::node::Lease>,
    /// The server's capture backlog (`--capture-backlog`), in MiB permits:
    /// a state snapshot holds its estimated bytes from capture until it
    /// completes or fails.
    captures: Arc<tokio::sync::Semaphore>,
    /// The digests of served files, as far as responses carried them.
    pub(crate) digests: Arc<crate::snapshot::digests::DigestCache>,
    /// The recipes of files served lately.
    pub(crate) recipes: download::Recipes,
}

/// The part a catalog row describes, for the one verified reader, held to
/// everything the catalog recorded of it (size, sha256, block checksums).
pub(crate) fn stored_part(
    objects: &ObjectStore,
    f: &FileRow,
) -> Arc<crate::snapshot::source::PartLoc> {
    crate::snapshot::source::PartLoc::recorded_with(
        objects,
        &f.path,
        f.bytes,
        &f.sha256,
        f.blocks.clone(),
    )
}

/// How the snapshot service is held.
pub type Snaps = Arc<SnapshotService>;

impl SnapshotService {
    pub fn new(ctx: &Context) -> Snaps {
        Arc::new(SnapshotService {
            pending: Snapshots::new(ctx.args.data_dir.clone()),
            args: ctx.args.clone(),
            store: ctx.store.clone(),
            objects: ctx.objects.clone(),
            catalog: ctx.catalog.clone(),
            registry: ctx.registry.clone(),
            events: ctx.events.clone(),
            metrics: ctx.metrics.clone(),
            lease: ctx.lease.clone(),
            captures: Arc::new(tokio::sync::Semaphore::new(backlog_permits(
                ctx.args.capture_backlog.0,
            ))),
            digests: Arc::default(),
            recipes: download::Recipes::default(),
        })
    }

    pub fn run(&self, name: &str) -> Option<Arc<RunHandle>> {
        self.registry.run(name)
    }

    pub fn all_runs(&self) -> Vec<Arc<RunHandle>> {
        self.registry.all_runs()
    }

    /// Records the new counters of a rank (after a restore).
    pub(crate) fn record_rank(
        &self,
        run: &RunHandle,
        rank: u32,
        summary: &crate::registry::RankSummary,
        layout: Option<&crate::engine::rank::RankLayout>,
    ) {
        crate::services::record_rank(&self.catalog, run, rank, summary, layout);
    }
}

/// MiB (rounded up) of `bytes`, at least one: the capture backlog's unit.
fn backlog_permits(bytes: u64) -> usize {
    bytes.div_ceil(1 << 20).max(1) as usize
}

impl SnapshotService {
    /// Starts the task that writes what the engines capture, and the ticker
    /// that fails late snapshots and takes periodic state snapshots.
    pub fn spawn(
        self: &Arc<Self>,
        captures: mpsc::UnboundedReceiver<CaptureEvent>,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        run_tasks(self.clone(), captures, stop)
    }
}

fn run_tasks(
    state: Snaps,
    mut captures: mpsc::UnboundedReceiver<CaptureEvent>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                event = captures.recv() => match event {
                    Some(event) => on_event(&state, event).await,
                    None => break,
                },
                _ = tick.tick() => {
                    fail_late(&state).await;
                    retry_unrecorded(&state).await;
                    disk::refresh_gauge(&state);
                    persist_due(&state).await;
                }
                _ = stop.changed() => break,
            }
        }
    })
}
