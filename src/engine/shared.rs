//! What the engines holding one run's ranks share.
//!
//! With `--engines N` (or several devices) a run's ranks live on several
//! engine threads. Most of a run's work is per rank and stays on the
//! rank's engine; three decisions are the run's and must be taken once for
//! all of its engines:
//!
//! - **Finishing.** A run is finished at its furthest rank's step, and no
//!   later push may pass it on any engine. Each push *claims* its step
//!   before it is applied and *settles* the rank's real last step after;
//!   [`RunShared::finish`] takes the highest claim, under the same lock,
//!   so a push in flight on another engine cannot slip past it.
//! - **Periodic cuts.** The first rank (on any engine) that applies a
//!   multiple of `snapshot_every` decides the cut for that step, taken or
//!   skipped; the other engines join the same snapshot id when one of their
//!   ranks gets there ([`RunShared::periodic`]).
//! - **The write backlog** of periodic cuts, one budget for the run.
//!
//! One uncontended lock per push: nothing here waits on an apply.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::FinishedAt;

/// How many decided periodic steps a run remembers for engines that have
/// not joined them yet (an engine whose ranks lag further behind than
/// this many cuts fails to join, and the cut times out with its reason).
const REMEMBERED_CUTS: usize = 8;

/// A periodic cut decided for a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenedCut {
    pub step: u64,
    /// `None`: skipped (the backlog had no room).
    pub snapshot: Option<String>,
}

/// What an engine does for the periodic cut of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Periodic {
    /// This engine already took part, or the step was skipped (or decided
    /// so long ago that it is forgotten).
    Nothing,
    /// This engine decided the step: the snapshot it opened, `None` when it
    /// skipped the cut.
    Decided(Option<String>),
    /// Another engine opened this snapshot for the step: join it.
    Join(String),
}

/// Why a push may not claim its step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The run is finished there.
    Finished(FinishedAt),
    /// A finish across nodes is being agreed on and the step is past this
    /// node's furthest: retry shortly (it is taken if the finish lands at
    /// or past it).
    Held,
}

#[derive(Debug, Default)]
struct Inner {
    finished: Option<FinishedAt>,
    /// A finish across nodes holds the run at this step (the node's
    /// furthest claim when it was asked) until this instant, unless it is
    /// committed or released before.
    held: Option<(Option<u64>, std::time::Instant)>,
    /// Per rank: the highest step a push in flight may leave it at, or
    /// its last applied step once settled.
    claimed: Vec<Option<u64>>,
    /// The last step a periodic cut was decided for.
    decided: Option<u64>,
    recent: VecDeque<OpenedCut>,
}

/// Shared by every engine holding a rank of one run.
#[derive(Debug)]
pub struct RunShared {
    inner: Mutex<Inner>,
    /// Bytes captured by open periodic cuts and not yet written.
    pub periodic_backlog: Arc<AtomicU64>,
    /// Per rank: the bytes its buffers hold (for the backlog's estimate of
    /// a whole cut).
    resident: Vec<AtomicU64>,
    /// What a periodic cut's id is made from when the run's ranks are
    /// spread over several nodes: the run's creation time and a hash of its
    /// name and that time (see [`Self::periodic_id`]).
    cut_seed: Option<(u64, u64)>,
    /// The furthest step whose periodic cut the snapshot writer has
    /// recorded in the catalog (or given up recording): a push that opened
    /// one is answered once it is listed.
    recorded: tokio::sync::watch::Sender<Option<u64>>,
}

impl RunShared {
    pub fn new(world_size: u32) -> Arc<Self> {
        Self::build(world_size, None)
    }

    /// The shared state of run `name` created at `created_at_ms`, whose
    /// ranks other nodes hold too: its periodic cuts get ids every node
    /// agrees on.
    pub fn spread(world_size: u32, name: &str, created_at_ms: i64) -> Arc<Self> {
        let hash = xxhash_rust::xxh3::xxh3_64(format!("{name}\0{created_at_ms}").as_bytes());
        Self::build(world_size, Some((created_at_ms.max(0) as u64, hash)))
    }

