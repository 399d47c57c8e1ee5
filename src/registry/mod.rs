//! The run registry: every run the server holds, its ranks' summaries and
//! the engine of each device. What services and handlers look runs up in;
//! no tensor lives here (the engines own them).
//!
//! Layout: `summary` (what a rank's pushes left: [`RankSummary`]), `handle`
//! (a run as services see it: [`RunHandle`]), `runs` (the run table:
//! install, look up, remove), `load` (the catalog's runs at start),
//! `placement` (who owns each rank), `engines` (ranks placed on the
//! engines of a device), `failover` (ranks taken over or given up).

mod engines;
mod failover;
mod handle;
mod load;
mod placement;
mod runs;
mod summary;

pub use handle::{token_hash, IngestWindow, RunHandle, RunTokens};
pub use summary::{counts_of, RankSummary, STALE_AFTER_MS};

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};

use prometheus::IntGauge;

use crate::engine::capture::CaptureEvent;
use crate::engine::{device, EngineHandle};
pub use crate::node::{Failover, Owner};

/// Locks run names are hashed over (creation and deletion are rare).
const NAME_LOCKS: usize = 64;

/// Every run, by name, and the engines of each device.
pub struct Registry {
    runs: RwLock<BTreeMap<String, Arc<RunHandle>>>,
    /// By label (`cpu#0`, `cuda:1`), with the ranks each holds.
    engines: Mutex<HashMap<String, (EngineHandle, usize)>>,
    /// Engine threads a CPU run's ranks are spread over (`--engines`).
    cpu_engines: usize,
    /// Creating and deleting a run take its name's lock (names hashed over
    /// a few locks): a delete never frees the engines, files or alerts of
    /// a run of the same name created while it ran.
    name_locks: [tokio::sync::Mutex<()>; NAME_LOCKS],
    /// The device new runs get when they do not name one (`cpu`, `cuda`
    /// or `cuda:N`).
    default_device: String,
    /// This node's GPUs (`--devices`), one engine each.
    gpus: Vec<tch::Device>,
    /// How engines are started: queue depth, periodic-capture backlog, and
    /// where they send their captures.
    engine_queue_depth: usize,
    periodic_backlog: u64,
    captures: tokio::sync::mpsc::UnboundedSender<CaptureEvent>,
    /// The `polyak_runs` gauge, kept equal to the number of runs.
    runs_gauge: IntGauge,
    /// This node's id and URL, as placement names them.
    node_id: String,
    node_url: String,
}

impl Registry {
    pub fn new(
        (default_device, gpus): (String, Vec<tch::Device>),
        cpu_engines: usize,
        engine_queue_depth: usize,
        periodic_backlog: u64,
        captures: tokio::sync::mpsc::UnboundedSender<CaptureEvent>,
        runs_gauge: IntGauge,
        (node_id, node_url): (String, String),
    ) -> Self {
        Registry {
            runs: RwLock::new(BTreeMap::new()),
            engines: Mutex::new(HashMap::new()),
            cpu_engines: cpu_engines.max(1),
            name_locks: std::array::from_fn(|_| tokio::sync::Mutex::new(())),
            default_device,
            gpus,
            engine_queue_depth,
            periodic_backlog,
            captures,
            runs_gauge,
            node_id,
            node_url,
        }
    }

    /// Holds `name`'s lock (see `name_locks`) until the guard drops.
    pub async fn lock_name(&self, name: &str) -> tokio::sync::MutexGuard<'_, ()> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        name.hash(&mut h);
        self.name_locks[h.finish() as usize % NAME_LOCKS]
            .lock()
            .await
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// This node as the owner of a rank it takes at `epoch`.
    pub fn me(&self, epoch: u64) -> Owner {
        Owner {
            node_id: self.node_id.clone(),
            url: self.node_url.clone(),
            epoch,
            engine: None,
        }
    }

    /// The device new runs get when they do not name one.
    pub fn default_device(&self) -> &str {
        &self.default_device
    }

    /// The canonical device of a run asking for `request` (see
    /// [`device::canonical`]), or why this node cannot hold it.
    pub fn device_for(&self, request: &str) -> Result<String, String> {
        device::canonical(request, &self.gpus)
    }
}
