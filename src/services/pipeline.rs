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

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::ServiceError;

/// The header naming a push's predecessor step.
pub const PREV_STEP: &str = "polyak-prev-step";

/// The waiting pushes of every rank.
pub struct Pipeline {
    lanes: Mutex<HashMap<(String, u32), Arc<Lane>>>,
    timeout: Duration,
    depth: usize,
}

/// One rank's order.
struct Lane {
    /// The highest step answered on this rank since the server started.
    answered: watch::Sender<Option<u64>>,
    /// Pushes waiting for their predecessor now.
    waiting: AtomicUsize,
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

    fn lane(&self, run: &str, rank: u32) -> Arc<Lane> {
        let mut lanes = self.lanes.lock().expect("pipeline lanes");
        lanes
            .entry((run.to_string(), rank))
            .or_insert_with(|| {
                Arc::new(Lane {
                    answered: watch::channel(None).0,
                    waiting: AtomicUsize::new(0),
                })
            })
            .clone()
    }

    /// Waits until `prev` was answered, or `applied()` (the rank's last
    /// applied step, read when the wait starts and on each answer) is at or
    /// past it.
    pub async fn wait_for(
        &self,
        run: &str,
        rank: u32,
        step: u64,
        prev: u64,
        applied: impl Fn() -> Option<u64>,
        retry_after: u64,
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
        let mut rx = lane.answered.subscribe();
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let answered = rx.borrow_and_update().is_some_and(|s| s >= prev);
            if answered || applied().is_some_and(|s| s >= prev) {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) => return Ok(()),
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

    /// `step` of `rank` has been answered: pushes waiting for it go on.
    pub fn answered(&self, run: &str, rank: u32, step: u64) {
        let lane = self.lane(run, rank);
        lane.answered
            .send_modify(|s| *s = Some(s.map_or(step, |a| a.max(step))));
    }

    /// Forgets a deleted run's ranks.
    pub fn forget(&self, run: &str) {
        self.lanes
            .lock()
            .expect("pipeline lanes")
            .retain(|(r, _), _| r != run);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waits_for_the_predecessor_then_times_out() {
        let p = Arc::new(Pipeline::new(Duration::from_millis(300), 2));
        // Already applied: no wait.
        p.wait_for("r", 0, 5, 4, || Some(4), 1).await.unwrap();
        // Waits until step 6 is answered.
        let waiter = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for("r", 0, 7, 6, || None, 1).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        p.answered("r", 0, 6);
        waiter.await.unwrap().unwrap();
        // Never answered: a clear 409.
        let err = p.wait_for("r", 1, 9, 8, || None, 1).await.unwrap_err();
        assert_eq!((err.status, err.code), (409, "predecessor_timeout"));
        // Bounded: a third waiter on one rank is refused at once.
        let a = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for("r", 2, 20, 19, || None, 1).await })
        };
        let b = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_for("r", 2, 21, 20, || None, 1).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let err = p.wait_for("r", 2, 22, 21, || None, 1).await.unwrap_err();
        assert_eq!(err.status, 429);
        p.answered("r", 2, 20);
        a.await.unwrap().unwrap();
        b.await.unwrap().unwrap();
    }
}
