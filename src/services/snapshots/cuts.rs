//! Manual cuts and the final snapshot of a finished run: where a cut
//! falls, its catalog row, and the engine request that captures it.

#[allow(unused_imports)]
use super::*;
use crate::engine::EngineError;

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
pub fn cut_now(config: &RunConfig, steps: &[Option<u64>]) -> (u64, CutKind) {
    let first = steps.first().copied().flatten();
    if let Some(s) = first {
        if steps.iter().all(|r| *r == Some(s)) && config.is_update_step(s) {
            return (s, CutKind::Current);
        }
    }
    let furthest = steps.iter().flatten().copied().max();
    (next_step(config, furthest), CutKind::NextUpdate)
}

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
        let steps = spread::all_steps(state, run).await?;
        let (at, cut) = match step {
            Some(s) => (s, CutKind::Requested),
            None => cut_now(&config, &steps),
        };
        match schedule_manual(state, run, at, &names, &indices, label.clone(), cut).await {
            Err(SnapshotError::Conflict(_)) if step.is_none() && attempt < 3 => attempt += 1,
            other => return other,
        }
    }
}

/// The profile names and indices a snapshot captures (default all).
pub fn profile_choice(
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
pub(super) async fn schedule_manual(
    state: &Snaps,
    run: &RunHandle,
    step: u64,
    names: &[String],
    indices: &[usize],
    label: Option<String>,
    cut: CutKind,
) -> Result<SnapshotRow, SnapshotError> {
    let config = run.config.clone();
    if !config.is_update_step(step) {
        return Err(SnapshotError::Invalid(format!(
            "step: {step} is not an update step (update_every = {})",
            config.update_every
        )));
    }
    let id = snapshot_id(SnapshotKind::Manual, step);
    let timeout = Duration::from_secs(config.snapshot_timeout_secs.max(1));
    let row = SnapshotRow {
        label,
        deadline_ms: Some(now_ms() + timeout.as_millis() as i64),
        detail: serde_json::json!({"cut": cut}),
        ..SnapshotRow::pending(
            &id,
            &config.name,
            step,
            SnapshotKind::Manual,
            names.to_vec(),
        )
    };
    state.store.insert_snapshot(&row).await?;
    if let Err(e) = accept(state, run, &id, step, indices).await {
        state.store.delete_snapshot(&id).await?;
        return Err(e);
    }
    // The other nodes holding ranks of the run capture theirs at the same
    // step; when one cannot, the cut is withdrawn everywhere.
    if let Err(e) = spread::schedule_on_peers(state, run, &id, step, names).await {
        withdraw(state, run, &id).await;
        state.store.delete_snapshot(&id).await?;
        return Err(e);
    }
    state.events.emit(
        &config.name,
        None,
        Some(step),
        Event::Snapshot(SnapshotEvent::Pending {
            id,
            kind: SnapshotKind::Manual,
            cut: Some(cut),
        }),
    );
    Ok(row)
}

/// Registers this node's part of cut `id` at `step` and asks its engines
/// for it (ranks already at `step` are captured at once); nothing when the
/// node holds no rank of the run. The part is complete when this node's
/// ranks are written; the snapshot, when every rank of the run is.
pub async fn accept(
    state: &Snaps,
    run: &RunHandle,
    id: &str,
    step: u64,
    indices: &[usize],
) -> Result<(), SnapshotError> {
    let config = &run.config;
    let held = run.held_ranks();
    if held.is_empty() {
        return Ok(());
    }
    // The resident bytes of this node's ranks bound what it writes (every
    // profile, copied tensors, mirror).
    disk::check(state, run.resident_bytes())?;
    let timeout = Duration::from_secs(config.snapshot_timeout_secs.max(1));
    state.pending.register(
        id,
        &config.name,
        SnapshotKind::Manual,
        (held.into_iter().collect(), config.world_size),
        Some(Instant::now() + timeout),
        None,
    );
    let scheduled = run
        .engines
        .schedule_cut(&config.name, id, step, indices.to_vec())
        .await;
    match scheduled {
        Ok(_) => Ok(()),
        Err(e) => {
            state.pending.take(id);
            Err(match e {
                EngineError::Stopped | EngineError::QueueFull => e.into(),
                other => SnapshotError::Conflict(other.to_string()),
            })
        }
    }
}

/// Withdraws this node's part of cut `id` (another node could not take
/// its part): the engines forget it, and what was already captured for it
/// is discarded when written.
pub async fn withdraw(state: &Snaps, run: &RunHandle, id: &str) {
    run.engines.cancel_cut(&run.config.name, id).await;
    state.pending.take(id);
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
    // One finish at a time per run: a caller that waited here finds the
    // run finished and answers with the same final snapshot.
    let finisher = state.pending.finisher(&name);
    let _one = finisher.lock().await;
    if let Some(done) = run.finished() {
        return answered(state, &name, done).await;
    }
    // And one at a time across the nodes of a service: a caller on another
    // node that waited here finds the finish in the catalog and answers it.
    let across = state.store.lock_finish(&name).await?;
    let result = finish_held(state, run, label).await;
    if let Some(lock) = across {
        lock.release().await;
    }
    result
}

/// How a finished run ended, with its final snapshot's row.
async fn answered(
    state: &Snaps,
    name: &str,
    done: RunFinish,
) -> Result<(RunFinish, Option<SnapshotRow>), SnapshotError> {
    let row = match &done.snapshot {
        Some(id) => state.store.snapshot(name, id).await?,
        None => None,
    };
    Ok((done, row))
}

/// [`finish`] under the run's finish locks.
async fn finish_held(
    state: &Snaps,
    run: &RunHandle,
    label: Option<String>,
) -> Result<(RunFinish, Option<SnapshotRow>), SnapshotError> {
    let name = run.config.name.clone();
    if let Some(done) = state.store.run_finish(&name).await? {
        // Finished through another node since this one last synced.
        run.engines
            .shared()
            .set_finished(Some(crate::engine::FinishedAt(done.step)));
        *run.finished.lock().expect("run finish lock") = Some(done.clone());
        return answered(state, &name, done).await;
    }
    let at = if run.is_spread() {
        super::spread::finish_across(state, run).await?
    } else {
        run.engines.shared().finish()
    };
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
                CutKind::Final,
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
        None,
        at.0,
        Event::Finished(events::Finished {
            snapshot: done.snapshot.clone(),
        }),
    );
    tracing::info!(run = %name, step = ?at.0, "run finished");
    Ok((done, row))
}
