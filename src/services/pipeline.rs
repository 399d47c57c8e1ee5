//! Pipelined pushes: a rank may have several pushes in flight, each on its
//! own connection, and still have them applied in step order.
//!
//! A push names the step its client pushed before it (`Polyak-Prev-Step`).
//! Its body is received and validated at once, while the earlier push is
//! being applied; then it waits here until that predecessor has been
//! answered (applied, duplicate, or refused) or the rank already applied a
//! step at or past it, and only then goes to the engine, whose queue keeps
//! the order. Each push is answered after its own apply, so the contract
//! (applied, duplicate, drift) holds per push. At most `depth` pushes of a
//! rank wait at once (429 past it), and a predecessor that never arrives
//! times out with `409 predecessor_timeout`. A push without the header is
//! applied as soon as it is validated, as before.
//!
//! A predecessor answered with something its client retries (429, 408, a
//! server fault) is not answered for good: its successors would keep
//! waiting for the retry while holding their bodies, and so the in-flight
//! byte budget the retry needs. They are refused at once instead, with
//! `429 predecessor_retry` (each such refusal refuses its own successors in
//! turn), and the client sends them again after the predecessor. Deleting
//! or resuming a run forgets its ranks' order: pushes still waiting are
//! refused with `409 pipeline_reset`, and the next pushes start afresh.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::ServiceError;

/// The header naming a push's predecessor step.
pub const PREV_STEP: &str = "polyak-prev-step";

/// A run as the pipeline knows it: its name and when it was created, so
/// that a run deleted and created again under its name is another run.
pub type RunId<'a> = (&'a str, i64);

/// The waiting pushes of every rank.
pub struct Pipeline {
    lanes: Mutex<HashMap<(String, i64, u32), Arc<Lane>>>,
    timeout: Duration,
    depth: usize,
}

/// One rank's order.
struct Lane {
    state: watch::Sender<LaneState>,
    /// Pushes waiting for their predecessor now.
    waiting: AtomicUsize,
    /// Steps whose push has begun here (its headers read) and is not
    /// answered yet: a predecessor on its way.
    arrived: Mutex<BTreeSet<u64>>,
}

impl Lane {
    fn has_arrived(&self, step: u64) -> bool {
        self.arrived
            .lock()
            .expect("pipeline arrivals")
            .contains(&step)
    }
}

/// What a waiting push watches.
#[derive(Debug, Clone, Copy, Default)]
struct LaneState {
    /// The highest step answered for good on this rank.
    answered: Option<u64>,
    /// The latest push answered with something its client retries, and how
    /// many such answers the rank had (so a second refusal of the same
    /// step is seen as new).
    retried: Option<u64>,
    retries: u64,
    /// The run was deleted or resumed: the lane is no longer used.
    reset: bool,
}

