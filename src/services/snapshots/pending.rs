//! The snapshot registry: snapshots being captured and written, who
//! waits on them, compare results, derived-job progress, failures the
//! catalog did not take yet. Its maps are private: the methods here are the
//! only code that takes their locks, each one complete operation under
//! one lock, never held across an await.

#[allow(unused_imports)]
use super::*;

/// A snapshot being captured and written.
pub(super) struct Pending {
    pub(super) run: String,
    pub(super) kind: SnapshotKind,
    /// Ranks of this node whose files must be written before its part is
    /// recorded.
    pub(super) expected: BTreeSet<u32>,
    /// Ranks with files the snapshot needs in all (other nodes write the
    /// ranks they hold): it completes when the catalog has that many.
    pub(super) needed: u32,
    pub(super) written: Vec<FileRow>,
    pub(super) writing: BTreeSet<u32>,
    pub(super) deadline: Option<Instant>,
    pub(super) waiters: Vec<oneshot::Sender<Finished>>,
    /// A periodic cut's share of its run's backlog, given back when this
    /// entry is dropped (complete, failed or deleted).
    pub(super) _backlog: Option<Backlog>,
}

/// What [`Snapshots::rank_written`] found.
pub(super) enum RankWritten {
    /// The snapshot failed or was deleted meanwhile: nothing will list
    /// these files.
    Gone(Vec<FileRow>),
    /// Other ranks are still to come.
    More,
    /// That was the last rank: the snapshot, out of the registry.
    Last(Pending),
}

/// Bytes per second below which a state write's rate is not believed (see
/// [`Snapshots::state_write_cost`]).
const STATE_RATE_FLOOR: f64 = 64.0 * 1024.0 * 1024.0;

/// The snapshot registry: what is being written and who waits on it.
pub struct Snapshots {
    pub(super) data_dir: PathBuf,
    pending: Mutex<HashMap<String, Pending>>,
    compare_cache: Mutex<HashMap<String, Arc<CompareResult>>>,
    /// When each run's last state snapshot was attempted.
    last_state: Mutex<HashMap<String, Instant>>,
    /// Per run, the fastest its `state` writes went (bytes per second):
    /// what a write costs the machine, which a store that hung for a while
    /// (time spent waiting, not working) does not change.
    state_rates: Mutex<HashMap<String, f64>>,
    /// Per `state` snapshot being written, the CPU time its writing
    /// threads took so far (see [`Snapshots::add_write_cpu`]).
    write_cpu: Mutex<HashMap<String, Duration>>,
    /// Per run, held while one of its state snapshots is captured and
    /// written: at most one in flight.
    state_writers: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Per run, held while it is being finished: concurrent finishes take
    /// one final snapshot, and the later ones answer with it.
    finishers: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Derived snapshots being written: how far along.
    progress: Mutex<HashMap<String, derived::Progress>>,
    /// Failures the catalog did not take yet (`id -> reason`), retried by
    /// the ticker: a failed snapshot must never read `pending` forever.
    unrecorded: Mutex<HashMap<String, String>>,
}

