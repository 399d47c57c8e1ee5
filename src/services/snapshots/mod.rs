//! The snapshot service: consistent cuts captured by the engine, persisted
//! durably, listed in the catalog, retained, resumed from, and used for
//! crash recovery; and the derived snapshots built from stored ones. The
//! on-disk format and the readers over it are in `crate::snapshot`.
//!
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

pub mod derived;
pub mod disk;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::clock::now_ms;
use crate::engine::capture::{Backlog, CaptureEvent, RankCapture, RankMeta, RestoredRank};
use crate::engine::{snapshot_id, EngineError};
use crate::registry::RunHandle;
use crate::run::RunConfig;
use crate::services::{Context, Shared};
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

/// A snapshot being captured and written.
struct Pending {
    run: String,
    kind: String,
    /// Ranks whose files must be written before it completes.
    expected: BTreeSet<u32>,
    written: Vec<FileRow>,
    writing: BTreeSet<u32>,
    deadline: Option<Instant>,
    waiters: Vec<oneshot::Sender<Finished>>,
    /// A periodic cut's share of its run's backlog, given back when this
    /// entry is dropped (complete, failed or deleted).
    _backlog: Option<Backlog>,
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

/// The snapshot registry: what is being written and who waits on it.
pub struct Snapshots {
    data_dir: PathBuf,
    pending: Mutex<HashMap<String, Pending>>,
    compare_cache: Mutex<HashMap<String, Arc<CompareResult>>>,
    last_state: Mutex<HashMap<String, Instant>>,
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
            progress: Mutex::new(HashMap::new()),
            unrecorded: Mutex::new(HashMap::new()),
        }
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    fn register(
        &self,
        id: &str,
        run: &str,
        kind: &str,
        expected: BTreeSet<u32>,
        deadline: Option<Instant>,
        backlog: Option<Backlog>,
    ) {
        self.pending.lock().expect("pending lock").insert(
            id.to_string(),
            Pending {
                run: run.to_string(),
                kind: kind.to_string(),
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

/// The next update step after the furthest rank (0 when no rank pushed).
pub fn next_step(config: &RunConfig, furthest: Option<u64>) -> u64 {
    match furthest {
        None => 0,
        Some(s) => (s / config.update_every + 1) * config.update_every,
    }
}

/// Where a snapshot without a step cuts: at the ranks' current step when
/// every rank has applied it (`current`: nothing to wait for), else at the
/// next update step after the furthest rank (`next_update`: ranks are mid
/// step, or some never pushed), as v1 did.
pub fn cut_now(config: &RunConfig, steps: &[Option<u64>]) -> (u64, &'static str) {
    let first = steps.first().copied().flatten();
    if let Some(s) = first {
        if steps.iter().all(|r| *r == Some(s)) && config.is_update_step(s) {
            return (s, CUT_CURRENT);
        }
    }
    let furthest = steps.iter().flatten().copied().max();
    (next_step(config, furthest), CUT_NEXT_UPDATE)
}

/// `detail.cut` of a manual snapshot: how its step was chosen.
pub const CUT_CURRENT: &str = "current";
pub const CUT_NEXT_UPDATE: &str = "next_update";
pub const CUT_REQUESTED: &str = "requested";
pub const CUT_FINAL: &str = "final";

/// Schedules a consistent cut of `run` at `step`; without one, at the
/// ranks' current step or the next update step (see [`cut_now`]; the row's
/// `detail.cut` says which). Returns the catalog row.
pub async fn create(
    state: &Snaps,
    run: &RunHandle,
    step: Option<u64>,
    profiles: Option<Vec<String>>,
    label: Option<String>,
) -> Result<SnapshotRow, SnapshotError> {
    let config = run.config.clone();
    let (names, indices) = profile_choice(&config, profiles)?;
    // A push may move a rank past the step read here before the cut is
    // scheduled; a cut of "now" then looks again (a bounded number of times).
    let mut attempt = 0;
    loop {
        let run_name = config.name.clone();
        let steps = run.engine.call(move |e| e.rank_steps(&run_name)).await??;
        let (at, cut) = match step {
            Some(s) => (s, CUT_REQUESTED),
            None => cut_now(&config, &steps),
        };
        match schedule_manual(state, run, at, &names, &indices, label.clone(), cut).await {
            Err(SnapshotError::Conflict(_)) if step.is_none() && attempt < 3 => attempt += 1,
            other => return other,
        }
    }
}

/// The profile names and indices a snapshot captures (default all).
fn profile_choice(
    config: &RunConfig,
    profiles: Option<Vec<String>>,
) -> Result<(Vec<String>, Vec<usize>), SnapshotError> {
    let names = match profiles {
        None => config
            .profiles
            .iter()
            .map(|p| p.name().to_string())
            .collect(),
        Some(list) if list.is_empty() => {
            return Err(SnapshotError::Invalid(
                "profiles: give at least one profile".into(),
            ))
        }
        Some(list) => list,
    };
    let mut indices = Vec::new();
    for name in &names {
        indices.push(config.profile_index(name).ok_or_else(|| {
            SnapshotError::Invalid(format!("profiles: no profile `{name}` in this run"))
        })?);
    }
    Ok((names, indices))
}

/// Records a pending manual snapshot at `step` and asks the engine for the
/// cut (ranks already at `step` are captured at once).
async fn schedule_manual(
    state: &Snaps,
    run: &RunHandle,
    step: u64,
    names: &[String],
    indices: &[usize],
    label: Option<String>,
    cut: &str,
) -> Result<SnapshotRow, SnapshotError> {
    let config = run.config.clone();
    if !config.is_update_step(step) {
        return Err(SnapshotError::Invalid(format!(
            "step: {step} is not an update step (update_every = {})",
            config.update_every
        )));
    }
    // The run's resident bytes bound what the cut writes (every profile,
    // copied tensors, mirror).
    disk::check(state, run.resident_bytes())?;
    let id = snapshot_id(MANUAL, step);
    let timeout = Duration::from_secs(config.snapshot_timeout_secs.max(1));
    let row = SnapshotRow {
        label,
        deadline_ms: Some(now_ms() + timeout.as_millis() as i64),
        detail: serde_json::json!({"cut": cut}),
        ..SnapshotRow::pending(&id, &config.name, step, MANUAL, names.to_vec())
    };
    state.store.insert_snapshot(&row).await?;
    state.pending.register(
        &id,
        &config.name,
        MANUAL,
        (0..config.world_size).collect(),
        Some(Instant::now() + timeout),
        None,
    );
    let (run_name, sid, indices) = (config.name.clone(), id.clone(), indices.to_vec());
    let scheduled = run
        .engine
        .call(move |e| e.schedule_cut(&run_name, &sid, step, indices))
        .await?;
    if let Err(e) = scheduled {
        state
            .pending
            .pending
            .lock()
            .expect("pending lock")
            .remove(&id);
        state.store.delete_snapshot(&id).await?;
        return Err(SnapshotError::Conflict(e.to_string()));
    }
    state.events.emit(
        &config.name,
        "snapshot",
        None,
        Some(step),
        serde_json::json!({"id": id, "status": "pending", "kind": MANUAL, "cut": cut}),
    );
    Ok(row)
}

/// `POST /finish`: marks the run finished at its furthest rank's last step
/// (later pushes are refused from here on) and takes the final snapshot
/// there: ranks already at that step are captured at once, ranks behind
/// when they push it. A finished run answers with how it ended.
pub async fn finish(
    state: &Snaps,
    run: &RunHandle,
    label: Option<String>,
) -> Result<(RunFinish, Option<SnapshotRow>), SnapshotError> {
    let name = run.config.name.clone();
    if let Some(done) = run.finished() {
        let row = match &done.snapshot {
            Some(id) => state.store.snapshot(&name, id).await?,
            None => None,
        };
        return Ok((done, row));
    }
    let run_name = name.clone();
    let at = run.engine.call(move |e| e.finish(&run_name)).await??;
    let (names, indices) = profile_choice(&run.config, None)?;
    let row = match at.0 {
        Some(step) => Some(
            schedule_manual(
                state,
                run,
                step,
                &names,
                &indices,
                Some(label.unwrap_or_else(|| "final".into())),
                CUT_FINAL,
            )
            .await?,
        ),
        None => None,
    };
    let done = RunFinish {
        at_ms: now_ms(),
        step: at.0,
        snapshot: row.as_ref().map(|r| r.id.clone()),
    };
    state.store.finish_run(&name, &done).await?;
    *run.finished.lock().expect("run finish lock") = Some(done.clone());
    state.events.emit(
        &name,
        "finished",
        None,
        at.0,
        serde_json::json!({"snapshot": done.snapshot}),
    );
    tracing::info!(run = %name, step = ?at.0, "run finished");
    Ok((done, row))
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

async fn on_event(state: &Snaps, event: CaptureEvent) {
    match event {
        CaptureEvent::PeriodicOpened {
            snapshot,
            run,
            step,
            profiles,
            backlog,
        } => {
            let Some(handle) = state.run(&run) else {
                return;
            };
            let timeout = Duration::from_secs(handle.config.snapshot_timeout_secs.max(1));
            state.pending.register(
                &snapshot,
                &run,
                PERIODIC,
                (0..handle.config.world_size).collect(),
                Some(Instant::now() + timeout),
                Some(backlog),
            );
            let row = SnapshotRow {
                deadline_ms: Some(now_ms() + timeout.as_millis() as i64),
                ..SnapshotRow::pending(&snapshot, &run, step, PERIODIC, profiles)
            };
            if let Err(e) = state.store.insert_snapshot(&row).await {
                tracing::error!(run = %run, error = %e, "recording a periodic snapshot failed");
            }
            state.events.emit(
                &run,
                "snapshot",
                None,
                Some(step),
                serde_json::json!({"id": snapshot, "status": "pending", "kind": PERIODIC}),
            );
        }
        CaptureEvent::PeriodicSkipped {
            run,
            step,
            held,
            bytes,
        } => {
            let limit = state.args.periodic_backlog.0;
            let reason = format!(
                "earlier periodic snapshots still hold {held} captured bytes not yet written; \
                 this one ({bytes} bytes) would pass the backlog of {limit} bytes"
            );
            tracing::warn!(run = %run, step, "periodic snapshot skipped: {reason}");
            state
                .metrics
                .snapshots_skipped
                .with_label_values(&[&run])
                .inc();
            state.events.emit(
                &run,
                "snapshot",
                None,
                Some(step),
                serde_json::json!({"status": "skipped", "kind": PERIODIC, "reason": reason}),
            );
        }
        CaptureEvent::Captured(capture) => write_capture(state.clone(), *capture),
        CaptureEvent::Failed { snapshot, reason } => fail(state, &snapshot, &reason).await,
    }
}

/// Serialises and writes one rank's capture off the async threads.
fn write_capture(state: Snaps, capture: RankCapture) {
    let id = capture.snapshot.clone();
    let rank = capture.rank;
    {
        let mut pending = state.pending.pending.lock().expect("pending lock");
        match pending.get_mut(&id) {
            Some(p) => {
                p.writing.insert(rank);
            }
            None => return, // failed or deleted meanwhile
        }
    }
    tokio::spawn(async move {
        if let Err(e) = disk::check(&state, capture_bytes(&capture)) {
            fail(&state, &id, &format!("rank {rank} not written: {e}")).await;
            return;
        }
        let data_dir = state.pending.data_dir.clone();
        let written = tokio::task::spawn_blocking(move || write_rank(&data_dir, capture)).await;
        let result = match written {
            Ok(Ok(files)) => Ok(files),
            Ok(Err(e)) => Err(format!("writing rank {rank} failed: {e}")),
            Err(e) => Err(format!("writing rank {rank} panicked: {e}")),
        };
        match result {
            Ok(files) => rank_written(&state, &id, rank, files).await,
            Err(reason) => fail(&state, &id, &reason).await,
        }
    });
}

/// Bytes of tensor data a capture writes (headers aside).
fn capture_bytes(capture: &RankCapture) -> u64 {
    let bytes = |t: &tch::Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
    let profiles: u64 = capture.profiles.iter().map(|(_, t)| bytes(t)).sum();
    let copied: u64 = capture.copied.iter().map(bytes).sum();
    let mirror: u64 = capture.mirror.iter().flatten().map(bytes).sum();
    profiles + copied * capture.profiles.len() as u64 + mirror
}

/// Writes every part of a rank; returns their catalog rows.
fn write_rank(data_dir: &Path, capture: RankCapture) -> Result<Vec<FileRow>, SnapshotError> {
    let dir = files::snapshot_rel_dir(&capture.run, &capture.snapshot);
    let meta_json =
        serde_json::to_string(&capture.meta).map_err(|e| SnapshotError::Internal(e.to_string()))?;
    let base_meta = |part: &str| {
        format::part_metadata(
            &capture.run,
            &capture.snapshot,
            capture.rank,
            capture.step,
            part,
        )
    };
    let host = |t: tch::Tensor| -> Result<tch::Tensor, SnapshotError> {
        t.f_to_device(tch::Device::Cpu)
            .and_then(|t| t.f_contiguous())
            .map_err(|e| SnapshotError::Engine(e.into()))
    };
    let copied: Vec<tch::Tensor> = capture
        .copied
        .iter()
        .map(|t| host(t.shallow_clone()))
        .collect::<Result<_, _>>()?;
    let mut rows = Vec::new();
    let mut record = |part: &str, file: &format::PartFile| -> Result<(), SnapshotError> {
        let rel = dir.join(files::part_file_name(capture.rank, part));
        let w = files::write_part(data_dir, &rel, file)?;
        rows.push(FileRow {
            rank: capture.rank,
            part: part.to_string(),
            path: w.path,
            sha256: w.sha256,
            bytes: w.bytes,
            step: capture.step,
            state: meta_json.clone(),
        });
        Ok(())
    };
    for (name, ema) in &capture.profiles {
        let copies = copied.iter().map(|t| t.shallow_clone()).collect();
        let part = format::profile_part(
            &capture.layout,
            host(ema.shallow_clone())?,
            copies,
            base_meta(name),
        );
        record(name, &part)?;
    }
    if let Some(mirror) = &capture.mirror {
        let tensors = mirror
            .iter()
            .map(|t| host(t.shallow_clone()))
            .collect::<Result<_, _>>()?;
        let part = format::mirror_part(&capture.layout, tensors, base_meta(MIRROR_PART));
        record(MIRROR_PART, &part)?;
    }
    files::sync_dir(&data_dir.join(&dir))?;
    Ok(rows)
}

async fn rank_written(state: &Snaps, id: &str, rank: u32, rows: Vec<FileRow>) {
    let done = {
        let mut pending = state.pending.pending.lock().expect("pending lock");
        let Some(p) = pending.get_mut(id) else {
            // Failed, or its run deleted, while this rank was being
            // written: nothing will list these files.
            drop(pending);
            discard_files(state, &rows);
            return;
        };
        p.writing.remove(&rank);
        p.expected.remove(&rank);
        p.written.extend(rows);
        if p.expected.is_empty() && p.writing.is_empty() {
            pending.remove(id)
        } else {
            None
        }
    };
    if let Some(p) = done {
        finalize(state, id, p).await;
    }
}

async fn finalize(state: &Snaps, id: &str, p: Pending) {
    let step = p.written.iter().map(|f| f.step).max().unwrap_or(0);
    let bytes: u64 = p.written.iter().map(|f| f.bytes).sum();
    match state
        .store
        .complete_snapshot(id, step, &p.written, now_ms())
        .await
    {
        Ok(true) => {
            tracing::info!(run = %p.run, snapshot = %id, step, bytes, "snapshot complete");
            state.events.emit(
                &p.run,
                "snapshot",
                None,
                Some(step),
                serde_json::json!({"id": id, "status": "complete", "kind": p.kind, "bytes": bytes}),
            );
            for w in p.waiters {
                let _ = w.send(Finished::Complete);
            }
            if let Err(e) = apply_retention(state, &p.run).await {
                tracing::warn!(run = %p.run, error = %e, "retention failed");
            }
        }
        Ok(false) => {
            // Deleted or failed meanwhile: its files go.
            remove_files(state, &p.run, id);
            for w in p.waiters {
                let _ = w.send(Finished::Failed("deleted".into()));
            }
        }
        Err(e) => {
            tracing::error!(snapshot = %id, error = %e, "completing a snapshot failed");
            for w in p.waiters {
                let _ = w.send(Finished::Failed(e.to_string()));
            }
        }
    }
}

/// Fails a pending snapshot: files, engine, catalog.
///
/// The partial files go first: when the disk filled up they hold the space
/// the catalog (on the same filesystem) needs to record the failure.
pub async fn fail(state: &Snaps, id: &str, reason: &str) {
    let Some(p) = state
        .pending
        .pending
        .lock()
        .expect("pending lock")
        .remove(id)
    else {
        return;
    };
    tracing::warn!(run = %p.run, snapshot = %id, "snapshot failed: {reason}");
    if let Some(run) = state.run(&p.run) {
        let (r, s) = (p.run.clone(), id.to_string());
        let _ = run.engine.call(move |e| e.cancel_cut(&r, &s)).await;
    }
    remove_files(state, &p.run, id);
    record_failure(state, id, reason).await;
    state.events.emit(
        &p.run,
        "snapshot",
        None,
        None,
        serde_json::json!({"id": id, "status": "failed", "reason": reason}),
    );
    for w in p.waiters {
        let _ = w.send(Finished::Failed(reason.to_string()));
    }
}

/// Attempts at recording a failure before it is left to the ticker.
const RECORD_ATTEMPTS: u32 = 4;

/// Marks a snapshot failed in the catalog, retrying with backoff; what
/// still does not go through is kept and retried every second
/// ([`retry_unrecorded`]), and a stop leaves the row `pending`, which the
/// next start fails ([`recover`]).
pub async fn record_failure(state: &Snaps, id: &str, reason: &str) {
    let mut delay = Duration::from_millis(50);
    for attempt in 1..=RECORD_ATTEMPTS {
        match state.store.fail_snapshot(id, reason, now_ms()).await {
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(snapshot = %id, attempt, error = %e, "recording a snapshot failure failed");
                if attempt < RECORD_ATTEMPTS {
                    tokio::time::sleep(delay).await;
                    delay *= 4;
                }
            }
        }
    }
    let mut unrecorded = state.pending.unrecorded.lock().expect("unrecorded lock");
    unrecorded.insert(id.to_string(), reason.to_string());
    state
        .metrics
        .unrecorded_failures
        .set(unrecorded.len() as i64);
}

/// Retries the failures the catalog did not take.
async fn retry_unrecorded(state: &Snaps) {
    let due: Vec<(String, String)> = state
        .pending
        .unrecorded
        .lock()
        .expect("unrecorded lock")
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (id, reason) in due {
        match state.store.fail_snapshot(&id, &reason, now_ms()).await {
            Ok(_) => {
                let mut unrecorded = state.pending.unrecorded.lock().expect("unrecorded lock");
                unrecorded.remove(&id);
                state
                    .metrics
                    .unrecorded_failures
                    .set(unrecorded.len() as i64);
                tracing::info!(snapshot = %id, "snapshot failure recorded");
            }
            Err(e) => {
                tracing::debug!(snapshot = %id, error = %e, "recording a snapshot failure failed again");
                return;
            }
        }
    }
}

fn discard_files(state: &Snaps, rows: &[FileRow]) {
    for row in rows {
        let path = state.pending.data_dir.join(&row.path);
        if let Err(e) = std::fs::remove_file(&path) {
            tracing::warn!(path = %path.display(), error = %e, "removing an orphaned snapshot file failed");
        }
        if let Some(dir) = path.parent() {
            // Only succeeds once the directory is empty.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// After a run is deleted: fails its pending snapshots and removes every
/// file it had (`runs/<run>/`), so a deleted run's disk space comes back at
/// once, not at the next start.
pub async fn remove_run_files(state: &Snaps, run: &str) -> Result<(), SnapshotError> {
    let pending: Vec<String> = state
        .pending
        .pending
        .lock()
        .expect("pending lock")
        .iter()
        .filter(|(_, p)| p.run == run)
        .map(|(id, _)| id.clone())
        .collect();
    for id in pending {
        fail(state, &id, "the run was deleted").await;
    }
    let dir = state.pending.data_dir.join(files::run_rel_dir(run));
    tokio::task::spawn_blocking(move || match std::fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    })
    .await
    .map_err(|e| SnapshotError::Worker(e.to_string()))??;
    Ok(())
}

fn remove_files(state: &Snaps, run: &str, id: &str) {
    let dir = state
        .pending
        .data_dir
        .join(files::snapshot_rel_dir(run, id));
    if dir.exists() {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!(path = %dir.display(), error = %e, "removing snapshot files failed");
        }
    }
}

async fn fail_late(state: &Snaps) {
    let now = Instant::now();
    let late: Vec<(String, Vec<u32>)> = state
        .pending
        .pending
        .lock()
        .expect("pending lock")
        .iter()
        .filter(|(_, p)| p.deadline.is_some_and(|d| d <= now) && p.writing.is_empty())
        .map(|(id, p)| (id.clone(), p.expected.iter().copied().collect()))
        .collect();
    for (id, missing) in late {
        let reason =
            format!("timed out: rank(s) {missing:?} did not reach the snapshot step in time");
        fail(state, &id, &reason).await;
    }
}

/// Deletes a snapshot: the catalog row first (so a crash never leaves a
/// complete snapshot without files), then the files.
pub async fn delete(state: &Snaps, run: &str, id: &str) -> Result<bool, SnapshotError> {
    if state
        .pending
        .pending
        .lock()
        .expect("pending lock")
        .contains_key(id)
    {
        fail(state, id, "deleted while pending").await;
    }
    let existed = state.store.delete_snapshot(id).await?;
    remove_files(state, run, id);
    Ok(existed)
}

/// Applies the run's retention to complete manual and periodic snapshots,
/// and keeps the newest state snapshots.
async fn apply_retention(state: &Snaps, run: &str) -> Result<(), SnapshotError> {
    let Some(handle) = state.run(run) else {
        return Ok(());
    };
    let retention = handle.config.retention.clone();
    let all = state.store.snapshots(run).await?;
    let mut doomed = Vec::new();
    let mut states: Vec<&SnapshotRow> = all
        .iter()
        .filter(|s| s.kind == STATE && s.status == "complete")
        .collect();
    states.sort_by_key(|s| std::cmp::Reverse(s.completed_at_ms));
    doomed.extend(states.iter().skip(STATE_KEEP).map(|s| s.id.clone()));
    if retention.keep_last > 0 {
        let mut cuts: Vec<&SnapshotRow> = all
            .iter()
            .filter(|s| (s.kind == MANUAL || s.kind == PERIODIC) && s.status == "complete")
            .collect();
        cuts.sort_by_key(|s| std::cmp::Reverse((s.step, s.created_at_ms)));
        for s in cuts.iter().skip(retention.keep_last as usize) {
            if retention.keep_every > 0 && s.step % retention.keep_every == 0 {
                continue;
            }
            doomed.push(s.id.clone());
        }
    }
    for id in doomed {
        delete(state, run, &id).await?;
        state.events.emit(
            run,
            "snapshot",
            None,
            None,
            serde_json::json!({"id": id, "status": "deleted", "reason": "retention"}),
        );
    }
    Ok(())
}

/// Takes a `state` snapshot of `run` now (each rank at its own last step),
/// unless nothing changed since the last one and `force` is false.
/// Returns the snapshot id, once complete.
pub async fn persist_state(
    state: &Snaps,
    run: &RunHandle,
    force: bool,
) -> Result<Option<String>, SnapshotError> {
    // Counted as an attempt even when refused, so a full disk is reported
    // once per interval, not on every tick.
    state
        .pending
        .last_state
        .lock()
        .expect("state lock")
        .insert(run.config.name.clone(), Instant::now());
    disk::check(state, run.resident_bytes())?;
    let id = snapshot_id(STATE, 0);
    let (run_name, sid) = (run.config.name.clone(), id.clone());
    let captures = run
        .engine
        .call(move |e| e.capture_state(&run_name, &sid, force))
        .await??;
    let Some((captures, covered)) = captures else {
        return Ok(None);
    };
    if captures.is_empty() {
        return Ok(None);
    }
    let step = captures.iter().map(|c| c.step).max().unwrap_or(0);
    let profiles = run
        .config
        .profiles
        .iter()
        .map(|p| p.name().to_string())
        .collect();
    let row = SnapshotRow {
        detail: serde_json::json!({
            "rank_steps": captures.iter().map(|c| (c.rank.to_string(), c.step)).collect::<BTreeMap<_, _>>()
        }),
        ..SnapshotRow::pending(&id, &run.config.name, step, STATE, profiles)
    };
    state.store.insert_snapshot(&row).await?;
    state.pending.register(
        &id,
        &run.config.name,
        STATE,
        captures.iter().map(|c| c.rank).collect(),
        None,
        None,
    );
    let (tx, rx) = oneshot::channel();
    if let Some(p) = state
        .pending
        .pending
        .lock()
        .expect("pending lock")
        .get_mut(&id)
    {
        p.waiters.push(tx);
    }
    for c in captures {
        write_capture(state.clone(), c);
    }
    match rx.await {
        Ok(Finished::Complete) => {
            // Only now is the newest EMA durable: until here the run stays
            // dirty, so a failed write is taken again.
            let run_name = run.config.name.clone();
            run.engine
                .call(move |e| e.mark_persisted(&run_name, covered))
                .await?;
            Ok(Some(id))
        }
        Ok(Finished::Failed(reason)) => Err(SnapshotError::WriteFailed(reason)),
        Err(_) => Err(SnapshotError::WriteFailed(
            "state snapshot abandoned".into(),
        )),
    }
}

/// How soon a failed state snapshot is tried again (never later than the
/// run's own interval).
const STATE_RETRY: Duration = Duration::from_secs(2);

/// State snapshots of runs whose `persist_every_secs` has elapsed.
async fn persist_due(state: &Snaps) {
    let runs: Vec<Arc<RunHandle>> = state.all_runs();
    for run in runs {
        let every = run.config.persist_every_secs;
        if every == 0 {
            continue;
        }
        let due = {
            let mut last = state.pending.last_state.lock().expect("state lock");
            let at = *last
                .entry(run.config.name.clone())
                .or_insert_with(Instant::now);
            at.elapsed() >= Duration::from_secs(every)
        };
        if due {
            let state = state.clone();
            // Off the ticker, so a long write does not delay deadlines.
            tokio::spawn(async move {
                if let Err(e) = persist_state(&state, &run, false).await {
                    tracing::warn!(run = %run.config.name, error = %e, "state snapshot failed; retrying");
                    retry_state_soon(&state, &run.config.name, every);
                }
            });
        }
    }
}

/// Makes a run's next state snapshot due [`STATE_RETRY`] from now.
fn retry_state_soon(state: &Snaps, run: &str, every_secs: u64) {
    let every = Duration::from_secs(every_secs);
    let wait = STATE_RETRY.min(every);
    let at = Instant::now()
        .checked_sub(every - wait)
        .unwrap_or_else(Instant::now);
    state
        .pending
        .last_state
        .lock()
        .expect("state lock")
        .insert(run.to_string(), at);
}

/// Attempts at persisting a run's state on shutdown before giving up.
const SHUTDOWN_ATTEMPTS: u32 = 3;

/// On graceful shutdown: a state snapshot of every run that changed (or
/// whose last state write failed), each tried a few times.
pub async fn persist_all(state: &Snaps) {
    let runs: Vec<Arc<RunHandle>> = state.all_runs();
    for run in runs {
        for attempt in 1..=SHUTDOWN_ATTEMPTS {
            match persist_state(state, &run, false).await {
                Ok(Some(id)) => {
                    tracing::info!(run = %run.config.name, snapshot = %id, "state persisted");
                    break;
                }
                Ok(None) => break,
                Err(e) if attempt < SHUTDOWN_ATTEMPTS => {
                    tracing::warn!(run = %run.config.name, error = %e, attempt, "persisting state failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => {
                    tracing::error!(run = %run.config.name, error = %e, "persisting state failed")
                }
            }
        }
    }
}

/// The files of a complete snapshot, by rank, for one part.
pub async fn parts_of(
    state: &Snaps,
    row: &SnapshotRow,
    part: &str,
) -> Result<Vec<assemble::StoredPart>, SnapshotError> {
    let files = state.store.snapshot_files(&row.id).await?;
    let mut out = Vec::new();
    for f in files.into_iter().filter(|f| f.part == part) {
        let meta: RankMeta =
            serde_json::from_str(&f.state).map_err(|e| SnapshotError::Store(e.into()))?;
        let mut meta = meta;
        meta.layout.rebuild_index();
        out.push(assemble::StoredPart {
            rank: f.rank,
            path: Arc::new(state.pending.data_dir.join(&f.path)),
            sha256: f.sha256,
            meta: Arc::new(meta),
        });
    }
    Ok(out)
}

/// Reads every rank of a complete snapshot back into restorable tensors.
fn load_restorable(
    data_dir: &Path,
    config: &RunConfig,
    files: Vec<FileRow>,
) -> Result<Vec<(u32, RestoredRank)>, SnapshotError> {
    let mut by_rank: BTreeMap<u32, Vec<FileRow>> = BTreeMap::new();
    for f in files {
        by_rank.entry(f.rank).or_default().push(f);
    }
    let mut out = Vec::new();
    for (rank, files) in by_rank {
        let meta: RankMeta =
            serde_json::from_str(&files[0].state).map_err(|e| SnapshotError::Store(e.into()))?;
        let read = |part: &str| -> Result<Option<Vec<u8>>, SnapshotError> {
            match files.iter().find(|f| f.part == part) {
                Some(f) => Ok(Some(std::fs::read(data_dir.join(&f.path))?)),
                None => Ok(None),
            }
        };
        let mut profiles = Vec::new();
        for p in &config.profiles {
            profiles.push(read(p.name())?.ok_or_else(|| {
                SnapshotError::Corrupt(format!(
                    "rank {rank} has no file for profile `{}`",
                    p.name()
                ))
            })?);
        }
        let mirror = if config.mirror {
            read(MIRROR_PART)?
        } else {
            None
        };
        let restored =
            format::restore_rank(meta, &profiles, mirror.as_deref(), config.ema_dtype.kind())
                .map_err(|e| SnapshotError::Corrupt(format!("rank {rank}: {e}")))?;
        out.push((rank, restored));
    }
    Ok(out)
}

/// Whether a complete snapshot can restore the run: every profile present.
fn restorable(config: &RunConfig, row: &SnapshotRow) -> bool {
    // Derived snapshots (post-hoc, merged) hold weights no run ever had.
    row.status == "complete"
        && matches!(row.kind.as_str(), MANUAL | PERIODIC | STATE)
        && config
            .profiles
            .iter()
            .all(|p| row.profiles.iter().any(|n| n == p.name()))
}

/// Restores every rank of `run` from `row`; ranks absent from it are
/// emptied. Updates the rank summaries; returns per-rank steps.
pub async fn restore_from(
    state: &Snaps,
    run: &RunHandle,
    row: &SnapshotRow,
) -> Result<BTreeMap<u32, u64>, SnapshotError> {
    let files = state.store.snapshot_files(&row.id).await?;
    let config = run.config.clone();
    let data_dir = state.pending.data_dir.clone();
    let ranks = tokio::task::spawn_blocking(move || load_restorable(&data_dir, &config, files))
        .await
        .map_err(|e| SnapshotError::Worker(e.to_string()))??;
    let steps: BTreeMap<u32, u64> = ranks
        .iter()
        .map(|(r, rr)| (*r, rr.meta.last_step.unwrap_or(0)))
        .collect();
    let run_name = run.config.name.clone();
    run.engine
        .call(move |e| e.restore(&run_name, ranks))
        .await??;
    for rank in 0..run.config.world_size {
        let summary = run.update_rank(rank, |s| match steps.get(&rank) {
            Some(&step) => {
                s.last_step = Some(step);
                s.live = true;
            }
            None => {
                s.last_step = None;
                s.live = false;
            }
        });
        state.record_rank(run, rank, &summary, None);
    }
    Ok(steps)
}

/// The lowest step any rank of a restorable snapshot sits at: a cut's
/// step, or for a `state` snapshot the lowest of its ranks' steps.
fn lowest_rank_step(row: &SnapshotRow) -> u64 {
    row.detail["rank_steps"]
        .as_object()
        .and_then(|steps| steps.values().filter_map(|v| v.as_u64()).min())
        .unwrap_or(row.step)
}

/// What `resume` restored.
pub struct Resumed {
    pub row: SnapshotRow,
    pub rank_steps: BTreeMap<u32, u64>,
    /// The snapshot misses updates up to the step asked for (only with
    /// `allow_older`).
    pub older: bool,
}

/// `POST /resume`: the newest restorable snapshot at or before `step`.
///
/// `step` is the last step the trainer's checkpoint pushed (the number of
/// optimizer steps it took, minus one). A snapshot older than the last
/// update step at or before it would leave the EMA without updates the
/// trainer will not push again: refused unless `allow_older`.
pub async fn resume(
    state: &Snaps,
    run: &RunHandle,
    step: u64,
    allow_older: bool,
) -> Result<Resumed, SnapshotError> {
    let rows = state.store.snapshots(&run.config.name).await?;
    let mut best: Option<(u64, &SnapshotRow)> = None;
    for row in rows.iter().filter(|r| restorable(&run.config, r)) {
        // A state snapshot's ranks may sit at different steps: all must be
        // at or before the requested one.
        let top = row.step;
        if top <= step
            && best.is_none_or(|(s, b)| {
                top > s || (top == s && row.completed_at_ms > b.completed_at_ms)
            })
        {
            best = Some((top, row));
        }
    }
    let Some((_, row)) = best else {
        return Err(SnapshotError::NotFound(format!(
            "no complete snapshot of run `{}` at or before step {step} holds every profile",
            run.config.name
        )));
    };
    let wanted = step - step % run.config.update_every;
    let lowest = lowest_rank_step(row);
    let older = lowest < wanted;
    if older && !allow_older {
        return Err(SnapshotError::Older(format!(
            "the newest complete snapshot of run `{}` at or before step {step} is `{}`, at step {lowest}: \
             restoring it would leave the EMA without the updates of steps {}..={wanted}. \
             `step` is the last step the checkpoint pushed (the optimizer steps it took minus one; \
             Lightning's and HF's global_step minus one); take a snapshot at that step when you \
             checkpoint, or pass allow_older: true to restore step {lowest} anyway",
            run.config.name,
            row.id,
            lowest + 1
        )));
    }
    let row = row.clone();
    let steps = restore_from(state, run, &row).await?;
    if older {
        tracing::warn!(run = %run.config.name, snapshot = %row.id, asked = step, restored = lowest,
            "resumed from an older snapshot (allow_older)");
    }
    state.events.emit(
        &run.config.name,
        "resumed",
        None,
        Some(row.step),
        serde_json::json!({"snapshot": row.id, "rank_steps": steps, "requested_step": step, "older": older}),
    );
    Ok(Resumed {
        row,
        rank_steps: steps,
        older,
    })
}

/// At start: fails snapshots a stop interrupted, removes files the catalog
/// does not list as complete, and restores every run from its newest
/// restorable snapshot.
pub async fn recover(state: &Snaps) -> Result<(), SnapshotError> {
    let interrupted = state.store.fail_interrupted(now_ms()).await?;
    for (run, id) in &interrupted {
        tracing::warn!(run = %run, snapshot = %id, "snapshot interrupted by the last stop; marked failed");
    }
    let keep = state.store.complete_snapshot_ids().await?;
    let data_dir = state.pending.data_dir.clone();
    let removed = tokio::task::spawn_blocking(move || files::remove_unlisted(&data_dir, &keep))
        .await
        .map_err(|e| SnapshotError::Worker(e.to_string()))??;
    for path in removed {
        tracing::info!(path = %path.display(), "removed an incomplete snapshot file");
    }
    let runs: Vec<Arc<RunHandle>> = state.all_runs();
    for run in runs {
        let rows = state.store.snapshots(&run.config.name).await?;
        let newest = rows
            .iter()
            .filter(|r| restorable(&run.config, r))
            .max_by_key(|r| (r.completed_at_ms, r.step));
        let Some(row) = newest else { continue };
        match restore_from(state, &run, row).await {
            Ok(steps) => {
                for (rank, step) in &steps {
                    tracing::info!(run = %run.config.name, rank, step, snapshot = %row.id, "rank resumed from snapshot");
                }
                state.events.emit(
                    &run.config.name,
                    "restored",
                    None,
                    Some(row.step),
                    serde_json::json!({"snapshot": row.id, "rank_steps": steps}),
                );
            }
            Err(e) => {
                tracing::error!(run = %run.config.name, snapshot = %row.id, error = %e, "restoring failed")
            }
        }
    }
    Ok(())
}
