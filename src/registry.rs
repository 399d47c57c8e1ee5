//! The run registry: every run the server holds, its ranks' summaries and
//! the engine of each device. What services and handlers look runs up in;
//! no tensor lives here (the engines own them).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};

use prometheus::IntGauge;
use sha2::{Digest, Sha256};

use crate::clock::now_ms;
use crate::contract::NodeStatus;
use crate::engine::capture::{CaptureEvent, RestoredRank};
use crate::engine::rank::RankLayout;
use crate::engine::shared::RunShared;
use crate::engine::spread::RunEngines;
use crate::engine::{device, EngineError, EngineHandle, FinishedAt};
pub use crate::node::{Failover, Owner};
use crate::run::RunConfig;
use crate::snapshot::meta;
use crate::store::nodes::NodeRow;
use crate::store::placement::Placed;
use crate::store::{RunFinish, Store, StoreError, StoredRank, StoredRun};

/// sha256 hex of a token; only hashes are stored.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// What the server knows of a rank without asking the engine.
#[derive(Debug, Clone, Default)]
pub struct RankSummary {
    pub last_step: Option<u64>,
    pub pushes: u64,
    pub duplicates: u64,
    pub bytes_received: u64,
    pub rejections: u64,
    pub resident_bytes: u64,
    pub last_push_at_ms: Option<i64>,
    pub last_apply_seconds: Option<f64>,
    /// The registered layout (JSON), once the rank pushed.
    pub layout: Option<Arc<serde_json::Value>>,
    /// Number of tensors and elements in the layout.
    pub tensors: usize,
    pub numel: u64,
    /// The rank's EMA is held by the engine (false after a restart until
    /// the rank pushes again or its state is restored).
    pub live: bool,
    /// Exponentially weighted mean of push latency (request start to answer).
    pub push_seconds_ewma: Option<f64>,
    /// Recent pushes `(at_ms, bytes)`, for the rank's throughput.
    pub recent: std::collections::VecDeque<(i64, u64)>,
    /// Latest drift sample per profile: `(||EMA - online||^2, ||online||^2)`.
    pub drift: BTreeMap<String, (f64, f64)>,
    /// The step of that sample.
    pub drift_step: Option<u64>,
    /// Wire bytes against logical bytes, codec time.
    pub wire: crate::wire::stats::WireStats,
    /// The rank's last failover, when its node was ever lost.
    pub failover: Option<Failover>,
}

/// Milliseconds without a push after which a rank counts as stale, at
/// least (see [`RankSummary::stale_after_ms`]).
pub const STALE_AFTER_MS: i64 = 60_000;

/// Locks run names are hashed over (creation and deletion are rare).
const NAME_LOCKS: usize = 64;

/// Pushes remembered per rank for its throughput.
const RECENT_PUSHES: usize = 32;

impl RankSummary {
    /// Records an applied push's size and latency.
    pub fn note_push(&mut self, bytes: u64, seconds: f64) {
        let now = now_ms();
        self.push_seconds_ewma = Some(match self.push_seconds_ewma {
            None => seconds,
            Some(prev) => 0.8 * prev + 0.2 * seconds,
        });
        if self.recent.len() == RECENT_PUSHES {
            self.recent.pop_front();
        }
        self.recent.push_back((now, bytes));
    }

    /// Milliseconds without a push after which this rank counts as stale:
    /// [`STALE_AFTER_MS`], or three times its usual interval between pushes
    /// (the median over the remembered ones) when that is longer, so a run
    /// that pushes every few minutes is not shown stale between pushes.
    pub fn stale_after_ms(&self) -> i64 {
        let times: Vec<i64> = self.recent.iter().map(|(t, _)| *t).collect();
        if times.len() < 3 {
            return STALE_AFTER_MS;
        }
        let mut gaps: Vec<i64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        gaps.sort_unstable();
        STALE_AFTER_MS.max(3 * gaps[gaps.len() / 2])
    }

