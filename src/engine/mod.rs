//! The engine: one OS thread per device that owns every tensor.
//!
//! tch tensors are `Send` but not `Sync`, and grad mode is per thread, so no
//! tensor lives in shared async state. Callers send the engine a typed
//! [`Command`] (one variant per kind of work, each carrying its oneshot reply
//! channel) through a bounded queue and await the reply. Work a client
//! retries (pushes, exports) is refused at once when the queue is full
//! ([`EngineError::QueueFull`], which the HTTP layer answers with 429 and
//! `Retry-After`); control work waits for room.
//!
//! - [`queue`]: the commands, the engine thread's loop and its handle.
//! - [`error`]: the failures of engine work.
//! - [`spread`]: a run's ranks over several engines; run-wide commands fan
//!   out to each and their answers are merged.
//! - [`steps`]: the step rules a push is checked against.
//! - [`cuts`]: periodic cuts, and captures for the cuts waiting on a step.
//! - [`capture`]: what a cut captures, and ranks restored from snapshots.
//! - [`shared`]: what the engines of one run share.
//! - [`schedule`]: decay schedules, pure functions.
//! - [`rank`]: one rank's layout, flat buffers and the update path.
//! - [`kernels`]: the fused multi-profile CPU update.
//! - [`device`]: device names and availability.
//! - [`ids`]: snapshot ids; [`tensors`]: tensor copies and zero-copy bytes.

pub mod capture;
mod cuts;
pub mod device;
pub mod error;
mod ids;
pub mod kernels;
pub mod queue;
pub mod rank;
pub mod schedule;
pub mod shared;
pub mod spread;
mod steps;
mod tensors;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use tch::{Device, Kind, Tensor};
use tokio::sync::mpsc;

use crate::run::{EmaDtype, NonfinitePolicy, RunConfig};
use crate::wire::ParsedPush;
use capture::{capture_rank, CaptureEvent, PendingCut, RankCapture, RestoredRank};
use cuts::{capture_waiting, open_periodic};
use rank::{PushOutcome, RankLayout, RankState};
use shared::RunShared;
use steps::{check_relative, finished_error, mirror_mismatch, step_rules};

pub use error::EngineError;
pub use ids::snapshot_id;
pub use queue::{Command, CommandKind, EngineHandle};
pub use tensors::{deep_copy, host_bytes};

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

/// What one engine's part of a `state` snapshot covers
/// ([`Engine::state_plan`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatePlan {
    /// The engine's count of pushes applied when the plan was made.
    pub mark: u64,
    /// Some of those are not persisted yet.
    pub dirty: bool,
    /// The ranks holding data, in order, each with its last step then.
    pub ranks: Vec<(u32, u64)>,
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

    /// What a crash-recovery `state` snapshot of `run` covers, before
    /// anything is copied: the mark of the pushes applied so far, whether
    /// any of them is not persisted yet, and the ranks holding data with
    /// their steps (what the snapshot's row says until it completes). The
    /// writer then copies one rank at a time ([`Self::capture_rank_state`]),
    /// so its copies never hold more than the ranks it is writing. Pushes
    /// applied after the mark stay dirty, whichever rank they reached: the
    /// run stays dirty until [`Self::mark_persisted`] is told the snapshot
    /// completed (a failed write is retried).
    pub fn state_plan(&self, run: &str) -> Result<StatePlan, EngineError> {
        let entry = self
            .runs
            .get(run)
            .ok_or_else(|| EngineError::RunNotFound(run.to_string()))?;
        Ok(StatePlan {
            mark: entry.applied,
            dirty: entry.applied != entry.persisted,
            ranks: entry
                .ranks
                .iter()
                .enumerate()
                .filter_map(|(rank, s)| s.as_ref().map(|s| (rank as u32, s.last_step.unwrap_or(0))))
                .collect(),
        })
    }

    /// Copies one rank of `run` for a `state` snapshot, at its own last
    /// step; `None` when it holds no data (any more).
    pub fn capture_rank_state(
        &self,
        run: &str,
        snapshot: &str,
        rank: u32,
    ) -> Result<Option<RankCapture>, EngineError> {
        let entry = self
            .runs
            .get(run)
            .ok_or_else(|| EngineError::RunNotFound(run.to_string()))?;
        let Some(Some(s)) = entry.ranks.get(rank as usize) else {
            return Ok(None);
        };
        let profiles: Vec<usize> = (0..entry.config.profiles.len()).collect();
        capture_rank(&entry.config, s, snapshot, rank, &profiles).map(Some)
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
