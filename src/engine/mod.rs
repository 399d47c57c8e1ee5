//! The engine: one OS thread per device that owns every tensor.
//!
//! tch tensors are `Send` but not `Sync`, and grad mode is per thread, so no
//! tensor lives in shared async state. Handlers send the engine a job (a
//! closure over `&mut Engine`) through a bounded queue and await its reply
//! on a oneshot channel. A full queue is refused at once
//! ([`EngineError::QueueFull`], which the HTTP layer answers with 429 and
//! `Retry-After`).
//!
//! - [`schedule`]: decay schedules, pure functions.
//! - [`rank`]: one rank's layout, flat buffers and the update path.
//! - [`kernels`]: the fused multi-profile CPU update.
//! - [`device`]: device names and availability.

pub mod capture;
pub mod device;
pub mod kernels;
pub mod rank;
pub mod schedule;
pub mod shared;
pub mod spread;

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use tch::{Device, Kind, Tensor};
use tokio::sync::{mpsc, oneshot};

use crate::contract::SnapshotKind;
use crate::run::{EmaDtype, NonfinitePolicy, RunConfig};
use crate::wire::ParsedPush;
use capture::{capture_rank, Backlog, CaptureEvent, PendingCut, RankCapture, RestoredRank};
use rank::{PushOutcome, RankLayout, RankState};
use shared::{Periodic, RunShared};

/// Failures of engine work. The HTTP layer maps each to a status.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the engine queue is full; retry later")]
    QueueFull,
    #[error("the engine thread stopped")]
    Stopped,
    #[error("run `{0}` is not on this engine")]
    RunNotFound(String),
    #[error("rank {rank} of run `{run}` is held by another engine")]
    NotHere { run: String, rank: u32 },
    #[error("rank {rank} of run `{run}` has not pushed yet")]
    NoData { run: String, rank: u32 },
    #[error("{0}")]
    StepConflict(String),
    #[error("{0}")]
    RunFinished(String),
    #[error("{0}")]
    Finishing(String),
    #[error("layout mismatch: {0}")]
    LayoutMismatch(String),
    #[error("{0}")]
    NeedsKeyframe(String),
    #[error("tensor `{0}` holds NaN or Inf (the run's nonfinite policy is `reject`)")]
    Nonfinite(String),
    #[error("no profile `{0}` in this run")]
    UnknownProfile(String),
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
}

type Job = Box<dyn FnOnce(&mut Engine) + Send>;

thread_local! {
    /// Threads the fused CPU kernel splits one apply over, on this engine
    /// thread (0: all of torch's intra-op threads).
    static KERNEL_THREADS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Threads one apply on this thread may use: the engine's share of the
/// cores when several engines share them, else torch's intra-op threads.
pub fn kernel_threads() -> usize {
    match KERNEL_THREADS.with(|t| t.get()) {
        0 => tch::get_num_threads().max(1) as usize,
        n => n,
    }
}

/// The bytes a push would take in the registered dtypes, uncompressed and
/// unquantised (its header plus each tensor at its registered size): the
/// logical side of the wire ratio.
fn logical_bytes(push: &ParsedPush, layout: &RankLayout, order: &[usize]) -> u64 {
    let header = push
        .tensors
        .iter()
        .map(|t| t.range.start)
        .min()
        .unwrap_or(0) as u64;
    header
        + order
            .iter()
            .map(|&i| {
                let t = &layout.tensors[i];
                t.numel as u64 * t.dtype.size() as u64
            })
            .sum::<u64>()
}

/// A cheap, cloneable handle on an engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Job>,
    device: Device,
    label: Arc<str>,
    depth: usize,
}

