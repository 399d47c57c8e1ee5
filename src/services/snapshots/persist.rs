//! State persistence: `state` snapshots taken when due and at shutdown.

#[allow(unused_imports)]
use super::*;

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
        .set_state_attempt(&run.config.name, Instant::now());
    disk::check(state, run.resident_bytes())?;
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
        ..SnapshotRow::pending(&id, &run.config.name, step, SnapshotKind::State, profiles)
    };
    state.store.insert_snapshot(&row).await?;
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
    for c in captures {
        write_capture(state.clone(), c);
    }
    match rx.await {
        Ok(Finished::Complete) => {
            // Only now is the newest EMA durable: until here the run stays
            // dirty, so a failed write is taken again.
            run.engines
                .mark_persisted(&run.config.name, covered)
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
pub(super) async fn persist_due(state: &Snaps) {
    let runs: Vec<Arc<RunHandle>> = state.all_runs();
    for run in runs {
        let every = run.config.persist_every_secs;
        if every == 0 {
            continue;
        }
        let due = state
            .pending
            .state_due(&run.config.name, Duration::from_secs(every));
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
    state.pending.set_state_attempt(run, at);
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
