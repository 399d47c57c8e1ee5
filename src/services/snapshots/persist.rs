//! State persistence: `state` snapshots taken when due and at shutdown.

#[allow(unused_imports)]
use super::*;

/// Takes a `state` snapshot of `run` now (each rank at its own last step),
/// unless nothing changed since the last one and `force` is false.
/// Returns the snapshot id, once complete.
///
/// One at a time per run: a call while another is in flight waits for it
/// (the periodic ones are skipped instead, see [`persist_due`]), and for
/// room in the server's capture backlog.
pub async fn persist_state(
    state: &Snaps,
    run: &RunHandle,
    force: bool,
) -> Result<Option<String>, SnapshotError> {
    let one = state
        .pending
        .state_writer(&run.config.name)
        .lock_owned()
        .await;
    let permits = capture_permits(state, run);
    let room = state
        .captures
        .clone()
        .acquire_many_owned(permits)
        .await
        .map_err(|e| SnapshotError::Internal(e.to_string()))?;
    persist_held(state, run, force, (one, room)).await
}

/// `POST .../persist`: [`persist_state`], answered within
/// `--store-timeout-secs` whatever the object store does. A write that
/// takes longer goes on in the background (it completes, or fails with its
/// reason, as any snapshot does) and the caller hears `503
/// store_unavailable` saying so, never silence.
pub async fn persist_bounded(
    state: &Snaps,
    run: &Arc<RunHandle>,
) -> Result<Option<String>, SnapshotError> {
    let secs = state.args.store_timeout_secs;
    let (snaps, run) = (state.clone(), run.clone());
    let write = tokio::spawn(async move { persist_state(&snaps, &run, true).await });
    match tokio::time::timeout(Duration::from_secs_f64(secs), write).await {
        Ok(done) => done.map_err(|e| SnapshotError::Worker(e.to_string()))?,
        Err(_) => Err(SnapshotError::Objects(
            crate::objstore::StoreError::TimedOut {
                op: "persist",
                secs,
            },
        )),
    }
}

/// A state capture's share of the capture backlog (its run's bytes, never
/// more than the whole backlog: one is always allowed).
fn capture_permits(state: &Snaps, run: &RunHandle) -> u32 {
    let whole = backlog_permits(state.args.capture_backlog.0);
    backlog_permits(run.resident_bytes()).min(whole) as u32
}

/// What a state snapshot holds while it is in flight: its run's turn, and
/// its share of the capture backlog (both given back when it ends).
type InFlight = (
    tokio::sync::OwnedMutexGuard<()>,
    tokio::sync::OwnedSemaphorePermit,
);

/// The state snapshot itself, its run's turn and backlog share held.
async fn persist_held(
    state: &Snaps,
    run: &RunHandle,
    force: bool,
    _held: InFlight,
) -> Result<Option<String>, SnapshotError> {
    // Counted as an attempt even when refused, so a full disk is reported
    // once per interval, not on every tick.
    let started = Instant::now();
    state.pending.set_state_attempt(&run.config.name, started);
    check_lease(state, run)?;
    disk::check(state, run.resident_bytes())?;
    let epochs = held_epochs(state, run);
    let id = snapshot_id(SnapshotKind::State, 0);
    let captures = run
        .engines
        .capture_state(&run.config.name, &id, force)
        .await?;
    let Some((captures, covered)) = captures else {
        return Ok(None);
    };
    if captures.is_empty() {
        return Ok(None);
    }
    let fences = fences_of(state, run, &captures, &epochs)?;
    state
        .store
        .insert_snapshot(&state_row(run, &id, &captures))
        .await?;
    state.pending.register(
        &id,
        &run.config.name,
        SnapshotKind::State,
        (
            captures.iter().map(|c| c.rank).collect(),
            captures.len() as u32,
        ),
        None,
        None,
    );
    let Some(rx) = state.pending.waiter(&id) else {
        // Failed (its run deleted) the moment it was registered.
        return Err(SnapshotError::WriteFailed(
            "state snapshot abandoned".into(),
        ));
    };
    for (c, fence) in captures.into_iter().zip(fences) {
        write_capture(state.clone(), c, fence);
    }
    match rx.await {
        Ok(Finished::Complete) => {
            // Only now is the newest EMA durable: until here the run stays
            // dirty, so a failed write is taken again.
            run.engines
                .mark_persisted(&run.config.name, covered)
                .await?;
            let took = started.elapsed();
            let cost = state
                .pending
                .state_write_cost(&run.config.name, run.resident_bytes(), took);
            state.pending.set_state_attempt(
                &run.config.name,
                next_clock(Instant::now(), cost, run.config.persist_every_secs),
            );
            state
                .metrics
                .state_write_seconds
                .with_label_values(&[run.config.name.as_str()])
                .set(took.as_secs_f64());
            Ok(Some(id))
        }
        Ok(Finished::Failed(reason)) => Err(SnapshotError::WriteFailed(reason)),
        Err(_) => Err(SnapshotError::WriteFailed(
            "state snapshot abandoned".into(),
        )),
    }
}