impl EngineHandle {
    /// Starts the engine thread `label` for `device` (its fused applies
    /// split over `kernel_threads` threads, 0: torch's intra-op threads),
    /// with a queue of `depth` jobs;
    /// captures for snapshots go to `captures`, and a run's periodic cuts
    /// hold at most `periodic_backlog_limit` captured bytes (one always).
    pub fn start(
        device: Device,
        label: &str,
        kernel_threads: usize,
        depth: usize,
        captures: mpsc::UnboundedSender<CaptureEvent>,
        periodic_backlog_limit: u64,
    ) -> std::io::Result<Self> {
        let (tx, mut rx) = mpsc::channel::<Job>(depth.max(1));
        std::thread::Builder::new()
            .name(format!("polyak-engine-{label}"))
            .spawn(move || {
                let _guard = tch::no_grad_guard();
                KERNEL_THREADS.with(|t| t.set(kernel_threads));
                let mut engine = Engine::new(device, captures, periodic_backlog_limit);
                while let Some(job) = rx.blocking_recv() {
                    // A panicking job loses its reply (the caller sees
                    // `Stopped`), not the engine.
                    if std::panic::catch_unwind(AssertUnwindSafe(|| job(&mut engine))).is_err() {
                        tracing::error!("an engine job panicked; the engine goes on");
                    }
                }
            })?;
        Ok(EngineHandle {
            tx,
            device,
            label: label.into(),
            depth: depth.max(1),
        })
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The engine's name: its device, and with several engines on one
    /// device its index (`cpu#1`).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Jobs waiting in the queue.
    pub fn queued(&self) -> usize {
        self.depth - self.tx.capacity()
    }

    /// Runs `f` on the engine thread; refused at once when the queue is full.
    pub async fn try_call<R, F>(&self, f: F) -> Result<R, EngineError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Engine) -> R + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        self.tx
            .try_send(Box::new(move |e: &mut Engine| {
                let _ = tx.send(f(e));
            }))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => EngineError::QueueFull,
                mpsc::error::TrySendError::Closed(_) => EngineError::Stopped,
            })?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// Runs `f` on the engine thread, waiting for room in the queue (control
    /// work that must not be refused: creating and dropping runs).
    pub async fn call<R, F>(&self, f: F) -> Result<R, EngineError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Engine) -> R + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Box::new(move |e: &mut Engine| {
                let _ = tx.send(f(e));
            }))
            .await
            .map_err(|_| EngineError::Stopped)?;
        rx.await.map_err(|_| EngineError::Stopped)
    }
}

/// One run's tensors on the engine.
pub struct EngineRun {
    pub config: Arc<RunConfig>,
    copy: globset::GlobSet,
    /// `None` until the rank's first applied push (and always for the
    /// ranks other engines hold).
    pub ranks: Vec<Option<RankState>>,
    /// The ranks this engine holds.
    owned: Vec<bool>,
    /// Cuts waiting for ranks to reach their step.
    pending: Vec<PendingCut>,
    /// The last step this engine opened, joined or skipped a periodic cut for.
    last_periodic: Option<u64>,
    /// What the engines of this run share: the finish step, periodic cut
    /// decisions and their write backlog.
    shared: Arc<RunShared>,
    /// Pushes applied since the run was installed or restored, and how
    /// many of them the newest complete state snapshot covers. Marks, not
    /// a counter of changes: state writes overlap (a store that hangs),
    /// and one that completes must not mark as persisted the pushes that
    /// came after its capture.
    applied: u64,
    persisted: u64,
}

impl EngineRun {
    fn owns(&self, rank: u32) -> bool {
        self.owned.get(rank as usize).copied().unwrap_or(false)
    }

    /// The ranks this engine holds, with their state.
    fn owned_ranks(&self) -> impl Iterator<Item = (u32, Option<&RankState>)> {
        self.ranks
            .iter()
            .zip(&self.owned)
            .enumerate()
            .filter(|(_, (_, &owned))| owned)
            .map(|(rank, (state, _))| (rank as u32, state.as_ref()))
    }
}

/// Where a finished run stopped: its furthest rank's last step (`None`:
/// finished before any push).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinishedAt(pub Option<u64>);

/// A copy of one rank's EMA for one profile, taken on the engine thread
/// (a device-side copy) and serialised elsewhere.
pub struct EmaExport {
    pub layout: Arc<RankLayout>,
    pub ema: Tensor,
    pub copied: Vec<Tensor>,
    pub last_step: Option<u64>,
    pub ema_dtype: EmaDtype,
}

/// The state the engine thread owns.
pub struct Engine {
    device: Device,
    runs: HashMap<String, EngineRun>,
    captures: mpsc::UnboundedSender<CaptureEvent>,
    /// Captured bytes a run's periodic cuts may hold before one is skipped.
    periodic_backlog_limit: u64,
}

/// How scheduling a cut went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CutScheduled {
    /// Waiting for these ranks to reach the step.
    Waiting(Vec<u32>),
    /// Every rank was already at the step and has been captured.
    Captured,
}

