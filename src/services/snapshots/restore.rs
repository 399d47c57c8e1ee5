//! Restore and recovery: a run's EMA read back from a complete snapshot
//! (`resume`, and at start after a crash or restart).

#[allow(unused_imports)]
use super::*;
use crate::contract::NodeStatus;
use crate::node::Failover;
use crate::objstore::ObjectStore;

/// The files of a complete snapshot, by rank, for one part.
pub async fn parts_of(
    state: &Snaps,
    row: &SnapshotRow,
    part: &str,
) -> Result<Vec<assemble::StoredPart>, SnapshotError> {
    let files = state.store.snapshot_files(&row.id).await?;
    let mut out = Vec::new();
    for f in files.into_iter().filter(|f| f.part == part) {
        let meta = meta::decode_rank_meta(&f.state)?;
        out.push(assemble::StoredPart {
            rank: f.rank,
            path: crate::services::snapshots::stored_part(&state.objects, &f),
            sha256: f.sha256,
            meta: Arc::new(meta),
        });
    }
    Ok(out)
}

/// Reads every rank of a complete snapshot back into restorable tensors.
pub(super) fn load_restorable(
    objects: &ObjectStore,
    config: &RunConfig,
    files: Vec<FileRow>,
) -> Result<Vec<(u32, RestoredRank)>, SnapshotError> {
    let mut by_rank: BTreeMap<u32, Vec<FileRow>> = BTreeMap::new();
    for f in files {
        by_rank.entry(f.rank).or_default().push(f);
    }
    let mut out = Vec::new();
    for (rank, files) in by_rank {
        let meta = meta::decode_rank_meta(&files[0].state)?;
        let read = |part: &str| -> Result<Option<Vec<u8>>, SnapshotError> {
            match files.iter().find(|f| f.part == part) {
                // Through the one verified reader (each block checked
                // against its recorded checksum, or the whole part against
                // its sha256 where none were recorded): a part that does
                // not match refuses the restore (500 snapshot_corrupt).
                Some(f) => Ok(Some(
                    crate::services::snapshots::stored_part(objects, f).read_verified()?,
                )),
                None => Ok(None),
            }
        };
        let mut profiles = Vec::new();
        for p in &config.profiles {
            profiles.push(read(p.name())?.ok_or_else(|| {
                SnapshotError::Corrupt(format!(
                    "rank {rank} has no file for profile `{}`",
                    p.name()
                ))
            })?);
        }
        let mirror = if config.mirror {
            read(MIRROR_PART)?
        } else {
            None
        };
        let kind = config.ema_dtype.kind();
        let bad = |e| match e {
            format::FormatError::Meta(m @ MetaError::Newer { .. }) => SnapshotError::Meta(m),
            e => SnapshotError::Corrupt(format!("rank {rank}: {e}")),
        };
        let mut restored =
            convert::restore_rank(meta, &profiles, mirror.as_deref(), kind).map_err(bad)?;
        // A bema profile's w0 and plain EMA, held to their records too.
        for p in &config.profiles {
            let hidden = p.is_bema().then(|| {
                let [start, ema] = [format::BemaBuffer::Start, format::BemaBuffer::Ema]
                    .map(|b| read(&format::bema_part(p.name(), b)));
                let missing = || {
                    SnapshotError::Corrupt(format!(
                        "rank {rank} has no BEMA buffers for `{}`",
                        p.name()
                    ))
                };
                let (start, ema) = (start?.ok_or_else(missing)?, ema?.ok_or_else(missing)?);
                convert::restore_bema(&restored.meta.layout, &start, &ema, kind).map_err(bad)
            });
            restored.bema.push(hidden.transpose()?);
        }
        out.push((rank, restored));
    }
    Ok(out)
}

/// Whether a complete snapshot can restore the run: every profile present.
pub(super) fn restorable(config: &RunConfig, row: &SnapshotRow) -> bool {
    // Derived snapshots (post-hoc, merged) hold weights no run ever had.
    row.status == SnapshotStatus::Complete
        && !row.kind.is_derived()
        && config
            .profiles
            .iter()
            .all(|p| row.profiles.iter().any(|n| n == p.name()))
}