/// A lease is not a lock: after a lapse another node may hold these
/// ranks, so nothing is captured until the renewal that follows has read
/// the placement again (services::nodes). A capture already past this
/// point is refused by the catalog (its epoch is stale).
fn check_lease(state: &Snaps, run: &RunHandle) -> Result<(), SnapshotError> {
    match state.lease.fenced() {
        Some(age) => Err(SnapshotError::LeaseLost(format!(
            "this node's lease was last renewed {:.1} s ago (lease {:.1} s): it may no longer \
             hold the ranks of run `{}` and writes no state for them until it renews",
            age.as_secs_f64(),
            state.lease.length().as_secs_f64(),
            run.config.name
        ))),
        None => Ok(()),
    }
}

/// Each part's fencing token, read with no await since the capture: a
/// rank that changed hands meanwhile (a sync let it go, or took it again
/// in a later epoch) is written under neither epoch.
fn fences_of(
    state: &Snaps,
    run: &RunHandle,
    captures: &[RankCapture],
    epochs: &BTreeMap<u32, u64>,
) -> Result<Vec<Fence>, SnapshotError> {
    let fences: Vec<Fence> = captures.iter().map(|c| fence_of(state, c)).collect();
    if let Some(c) = captures
        .iter()
        .zip(&fences)
        .find(|(c, f)| epochs.get(&c.rank) != Some(&f.epoch))
        .map(|(c, _)| c)
    {
        return Err(SnapshotError::LeaseLost(format!(
            "rank {} of run `{}` changed hands while its state was captured",
            c.rank, run.config.name
        )));
    }
    Ok(fences)
}

/// The catalog row of a state snapshot: at its newest rank's step, with
/// every rank's step in its detail.
fn state_row(run: &RunHandle, id: &str, captures: &[RankCapture]) -> SnapshotRow {
    let step = captures.iter().map(|c| c.step).max().unwrap_or(0);
    let profiles = run
        .config
        .profiles
        .iter()
        .map(|p| p.name().to_string())
        .collect();
    SnapshotRow {
        detail: serde_json::json!({
            "rank_steps": captures.iter().map(|c| (c.rank.to_string(), c.step)).collect::<BTreeMap<_, _>>()
        }),
        ..SnapshotRow::pending(id, &run.config.name, step, SnapshotKind::State, profiles)
    }
}

/// The placement epoch of each rank of `run` this node holds, as it knows
/// them.
fn held_epochs(state: &Snaps, run: &RunHandle) -> BTreeMap<u32, u64> {
    let me = state.registry.node_id();
    run.owners()
        .into_iter()
        .enumerate()
        .filter(|(rank, owner)| owner.node_id == me && run.holds(*rank as u32))
        .map(|(rank, owner)| (rank as u32, owner.epoch))
        .collect()
}

/// The most of its time the server spends writing a run's state: the next
/// state write is due `persist_every_secs` after the last one *finished*,
/// or later when that write was long, so that writing stays under this
/// share of the time (a 10 MB state is persisted every interval; one whose
/// write takes 8 s, every 80 s).
pub const PERSIST_BUSY_SHARE: f64 = 0.1;

