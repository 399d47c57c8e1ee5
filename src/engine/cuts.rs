//! Cuts on the engine thread: a periodic cut opened (or joined) when a
//! rank applies its step, and the ranks captured for the cuts waiting on
//! the step they reach.

use tokio::sync::mpsc;

use super::capture::{capture_rank, Backlog, CaptureEvent, PendingCut};
use super::shared::Periodic;
use super::EngineRun;

/// Takes part in the periodic cut of `step` when it is one: the first
/// engine of the run to get there opens it (unless the run's write backlog
/// has no room: then it is skipped, and said so); the run's other engines
/// join the same snapshot when one of their ranks gets there.
pub(super) fn open_periodic(
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
pub(super) fn capture_waiting(
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