/// Restores every rank of `run` from `row` (a `resume`: each rank starts
/// a new lineage); ranks absent from it are emptied. Updates the rank
/// summaries; returns per-rank steps.
pub async fn restore_from(
    state: &Snaps,
    run: &RunHandle,
    row: &SnapshotRow,
) -> Result<BTreeMap<u32, u64>, SnapshotError> {
    // Only the ranks this node holds (the other nodes restore theirs).
    let files: Vec<FileRow> = state
        .store
        .snapshot_files(&row.id)
        .await?
        .into_iter()
        .filter(|f| run.holds(f.rank))
        .collect();
    // A resume goes back to an older step on purpose: the states it
    // restores start a new lineage, newer than every stored one (so a
    // crash after it restores what followed it, never what preceded it).
    let generation = state
        .store
        .complete_files(&run.config.name)
        .await?
        .iter()
        .map(|(_, f)| meta::generation_of(&f.state))
        .max()
        .unwrap_or(0)
        + 1;
    let config = run.config.clone();
    let objects = state.objects.clone();
    let mut ranks = tokio::task::spawn_blocking(move || load_restorable(&objects, &config, files))
        .await
        .map_err(|e| SnapshotError::Worker(e.to_string()))??;
    for (_, rank) in &mut ranks {
        rank.meta.generation = generation;
    }
    let steps: BTreeMap<u32, u64> = ranks
        .iter()
        .map(|(r, rr)| (*r, rr.meta.last_step.unwrap_or(0)))
        .collect();
    run.engines.restore(&run.config.name, ranks).await?;
    note_restored(state, run, &steps);
    Ok(steps)
}

/// The summaries of the ranks this node holds after a restore: each at its
/// restored step, or without data when `steps` has none for it.
fn note_restored(state: &Snaps, run: &RunHandle, steps: &BTreeMap<u32, u64>) {
    for rank in run.held_ranks() {
        // The engine counted the restored buffers: the figures read what
        // it holds, not 0 until the next push.
        let resident = run.engines.shared().resident(rank);
        let summary = run.update_rank(rank, |s| {
            s.last_step = steps.get(&rank).copied();
            s.live = s.last_step.is_some();
            s.resident_bytes = resident;
        });
        state.record_rank(run, rank, &summary, None);
    }
}

/// One rank read back from the newest restorable snapshot holding it.
pub struct NewestState {
    pub snapshot: String,
    pub step: u64,
    pub state: RestoredRank,
}

/// How a restore ranks the stored states of one rank, newest first: the
/// latest placement epoch (the catalog records a part only while its
/// epoch is the rank's placement, so a later epoch's owner took over from
/// whatever the earlier one had; a part of an older epoch that completed
/// later never wins), then the rank's lineage (`generation`, raised by
/// each `resume`, which goes back to an older step on purpose), then the
/// furthest step. Every one of these is an order the server keeps; the
/// wall clock (the capture time) only breaks a tie between two parts
/// alike in all three. Parts recorded before fencing existed count as
/// epoch 0, ordered by when their snapshot completed, as they were then.
fn restore_key(file: &FileRow, completed_at_ms: Option<i64>) -> (u64, u64, u64, i64) {
    let generation = meta::generation_of(&file.state);
    match &file.fence {
        Some(f) => (f.epoch, generation, file.step, f.captured_at_ms),
        None => (
            0,
            generation,
            completed_at_ms.unwrap_or(0).max(0) as u64,
            file.step as i64,
        ),
    }
}

/// Whether a restore that failed with `e` may try an older state: the
/// part is bad (does not match its record, cannot be parsed, is missing),
/// not the store or the catalog out of reach (then nothing older is taken:
/// the newest state may be fine once they are back).
fn part_unusable(e: &SnapshotError) -> bool {
    match e {
        SnapshotError::Corrupt(_) | SnapshotError::Io(_) => true,
        SnapshotError::Meta(m) => !matches!(m, MetaError::Newer { .. }),
        SnapshotError::Objects(o) => !o.is_unavailable(),
        _ => false,
    }
}