impl Snapshots {
    pub fn new(data_dir: PathBuf) -> Self {
        Snapshots {
            data_dir,
            pending: Mutex::new(HashMap::new()),
            compare_cache: Mutex::new(HashMap::new()),
            last_state: Mutex::new(HashMap::new()),
            state_rates: Mutex::new(HashMap::new()),
            write_cpu: Mutex::new(HashMap::new()),
            state_writers: Mutex::new(HashMap::new()),
            finishers: Mutex::new(HashMap::new()),
            progress: Mutex::new(HashMap::new()),
            unrecorded: Mutex::new(HashMap::new()),
        }
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub(super) fn register(
        &self,
        id: &str,
        run: &str,
        kind: SnapshotKind,
        (expected, needed): (BTreeSet<u32>, u32),
        deadline: Option<Instant>,
        backlog: Option<Backlog>,
    ) {
        self.pending.lock().expect("pending lock").insert(
            id.to_string(),
            Pending {
                run: run.to_string(),
                kind,
                expected,
                needed,
                written: Vec::new(),
                writing: BTreeSet::new(),
                deadline,
                waiters: Vec::new(),
                _backlog: backlog,
            },
        );
    }

    /// Waits until a snapshot completes or fails (or `timeout`).
    pub async fn wait(&self, id: &str, timeout: Duration) -> Option<Finished> {
        let rx = self.waiter(id)?;
        tokio::time::timeout(timeout, rx).await.ok()?.ok()
    }

    /// A receiver told how a pending snapshot ends; `None` when it is not
    /// pending (any more).
    pub(super) fn waiter(&self, id: &str) -> Option<oneshot::Receiver<Finished>> {
        let mut pending = self.pending.lock().expect("pending lock");
        let entry = pending.get_mut(id)?;
        let (tx, rx) = oneshot::channel();
        entry.waiters.push(tx);
        Some(rx)
    }

    pub(super) fn is_pending(&self, id: &str) -> bool {
        self.pending.lock().expect("pending lock").contains_key(id)
    }

    /// The pending snapshots of `run`.
    pub(super) fn pending_of(&self, run: &str) -> Vec<String> {
        self.pending
            .lock()
            .expect("pending lock")
            .iter()
            .filter(|(_, p)| p.run == run)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Takes a snapshot out of the registry (it failed, or was never
    /// scheduled): whoever gets it settles its waiters.
    pub(super) fn take(&self, id: &str) -> Option<Pending> {
        self.pending.lock().expect("pending lock").remove(id)
    }

    /// Marks `rank` of `id` as being written; `false` when the snapshot is
    /// no longer pending (failed or deleted meanwhile).
    pub(super) fn start_writing(&self, id: &str, rank: u32) -> bool {
        match self.pending.lock().expect("pending lock").get_mut(id) {
            Some(p) => {
                p.writing.insert(rank);
                true
            }
            None => false,
        }
    }

    /// Records `rank`'s written files; when it was the last rank, takes the
    /// snapshot out of the registry to be completed.
    pub(super) fn rank_written(&self, id: &str, rank: u32, rows: Vec<FileRow>) -> RankWritten {
        let mut pending = self.pending.lock().expect("pending lock");
        let Some(p) = pending.get_mut(id) else {
            return RankWritten::Gone(rows);
        };
        p.writing.remove(&rank);
        p.expected.remove(&rank);
        p.written.extend(rows);
        if p.expected.is_empty() && p.writing.is_empty() {
            RankWritten::Last(pending.remove(id).expect("present"))
        } else {
            RankWritten::More
        }
    }

    /// Snapshots past their deadline with no rank being written, and the
    /// ranks they still miss.
    pub(super) fn late(&self, now: Instant) -> Vec<(String, Vec<u32>)> {
        self.pending
            .lock()
            .expect("pending lock")
            .iter()
            .filter(|(_, p)| p.deadline.is_some_and(|d| d <= now) && p.writing.is_empty())
            .map(|(id, p)| (id.clone(), p.expected.iter().copied().collect()))
            .collect()
    }

    /// Sets when `run`'s last state snapshot was attempted.
    pub(super) fn set_state_attempt(&self, run: &str, at: Instant) {
        self.last_state
            .lock()
            .expect("state lock")
            .insert(run.to_string(), at);
    }

    /// A `state` write of `run` moved `bytes` in `took`: how long a write
    /// of that size takes at the fastest rate seen for the run (the work
    /// it costs; a slow store's waits are not counted), and never slower
    /// than [`STATE_RATE_FLOOR`]: a small state's write is all latency
    /// (a round trip, an fsync), which costs the machine nothing to wait on.
    pub(super) fn state_write_cost(&self, run: &str, bytes: u64, took: Duration) -> Duration {
        let rate = bytes as f64 / took.as_secs_f64().max(1e-6);
        let mut rates = self.state_rates.lock().expect("state lock");
        let best = rates.entry(run.to_string()).or_insert(rate);
        *best = best.max(rate);
        Duration::from_secs_f64(bytes as f64 / best.max(STATE_RATE_FLOOR))
    }

    /// Starts counting the CPU time the writes of snapshot `id` take (a
    /// `state` snapshot: what its pacing counts).
    pub(super) fn meter_write_cpu(&self, id: &str) {
        self.write_cpu
            .lock()
            .expect("write cpu lock")
            .insert(id.to_string(), Duration::ZERO);
    }

    /// A write of snapshot `id` took `cpu` of CPU time (counted when `id`
    /// is metered, see [`Self::meter_write_cpu`]).
    pub(super) fn add_write_cpu(&self, id: &str, cpu: Duration) {
        if let Some(total) = self.write_cpu.lock().expect("write cpu lock").get_mut(id) {
            *total += cpu;
        }
    }

    /// The CPU time the writes of snapshot `id` took, and its meter gone.
    pub(super) fn take_write_cpu(&self, id: &str) -> Duration {
        self.write_cpu
            .lock()
            .expect("write cpu lock")
            .remove(id)
            .unwrap_or_default()
    }

    /// Whether `every` has passed since `run`'s last state attempt (the
    /// first call for a run starts its clock).
    pub(super) fn state_due(&self, run: &str, every: Duration) -> bool {
        let mut last = self.last_state.lock().expect("state lock");
        let at = *last.entry(run.to_string()).or_insert_with(Instant::now);
        at.elapsed() >= every
    }

    /// The lock a run's state snapshot holds while it is in flight.
    pub(super) fn state_writer(&self, run: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut writers = self.state_writers.lock().expect("state writers lock");
        writers.entry(run.to_string()).or_default().clone()
    }

    /// The lock a finish of `run` holds.
    pub(super) fn finisher(&self, run: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut finishers = self.finishers.lock().expect("finishers lock");
        finishers.entry(run.to_string()).or_default().clone()
    }

    /// Forgets a deleted run's locks (a run created again under its name
    /// starts with fresh ones; whoever holds the old ones keeps them).
    pub(super) fn forget_run(&self, run: &str) {
        self.state_writers
            .lock()
            .expect("state writers lock")
            .remove(run);
        self.finishers.lock().expect("finishers lock").remove(run);
        self.last_state.lock().expect("state lock").remove(run);
        self.state_rates.lock().expect("state lock").remove(run);
    }

    /// Keeps a failure the catalog did not take; returns how many are kept.
    pub(super) fn keep_unrecorded(&self, id: &str, reason: &str) -> usize {
        let mut unrecorded = self.unrecorded.lock().expect("unrecorded lock");
        unrecorded.insert(id.to_string(), reason.to_string());
        unrecorded.len()
    }

    /// The failures the catalog did not take yet.
    pub(super) fn unrecorded(&self) -> Vec<(String, String)> {
        self.unrecorded
            .lock()
            .expect("unrecorded lock")
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Forgets a failure the catalog took; returns how many are left.
    pub(super) fn recorded(&self, id: &str) -> usize {
        let mut unrecorded = self.unrecorded.lock().expect("unrecorded lock");
        unrecorded.remove(id);
        unrecorded.len()
    }

    /// Starts the progress of derived snapshots `ids`, `total` bytes each.
    pub(super) fn progress_start<'a>(&self, ids: impl IntoIterator<Item = &'a str>, total: u64) {
        let mut progress = self.progress.lock().expect("progress lock");
        for id in ids {
            progress.insert(id.to_string(), derived::Progress { done: 0, total });
        }
    }

    /// Sets how far derived snapshots `ids` are.
    pub(super) fn progress_set<'a>(&self, ids: impl IntoIterator<Item = &'a str>, done: u64) {
        let mut progress = self.progress.lock().expect("progress lock");
        for id in ids {
            if let Some(p) = progress.get_mut(id) {
                p.done = done;
            }
        }
    }

    /// Forgets the progress of derived snapshots `ids` (written or failed).
    pub(super) fn progress_end<'a>(&self, ids: impl IntoIterator<Item = &'a str>) {
        let mut progress = self.progress.lock().expect("progress lock");
        for id in ids {
            progress.remove(id);
        }
    }

    /// How far a derived snapshot being written is.
    pub(super) fn progress_of(&self, id: &str) -> Option<derived::Progress> {
        self.progress
            .lock()
            .expect("progress lock")
            .get(id)
            .copied()
    }

    pub fn cached_compare(&self, key: &str) -> Option<Arc<CompareResult>> {
        self.compare_cache
            .lock()
            .expect("cache lock")
            .get(key)
            .cloned()
    }

    pub fn cache_compare(&self, key: String, result: Arc<CompareResult>) {
        let mut cache = self.compare_cache.lock().expect("cache lock");
        if cache.len() > 256 {
            cache.clear();
        }
        cache.insert(key, result);
    }
}