    fn build(world_size: u32, cut_seed: Option<(u64, u64)>) -> Arc<Self> {
        Arc::new(RunShared {
            inner: Mutex::new(Inner {
                claimed: vec![None; world_size as usize],
                ..Inner::default()
            }),
            periodic_backlog: Arc::new(AtomicU64::new(0)),
            resident: (0..world_size).map(|_| AtomicU64::new(0)).collect(),
            cut_seed,
            recorded: tokio::sync::watch::Sender::new(None),
        })
    }

    /// The id of the run's periodic cut at `step`. A run on one node gets
    /// a fresh id. A run spread over nodes gets the same id on every node
    /// (each opens the cut for its own ranks, and they meet in one catalog
    /// row): a ULID whose time is the run's creation plus `step`
    /// milliseconds, so its periodic cuts sort by step.
    pub fn periodic_id(&self, step: u64) -> String {
        let Some((created, hash)) = self.cut_seed else {
            return super::snapshot_id(crate::contract::SnapshotKind::Periodic, step);
        };
        let time = created.wrapping_add(step) & ((1 << 48) - 1);
        // The time already tells the steps apart; the hash, the runs.
        let random = (hash as u128) << 16 | (step as u128 & 0xffff);
        ulid::Ulid::from_parts(time, random)
            .to_string()
            .to_ascii_lowercase()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn finished(&self) -> Option<FinishedAt> {
        self.lock().finished
    }

    /// Before a push of `step` to `rank`: refused when the run is finished
    /// before `step` (the caller answers with [`FinishedAt`]), else the step
    /// is claimed until [`Self::settle`].
    pub fn claim(&self, rank: u32, step: u64) -> Result<(), Refused> {
        let mut inner = self.lock();
        if let Some(at @ FinishedAt(last)) = inner.finished {
            if last.is_none_or(|last| step > last) {
                return Err(Refused::Finished(at));
            }
        }
        if let Some((at, until)) = inner.held {
            if std::time::Instant::now() >= until {
                inner.held = None;
            } else if at.is_none_or(|at| step > at) {
                return Err(Refused::Held);
            }
        }
        if let Some(slot) = inner.claimed.get_mut(rank as usize) {
            *slot = (*slot).max(Some(step));
        }
        Ok(())
    }

    /// After a push (applied or not), or a restore: `rank`'s real last step.
    pub fn settle(&self, rank: u32, last_step: Option<u64>) {
        if let Some(slot) = self.lock().claimed.get_mut(rank as usize) {
            *slot = last_step;
        }
    }

    /// Finishes the run at the furthest step any rank applied or is
    /// applying (once; a finished run keeps its step).
    pub fn finish(&self) -> FinishedAt {
        let mut inner = self.lock();
        if let Some(at) = inner.finished {
            return at;
        }
        let at = FinishedAt(inner.claimed.iter().flatten().copied().max());
        inner.finished = Some(at);
        at
    }

    /// Restores the finished mark from the catalog (at start), or sets the
    /// step a finish across nodes agreed on (which ends its hold).
    pub fn set_finished(&self, at: Option<FinishedAt>) {
        let mut inner = self.lock();
        inner.finished = at;
        inner.held = None;
    }

    /// The first phase of a finish across nodes: no push past this node's
    /// furthest claim is taken for `ttl` (or until [`Self::set_finished`]
    /// or [`Self::release`]); answers that claim (a finished run: its
    /// step).
    pub fn hold(&self, ttl: std::time::Duration) -> FinishedAt {
        let mut inner = self.lock();
        if let Some(at) = inner.finished {
            return at;
        }
        let at = inner.claimed.iter().flatten().copied().max();
        inner.held = Some((at, std::time::Instant::now() + ttl));
        FinishedAt(at)
    }

    /// A finish across nodes was given up: pushes go on.
    pub fn release(&self) {
        self.lock().held = None;
    }

    pub fn set_resident(&self, rank: u32, bytes: u64) {
        if let Some(r) = self.resident.get(rank as usize) {
            r.store(bytes, Ordering::Relaxed);
        }
    }

    /// What one rank's buffers hold.
    pub fn resident(&self, rank: u32) -> u64 {
        self.resident
            .get(rank as usize)
            .map_or(0, |r| r.load(Ordering::Relaxed))
    }

    /// What every rank's buffers hold (a whole cut's bytes).
    pub fn resident_bytes(&self) -> u64 {
        self.resident
            .iter()
            .map(|r| r.load(Ordering::Relaxed))
            .sum()
    }

    /// A rank of an engine that last took part in the periodic cut of
    /// `joined` applied `step`, a cut step. The first engine to get there
    /// decides, by calling `decide` under the lock: it opens the snapshot
    /// (and says so to the snapshot writer) or skips it, returning the id
    /// or `None`. Holding the lock while it does so means no other engine
    /// can join, capture and report a part of that snapshot before the
    /// writer has heard of it.
    pub fn periodic(
        &self,
        step: u64,
        joined: Option<u64>,
        decide: impl FnOnce() -> Option<String>,
    ) -> Periodic {
        if joined.is_some_and(|j| j >= step) {
            return Periodic::Nothing;
        }
        let mut inner = self.lock();
        if inner.decided.is_none_or(|d| d < step) {
            let snapshot = decide();
            inner.decided = Some(step);
            inner.recent.push_back(OpenedCut {
                step,
                snapshot: snapshot.clone(),
            });
            while inner.recent.len() > REMEMBERED_CUTS {
                inner.recent.pop_front();
            }
            return Periodic::Decided(snapshot);
        }
        match inner.recent.iter().find(|c| c.step == step) {
            Some(OpenedCut {
                snapshot: Some(id), ..
            }) => Periodic::Join(id.clone()),
            _ => Periodic::Nothing,
        }
    }

    /// Whether a periodic cut was opened (not skipped) at `step`, among
    /// the ones remembered.
    pub fn opened_cut(&self, step: u64) -> bool {
        self.lock()
            .recent
            .iter()
            .any(|c| c.step == step && c.snapshot.is_some())
    }

    /// The snapshot writer recorded the periodic cut of `step` (or gave up).
    pub fn cut_recorded(&self, step: u64) {
        self.recorded.send_modify(|s| *s = (*s).max(Some(step)));
    }

    /// Waits at most `within` for the periodic cut of `step` to be
    /// recorded; whether it was.
    pub async fn wait_cut_recorded(&self, step: u64, within: std::time::Duration) -> bool {
        let mut rx = self.recorded.subscribe();
        let listed = tokio::time::timeout(within, rx.wait_for(|s| s.is_some_and(|s| s >= step)))
            .await
            .is_ok_and(|seen| seen.is_ok());
        listed
    }

    /// Periodic cuts opened after a restore start past `step`.
    pub fn reset_periodic(&self, step: Option<u64>) {
        let mut inner = self.lock();
        inner.decided = step;
        inner.recent.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn periodic_ids_are_the_same_on_every_node_and_sort_by_step() {
        let a = RunShared::spread(2, "run", 1_700_000_000_000);
        let b = RunShared::spread(4, "run", 1_700_000_000_000);
        assert_eq!(a.periodic_id(10), b.periodic_id(10));
        assert_ne!(a.periodic_id(10), a.periodic_id(20));
        assert!(a.periodic_id(10) < a.periodic_id(20));
        // Another run (or the same name created again) gets other ids.
        let other = RunShared::spread(2, "run", 1_700_000_000_001);
        assert_ne!(a.periodic_id(10), other.periodic_id(9));
        assert_ne!(
            a.periodic_id(10),
            RunShared::spread(2, "r2", 1_700_000_000_000).periodic_id(10)
        );
        let id = a.periodic_id(10);
        assert_eq!(id.len(), 26);
        assert_eq!(id, id.to_ascii_lowercase());
        assert_eq!(
            ulid::Ulid::from_string(&id).unwrap().timestamp_ms(),
            1_700_000_000_010
        );
        // A run on one node: a fresh id each time.
        let alone = RunShared::new(2);
        assert_ne!(alone.periodic_id(10), alone.periodic_id(10));
    }

    #[test]
    fn finish_takes_the_highest_claim_and_refuses_later_steps() {
        let s = RunShared::new(3);
        s.claim(0, 4).unwrap();
        s.settle(0, Some(4));
        // Rank 2 is applying step 6 on another engine when the run finishes.
        s.claim(2, 6).unwrap();
        assert_eq!(s.finish(), FinishedAt(Some(6)));
        s.settle(2, Some(6));
        assert_eq!(s.claim(1, 7), Err(Refused::Finished(FinishedAt(Some(6)))));
        assert!(
            s.claim(1, 6).is_ok(),
            "a lagging rank may still reach the final step"
        );
        // Finishing again keeps the step.
        assert_eq!(s.finish(), FinishedAt(Some(6)));
    }

    #[test]
    fn a_hold_refuses_later_steps_until_committed_released_or_expired() {
        let s = RunShared::new(2);
        s.claim(0, 4).unwrap();
        s.settle(0, Some(4));
        assert_eq!(s.hold(Duration::from_secs(60)), FinishedAt(Some(4)));
        // Past the hold: retry later; at or below it: taken.
        assert_eq!(s.claim(1, 5), Err(Refused::Held));
        assert!(s.claim(1, 4).is_ok());
        s.settle(1, Some(4));
        // The finish lands further (another node was at 7): up to 7 taken.
        s.set_finished(Some(FinishedAt(Some(7))));
        assert!(s.claim(1, 7).is_ok());
        assert_eq!(s.claim(1, 8), Err(Refused::Finished(FinishedAt(Some(7)))));
        // Released: pushes go on.
        let r = RunShared::new(1);
        r.hold(Duration::from_secs(60));
        assert_eq!(r.claim(0, 1), Err(Refused::Held));
        r.release();
        assert!(r.claim(0, 1).is_ok());
        // Expired: the same.
        let e = RunShared::new(1);
        e.hold(Duration::from_millis(20));
        std::thread::sleep(Duration::from_millis(30));
        assert!(e.claim(0, 1).is_ok());
    }

    #[test]
    fn a_refused_push_does_not_move_the_finish_step() {
        let s = RunShared::new(2);
        s.claim(0, 3).unwrap();
        s.settle(0, Some(3));
        s.claim(1, 9).unwrap();
        // The push of step 9 was refused: the rank stays where it was.
        s.settle(1, Some(2));
        assert_eq!(s.finish(), FinishedAt(Some(3)));
    }

    #[test]
    fn a_run_finished_before_any_push_refuses_every_step() {
        let s = RunShared::new(1);
        assert_eq!(s.finish(), FinishedAt(None));
        assert_eq!(s.claim(0, 0), Err(Refused::Finished(FinishedAt(None))));
    }

    #[test]
    fn the_first_engine_at_a_step_decides_and_the_others_join() {
        let s = RunShared::new(4);
        let opened = s.periodic(10, None, || Some("a".into()));
        assert_eq!(opened, Periodic::Decided(Some("a".into())));
        // Another engine at the same step joins; it is never asked to decide.
        let joined = s.periodic(10, None, || panic!("decided twice"));
        assert_eq!(joined, Periodic::Join("a".into()));
        assert_eq!(s.periodic(10, Some(10), || panic!()), Periodic::Nothing);
        // A skipped step has nothing to join.
        assert_eq!(s.periodic(20, Some(10), || None), Periodic::Decided(None));
        assert_eq!(s.periodic(20, Some(10), || panic!()), Periodic::Nothing);
        // Old decisions are forgotten after a while.
        for k in 3..20u64 {
            let id = format!("c{k}");
            assert_eq!(
                s.periodic(10 * k, None, || Some(id.clone())),
                Periodic::Decided(Some(id.clone()))
            );
        }
        assert_eq!(s.periodic(10, None, || panic!()), Periodic::Nothing);
        assert_eq!(
            s.periodic(190, None, || panic!()),
            Periodic::Join("c19".into())
        );
        // After a restore to step 5 the next cut step is decided afresh.
        s.reset_periodic(Some(5));
        assert_eq!(
            s.periodic(10, Some(5), || Some("d".into())),
            Periodic::Decided(Some("d".into()))
        );
    }
}