/// Per rank of `ranks`: its state from the complete restorable snapshot
/// that holds the newest state of it ([`restore_key`]) and reads back
/// whole; a snapshot whose part does not (one flipped bit, a part cut
/// short) is reported to `found_bad` and the next newest is taken, so a
/// bad part costs the steps between the two, said in the rank's record,
/// never the whole EMA. `None` when no snapshot holds a readable state of
/// the rank. The ranks of a run spread over nodes may come from different
/// snapshots: each node's `state` snapshots hold only its own ranks, a cut
/// holds them all.
pub async fn newest_states(
    store: &crate::store::Store,
    objects: &ObjectStore,
    config: &Arc<RunConfig>,
    ranks: &[u32],
    found_bad: &(dyn Fn(&SnapshotError) + Send + Sync),
) -> Result<BTreeMap<u32, Option<NewestState>>, SnapshotError> {
    let rows: HashMap<String, SnapshotRow> = store
        .snapshots(&config.name)
        .await?
        .into_iter()
        .filter(|r| restorable(config, r))
        .map(|r| (r.id.clone(), r))
        .collect();
    let wanted: BTreeSet<u32> = ranks.iter().copied().collect();
    let candidates: Vec<(String, FileRow)> = store
        .complete_files(&config.name)
        .await?
        .into_iter()
        .filter(|(id, f)| wanted.contains(&f.rank) && rows.contains_key(id))
        .collect();
    let ranked = rank_newest(&candidates, |id| {
        rows.get(id).and_then(|r| r.completed_at_ms)
    });
    let mut out: BTreeMap<u32, Option<NewestState>> = ranks.iter().map(|&r| (r, None)).collect();
    for (rank, ids) in ranked {
        for id in ids {
            let files: Vec<FileRow> = candidates
                .iter()
                .filter(|(i, f)| *i == id && f.rank == rank)
                .map(|(_, f)| f.clone())
                .collect();
            let (objects, for_load) = (objects.clone(), config.clone());
            let loaded =
                tokio::task::spawn_blocking(move || load_restorable(&objects, &for_load, files))
                    .await
                    .map_err(|e| SnapshotError::Worker(e.to_string()))?;
            match loaded {
                Ok(mut states) => {
                    if let Some((_, state)) = states.pop() {
                        out.insert(
                            rank,
                            Some(NewestState {
                                snapshot: id.clone(),
                                step: state.meta.last_step.unwrap_or(0),
                                state,
                            }),
                        );
                    }
                    break;
                }
                Err(e) if part_unusable(&e) => {
                    found_bad(&e);
                    tracing::error!(run = %config.name, rank, snapshot = %id, error = %e,
                        "a stored state of the rank does not read back; trying the next newest");
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok(out)
}

/// Per rank: the snapshots (of `candidates`, `(snapshot id, file)`) that
/// hold a state of it, newest first by [`restore_key`]; `completed` gives
/// a snapshot's completion time.
fn rank_newest(
    candidates: &[(String, FileRow)],
    completed: impl Fn(&str) -> Option<i64>,
) -> BTreeMap<u32, Vec<String>> {
    type Key = (u64, u64, u64, i64);
    let mut by_rank: BTreeMap<u32, Vec<(Key, &str)>> = BTreeMap::new();
    for (id, f) in candidates {
        let key = restore_key(f, completed(id));
        let seen = by_rank.entry(f.rank).or_default();
        // A snapshot holds several parts of a rank (profiles, mirror):
        // it is ranked once, by the best of them.
        match seen.iter_mut().find(|(_, s)| *s == id.as_str()) {
            Some(entry) => entry.0 = entry.0.max(key),
            None => seen.push((key, id)),
        }
    }
    by_rank
        .into_iter()
        .map(|(rank, mut ids)| {
            ids.sort_by(|a, b| b.cmp(a));
            (
                rank,
                ids.into_iter().map(|(_, id)| id.to_string()).collect(),
            )
        })
        .collect()
}

/// Per rank: the snapshot holding its newest state ([`rank_newest`]'s first).
#[cfg(test)]
fn choose_newest(
    candidates: &[(String, FileRow)],
    completed: impl Fn(&str) -> Option<i64>,
) -> BTreeMap<u32, String> {
    rank_newest(candidates, completed)
        .into_iter()
        .filter_map(|(rank, ids)| ids.into_iter().next().map(|id| (rank, id)))
        .collect()
}

/// Restores the ranks this node holds of `run`, each from the newest
/// snapshot holding a readable state of it ([`newest_states`]); per rank,
/// the snapshot and step restored (`None`: no snapshot held one).
async fn restore_held(
    state: &Snaps,
    run: &RunHandle,
) -> Result<BTreeMap<u32, Option<(String, u64)>>, SnapshotError> {
    let held = run.held_ranks();
    let (events, metrics) = (state.events.clone(), state.metrics.clone());
    let report = move |e: &SnapshotError| {
        if let Some(m) = e.mismatch() {
            super::verify::report_mismatch(&events, &metrics, m, "restore");
        }
    };
    let newest = newest_states(&state.store, &state.objects, &run.config, &held, &report).await?;
    let mut restored = BTreeMap::new();
    let mut ranks = Vec::new();
    for (rank, found) in newest {
        match found {
            Some(found) => {
                restored.insert(rank, Some((found.snapshot, found.step)));
                ranks.push((rank, found.state));
            }
            None => {
                restored.insert(rank, None);
            }
        }
    }
    run.engines.restore(&run.config.name, ranks).await?;
    let steps = restored
        .iter()
        .filter_map(|(r, found)| found.as_ref().map(|(_, step)| (*r, *step)))
        .collect();
    note_restored(state, run, &steps);
    Ok(restored)
}

/// After a restart, each rank of `run` this node restored (or could not)
/// gets the record a failover gives ([`Failover`], `restart: true`): the
/// step restored, the last step the catalog saw applied before the stop
/// (`last_seen`, read before the restore; never below the restored one),
/// and at the first push after it, the steps lost. A rank that never
/// pushed (no step in the catalog, nothing stored) gets none. Reported like
/// a failover: the rank view, a `failover` event, the metric; the loss
/// itself (an alert, the run's health) once the next push makes it known.
async fn note_restart(
    state: &Snaps,
    run: &RunHandle,
    last_seen: &BTreeMap<u32, Option<u64>>,
    restored: &BTreeMap<u32, Option<(String, u64)>>,
) {
    let name = &run.config.name;
    let owners = run.owners();
    let finished = run.finished().map(|f| f.step);
    let at_ms = now_ms();
    for (&rank, found) in restored {
        let (snapshot, restored_step) = match found {
            Some((id, step)) => (Some(id.clone()), Some(*step)),
            None => (None, None),
        };
        // The catalog's record trails the pushes by its writer's batching
        // interval: a stored state it has not caught up with is seen too.
        let Some(seen) = last_seen.get(&rank).copied().flatten().max(restored_step) else {
            continue; // the rank never pushed
        };
        let mut failover = Failover {
            from_node: state.registry.node_id().to_string(),
            restart: true,
            epoch: owners.get(rank as usize).map_or(0, |o| o.epoch),
            at_ms,
            snapshot,
            restored_step,
            last_seen_step: Some(seen),
            resumed_step: None,
            lost_steps: None,
        };
        if let Some(finished_at) = finished {
            // A finished run takes no more pushes: what it lost is known
            // now (the steps up to its finish), and nothing if it has all.
            if restored_step.is_some_and(|r| r >= seen) {
                continue;
            }
            failover.resumed_at(finished_at.unwrap_or(seen) + 1, run.config.update_every);
        }
        let summary = run.update_rank(rank, |s| s.failover = Some(failover.clone()));
        state.record_rank(run, rank, &summary, None);
        state.store.note_rank_failover(name, rank, &failover).await;
        state
            .metrics
            .failover_ranks
            .with_label_values(&[name])
            .inc();
        if failover.lost_steps.is_some() {
            state
                .metrics
                .failover_steps_lost
                .with_label_values(&[name])
                .inc_by(failover.lost_steps.unwrap_or(0));
        }
        tracing::warn!(run = %name, rank, snapshot = ?failover.snapshot,
            restored_step = ?failover.restored_step, last_seen_step = seen,
            "rank restored after a restart; the steps lost are known at its next push");
        let step = failover.restored_step;
        state
            .events
            .emit(name, Some(rank), step, Event::Failover(failover));
    }
}

/// The lowest step any rank of a restorable snapshot sits at: a cut's
/// step, or for a `state` snapshot the lowest of its ranks' steps.
pub(super) fn lowest_rank_step(row: &SnapshotRow) -> u64 {
    row.detail["rank_steps"]
        .as_object()
        .and_then(|steps| steps.values().filter_map(|v| v.as_u64()).min())
        .unwrap_or(row.step)
}

/// What `resume` restored.
pub struct Resumed {
    pub row: SnapshotRow,
    pub rank_steps: BTreeMap<u32, u64>,
    /// The snapshot misses updates up to the step asked for (only with
    /// `allow_older`).
    pub older: bool,
}

/// `POST /resume`: the newest restorable snapshot at or before `step`.
///
/// `step` is the last step the trainer's checkpoint pushed (the number of
/// optimizer steps it took, minus one). A snapshot older than the last
/// update step at or before it would leave the EMA without updates the
/// trainer will not push again: refused unless `allow_older`.
pub async fn resume(
    state: &Snaps,
    run: &RunHandle,
    step: u64,
    allow_older: bool,
) -> Result<Resumed, SnapshotError> {
    let rows = state.store.snapshots(&run.config.name).await?;
    let mut best: Option<(u64, &SnapshotRow)> = None;
    for row in rows.iter().filter(|r| restorable(&run.config, r)) {
        // A state snapshot's ranks may sit at different steps: all must be
        // at or before the requested one.
        let top = row.step;
        if top <= step
            && best.is_none_or(|(s, b)| {
                top > s || (top == s && row.completed_at_ms > b.completed_at_ms)
            })
        {
            best = Some((top, row));
        }
    }
    let Some((_, row)) = best else {
        return Err(SnapshotError::NotFound(format!(
            "no complete snapshot of run `{}` at or before step {step} holds every profile",
            run.config.name
        )));
    };
    let wanted = step - step % run.config.update_every;
    let lowest = lowest_rank_step(row);
    let older = lowest < wanted;
    if older && !allow_older {
        return Err(SnapshotError::Older(format!(
            "the newest complete snapshot of run `{}` at or before step {step} is `{}`, at step {lowest}: \
             restoring it would leave the EMA without the updates of steps {}..={wanted}. \
             `step` is the last step the checkpoint pushed (the optimizer steps it took minus one; \
             Lightning's and HF's global_step minus one); take a snapshot at that step when you \
             checkpoint, or pass allow_older: true to restore step {lowest} anyway",
            run.config.name,
            row.id,
            lowest + 1
        )));
    }
    let row = row.clone();
    let steps = super::verify::noted(
        &state.events,
        &state.metrics,
        "resume",
        restore_from(state, run, &row).await,
    )?;
    if older {
        tracing::warn!(run = %run.config.name, snapshot = %row.id, asked = step, restored = lowest,
            "resumed from an older snapshot (allow_older)");
    }
    state.events.emit(
        &run.config.name,
        None,
        Some(row.step),
        Event::Resumed(events::Resumed {
            snapshot: row.id.clone(),
            rank_steps: steps.clone(),
            requested_step: step,
            older,
        }),
    );
    Ok(Resumed {
        row,
        rank_steps: steps,
        older,
    })
}

/// Aborts the multipart uploads the catalog lists as open: a crash left
/// them (an open S3 upload keeps its parts until it is aborted).
///
/// Two sources: the ids the catalog recorded, and the store's own list of
/// open uploads under `runs/` (which also has an upload whose id a crash
/// kept from being recorded). An upload of a snapshot still pending (a
/// node of the same service writing it now) is left alone.
async fn abort_open_uploads(state: &Snaps) -> Result<(), SnapshotError> {
    for open in state.store.open_uploads().await? {
        state
            .objects
            .abort_upload(&open.key, &open.upload_id)
            .await?;
        state.store.forget_upload(&open.upload_id).await?;
        tracing::info!(key = %open.key, snapshot = %open.snapshot, "aborted an upload left open by the last stop");
    }
    for (key, upload_id) in state.objects.open_uploads("runs/").await? {
        // runs/<run>/snapshots/<id>/<part>
        let mut parts = key.split('/');
        if let (Some("runs"), Some(run), Some("snapshots"), Some(id)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        {
            let row = state.store.snapshot(run, id).await?;
            if row.is_some_and(|r| r.status == SnapshotStatus::Pending) {
                continue;
            }
        }
        state.objects.abort_upload(&key, &upload_id).await?;
        tracing::info!(key = %key, "aborted an upload the store listed as open");
    }
    Ok(())
}

/// Removes the parts of every snapshot that is not complete (a crash's
/// leftovers), half-written files, and derived parts left in staging.
async fn remove_unlisted(
    state: &Snaps,
    keep: std::collections::HashSet<(String, String)>,
) -> Result<(), SnapshotError> {
    let staging = state.pending.data_dir.join("staging");
    if staging.exists() {
        std::fs::remove_dir_all(&staging)?;
    }
    if let Some(root) = state.objects.local_path("") {
        let removed = tokio::task::spawn_blocking(move || files::remove_unlisted(&root, &keep))
            .await
            .map_err(|e| SnapshotError::Worker(e.to_string()))??;
        for path in removed {
            tracing::info!(path = %path.display(), "removed an incomplete snapshot file");
        }
        return Ok(());
    }
    for (key, _) in state.objects.list("runs").await? {
        // runs/<run>/snapshots/<id>/<part>
        let mut parts = key.split('/');
        let (Some("runs"), Some(run), Some("snapshots"), Some(id)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if !keep.contains(&(run.to_string(), id.to_string())) {
            state.objects.delete(&key).await?;
            tracing::info!(key = %key, "removed an incomplete snapshot part");
        }
    }
    Ok(())
}

/// At start: fails snapshots a stop interrupted, removes files the catalog
/// does not list as complete, and restores every run from its newest
/// restorable snapshot. A node joining a service whose other nodes are
/// live leaves the clean-up alone: what looks interrupted may be theirs,
/// being written now.
pub async fn recover(state: &Snaps) -> Result<(), SnapshotError> {
    let me = state.registry.node_id().to_string();
    let others = state
        .store
        .list_nodes()
        .await?
        .into_iter()
        .filter(|n| n.status == NodeStatus::Live && n.info.node_id != me)
        .count();
    if others == 0 {
        let interrupted = state.store.fail_interrupted(now_ms()).await?;
        for (run, id) in &interrupted {
            tracing::warn!(run = %run, snapshot = %id, "snapshot interrupted by the last stop; marked failed");
        }
        abort_open_uploads(state).await?;
        let keep = state.store.complete_snapshot_ids().await?;
        remove_unlisted(state, keep).await?;
    } else {
        tracing::info!(
            nodes = others,
            "other nodes are live: their pending snapshots are left to them"
        );
    }
    let runs: Vec<Arc<RunHandle>> = state.all_runs();
    for run in runs {
        if run.held_ranks().is_empty() {
            continue;
        }
        // The last step the catalog saw each rank apply before the stop:
        // what a restore short of it lost (read before the restore moves
        // the summaries to the restored steps).
        let last_seen: BTreeMap<u32, Option<u64>> = run
            .held_ranks()
            .into_iter()
            .map(|r| (r, run.rank(r).and_then(|s| s.last_step)))
            .collect();
        // Each rank from the snapshot holding its newest state (a spread
        // run's nodes each write their own ranks' `state` snapshots).
        let restored = restore_held(state, &run).await;
        match restored {
            Ok(restored) => {
                note_restart(state, &run, &last_seen, &restored).await;
                let mut by_snapshot: BTreeMap<&str, BTreeMap<u32, u64>> = BTreeMap::new();
                for (rank, found) in &restored {
                    let Some((snapshot, step)) = found else {
                        tracing::warn!(run = %run.config.name, rank, "no stored state of the rank reads back: its EMA starts again at its next push");
                        continue;
                    };
                    tracing::info!(run = %run.config.name, rank, step, snapshot = %snapshot, "rank resumed from snapshot");
                    by_snapshot
                        .entry(snapshot)
                        .or_default()
                        .insert(*rank, *step);
                }
                for (snapshot, steps) in by_snapshot {
                    let top = steps.values().copied().max();
                    state.events.emit(
                        &run.config.name,
                        None,
                        top,
                        Event::Restored(Restored {
                            snapshot: snapshot.to_string(),
                            rank_steps: steps,
                        }),
                    );
                }
            }
            Err(e) => {
                tracing::error!(run = %run.config.name, error = %e, "restoring failed")
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::snapshots::Fence;

    fn part(rank: u32, step: u64, fence: Option<(&str, u64, i64)>) -> FileRow {
        part_of(rank, step, fence, 0)
    }

    fn part_of(rank: u32, step: u64, fence: Option<(&str, u64, i64)>, generation: u64) -> FileRow {
        FileRow {
            rank,
            part: "c".into(),
            path: String::new(),
            sha256: String::new(),
            bytes: 0,
            step,
            state: format!("{{\"format\": 1, \"generation\": {generation}}}"),
            fence: fence.map(|(node, epoch, at)| Fence {
                node_id: node.into(),
                epoch,
                captured_at_ms: at,
            }),
            blocks: None,
        }
    }

    /// The wall clock stepped back between two captures of one owner (an
    /// NTP correction, a VM restored): the furthest step of the lineage is
    /// still the newest state, whatever the capture times say.
    #[test]
    fn a_restore_never_follows_the_wall_clock() {
        let candidates: Vec<(String, FileRow)> = [
            ("early", part(0, 9, Some(("a", 1, 1_000_000)))),
            ("after-the-step-back", part(0, 19, Some(("a", 1, 400_000)))),
        ]
        .into_iter()
        .map(|(id, f)| (id.to_string(), f))
        .collect();
        let chosen = rank_newest(&candidates, |_| None);
        assert_eq!(chosen[&0], ["after-the-step-back", "early"]);
    }

    /// Each rank's state comes from the newest epoch, then the newest
    /// lineage, then the furthest step, never from the order snapshots
    /// completed in.
    #[test]
    fn a_restore_takes_the_newest_epoch_then_the_newest_capture() {
        let completed: HashMap<&str, i64> = [
            ("a-old", 100),
            ("b-new", 200),
            ("a-stale", 300),
            ("cut", 900),
            ("state", 500),
            ("before-resume", 50),
            ("after-resume", 60),
            ("legacy", 10_000),
        ]
        .into();
        let candidates: Vec<(String, FileRow)> = [
            // Rank 0: a held it in epoch 1 (steps 4, then 10 written late),
            // b took it over in epoch 2 and wrote step 19.
            ("a-old", part(0, 4, Some(("a", 1, 90)))),
            ("b-new", part(0, 19, Some(("b", 2, 190)))),
            ("a-stale", part(0, 10, Some(("a", 1, 95)))),
            // Rank 1: a cut at step 50 captured before a state snapshot at
            // step 60, but completed after it.
            ("cut", part(1, 50, Some(("a", 1, 400)))),
            ("state", part(1, 60, Some(("a", 1, 450)))),
            // Rank 2: resumed from step 5 after step 80 was stored: the
            // capture after the resume (a new lineage) is the newest state.
            ("before-resume", part(2, 80, Some(("a", 1, 40)))),
            ("after-resume", part_of(2, 7, Some(("a", 1, 55)), 1)),
            // Rank 3: a part from before fencing loses to any fenced one.
            ("legacy", part(3, 99, None)),
            ("state", part(3, 60, Some(("a", 1, 450)))),
        ]
        .into_iter()
        .map(|(id, f)| (id.to_string(), f))
        .collect();
        let chosen = choose_newest(&candidates, |id| completed.get(id).copied());
        let want: BTreeMap<u32, String> = [
            (0, "b-new"),
            (1, "state"),
            (2, "after-resume"),
            (3, "state"),
        ]
        .into_iter()
        .map(|(r, id)| (r, id.to_string()))
        .collect();
        assert_eq!(chosen, want);
        // Among parts from before fencing: the snapshot completed last.
        let legacy = vec![
            ("x".to_string(), part(4, 9, None)),
            ("legacy".to_string(), part(4, 3, None)),
        ];
        let chosen = choose_newest(&legacy, |id| completed.get(id).copied());
        assert_eq!(chosen[&4], "legacy");
    }
}