impl Engine {
    fn new(
        device: Device,
        captures: mpsc::UnboundedSender<CaptureEvent>,
        periodic_backlog_limit: u64,
    ) -> Self {
        Engine {
            device,
            runs: HashMap::new(),
            captures,
            periodic_backlog_limit,
        }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Adds a run (at creation, or when the catalog is loaded at start)
    /// with the ranks this engine holds; `shared` is the same for every
    /// engine holding a rank of the run.
    pub fn add_run(&mut self, config: Arc<RunConfig>, owned: &[u32], shared: Arc<RunShared>) {
        let copy = config.copy_matcher();
        let ranks = (0..config.world_size).map(|_| None).collect();
        let mut mask = vec![false; config.world_size as usize];
        for &r in owned {
            if let Some(m) = mask.get_mut(r as usize) {
                *m = true;
            }
        }
        self.runs.insert(
            config.name.clone(),
            EngineRun {
                config,
                copy,
                ranks,
                owned: mask,
                pending: Vec::new(),
                last_periodic: None,
                shared,
                applied: 0,
                persisted: 0,
            },
        );
    }

    /// Ranks taken over from a node that is gone: this engine holds them
    /// from now, each restored (or empty, to be registered by its next
    /// push). The run's other ranks here are left as they are.
    pub fn adopt(
        &mut self,
        config: Arc<RunConfig>,
        shared: Arc<RunShared>,
        ranks: Vec<(u32, Option<RestoredRank>)>,
    ) -> Result<(), EngineError> {
        let device = self.device;
        let mut built = Vec::with_capacity(ranks.len());
        for (rank, restored) in ranks {
            let mut state = restored
                .map(|r| r.into_state(&config, device))
                .transpose()?;
            // The mirror is the lost node's at its last state snapshot; the
            // trainer's copy went on with the pushes that node acknowledged
            // after it. A delta or XOR push would add to the wrong base, so
            // the first relative push is refused until a full one comes.
            if let Some(s) = state.as_mut() {
                s.has_keyframe = false;
            }
            built.push((rank, state));
        }
        if !self.runs.contains_key(&config.name) {
            self.add_run(config.clone(), &[], shared);
        }
        let entry = self.runs.get_mut(&config.name).expect("run added");
        for (rank, state) in built {
            let r = rank as usize;
            if r >= entry.ranks.len() {
                continue;
            }
            let step = state.as_ref().and_then(|s| s.last_step);
            entry.shared.settle(rank, step);
            entry.shared.set_resident(
                rank,
                state.as_ref().map_or(0, |s| s.resident_bytes(&config)),
            );
            entry.owned[r] = true;
            entry.ranks[r] = state;
            if step > entry.last_periodic {
                entry.last_periodic = step;
            }
        }
        Ok(())
    }

    /// Ranks another node took: their tensors are freed and pushes for
    /// them refused here.
    pub fn release(&mut self, run: &str, ranks: &[u32]) {
        let Some(entry) = self.runs.get_mut(run) else {
            return;
        };
        for &rank in ranks {
            let r = rank as usize;
            if r < entry.ranks.len() {
                entry.owned[r] = false;
                entry.ranks[r] = None;
                entry.shared.set_resident(rank, 0);
            }
        }
    }

    /// Frees every tensor of a run.
    pub fn drop_run(&mut self, name: &str) -> bool {
        self.runs.remove(name).is_some()
    }

    pub fn run(&self, name: &str) -> Option<&EngineRun> {
        self.runs.get(name)
    }

    pub fn run_mut(&mut self, name: &str) -> Option<&mut EngineRun> {
        self.runs.get_mut(name)
    }

    /// Applies a validated push: step rules, layout registration or check,
    /// then the update of every profile. Nothing changes on any error.
    pub fn push(
        &mut self,
        run: &str,
        rank: u32,
        step: u64,
        push: ParsedPush,
    ) -> Result<PushOutcome, EngineError> {
        let entry = self
            .runs
            .get(run)
            .ok_or_else(|| EngineError::RunNotFound(run.to_string()))?;
        if !entry.owns(rank) {
            return Err(EngineError::NotHere {
                run: run.to_string(),
                rank,
            });
        }
        // The finish check and this rank's claim on `step` are one step
        // under the run's shared lock; the real last step is settled after.
        let shared = entry.shared.clone();
        shared.claim(rank, step).map_err(|refused| match refused {
            shared::Refused::Finished(at) => finished_error(run, at),
            shared::Refused::Held => EngineError::Finishing(format!(
                "run `{run}` is being finished across its nodes; step {step} is taken if the \
                     finish lands at or past it: retry shortly"
            )),
        })?;
        let outcome = match (self.push_claimed(run, rank, step, push), shared.finished()) {
            // A script run again against a finished run: that the run is
            // finished is the answer, not a hint to `resume` it.
            (Err(EngineError::StepConflict(_)), Some(at)) => Err(finished_error(run, at)),
            (outcome, _) => outcome,
        };
        let state = self
            .runs
            .get(run)
            .and_then(|e| e.ranks[rank as usize].as_ref());
        shared.settle(rank, state.and_then(|s| s.last_step));
        outcome
    }

    fn push_claimed(
        &mut self,
        run: &str,
        rank: u32,
        step: u64,
        mut push: ParsedPush,
    ) -> Result<PushOutcome, EngineError> {
        let started = Instant::now();
        let device = self.device;
        let entry = self
            .runs
            .get_mut(run)
            .ok_or_else(|| EngineError::RunNotFound(run.to_string()))?;
        let config = entry.config.clone();
        let slot = entry
            .ranks
            .get_mut(rank as usize)
            .ok_or_else(|| EngineError::RunNotFound(run.to_string()))?;

        if let Some(state) = slot.as_ref() {
            if let Some(duplicate) = step_rules(run, rank, step, state, &push, &config)? {
                return Ok(duplicate);
            }
        }

        // Layout: registered by the first push, checked on every later one.
        let mut registered = None;
        let order = match slot.as_ref() {
            Some(state) => state
                .layout
                .match_push(&push)
                .map_err(EngineError::LayoutMismatch)?,
            None => {
                let layout = Arc::new(RankLayout::register(&push, &config, &entry.copy));
                registered = Some(layout.clone());
                (0..push.tensors.len()).collect()
            }
        };
        check_relative(&push, &config, rank, slot.as_ref())?;
        if let Some(layout) = &registered {
            *slot = Some(RankState::new(layout.clone(), &config, device)?);
        }
        let state = slot.as_mut().expect("rank state present");
        if push.kind == crate::wire::PushKind::Xor && config.nonfinite != NonfinitePolicy::Allow {
            let flags = state.xor_nonfinite(&push, &order, device)?;
            for (t, bad) in push.tensors.iter_mut().zip(flags) {
                if bad && config.nonfinite == NonfinitePolicy::Reject {
                    return Err(EngineError::Nonfinite(t.name.clone()));
                }
                t.nonfinite = bad;
            }
        }
        let mirror_mismatch = mirror_mismatch(&push, state, &order)?;
        let logical_bytes = logical_bytes(&push, &state.layout, &order);
        let report = state.apply_push(&config, &push, &order, step, device)?;
        // Before `after_apply`: a periodic cut decided there sizes its
        // backlog from every rank's bytes, this one's included.
        entry
            .shared
            .set_resident(rank, state.resident_bytes(&config));
        entry.applied += 1;
        self.after_apply(run, rank, step);
        let state = self.runs[run].ranks[rank as usize]
            .as_ref()
            .expect("rank state present");
        Ok(PushOutcome {
            applied: true,
            duplicate: false,
            step,
            last_step: state.last_step,
            skipped: report.skipped,
            registered,
            resident_bytes: state.resident_bytes(&config),
            apply_seconds: started.elapsed().as_secs_f64(),
            drift: report.drift,
            logical_bytes,
            mirror_mismatch,
        })
    }

    /// Captures a rank for the cuts waiting on `step`, fails the cuts it
    /// jumped over, and opens a periodic cut when `step` is one.
    fn after_apply(&mut self, run: &str, rank: u32, step: u64) {
        let captures = self.captures.clone();
        let limit = self.periodic_backlog_limit;
        let Some(entry) = self.runs.get_mut(run) else {
            return;
        };
        open_periodic(entry, run, step, &captures, limit);
        capture_waiting(entry, rank, step, &captures);
    }

    /// Schedules a cut at `step`: ranks already there are captured now, a
    /// rank already past it makes the cut impossible.
    pub fn schedule_cut(
        &mut self,
        run: &str,
        snapshot: &str,
        step: u64,
        profiles: Vec<usize>,
    ) -> Result<CutScheduled, EngineError> {
        let captures = self.captures.clone();
        let entry = self
            .runs
            .get_mut(run)
            .ok_or_else(|| EngineError::RunNotFound(run.to_string()))?;
        let config = entry.config.clone();
        for (rank, state) in entry.owned_ranks() {
            if let Some(last) = state.and_then(|s| s.last_step) {
                if last > step {
                    return Err(EngineError::StepConflict(format!(
                        "rank {rank} is already at step {last}, past the snapshot step {step}"
                    )));
                }
            }
        }
        let mut remaining = std::collections::BTreeSet::new();
        let mut captured = Vec::new();
        for (rank, state) in entry.owned_ranks() {
            match state {
                Some(s) if s.last_step == Some(step) => {
                    captured.push(capture_rank(&config, s, snapshot, rank, &profiles)?);
                }
                _ => {
                    remaining.insert(rank);
                }
            }
        }
        for c in captured {
            let _ = captures.send(CaptureEvent::Captured(Box::new(c)));
        }
        if remaining.is_empty() {
            return Ok(CutScheduled::Captured);
        }
        let waiting = remaining.iter().copied().collect();
        entry.pending.push(PendingCut {
            snapshot: snapshot.to_string(),
            step,
            profiles,
            remaining,
        });
        Ok(CutScheduled::Waiting(waiting))
    }

    /// Forgets a pending cut (timed out or deleted); returns whether it was
    /// pending.
    pub fn cancel_cut(&mut self, run: &str, snapshot: &str) -> bool {
        let Some(entry) = self.runs.get_mut(run) else {
            return false;
        };
        let before = entry.pending.len();
        entry.pending.retain(|c| c.snapshot != snapshot);
        entry.pending.len() != before
    }

    /// Captures every rank that holds data, each at its own last step (a
    /// crash-recovery `state` snapshot), with the mark of the pushes it
    /// covers. `None` when nothing changed since the last persisted one
    /// (unless `force`). The run stays dirty until [`Self::mark_persisted`]
    /// is told the snapshot completed: a failed write is retried.
    pub fn capture_state(
        &mut self,
        run: &str,
        snapshot: &str,
        force: bool,
    ) -> Result<Option<(Vec<RankCapture>, u64)>, EngineError> {
        let entry = self
            .runs
            .get_mut(run)
            .ok_or_else(|| EngineError::RunNotFound(run.to_string()))?;
        if entry.applied == entry.persisted && !force {
            return Ok(None);
        }
        let config = entry.config.clone();
        let profiles: Vec<usize> = (0..config.profiles.len()).collect();
        let mut out = Vec::new();
        for (rank, state) in entry.ranks.iter().enumerate() {
            if let Some(s) = state {
                out.push(capture_rank(&config, s, snapshot, rank as u32, &profiles)?);
            }
        }
        Ok(Some((out, entry.applied)))
    }

    /// A state snapshot that covered the pushes up to mark `covered` is
    /// complete: those no longer need persisting (pushes applied since
    /// still do, whichever order overlapping writes complete in).
    pub fn mark_persisted(&mut self, run: &str, covered: u64) {
        if let Some(entry) = self.runs.get_mut(run) {
            entry.persisted = entry.persisted.max(covered.min(entry.applied));
        }
    }

    /// Replaces the run's ranks with restored tensors (start-up recovery and
    /// `resume`); ranks not restored are emptied. Pending cuts are dropped.
    pub fn restore(
        &mut self,
        run: &str,
        ranks: Vec<(u32, RestoredRank)>,
    ) -> Result<(), EngineError> {
        let device = self.device;
        let entry = self
            .runs
            .get_mut(run)
            .ok_or_else(|| EngineError::RunNotFound(run.to_string()))?;
        let config = entry.config.clone();
        let mut built = Vec::with_capacity(ranks.len());
        for (rank, restored) in ranks {
            built.push((rank, restored.into_state(&config, device)?));
        }
        for slot in entry.ranks.iter_mut() {
            *slot = None;
        }
        for (rank, state) in built {
            if entry.owns(rank) {
                entry.ranks[rank as usize] = Some(state);
            }
        }
        entry.last_periodic = entry
            .ranks
            .iter()
            .filter_map(|s| s.as_ref().and_then(|s| s.last_step))
            .max();
        for (rank, state) in entry.owned_ranks() {
            entry.shared.settle(rank, state.and_then(|s| s.last_step));
            let bytes = state.map_or(0, |s| s.resident_bytes(&config));
            entry.shared.set_resident(rank, bytes);
        }
        entry.pending.clear();
        entry.persisted = entry.applied;
        Ok(())
    }

    /// Applied pushes not yet covered by a state snapshot.
    pub fn dirty(&self, run: &str) -> u64 {
        self.runs.get(run).map_or(0, |e| e.applied - e.persisted)
    }

    /// Per rank: the last applied step (`None`: no data).
    pub fn rank_steps(&self, run: &str) -> Result<Vec<Option<u64>>, EngineError> {
        let entry = self
            .runs
            .get(run)
            .ok_or_else(|| EngineError::RunNotFound(run.to_string()))?;
        Ok(entry
            .ranks
            .iter()
            .map(|s| s.as_ref().and_then(|s| s.last_step))
            .collect())
    }

    /// Copies one profile of every rank that holds data (for `compare`
    /// against the live EMA).
    pub fn export_all(
        &self,
        run: &str,
        profile: &str,
    ) -> Result<Vec<(u32, EmaExport)>, EngineError> {
        let entry = self
            .runs
            .get(run)
            .ok_or_else(|| EngineError::RunNotFound(run.to_string()))?;
        let mut out = Vec::new();
        for (rank, state) in entry.ranks.iter().enumerate() {
            if state.is_some() {
                out.push((rank as u32, self.export_ema(run, rank as u32, profile)?));
            }
        }
        Ok(out)
    }

    /// Copies one rank's EMA of one profile (device-side copy; the caller
    /// moves it to the host and serialises it off this thread).
    pub fn export_ema(
        &self,
        run: &str,
        rank: u32,
        profile: &str,
    ) -> Result<EmaExport, EngineError> {
        let entry = self
            .runs
            .get(run)
            .ok_or_else(|| EngineError::RunNotFound(run.to_string()))?;
        let p = entry
            .config
            .profile_index(profile)
            .ok_or_else(|| EngineError::UnknownProfile(profile.to_string()))?;
        let state = entry
            .ranks
            .get(rank as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| EngineError::NoData {
                run: run.to_string(),
                rank,
            })?;
        Ok(EmaExport {
            layout: state.layout.clone(),
            ema: deep_copy(&state.ema[p])?,
            copied: state
                .copied
                .iter()
                .map(deep_copy)
                .collect::<Result<_, _>>()?,
            last_step: state.last_step,
            ema_dtype: entry.config.ema_dtype,
        })
    }
}

impl EmaExport {
    /// Moves the copy to host memory, optionally casting the averaged
    /// tensors. Runs on a blocking thread.
    pub fn to_host(mut self, cast: Option<Kind>) -> Result<Self, EngineError> {
        if let Some(kind) = cast {
            self.ema = self.ema.f_to_kind(kind)?;
        }
        self.ema = self.ema.f_to_device(Device::Cpu)?.f_contiguous()?;
        self.copied = self
            .copied
            .into_iter()
            .map(|t| t.f_to_device(Device::Cpu).and_then(|t| t.f_contiguous()))
            .collect::<Result<_, _>>()?;
        Ok(self)
    }
}

/// What a trainer that restarted from a checkpoint should do, for the
/// `step_conflict` answers: a restart without `resume` is the usual cause.
fn resume_hint(run: &str, last: u64) -> String {
    format!(
        "a trainer restarted from a checkpoint first restores the EMA with `run.resume(S)` \
         (POST /v1/runs/{run}/resume {{\"step\": S}}, S = the last step the checkpoint pushed), \
         then pushes S + 1 onward; otherwise push steps after {last}"
    )
}

/// Takes part in the periodic cut of `step` when it is one: the first
/// engine of the run to get there opens it (unless the run's write backlog
/// has no room: then it is skipped, and said so); the run's other engines
/// join the same snapshot when one of their ranks gets there.
fn open_periodic(
    entry: &mut EngineRun,
    run: &str,
    step: u64,
    captures: &mpsc::UnboundedSender<CaptureEvent>,
    limit: u64,
) {
    let config = entry.config.clone();
    if config.snapshot_every == 0
        || step % config.snapshot_every != 0
        || entry.pending.iter().any(|c| c.step == step)
    {
        return;
    }
    let shared = entry.shared.clone();
    let decision = shared.periodic(step, entry.last_periodic, || {
        // Every profile, copied tensor and mirror of every rank.
        let bytes = shared.resident_bytes();
        match Backlog::take(&shared.periodic_backlog, bytes, limit) {
            Ok(backlog) => {
                let snapshot = shared.periodic_id(step);
                let _ = captures.send(CaptureEvent::PeriodicOpened {
                    snapshot: snapshot.clone(),
                    run: run.to_string(),
                    step,
                    profiles: config
                        .profiles
                        .iter()
                        .map(|p| p.name().to_string())
                        .collect(),
                    backlog,
                });
                Some(snapshot)
            }
            Err(held) => {
                let _ = captures.send(CaptureEvent::PeriodicSkipped {
                    run: run.to_string(),
                    step,
                    held,
                    bytes,
                });
                None
            }
        }
    });
    // Decided once per step, taken or skipped: a rank that applies the
    // step later must not open a cut others are already past.
    entry.last_periodic = entry.last_periodic.max(Some(step));
    let snapshot = match decision {
        Periodic::Decided(Some(id)) | Periodic::Join(id) => id,
        Periodic::Decided(None) | Periodic::Nothing => return,
    };
    let profiles: Vec<usize> = (0..config.profiles.len()).collect();
    let mut remaining = std::collections::BTreeSet::new();
    for (rank, state) in entry.owned_ranks() {
        match state.and_then(|s| s.last_step) {
            // A rank of this engine went past the step without applying
            // it (before this engine heard of the cut).
            Some(last) if last > step => {
                let _ = captures.send(CaptureEvent::Failed {
                    snapshot,
                    reason: format!(
                        "rank {rank} went from before step {step} to step {last} without applying it"
                    ),
                });
                return;
            }
            _ => {
                remaining.insert(rank);
            }
        }
    }
    entry.pending.push(PendingCut {
        snapshot,
        step,
        profiles,
        remaining,
    });
}

/// Captures `rank` for the cuts waiting on `step` and fails the cuts it
/// jumped over; drops the cuts that are done.
fn capture_waiting(
    entry: &mut EngineRun,
    rank: u32,
    step: u64,
    captures: &mpsc::UnboundedSender<CaptureEvent>,
) {
    let config = entry.config.clone();
    let state = entry.ranks[rank as usize]
        .as_ref()
        .expect("rank state present");
    let mut finished = Vec::new();
    for (i, cut) in entry.pending.iter_mut().enumerate() {
        if !cut.remaining.contains(&rank) {
            continue;
        }
        if cut.step == step {
            match capture_rank(&config, state, &cut.snapshot, rank, &cut.profiles) {
                Ok(c) => {
                    let _ = captures.send(CaptureEvent::Captured(Box::new(c)));
                    cut.remaining.remove(&rank);
                    if cut.remaining.is_empty() {
                        finished.push(i);
                    }
                }
                Err(e) => {
                    let _ = captures.send(CaptureEvent::Failed {
                        snapshot: cut.snapshot.clone(),
                        reason: format!("capturing rank {rank} failed: {e}"),
                    });
                    finished.push(i);
                }
            }
        } else if step > cut.step {
            let _ = captures.send(CaptureEvent::Failed {
                snapshot: cut.snapshot.clone(),
                reason: format!(
                    "rank {rank} went from before step {} to step {step} without applying it",
                    cut.step
                ),
            });
            finished.push(i);
        }
    }
    for i in finished.into_iter().rev() {
        entry.pending.remove(i);
    }
}

/// The refusal of a push past the step a run was finished at.
fn finished_error(run: &str, FinishedAt(last): FinishedAt) -> EngineError {
    let at = last.map_or("before any push".to_string(), |l| format!("at step {l}"));
    EngineError::RunFinished(format!(
        "run `{run}` was finished {at}; it takes no more pushes (create a new run to train on)"
    ))
}

/// Step rules (`docs/contract.md`, step semantics) for a rank that pushed
/// before: an older step is refused, the last step again is a duplicate
/// (answered without applying) when its bytes are the same and refused
/// otherwise. `None`: apply it.
fn step_rules(
    run: &str,
    rank: u32,
    step: u64,
    state: &RankState,
    push: &ParsedPush,
    config: &RunConfig,
) -> Result<Option<PushOutcome>, EngineError> {
    let Some(last) = state.last_step else {
        return Ok(None);
    };
    // A pipelined push applied, its answer lost, retried after its
    // successor was applied: the same bytes are a duplicate.
    let seen_before = step < last
        && state
            .recent
            .iter()
            .any(|&(s, d)| s == step && d.matches(push.digest, &push.body));
    if seen_before {
        return Ok(Some(duplicate(step, last, state, config)));
    }
    if step < last {
        return Err(EngineError::StepConflict(format!(
            "step {step} is older than rank {rank}'s last applied step {last}; {}",
            resume_hint(run, last)
        )));
    }
    if step > last {
        return Ok(None);
    }
    if state
        .last_digest
        .is_some_and(|d| d.matches(push.digest, &push.body))
    {
        return Ok(Some(duplicate(step, last, state, config)));
    }
    Err(EngineError::StepConflict(format!(
        "step {step} was already applied for rank {rank} with other bytes; {}",
        resume_hint(run, last)
    )))
}

/// The answer to a push whose bytes were already applied at `step`.
fn duplicate(step: u64, last: u64, state: &RankState, config: &RunConfig) -> PushOutcome {
    PushOutcome {
        applied: false,
        duplicate: true,
        step,
        last_step: Some(last),
        skipped: Vec::new(),
        registered: None,
        resident_bytes: state.resident_bytes(config),
        apply_seconds: 0.0,
        drift: None,
        logical_bytes: 0,
        mirror_mismatch: None,
    }
}

/// A delta or XOR push needs a mirror and a keyframe to apply to.
fn check_relative(
    push: &ParsedPush,
    config: &RunConfig,
    rank: u32,
    state: Option<&RankState>,
) -> Result<(), EngineError> {
    if !push.kind.is_relative() {
        return Ok(());
    }
    if !config.mirror {
        return Err(EngineError::NeedsKeyframe(
            "needs keyframe: delta and xor pushes need a run created with `mirror: true`".into(),
        ));
    }
    if !state.is_some_and(|s| s.has_keyframe) {
        return Err(EngineError::NeedsKeyframe(format!(
            "needs keyframe: rank {rank} has no full push to add a delta to (none yet, or the rank was taken over from a lost node and its mirror may be behind the trainer's)"
        )));
    }
    Ok(())
}

/// A keyframe checks the client's idea of the mirror against the mirror,
/// before it overwrites (and so repairs) it.
fn mirror_mismatch(
    push: &ParsedPush,
    state: &RankState,
    order: &[usize],
) -> Result<Option<rank::MirrorMismatch>, EngineError> {
    match push.mirror_crc32 {
        Some(claimed)
            if push.kind == crate::wire::PushKind::Full
                && state.has_keyframe
                && state.mirror.is_some() =>
        {
            let found = state.mirror_crc32(order)?;
            Ok((found != claimed).then_some(rank::MirrorMismatch {
                client_crc32: format!("{claimed:08x}"),
                server_crc32: format!("{found:08x}"),
            }))
        }
        _ => Ok(None),
    }
}

/// A new snapshot id: a ULID in lower case (26 characters, 48 bits of
/// milliseconds then 80 random bits), unique across runs and servers and
/// ordered by creation time as a string; safe as a path component. Ids
/// made in the same millisecond by this process increase by one, so they
/// stay ordered too. (Catalogs written before keep their
/// `<kind>-<step>-<4 hex>` ids: ids are opaque everywhere else.)
pub fn snapshot_id(_kind: SnapshotKind, _step: u64) -> String {
    static GENERATOR: std::sync::Mutex<ulid::Generator> =
        std::sync::Mutex::new(ulid::Generator::new());
    let mut generator = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    let id = match generator.generate() {
        Ok(id) => id,
        // 2^80 ids in one millisecond: start a fresh random sequence.
        Err(_) => ulid::Ulid::new(),
    };
    id.to_string().to_ascii_lowercase()
}

/// A new tensor with the same values, on the same device.
pub fn deep_copy(t: &Tensor) -> Result<Tensor, tch::TchError> {
    let mut out = t.f_empty_like()?;
    out.f_copy_(t)?;
    Ok(out)
}

/// A contiguous host tensor viewed as bytes, kept alive by the `Bytes` that
/// owns it: responses stream tensor memory without copying it.
struct HostTensorBytes {
    tensor: Tensor,
    len: usize,
}

// SAFETY: the tensor is only read through `as_ref`; tch tensors are `Send`.
impl AsRef<[u8]> for HostTensorBytes {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `tensor` is a contiguous CPU tensor of `len` bytes, owned
        // by `self` and never written while shared.
        unsafe { std::slice::from_raw_parts(self.tensor.data_ptr() as *const u8, self.len) }
    }
}