/// Gives a waiting place back when the wait ends, however it ends.
struct Waiting(Arc<Lane>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Pipeline {
    pub fn new(timeout: Duration, depth: usize) -> Self {
        Pipeline {
            lanes: Mutex::new(HashMap::new()),
            timeout,
            depth: depth.max(1),
        }
    }

    fn lane(&self, (run, created): RunId<'_>, rank: u32) -> Arc<Lane> {
        let mut lanes = self.lanes.lock().expect("pipeline lanes");
        lanes
            .entry((run.to_string(), created, rank))
            .or_insert_with(|| {
                Arc::new(Lane {
                    state: watch::channel(LaneState::default()).0,
                    waiting: AtomicUsize::new(0),
                    arrived: Mutex::new(BTreeSet::new()),
                })
            })
            .clone()
    }

    /// A push of `step` has begun (its headers are read): a successor that
    /// waits for it with a grace ([`Pipeline::wait_for`]'s `lost_after`)
    /// knows it is on its way, however long its body takes to arrive.
    pub fn arrive(&self, run: RunId<'_>, rank: u32, step: u64) {
        let lane = self.lane(run, rank);
        lane.arrived.lock().expect("pipeline arrivals").insert(step);
    }

    /// Waits until `prev` was answered, or `applied()` (the rank's last
    /// applied step, read when the wait starts and on each answer) is at or
    /// past it. Fails at once when `prev` is answered with something its
    /// client retries meanwhile (429 `predecessor_retry`) or the run's order
    /// is forgotten (409 `pipeline_reset`). With `lost_after` (a rank taken
    /// over from a lost node, whose predecessor may have been applied there
    /// only), a predecessor whose push has not begun here within that time
    /// is taken as lost and the wait ends; one that has begun is waited for
    /// as usual.
    #[allow(clippy::too_many_arguments)]
    pub async fn wait_for(
        &self,
        run: RunId<'_>,
        rank: u32,
        step: u64,
        prev: u64,
        applied: impl Fn() -> Option<u64>,
        retry_after: u64,
        lost_after: Option<Duration>,
    ) -> Result<(), ServiceError> {
        let lane = self.lane(run, rank);
        if lane.waiting.fetch_add(1, Ordering::AcqRel) >= self.depth {
            lane.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(ServiceError::busy(
                format!(
                    "rank {rank} already has {} pushes waiting for their predecessors",
                    self.depth
                ),
                retry_after,
            ));
        }
        let _place = Waiting(lane.clone());
        let mut rx = lane.state.subscribe();
        let seen_retries = rx.borrow().retries;
        let deadline = tokio::time::Instant::now() + self.timeout;
        let grace = lost_after.map(|d| (tokio::time::Instant::now() + d).min(deadline));
        loop {
            let state = *rx.borrow_and_update();
            if state.reset {
                return Err(ServiceError::conflict(
                    "pipeline_reset",
                    format!(
                        "step {step} was waiting for its predecessor step {prev} when the run was deleted or resumed; push it again without {PREV_STEP} if the run still exists"
                    ),
                ));
            }
            if state.answered.is_some_and(|s| s >= prev) || applied().is_some_and(|s| s >= prev) {
                return Ok(());
            }
            if state.retries != seen_retries && state.retried == Some(prev) {
                return Err(ServiceError {
                    code: "predecessor_retry",
                    ..ServiceError::busy(
                        format!(
                            "step {step} waits for step {prev}, which was answered with a retry; send step {step} again after step {prev}"
                        ),
                        retry_after,
                    )
                });
            }
            // Still within the grace, with the predecessor not begun here:
            // wake at the grace's end to look again.
            let waiting_to_arrive = grace.filter(|_| !lane.has_arrived(prev));
            if let Some(end) = waiting_to_arrive {
                if tokio::time::Instant::now() >= end {
                    return Ok(());
                }
            }
            let wake = waiting_to_arrive.unwrap_or(deadline);
            match tokio::time::timeout_at(wake, rx.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) => return Ok(()),
                Err(_) if wake < deadline => continue,
                Err(_) => {
                    return Err(ServiceError::conflict(
                        "predecessor_timeout",
                        format!(
                            "step {step} waited {:.1}s for its predecessor step {prev} (Polyak-Prev-Step), which was never pushed; push step {prev} or send a keyframe without the header",
                            self.timeout.as_secs_f64()
                        ),
                    ))
                }
            }
        }
    }

    /// `step` of `rank` has been answered for good: pushes waiting for it
    /// go on.
    pub fn answered(&self, run: RunId<'_>, rank: u32, step: u64) {
        let lane = self.lane(run, rank);
        lane.arrived
            .lock()
            .expect("pipeline arrivals")
            .retain(|s| *s > step);
        lane.state.send_modify(|s| {
            s.answered = Some(s.answered.map_or(step, |a| a.max(step)));
        });
    }

    /// `step` of `rank` was answered with something its client retries
    /// (busy, too slow, a server fault): pushes waiting for it are refused
    /// with `429 predecessor_retry`, so they give their bodies (and budget)
    /// back while the retry is under way.
    pub fn retry_later(&self, run: RunId<'_>, rank: u32, step: u64) {
        let lane = self.lane(run, rank);
        lane.arrived
            .lock()
            .expect("pipeline arrivals")
            .remove(&step);
        lane.state.send_modify(|s| {
            s.retried = Some(step);
            s.retries += 1;
        });
    }

    /// Forgets the ranks of every run named `run` (the run was deleted, or
    /// resumed from a snapshot): pushes waiting now are refused with
    /// `409 pipeline_reset`, and the next pushes start with no order.
    pub fn forget(&self, run: &str) {
        let mut lanes = self.lanes.lock().expect("pipeline lanes");
        lanes.retain(|(r, _, _), lane| {
            if r == run {
                lane.state.send_modify(|s| s.reset = true);
            }
            r != run
        });
    }

    /// Ranks whose order is kept (for tests).
    pub fn lanes(&self) -> usize {
        self.lanes.lock().expect("pipeline lanes").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: RunId<'static> = ("r", 1);
    const OTHER: RunId<'static> = ("other", 1);

    #[tokio::test]
    async fn waits_for_the_predecessor_then_times_out() {
        let p = Arc::new(Pipeline::new(Duration::from_millis(300), 2));
        // Already applied: no wait.
        p.wait_for(R, 0, 5, 4, || Some(4), 1, None).await.unwrap();
        // Waits until step 6 is answered.
        let waiter = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for(R, 0, 7, 6, || None, 1, None).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        p.answered(R, 0, 6);
        waiter.await.unwrap().unwrap();
        // Never answered: a clear 409.
        let err = p.wait_for(R, 1, 9, 8, || None, 1, None).await.unwrap_err();
        assert_eq!((err.status(), err.code), (409, "predecessor_timeout"));
        // Bounded: a third waiter on one rank is refused at once.
        let a = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for(R, 2, 20, 19, || None, 1, None).await })
        };
        let b = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for(R, 2, 21, 20, || None, 1, None).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let err = p
            .wait_for(R, 2, 22, 21, || None, 1, None)
            .await
            .unwrap_err();
        assert_eq!(err.status(), 429);
        p.answered(R, 2, 20);
        a.await.unwrap().unwrap();
        b.await.unwrap().unwrap();
    }

    /// A rank taken over from a lost node: its first pushes may name a
    /// predecessor applied on the lost node only. A predecessor that never
    /// begins here is taken as lost after the grace; one that has begun
    /// (however slow its body) is waited for, so two pushes resent at once
    /// still apply in step order.
    #[tokio::test]
    async fn after_a_failover_only_a_predecessor_that_never_began_is_skipped() {
        let p = Arc::new(Pipeline::new(Duration::from_secs(30), 4));
        let grace = Some(Duration::from_millis(200));
        // Never begun: the wait ends after the grace, not the timeout.
        let t = tokio::time::Instant::now();
        p.wait_for(R, 0, 11, 10, || Some(2), 1, grace)
            .await
            .unwrap();
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(5));
        // Step 5's push began before step 6 waited: step 6 waits past the
        // grace until step 5 is answered.
        p.arrive(R, 1, 5);
        let six = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for(R, 1, 6, 5, || Some(2), 1, grace).await })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!six.is_finished());
        p.answered(R, 1, 5);
        six.await.unwrap().unwrap();
        // Step 8's push begins while step 9 already waits, within the grace:
        // step 9 waits for it too.
        let nine = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for(R, 2, 9, 8, || Some(2), 1, grace).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        p.arrive(R, 2, 8);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!nine.is_finished());
        p.answered(R, 2, 8);
        nine.await.unwrap().unwrap();
        // Answers forget what arrived: a later wait on step 8 of rank 2 is
        // not held by it.
        assert!(!p.lane(R, 2).has_arrived(8));
    }

    #[tokio::test]
    async fn a_retried_predecessor_refuses_its_waiting_successors() {
        let p = Arc::new(Pipeline::new(Duration::from_secs(30), 4));
        // Step 3 was refused busy before step 4 started waiting: step 4 waits
        // (the retry may come through) ...
        p.retry_later(R, 0, 3);
        let four = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for(R, 0, 4, 3, || None, 2, None).await })
        };
        let five = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for(R, 0, 5, 4, || None, 2, None).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!four.is_finished() && !five.is_finished());
        // ... a waiter on another step is not concerned ...
        p.retry_later(R, 0, 9);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!four.is_finished());
        // ... and the retry of step 3 refused again refuses step 4 at once,
        // with a retry delay; step 4's refusal is told on to step 5.
        p.retry_later(R, 0, 3);
        let err = four.await.unwrap().unwrap_err();
        assert_eq!(
            (err.status(), err.code, err.retry_after),
            (429, "predecessor_retry", Some(2))
        );
        assert!(!five.is_finished());
        p.retry_later(R, 0, 4);
        let err = five.await.unwrap().unwrap_err();
        assert_eq!((err.status(), err.code), (429, "predecessor_retry"));
        // Answered for good: the next waiter goes on.
        p.answered(R, 0, 4);
        p.wait_for(R, 0, 5, 4, || None, 2, None).await.unwrap();
    }

    #[tokio::test]
    async fn forgetting_a_run_refuses_its_waiters_and_drops_its_order() {
        let p = Arc::new(Pipeline::new(Duration::from_secs(30), 4));
        p.answered(R, 0, 10);
        p.answered(OTHER, 0, 10);
        let waiter = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for(R, 1, 21, 20, || None, 1, None).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(p.lanes(), 3);
        p.forget("r");
        let err = waiter.await.unwrap().unwrap_err();
        assert_eq!((err.status(), err.code), (409, "pipeline_reset"));
        assert_eq!(p.lanes(), 1);
        // Resumed (the same run): step 10 answered before is forgotten, so a
        // push naming step 4 waits for it (and times out here) ...
        let short = Pipeline::new(Duration::from_millis(100), 4);
        short.answered(R, 0, 10);
        short.forget("r");
        let err = short
            .wait_for(R, 0, 5, 4, || None, 1, None)
            .await
            .unwrap_err();
        assert_eq!(err.code, "predecessor_timeout");
        // ... a push of the deleted run answered after the forget does not
        // speak for the run created again under its name ...
        short.answered(R, 0, 10);
        let err = short
            .wait_for(("r", 2), 0, 5, 4, || None, 1, None)
            .await
            .unwrap_err();
        assert_eq!(err.code, "predecessor_timeout");
        // ... and the other run keeps its order.
        p.wait_for(OTHER, 0, 5, 4, || None, 1, None).await.unwrap();
    }
}
