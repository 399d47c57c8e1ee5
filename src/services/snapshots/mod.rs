//! The snapshot service: consistent cuts captured by the engine, persisted
//! durably, listed in the catalog, retained, resumed from, and used for
//! crash recovery; and the derived snapshots built from stored ones. The
//! on-disk format and the readers over it are in `crate::snapshot`.
//!
//! - `pending`: the snapshot registry (what is being written, who waits).
//! - `cuts`: manual cuts and the final snapshot of a finished run.
//! - `capture`: the capture writer; completion and failure.
//! - `retention`: deletion and the run's retention.
//! - `persist`: `state` snapshots, when due and at shutdown.
//! - `restore`: resume and recovery at start.
//! - [`disk`]: free space, checked before every snapshot or state write.
//! - [`derived`]: post-hoc and merged-checkpoint snapshots (plan, catalog,
//!   background job, progress).
//!
//! Life of a snapshot: a catalog row is inserted `pending`; the engine
//! captures each rank right after it applies the step (a device-side copy)
//! and sends the copy here; each rank's parts are serialised and written on
//! a blocking thread; when every rank is on disk the catalog marks the
//! snapshot `complete` with its files' sha256 in one transaction. A rank
//! that does not arrive before the deadline fails it.

mod capture;
mod cuts;
pub mod derived;
pub mod disk;
mod pending;
mod persist;
mod restore;
mod retention;

use capture::*;
pub use capture::{fail, record_failure};
pub use cuts::{
    create, cut_now, finish, next_step, CUT_CURRENT, CUT_FINAL, CUT_NEXT_UPDATE, CUT_REQUESTED,
};
pub use pending::Snapshots;
use pending::*;
use persist::*;
pub use persist::{persist_all, persist_state};
pub use restore::{parts_of, recover, restore_from, resume, Resumed};
use retention::*;
pub use retention::{delete, remove_run_files};

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::clock::now_ms;
use crate::engine::capture::{Backlog, CaptureEvent, RankCapture, RestoredRank};
use crate::engine::{snapshot_id, EngineError};
use crate::registry::RunHandle;
use crate::run::RunConfig;
use crate::services::{Context, Shared};
use crate::snapshot::meta::{self, MetaError};
use crate::snapshot::{assemble, compare, files, format};
use crate::store::snapshots::{FileRow, SnapshotRow};
use crate::store::{RunFinish, StoreError};
use compare::CompareResult;
use format::MIRROR_PART;

/// Snapshot kinds.
pub const MANUAL: &str = "manual";
pub const PERIODIC: &str = "periodic";
pub const STATE: &str = "state";

/// State snapshots kept per run (older ones are deleted).
const STATE_KEEP: usize = 2;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    /// `resume` found only a snapshot older than the step asked for.
    #[error("{0}")]
    Older(String),
    /// The server's fault (a worker that panicked, catalog data that does
    /// not hold together): answered 500, never blamed on the request.
    #[error("{0}")]
    Internal(String),
    /// A stored part could not be read back (truncated, bytes that do not
    /// parse, a part missing for a profile): 500 `snapshot_corrupt`.
    #[error("{0}")]
    Corrupt(String),
    /// A part's metadata (in the catalog) or a part file that this server
    /// cannot read: malformed (500 `catalog_corrupt`), or written in a
    /// newer format (500 `snapshot_format_unsupported`).
    #[error("{0}")]
    Meta(#[from] MetaError),
    /// Writing a snapshot's parts or committing it failed (the reason is
    /// the snapshot's): 500 `snapshot_write_failed`.
    #[error("{0}")]
    WriteFailed(String),
    /// A blocking worker panicked or was cancelled: 500 `worker_failed`.
    #[error("a worker failed: {0}")]
    Worker(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The object store (an outage: 503 `store_unavailable`; a part
    /// missing: 500 `snapshot_part_missing`).
    #[error(transparent)]
    Objects(#[from] crate::objstore::StoreError),
    #[error("snapshot files: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    NoSpace(#[from] disk::NoSpace),
}

/// How a snapshot ended, for those waiting on it.
#[derive(Debug, Clone)]
pub enum Finished {
    Complete,
    Failed(String),
}

/// The snapshot service: the shared context and the snapshot registry.
pub struct SnapshotService {
    ctx: Context,
    /// Snapshots being written, compare results, progress of derived jobs.
    pub pending: Snapshots,
}

/// How the snapshot service is held.
pub type Snaps = Arc<SnapshotService>;

impl SnapshotService {
    pub fn new(ctx: Context) -> Snaps {
        Arc::new(SnapshotService {
            pending: Snapshots::new(ctx.args.data_dir.clone()),
            ctx,
        })
    }
}

impl std::ops::Deref for SnapshotService {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.ctx
    }
}

/// Starts the task that writes what the engines capture, and the ticker
/// that fails late snapshots and takes periodic state snapshots.
pub fn spawn_tasks(
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
