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

/// The state snapshot itself, its run's turn and backlog share held
/// until it ends.
///
/// Its ranks are copied one after the other, each once its share of the
/// backlog the write holds is free: a rank's copy is written (and freed)
/// while the next ones are taken, so the copies never hold more than that
/// share, or one rank when a rank is larger. Each rank sits at its own
/// step, as in any state snapshot; the catalog records the steps its parts
/// were written at.
async fn persist_held(
    state: &Snaps,
    run: &RunHandle,
    force: bool,
    (_one, room): InFlight,
) -> Result<Option<String>, SnapshotError> {
    // Counted as an attempt even when refused, so a full disk is reported
    // once per interval, not on every tick.
    let started = Instant::now();
    let name = run.config.name.as_str();
    state.pending.set_state_attempt(name, started);
    check_lease(state, run)?;
    disk::check(state, run.resident_bytes())?;
    let epochs = held_epochs(state, run);
    let Some(plan) = run.engines.state_plan(name, force).await? else {
        return Ok(None);
    };
    if plan.ranks.is_empty() {
        return Ok(None);
    }
    if let Some((rank, _)) = plan.ranks.iter().find(|(r, _)| !epochs.contains_key(r)) {
        return Err(changed_hands(name, *rank));
    }
    let id = snapshot_id(SnapshotKind::State, 0);
    let meter = WriteCpu::start(state, &id);
    state
        .store
        .insert_snapshot(&state_row(run, &id, &plan.ranks))
        .await?;
    state.pending.register(
        &id,
        name,
        SnapshotKind::State,
        (
            plan.ranks.iter().map(|&(rank, _)| rank).collect(),
            plan.ranks.len() as u32,
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
    let (capture_cpu, held) =
        match copy_and_write(state, run, &id, &plan.ranks, &epochs, &room).await {
            Ok(copied) => copied,
            Err(e) => {
                // Its waiters, the catalog and the event stream hear why; the
                // ranks already written are removed.
                fail(state, &id, &e.to_string()).await;
                return Err(e);
            }
        };
    let outcome = rx.await;
    match outcome {
        Ok(Finished::Complete) => {
            // Only now is the newest EMA durable: until here the run stays
            // dirty, so a failed write is taken again.
            run.engines.mark_persisted(name, plan.covered).await?;
            let took = started.elapsed();
            let cost = WriteCost {
                wall: state
                    .pending
                    .state_write_cost(name, run.resident_bytes(), took),
                took,
                cpu: capture_cpu + meter.total(),
            };
            state.pending.set_state_attempt(
                name,
                next_clock(Instant::now(), &cost, run.config.persist_every_secs),
            );
            state
                .metrics
                .state_write_seconds
                .with_label_values(&[name])
                .set(took.as_secs_f64());
            state
                .metrics
                .state_write_held_bytes
                .with_label_values(&[name])
                .set(held as i64);
            Ok(Some(id))
        }
        Ok(Finished::Failed(reason)) => Err(SnapshotError::WriteFailed(reason)),
        Err(_) => Err(SnapshotError::WriteFailed(
            "state snapshot abandoned".into(),
        )),
    }
}

/// Copies the ranks of state snapshot `id` one after the other and hands
/// each to the writer, within the backlog share `room` (one rank always
/// allowed): a rank is copied once the copies still being written leave
/// room for it. Returns the CPU time the copies took and the most bytes
/// of copies held at once; an error when a rank cannot be copied or
/// changed hands (the caller fails the snapshot with it).
async fn copy_and_write(
    state: &Snaps,
    run: &RunHandle,
    id: &str,
    ranks: &[(u32, u64)],
    epochs: &BTreeMap<u32, u64>,
    room: &tokio::sync::OwnedSemaphorePermit,
) -> Result<(Duration, u64), SnapshotError> {
    let name = run.config.name.as_str();
    let whole = room.num_permits() as u32;
    let window = Arc::new(tokio::sync::Semaphore::new(whole as usize));
    let held = Arc::new(HeldBytes::default());
    let mut cpu = Duration::ZERO;
    for &(rank, _) in ranks {
        let bytes = run.rank_resident_bytes(rank);
        let share = (backlog_permits(bytes) as u32).min(whole);
        let permit = window
            .clone()
            .acquire_many_owned(share)
            .await
            .map_err(|e| SnapshotError::Internal(e.to_string()))?;
        if !state.pending.is_pending(id) {
            // Failed meanwhile (a write error, the run deleted): its
            // waiters already know why.
            return Ok((cpu, held.peak()));
        }
        let before = process_cpu();
        let captured = run.engines.capture_rank_state(name, id, rank).await;
        cpu += process_cpu().saturating_sub(before);
        let Some(capture) = captured? else {
            return Err(SnapshotError::WriteFailed(format!(
                "rank {rank} holds no data on this node any more"
            )));
        };
        // The fence is read with no await since the copy: a rank that
        // changed hands meanwhile is written under neither epoch.
        let fence = fence_of(state, &capture);
        if epochs.get(&rank) != Some(&fence.epoch) {
            return Err(changed_hands(name, rank));
        }
        let copy = capture_bytes(&capture);
        held.add(copy);
        let release = HeldCopy {
            held: held.clone(),
            bytes: copy,
            _permit: permit,
        };
        write_capture_holding(state.clone(), capture, fence, release);
    }
    Ok((cpu, held.peak()))
}

fn changed_hands(run: &str, rank: u32) -> SnapshotError {
    SnapshotError::LeaseLost(format!(
        "rank {rank} of run `{run}` changed hands while its state was captured"
    ))
}

/// Bytes of copies a state write holds now, and the most it held.
#[derive(Default)]
struct HeldBytes {
    now: std::sync::atomic::AtomicU64,
    peak: std::sync::atomic::AtomicU64,
}

impl HeldBytes {
    fn add(&self, bytes: u64) {
        use std::sync::atomic::Ordering::AcqRel;
        let now = self.now.fetch_add(bytes, AcqRel) + bytes;
        self.peak.fetch_max(now, AcqRel);
    }

    fn peak(&self) -> u64 {
        self.peak.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// One rank's copy in flight: its bytes and its share of the write's
/// backlog, given back once the writer is done with it (written or not).
struct HeldCopy {
    held: Arc<HeldBytes>,
    bytes: u64,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for HeldCopy {
    fn drop(&mut self) {
        self.held
            .now
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::AcqRel);
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

/// The catalog row of a state snapshot: at its newest rank's step, with
/// every rank's step in its detail (as the plan found them; the catalog
/// sets the steps its parts were written at when it completes).
fn state_row(run: &RunHandle, id: &str, ranks: &[(u32, u64)]) -> SnapshotRow {
    let step = ranks.iter().map(|&(_, step)| step).max().unwrap_or(0);
    let profiles = run
        .config
        .profiles
        .iter()
        .map(|p| p.name().to_string())
        .collect();
    SnapshotRow {
        detail: serde_json::json!({
            "rank_steps": ranks.iter().map(|&(r, step)| (r.to_string(), step)).collect::<BTreeMap<_, _>>()
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

/// The most of its time, and of one core's, the server spends writing a
/// run's state: the next state write is due `persist_every_secs` after the
/// last one *finished*, or later when that write was long or took much CPU
/// time, so that writing stays under this share of the time and its CPU
/// time under this share of one core (a 10 MB state is persisted every
/// interval; one whose write takes 8 s and 10 s of CPU time, every 100 s).
pub const PERSIST_BUSY_SHARE: f64 = 0.1;

/// What a state write cost, as its pacing counts it.
struct WriteCost {
    /// Its duration at the fastest rate the run's writes went (a store that
    /// hung a while does not delay the next write).
    wall: Duration,
    /// Its duration, capture to commit, as it went.
    took: Duration,
    /// Its CPU time: the capture (the process's while it was taken), the
    /// serialisation, writes and fsyncs on their threads, and the hashing
    /// beside them, so more than `took` when the hash runs on a second core.
    cpu: Duration,
}

/// How long after a state write ended the next one may start: `wall ×
/// (1/share − 1)`, so that writing takes at most [`PERSIST_BUSY_SHARE`] of
/// the time, and at least `cpu / share` from the write's start, so that
/// its CPU time is at most that share of one core.
fn rest_after(cost: &WriteCost) -> Duration {
    let time = cost.wall.mul_f64(1.0 / PERSIST_BUSY_SHARE - 1.0);
    let core = cost
        .cpu
        .div_f64(PERSIST_BUSY_SHARE)
        .saturating_sub(cost.took);
    time.max(core)
}

/// The instant `state_due` counts the interval from, after a state write
/// that finished at `now` and cost `cost`: `now`, pushed later so the
/// next one starts no sooner than [`rest_after`] from now.
fn next_clock(now: Instant, cost: &WriteCost, every_secs: u64) -> Instant {
    now + rest_after(cost).saturating_sub(Duration::from_secs(every_secs))
}

/// The CPU time the writes of one `state` snapshot take, counted while
/// this lives (see `Snapshots::add_write_cpu`); the meter is gone with it.
struct WriteCpu<'a> {
    state: &'a Snaps,
    id: String,
}

impl<'a> WriteCpu<'a> {
    fn start(state: &'a Snaps, id: &str) -> Self {
        state.pending.meter_write_cpu(id);
        WriteCpu {
            state,
            id: id.to_string(),
        }
    }

    fn total(self) -> Duration {
        self.state.pending.take_write_cpu(&self.id)
    }
}

impl Drop for WriteCpu<'_> {
    fn drop(&mut self) {
        self.state.pending.take_write_cpu(&self.id);
    }
}

/// CPU time (user and system) of the whole process, every thread's.
fn process_cpu() -> Duration {
    // SAFETY: `usage` is a valid rusage for the call to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn state_writes_take_at_most_their_share_of_the_time_and_of_a_core() {
        // (wall at the best rate, as it went, CPU time): an idle disk, a
        // hash beside the write (CPU over wall: a 1 GB state measured 3.7 s
        // and 4.0 s), a slow store, a small state.
        for (wall, took, cpu) in [
            (3.7, 3.7, 4.0),
            (2.0, 2.0, 1.0),
            (1.0, 30.0, 1.5),
            (0.01, 0.02, 0.03),
        ] {
            let cost = WriteCost {
                wall: secs(wall),
                took: secs(took),
                cpu: secs(cpu),
            };
            let rest = rest_after(&cost).as_secs_f64();
            let period = took + rest;
            assert!(
                wall / (wall + rest) <= PERSIST_BUSY_SHARE + 1e-9,
                "{wall} s of writing every {period} s"
            );
            assert!(
                cpu / period <= PERSIST_BUSY_SHARE + 1e-9,
                "{cpu} s of CPU every {period} s"
            );
        }
    }

    #[test]
    fn the_interval_is_counted_from_the_end_of_a_short_write() {
        let now = Instant::now();
        let cost = WriteCost {
            wall: secs(0.1),
            took: secs(0.1),
            cpu: secs(0.2),
        };
        assert_eq!(next_clock(now, &cost, 5), now);
        let long = WriteCost {
            wall: secs(3.7),
            took: secs(3.7),
            cpu: secs(4.0),
        };
        // 4.0 s of CPU at a tenth of a core: the next write starts 40 s
        // after this one started, 36.3 s after it ended.
        let due = next_clock(now, &long, 5) + Duration::from_secs(5);
        assert!(((due - now).as_secs_f64() - 36.3).abs() < 1e-6);
    }
}