    /// Bytes per second over the remembered pushes.
    pub fn bytes_per_second(&self) -> Option<f64> {
        let (first, _) = *self.recent.front()?;
        let (last, _) = *self.recent.back()?;
        if self.recent.len() < 2 || last <= first {
            return None;
        }
        let bytes: u64 = self.recent.iter().skip(1).map(|(_, b)| b).sum();
        Some(bytes as f64 / ((last - first) as f64 / 1000.0))
    }
}

impl RankSummary {
    pub fn from_stored(row: StoredRank) -> Self {
        // The catalog keeps the layout in the stored format; the summary
        // holds the view the API shows (as a live push leaves it).
        let layout = row.layout.and_then(|v| match meta::decode_layout(&v) {
            Ok(layout) => serde_json::to_value(&layout).ok(),
            Err(e) => {
                tracing::warn!(rank = row.rank, error = %e, "a rank's stored layout is unreadable");
                None
            }
        });
        let (tensors, numel) = layout.as_ref().map(layout_counts).unwrap_or_default();
        RankSummary {
            last_step: row.last_step,
            pushes: row.pushes,
            duplicates: 0,
            bytes_received: row.bytes_received,
            rejections: row.rejections,
            resident_bytes: 0,
            last_push_at_ms: row.last_push_at_ms,
            last_apply_seconds: None,
            layout: layout.map(Arc::new),
            tensors,
            numel,
            live: false,
            failover: row.failover.and_then(|f| serde_json::from_value(f).ok()),
            wire: row
                .wire
                .and_then(|w| serde_json::from_value(w).ok())
                .unwrap_or_default(),
            ..Default::default()
        }
    }

    pub fn to_row(&self, rank: u32) -> StoredRank {
        StoredRank {
            rank,
            layout: None,
            last_step: self.last_step,
            pushes: self.pushes,
            bytes_received: self.bytes_received,
            rejections: self.rejections,
            resident_bytes: self.resident_bytes,
            last_push_at_ms: self.last_push_at_ms,
            failover: None,
            wire: serde_json::to_value(&self.wire).ok(),
        }
    }
}