/// The instant `state_due` counts the interval from, after a state write
/// that finished at `now` and cost `took` (its size at the fastest rate
/// the run's writes went: a store that hung a while does not delay the
/// next write): `now`, pushed later so the next one starts no sooner than
/// `took × (1/share − 1)` from now.
fn next_clock(now: Instant, took: Duration, every_secs: u64) -> Instant {
    let rest = took.mul_f64(1.0 / PERSIST_BUSY_SHARE - 1.0);
    now + rest.saturating_sub(Duration::from_secs(every_secs))
}

/// How soon a failed state snapshot is tried again (never later than the
/// run's own interval).
const STATE_RETRY: Duration = Duration::from_secs(2);

/// State snapshots of runs whose `persist_every_secs` has elapsed. A run
/// whose last one is still being written, or a capture the server's
/// backlog has no room for, is skipped until its next interval (and
/// counted): a stalled object store never piles captures up in memory.
pub(super) async fn persist_due(state: &Snaps) {
    if state.lease.fenced().is_some() {
        // Nothing is captured for ranks this node may have lost; its next
        // renewal reads the placement again (see `persist_held`).
        return;
    }
    let runs: Vec<Arc<RunHandle>> = state.all_runs();
    for run in runs {
        let every = run.config.persist_every_secs;
        if every == 0 {
            continue;
        }
        let name = run.config.name.clone();
        if !state.pending.state_due(&name, Duration::from_secs(every)) {
            continue;
        }
        let one = state.pending.state_writer(&name).try_lock_owned();
        let room = state
            .captures
            .clone()
            .try_acquire_many_owned(capture_permits(state, &run));
        let (one, room) = match (one, room) {
            (Ok(one), Ok(room)) => (one, room),
            (Err(_), _) => {
                skip_state(
                    state,
                    &name,
                    "the run's last state snapshot is still being written",
                );
                continue;
            }
            (_, Err(_)) => {
                skip_state(
                    state,
                    &name,
                    "the server's capture backlog (--capture-backlog) is full",
                );
                continue;
            }
        };
        let state = state.clone();
        // Off the ticker, so a long write does not delay deadlines.
        tokio::spawn(async move {
            if let Err(e) = persist_held(&state, &run, false, (one, room)).await {
                tracing::warn!(run = %name, error = %e, "state snapshot failed; retrying");
                retry_state_soon(&state, &name, every);
            }
        });
    }
}

/// A due state snapshot not taken: counted, and due again a whole
/// interval from now (so a long stall counts one skip per interval).
fn skip_state(state: &Snaps, run: &str, why: &str) {
    state.pending.set_state_attempt(run, Instant::now());
    state
        .metrics
        .state_persist_skipped
        .with_label_values(&[run])
        .inc();
    tracing::debug!(run = %run, "due state snapshot skipped: {why}");
}

/// Makes a run's next state snapshot due [`STATE_RETRY`] from now.
fn retry_state_soon(state: &Snaps, run: &str, every_secs: u64) {
    let every = Duration::from_secs(every_secs);
    let wait = STATE_RETRY.min(every);
    let at = Instant::now()
        .checked_sub(every - wait)
        .unwrap_or_else(Instant::now);
    state.pending.set_state_attempt(run, at);
}

/// Attempts at persisting a run's state on shutdown before giving up.
const SHUTDOWN_ATTEMPTS: u32 = 3;

/// On graceful shutdown: [`persist_all`] until `deadline`; what is not
/// written by then (an object store that hangs) is logged and left: the
/// next start restores the newest state that did complete and reports
/// what that cost.
pub async fn persist_all_until(state: &Snaps, deadline: tokio::time::Instant) {
    if tokio::time::timeout_at(deadline, persist_all(state))
        .await
        .is_err()
    {
        tracing::error!(
            "the final state write did not finish within the shutdown timeout; stopping \
             without it (the restart restores the newest complete state and reports the steps lost)"
        );
    }
}

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
