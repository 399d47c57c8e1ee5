//! The snapshot registry: snapshots being captured and written, who
//! waits on them, compare results, derived-job progress, failures the
//! catalog did not take yet. The one place its locks are taken.

#[allow(unused_imports)]
use super::*;

/// A snapshot being captured and written.
pub(super) struct Pending {
    pub(super) run: String,
    pub(super) kind: SnapshotKind,
    /// Ranks whose files must be written before it completes.
    pub(super) expected: BTreeSet<u32>,
    pub(super) written: Vec<FileRow>,
    pub(super) writing: BTreeSet<u32>,
    pub(super) deadline: Option<Instant>,
    pub(super) waiters: Vec<oneshot::Sender<Finished>>,
    /// A periodic cut's share of its run's backlog, given back when this
    /// entry is dropped (complete, failed or deleted).
    pub(super) _backlog: Option<Backlog>,
}

/// The snapshot registry: what is being written and who waits on it.
pub struct Snapshots {
    pub(super) data_dir: PathBuf,
    pub(super) pending: Mutex<HashMap<String, Pending>>,
    pub(super) compare_cache: Mutex<HashMap<String, Arc<CompareResult>>>,
    pub(super) last_state: Mutex<HashMap<String, Instant>>,
    /// Derived snapshots being written: how far along.
    pub(super) progress: Mutex<HashMap<String, derived::Progress>>,
    /// Failures the catalog did not take yet (`id -> reason`), retried by
    /// the ticker: a failed snapshot must never read `pending` forever.
    pub(super) unrecorded: Mutex<HashMap<String, String>>,
}

impl Snapshots {
    pub fn new(data_dir: PathBuf) -> Self {
        Snapshots {
            data_dir,
            pending: Mutex::new(HashMap::new()),
            compare_cache: Mutex::new(HashMap::new()),
            last_state: Mutex::new(HashMap::new()),
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
        expected: BTreeSet<u32>,
        deadline: Option<Instant>,
        backlog: Option<Backlog>,
    ) {
        self.pending.lock().expect("pending lock").insert(
            id.to_string(),
            Pending {
                run: run.to_string(),
                kind,
                expected,
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
        let rx = {
            let mut pending = self.pending.lock().expect("pending lock");
            let entry = pending.get_mut(id)?;
            let (tx, rx) = oneshot::channel();
            entry.waiters.push(tx);
            rx
        };
        tokio::time::timeout(timeout, rx).await.ok()?.ok()
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