fn layout_counts(layout: &serde_json::Value) -> (usize, u64) {
    let tensors = layout["tensors"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let numel = tensors.iter().filter_map(|t| t["numel"].as_u64()).sum();
    (tensors.len(), numel)
}

/// Token hashes of a run (auth on).
#[derive(Debug, Clone)]
pub struct RunTokens {
    pub write_hash: String,
    pub read_hash: String,
}

/// Pushes since the last ingest sample of a run.
#[derive(Debug, Default, Clone, Copy)]
pub struct IngestWindow {
    pub pushes: u64,
    pub bytes: u64,
    pub seconds: f64,
}

/// A run as services and handlers see it.
pub struct RunHandle {
    pub config: Arc<RunConfig>,
    pub created_at_ms: i64,
    /// The engines holding the ranks this node owns.
    pub engines: RunEngines,
    /// Per rank, the node that owns it (this one or another).
    pub placement: RwLock<Vec<Owner>>,
    pub tokens: Option<RunTokens>,
    pub ranks: Vec<Mutex<RankSummary>>,
    /// Ingest since the last sample (see `monitor`).
    pub ingest: Mutex<IngestWindow>,
    /// Tags, note and alert rules (editable while the run lives).
    pub meta: Mutex<crate::store::meta::RunMeta>,
    /// Alerts firing now (kept by `alerts`).
    pub alerts_firing: std::sync::atomic::AtomicUsize,
    /// Set once the run is finished (`POST .../finish`).
    pub finished: Mutex<Option<RunFinish>>,
    /// Set when the run leaves the registry (deleted): a request or job
    /// still holding the handle then knows its failures come from that.
    pub deleted: std::sync::atomic::AtomicBool,
}

impl RunHandle {
    pub fn rank(&self, rank: u32) -> Option<RankSummary> {
        self.ranks
            .get(rank as usize)
            .map(|r| r.lock().expect("rank summary lock").clone())
    }

    /// Reads one field of a rank's summary without copying the summary.
    pub fn rank_with<R>(&self, rank: u32, f: impl FnOnce(&RankSummary) -> R) -> Option<R> {
        self.ranks
            .get(rank as usize)
            .map(|r| f(&r.lock().expect("rank summary lock")))
    }

    /// Updates a rank's summary and returns the new value.
    pub fn update_rank(&self, rank: u32, f: impl FnOnce(&mut RankSummary)) -> RankSummary {
        let mut guard = self.ranks[rank as usize].lock().expect("rank summary lock");
        f(&mut guard);
        guard.clone()
    }

    /// Who owns `rank`.
    pub fn owner(&self, rank: u32) -> Option<Owner> {
        self.placement
            .read()
            .expect("placement lock")
            .get(rank as usize)
            .cloned()
    }

    /// Every rank's owner.
    pub fn owners(&self) -> Vec<Owner> {
        self.placement.read().expect("placement lock").clone()
    }

    /// Whether this node holds `rank` (its EMA lives on an engine here).
    pub fn holds(&self, rank: u32) -> bool {
        self.engines.holds(rank)
    }

    /// The ranks this node holds.
    pub fn held_ranks(&self) -> Vec<u32> {
        (0..self.config.world_size)
            .filter(|&r| self.holds(r))
            .collect()
    }

    /// Whether other nodes hold some of the run's ranks.
    pub fn is_spread(&self) -> bool {
        (0..self.config.world_size).any(|r| !self.holds(r))
    }

    pub fn finished(&self) -> Option<RunFinish> {
        self.finished.lock().expect("run finish lock").clone()
    }

    /// Whether the run was deleted (removed from the registry).
    pub fn is_deleted(&self) -> bool {
        self.deleted.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Bytes the ranks this node holds keep resident (what its cuts and
    /// state snapshots write).
    pub fn resident_bytes(&self) -> u64 {
        self.ranks
            .iter()
            .enumerate()
            .filter(|(r, _)| self.holds(*r as u32))
            .map(|(_, s)| s.lock().expect("rank summary lock").resident_bytes)
            .sum()
    }
}

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

    /// Loads every run of the catalog, with the ranks this node owns on its
    /// engines (taking those never placed, or placed on a node that is
    /// gone: see [`Self::settle_placement`]).
    pub async fn load(&self, store: &Store) -> Result<(), StoreError> {
        let nodes = store.list_nodes().await?;
        for stored in store.list_runs().await? {
            self.load_run(store, &nodes, stored).await?;
        }
        for (name, meta) in store.run_metas().await? {
            if let Some(run) = self.run(&name) {
                *run.meta.lock().expect("meta lock") = meta;
            }
        }
        Ok(())
    }

    /// Installs one stored run; `None` when its engine refused it.
    pub async fn load_run(
        &self,
        store: &Store,
        nodes: &[NodeRow],
        stored: StoredRun,
    ) -> Result<Option<Arc<RunHandle>>, StoreError> {
        let ranks = store.list_ranks(&stored.config.name).await?;
        let name = stored.config.name.clone();
        let owners = self
            .settle_placement(store, nodes, &name, stored.config.world_size)
            .await?;
        let tokens =
            stored
                .write_token_hash
                .zip(stored.read_token_hash)
                .map(|(write_hash, read_hash)| RunTokens {
                    write_hash,
                    read_hash,
                });
        let mut config = stored.config;
        if let Err(e) = self.device_for(&config.device) {
            tracing::error!(run = %name, device = %config.device, "{e}; the run moves to the CPU");
            config.device = "cpu".into();
        }
        let handle = self
            .install_run(
                Arc::new(config),
                stored.created_at_ms,
                tokens,
                ranks,
                owners,
            )
            .await;
        match handle {
            Ok(handle) => {
                if let Some(finish) = stored.finished {
                    let at = FinishedAt(finish.step);
                    handle.engines.shared().set_finished(Some(at));
                    *handle.finished.lock().expect("run finish lock") = Some(finish);
                }
                self.record_engines(store, &handle).await;
                Ok(Some(handle))
            }
            Err(_) => {
                tracing::error!(run = %name, "the engine refused the run");
                Ok(None)
            }
        }
    }

    /// Records in the catalog which engine holds each of this node's ranks
    /// of `run` (what placement answers on every node).
    pub async fn record_engines(&self, store: &Store, run: &RunHandle) {
        let labels = run.engines.labels();
        let engines: Vec<(u32, String)> = labels
            .iter()
            .enumerate()
            .filter_map(|(r, l)| l.clone().map(|l| (r as u32, l)))
            .collect();
        if engines.is_empty() {
            return;
        }
        if let Err(e) = store
            .set_rank_engines(&run.config.name, &self.node_id, &engines)
            .await
        {
            tracing::warn!(run = %run.config.name, error = %e, "recording the ranks' engines failed");
        }
    }

    /// The owner of every rank of `run`, as the catalog records them, after
    /// this node took the ranks nobody may hold: ranks never placed (a run
    /// from before placement), and ranks of a node that left or whose lease
    /// expired. Each is taken at its epoch plus one, only if no other node
    /// took it first.
    pub async fn settle_placement(
        &self,
        store: &Store,
        nodes: &[NodeRow],
        run: &str,
        world_size: u32,
    ) -> Result<Vec<Owner>, StoreError> {
        let mut placed: Vec<Option<Placed>> = vec![None; world_size as usize];
        for p in store.placement(run).await? {
            if let Some(slot) = placed.get_mut(p.rank as usize) {
                *slot = Some(p);
            }
        }
        let live = |id: &str| {
            id == self.node_id
                || nodes
                    .iter()
                    .any(|n| n.info.node_id == id && n.status == NodeStatus::Live)
        };
        let orphans: Vec<(u32, Option<u64>)> = placed
            .iter()
            .enumerate()
            .filter_map(|(r, p)| match p {
                None => Some((r as u32, None)),
                Some(p) if !live(&p.node_id) => Some((r as u32, Some(p.epoch))),
                Some(_) => None,
            })
            .collect();
        if !orphans.is_empty() {
            let won = store
                .claim_ranks(run, &self.node_id, &orphans, now_ms())
                .await?;
            if !won.is_empty() {
                tracing::info!(run, ranks = ?won.iter().map(|p| p.rank).collect::<Vec<_>>(),
                    "took the ranks of a node that is gone");
            }
            // Whoever won, the catalog says who holds them now.
            placed = vec![None; world_size as usize];
            for p in store.placement(run).await? {
                if let Some(slot) = placed.get_mut(p.rank as usize) {
                    *slot = Some(p);
                }
            }
        }
        Ok(placed
            .into_iter()
            .map(|p| match p {
                Some(p) => self.owner_of(nodes, p),
                // Placed by nobody even now (the catalog refused the claim):
                // held here, so the rank is served.
                None => self.me(1),
            })
            .collect())
    }

    /// A placement row as an owner, with the node's URL.
    fn owner_of(&self, nodes: &[NodeRow], p: Placed) -> Owner {
        let url = if p.node_id == self.node_id {
            self.node_url.clone()
        } else {
            nodes
                .iter()
                .find(|n| n.info.node_id == p.node_id)
                .map(|n| n.info.url.clone())
                .unwrap_or_default()
        };
        Owner {
            node_id: p.node_id,
            url,
            epoch: p.epoch,
            engine: p.engine,
        }
    }

    /// The engines of a run's device, as (label, device): one per GPU of
    /// `--devices` for `cuda`, `--engines` threads on the CPU.
    fn labels_of(&self, device_name: &str) -> Result<Vec<(String, tch::Device)>, String> {
        device::engines_of(device_name, &self.gpus, self.cpu_engines)
    }

    /// Places a run's ranks on the engines of its device, balanced by the
    /// ranks each engine already holds (ties: the first), starting the
    /// engines on first use. Returns the engines the run uses and, per
    /// rank, its index among them.
    fn place(
        &self,
        device_name: &str,
        world_size: u32,
        owned: &[bool],
    ) -> std::io::Result<(Vec<EngineHandle>, Vec<Option<usize>>)> {
        let engines_of = self
            .labels_of(device_name)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let cpu_engines = engines_of
            .iter()
            .filter(|(_, d)| *d == tch::Device::Cpu)
            .count();
        let labels: Vec<String> = engines_of.iter().map(|(l, _)| l.clone()).collect();
        let mut engines = self.engines.lock().expect("engines lock");
        for (label, device) in engines_of {
            // Engines sharing the CPU share its cores: each apply is split
            // over its share, so engines side by side do not oversubscribe.
            let kernel_threads = match device {
                tch::Device::Cpu if cpu_engines > 1 => {
                    (tch::get_num_threads().max(1) as usize / cpu_engines).max(1)
                }
                _ => 0,
            };
            if !engines.contains_key(&label) {
                let engine = EngineHandle::start(
                    device,
                    &label,
                    kernel_threads,
                    self.engine_queue_depth,
                    self.captures.clone(),
                    self.periodic_backlog,
                )?;
                engines.insert(label.clone(), (engine, 0));
            }
        }
        let mut used: Vec<String> = Vec::new();
        let mut by_rank = Vec::with_capacity(world_size as usize);
        for rank in 0..world_size as usize {
            if !owned.get(rank).copied().unwrap_or(false) {
                by_rank.push(None);
                continue;
            }
            let label = labels
                .iter()
                .min_by_key(|l| engines[l.as_str()].1)
                .expect("a device has an engine");
            engines.get_mut(label.as_str()).expect("engine").1 += 1;
            let i = match used.iter().position(|u| u == label) {
                Some(i) => i,
                None => {
                    used.push(label.clone());
                    used.len() - 1
                }
            };
            by_rank.push(Some(i));
        }
        let handles = used.iter().map(|l| engines[l.as_str()].0.clone()).collect();
        Ok((handles, by_rank))
    }

    /// Ranks of `run` this node took over at `epoch` (their node is gone):
    /// each goes to the least loaded engine of the run's device, restored
    /// from `ranks`' state (or empty), and this node is their owner from now.
    pub async fn adopt_ranks(
        &self,
        run: &RunHandle,
        ranks: Vec<(u32, Option<RestoredRank>)>,
        epoch_of: &BTreeMap<u32, u64>,
    ) -> Result<(), EngineError> {
        type Part = Vec<(u32, Option<RestoredRank>)>;
        let mut per_engine: Vec<(EngineHandle, Part)> = Vec::new();
        for (rank, restored) in ranks {
            let (handle, _) = self
                .place(&run.config.device, 1, &[true])
                .map_err(|_| EngineError::Stopped)?;
            let handle = handle.into_iter().next().ok_or(EngineError::Stopped)?;
            match per_engine
                .iter_mut()
                .find(|(h, _)| h.label() == handle.label())
            {
                Some((_, part)) => part.push((rank, restored)),
                None => per_engine.push((handle, vec![(rank, restored)])),
            }
        }
        for (handle, part) in per_engine {
            let label = handle.label().to_string();
            let taken: Vec<u32> = part.iter().map(|(r, _)| *r).collect();
            run.engines.adopt(run.config.clone(), handle, part).await?;
            let mut owners = run.placement.write().expect("placement lock");
            for rank in taken {
                if let Some(slot) = owners.get_mut(rank as usize) {
                    let mut me = self.me(epoch_of.get(&rank).copied().unwrap_or(1));
                    me.engine = Some(label.clone());
                    *slot = me;
                }
            }
        }
        Ok(())
    }

    /// Ranks of `run` another node holds now (it took them over while this
    /// node was cut off): freed here, so pushes for them go to the owner.
    pub async fn release_ranks(&self, run: &RunHandle, ranks: &[u32]) {
        let freed = run.engines.release(&run.config.name, ranks).await;
        let mut engines = self.engines.lock().expect("engines lock");
        for label in freed {
            if let Some((_, held)) = engines.get_mut(&label) {
                *held = held.saturating_sub(1);
            }
        }
    }

    /// Gives back the ranks a run held on its engines (the run is gone).
    fn unplace(&self, run: &RunHandle) {
        let mut engines = self.engines.lock().expect("engines lock");
        for label in run.engines.labels().into_iter().flatten() {
            if let Some((_, held)) = engines.get_mut(&label) {
                *held = held.saturating_sub(1);
            }
        }
    }

    /// The engines this server runs or would start for its default device,
    /// and any other it started (`cpu#0`, `cuda:1`, ...), sorted.
    pub fn engine_labels(&self) -> Vec<String> {
        let mut labels: Vec<String> = self
            .labels_of(&self.default_device)
            .map(|e| e.into_iter().map(|(l, _)| l).collect())
            .unwrap_or_default();
        for engine in self.engines() {
            if !labels.iter().any(|l| l == engine.label()) {
                labels.push(engine.label().to_string());
            }
        }
        labels.sort();
        labels
    }

    pub fn engines(&self) -> Vec<EngineHandle> {
        let engines = self.engines.lock().expect("engines lock");
        let mut out: Vec<_> = engines.values().map(|(e, _)| e.clone()).collect();
        out.sort_by(|a, b| a.label().cmp(b.label()));
        out
    }

    /// Registers a run in the registry, with the ranks `owners` gives this
    /// node on its engines.
    pub async fn install_run(
        &self,
        config: Arc<RunConfig>,
        created_at_ms: i64,
        tokens: Option<RunTokens>,
        stored_ranks: Vec<StoredRank>,
        owners: Vec<Owner>,
    ) -> Result<Arc<RunHandle>, EngineError> {
        let owned: Vec<bool> = owners.iter().map(|o| o.node_id == self.node_id).collect();
        let (handles, by_rank) = self
            .place(&config.device, config.world_size, &owned)
            .map_err(|_| EngineError::Stopped)?;
        let shared = if owned.iter().all(|&o| o) {
            RunShared::new(config.world_size)
        } else {
            RunShared::spread(config.world_size, &config.name, created_at_ms)
        };
        let engines = RunEngines::new(handles, by_rank, shared);
        for (i, engine) in engines.all().iter().enumerate() {
            let (for_engine, owned) = (config.clone(), engines.ranks_of(i));
            let shared = engines.shared().clone();
            engine.add_run(for_engine, owned, shared).await?;
        }
        let mut ranks: Vec<RankSummary> = (0..config.world_size)
            .map(|_| RankSummary::default())
            .collect();
        for row in stored_ranks {
            if let Some(slot) = ranks.get_mut(row.rank as usize) {
                *slot = RankSummary::from_stored(row);
            }
        }
        let mut owners = owners;
        for (rank, label) in engines.labels().iter().enumerate() {
            if let (Some(owner), Some(label)) = (owners.get_mut(rank), label) {
                owner.engine = Some(label.clone());
            }
        }
        let handle = Arc::new(RunHandle {
            config: config.clone(),
            created_at_ms,
            engines,
            placement: RwLock::new(owners),
            tokens,
            ranks: ranks.into_iter().map(Mutex::new).collect(),
            ingest: Mutex::new(IngestWindow::default()),
            meta: Mutex::new(crate::store::meta::RunMeta::default()),
            alerts_firing: Default::default(),
            finished: Mutex::new(None),
            deleted: Default::default(),
        });
        let mut runs = self.runs.write().expect("runs lock");
        runs.insert(config.name.clone(), handle.clone());
        self.runs_gauge.set(runs.len() as i64);
        Ok(handle)
    }

    /// Every run, for the periodic jobs that visit them all.
    pub fn all_runs(&self) -> Vec<Arc<RunHandle>> {
        self.runs
            .read()
            .expect("runs lock")
            .values()
            .cloned()
            .collect()
    }

    pub fn len(&self) -> usize {
        self.runs.read().expect("runs lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn run(&self, name: &str) -> Option<Arc<RunHandle>> {
        self.runs.read().expect("runs lock").get(name).cloned()
    }

    /// Whether some run holds this token hash (read or write).
    pub fn token_known(&self, hash: &str) -> bool {
        self.runs.read().expect("runs lock").values().any(|r| {
            r.tokens
                .as_ref()
                .is_some_and(|t| t.read_hash == hash || t.write_hash == hash)
        })
    }

    pub fn remove_run(&self, name: &str) -> Option<Arc<RunHandle>> {
        let mut runs = self.runs.write().expect("runs lock");
        let removed = runs.remove(name);
        self.runs_gauge.set(runs.len() as i64);
        drop(runs);
        if let Some(run) = &removed {
            run.deleted
                .store(true, std::sync::atomic::Ordering::Release);
            self.unplace(run);
        }
        removed
    }
}

/// Counts of a freshly registered layout.
pub fn counts_of(layout: &RankLayout) -> (usize, u64) {
    (
        layout.tensors.len(),
        layout.tensors.iter().map(|t| t.numel as u64).sum(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pushed_at(times: &[i64]) -> RankSummary {
        RankSummary {
            recent: times.iter().map(|&t| (t, 1)).collect(),
            ..RankSummary::default()
        }
    }

    #[test]
    fn a_failover_counts_the_update_steps_between_restore_and_resume() {
        let taken = |restored| Failover {
            from_node: "b".into(),
            epoch: 2,
            at_ms: 0,
            snapshot: None,
            restored_step: restored,
            last_seen_step: None,
            resumed_step: None,
            lost_steps: None,
        };
        let lost = |restored, step, every| {
            let mut f = taken(restored);
            f.resumed_at(step, every);
            assert_eq!(f.resumed_step, Some(step));
            f.lost_steps.unwrap()
        };
        // Every step updates: 10..=14 lost between 9 and 15.
        assert_eq!(lost(Some(9), 15, 1), 5);
        // Nothing lost: the next step is the one after the restored one.
        assert_eq!(lost(Some(14), 15, 1), 0);
        // Every 5th step: the update steps after 5 and before the push ...
        assert_eq!(lost(Some(5), 20, 5), 2); // 10, 15
        assert_eq!(lost(Some(5), 10, 5), 0);
        // ... and a resume off the update grid counts those before it.
        assert_eq!(lost(Some(5), 17, 5), 2); // 10, 15
                                             // No snapshot held the rank: every update step before the push.
        assert_eq!(lost(None, 7, 1), 7);
        assert_eq!(lost(None, 0, 1), 0);
        assert_eq!(lost(None, 12, 5), 3); // 0, 5, 10
    }

    #[test]
    fn stale_after_follows_the_usual_push_interval() {
        // Too few pushes to tell, or frequent pushes: the floor.
        assert_eq!(pushed_at(&[0, 300_000]).stale_after_ms(), STALE_AFTER_MS);
        assert_eq!(
            pushed_at(&[0, 1_000, 2_000, 3_000]).stale_after_ms(),
            STALE_AFTER_MS
        );
        // Every five minutes, with one long pause: three median intervals.
        let rare = pushed_at(&[0, 300_000, 600_000, 4_000_000, 4_300_000]);
        assert_eq!(rare.stale_after_ms(), 3 * 300_000);
    }
}