/// The bytes of a contiguous CPU tensor, without a copy.
pub fn host_bytes(tensor: Tensor) -> bytes::Bytes {
    debug_assert!(tensor.device() == Device::Cpu && tensor.is_contiguous());
    let len = tensor.numel() * tensor.kind().elt_size_in_bytes();
    bytes::Bytes::from_owner(HostTensorBytes { tensor, len })
}

#[cfg(test)]
mod snapshot_id_tests {
    use super::{snapshot_id, SnapshotKind};

    /// 100,000 ids made by four threads (as runs on different engines and
    /// tasks would): all distinct, and every thread's ids increase, so
    /// sorting ids sorts snapshots by creation; the time part is now.
    #[test]
    fn ids_are_unique_and_ordered_by_creation() {
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let threads: Vec<_> = (0..4)
            .map(|t| {
                std::thread::spawn(move || {
                    (0..25_000)
                        .map(|i| {
                            snapshot_id(
                                [SnapshotKind::Manual, SnapshotKind::State][(i + t) % 2],
                                i as u64,
                            )
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let per_thread: Vec<Vec<String>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let mut all = std::collections::HashSet::new();
        for ids in &per_thread {
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids not increasing");
            for id in ids {
                assert_eq!(id.len(), 26);
                assert!(id
                    .bytes()
                    .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase()));
                assert!(all.insert(id.clone()), "duplicate id {id}");
            }
        }
        assert_eq!(all.len(), 100_000);
        // The first 10 characters are the creation time in milliseconds.
        let first = ulid::Ulid::from_string(&per_thread[0][0].to_ascii_uppercase()).unwrap();
        let last = ulid::Ulid::from_string(&per_thread[0][24_999].to_ascii_uppercase()).unwrap();
        assert!(first.timestamp_ms() >= before && last.timestamp_ms() >= first.timestamp_ms());
        // One id made after all the others sorts after every one of them.
        let later = snapshot_id(SnapshotKind::Manual, 0);
        assert!(all.iter().all(|id| *id < later));
    }
}
