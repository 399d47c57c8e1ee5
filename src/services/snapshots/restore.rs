//! Restore and recovery: a run's EMA read back from a complete snapshot
//! (`resume`, and at start after a crash or restart).

#[allow(unused_imports)]
use super::*;
use crate::contract::NodeStatus;
use crate::objstore::ObjectStore;
use crate::snapshot::source::PartLoc;

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
            path: PartLoc::recorded(&state.objects, &f.path, f.bytes, &f.sha256),
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
                // Held to the recorded size and sha256: a part that does
                // not match refuses the restore (500 snapshot_corrupt).
                Some(f) => Ok(Some(
                    PartLoc::recorded(objects, &f.path, f.bytes, &f.sha256).read_verified()?,
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
        let restored =
            convert::restore_rank(meta, &profiles, mirror.as_deref(), config.ema_dtype.kind())
                .map_err(|e| match e {
                    format::FormatError::Meta(m @ MetaError::Newer { .. }) => {
                        SnapshotError::Meta(m)
                    }
                    e => SnapshotError::Corrupt(format!("rank {rank}: {e}")),
                })?;
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

/// Restores every rank of `run` from `row`; ranks absent from it are
/// emptied. Updates the rank summaries; returns per-rank steps.
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
    let config = run.config.clone();
    let objects = state.objects.clone();
    let ranks = tokio::task::spawn_blocking(move || load_restorable(&objects, &config, files))
        .await
        .map_err(|e| SnapshotError::Worker(e.to_string()))??;
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
/// later never wins), then the latest capture of that owner (its captures
/// follow its steps, except across a `resume`, which goes back on purpose;
/// a cut that took long to write does not pass a later state snapshot),
/// then the furthest step. Parts recorded before fencing existed count
/// as epoch 0, captured when their snapshot completed.
fn restore_key(file: &FileRow, completed_at_ms: Option<i64>) -> (u64, i64, u64) {
    match &file.fence {
        Some(f) => (f.epoch, f.captured_at_ms, file.step),
        None => (0, completed_at_ms.unwrap_or(0), file.step),
    }
}

/// Per rank of `ranks`: its state from the complete restorable snapshot
/// that holds the newest state of it ([`restore_key`]), or `None` when
/// none does. The ranks of a run spread over nodes may come from different
/// snapshots: each node's `state` snapshots hold only its own ranks, a cut
/// holds them all.
pub async fn newest_states(
    store: &crate::store::Store,
    objects: &ObjectStore,
    config: &Arc<RunConfig>,
    ranks: &[u32],
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
    let snapshot_of = choose_newest(&candidates, |id| {
        rows.get(id).and_then(|r| r.completed_at_ms)
    });
    let files: Vec<FileRow> = candidates
        .into_iter()
        .filter(|(id, f)| snapshot_of.get(&f.rank) == Some(id))
        .map(|(_, f)| f)
        .collect();
    let (objects, for_load) = (objects.clone(), config.clone());
    let loaded = tokio::task::spawn_blocking(move || load_restorable(&objects, &for_load, files))
        .await
        .map_err(|e| SnapshotError::Worker(e.to_string()))??;
    let mut out: BTreeMap<u32, Option<NewestState>> = ranks.iter().map(|&r| (r, None)).collect();
    for (rank, state) in loaded {
        out.insert(
            rank,
            Some(NewestState {
                snapshot: snapshot_of.get(&rank).cloned().unwrap_or_default(),
                step: state.meta.last_step.unwrap_or(0),
                state,
            }),
        );
    }
    Ok(out)
}

/// Per rank: the snapshot (of `candidates`, `(snapshot id, file)`) whose
/// file holds its newest state by [`restore_key`]; `completed` gives a
/// snapshot's completion time.
fn choose_newest(
    candidates: &[(String, FileRow)],
    completed: impl Fn(&str) -> Option<i64>,
) -> BTreeMap<u32, String> {
    let mut best: BTreeMap<u32, ((u64, i64, u64), &str)> = BTreeMap::new();
    for (id, f) in candidates {
        let key = restore_key(f, completed(id));
        let better = best
            .get(&f.rank)
            .is_none_or(|(k, b)| key > *k || (key == *k && id.as_str() > *b));
        if better {
            best.insert(f.rank, (key, id));
        }
    }
    best.into_iter()
        .map(|(rank, (_, id))| (rank, id.to_string()))
        .collect()
}

/// Restores the ranks this node holds of a run spread over nodes, each
/// from the newest snapshot holding it ([`newest_states`]); per rank, the
/// snapshot and step restored.
async fn restore_held(
    state: &Snaps,
    run: &RunHandle,
) -> Result<BTreeMap<u32, (String, u64)>, SnapshotError> {
    let held = run.held_ranks();
    let newest = newest_states(&state.store, &state.objects, &run.config, &held).await?;
    let mut restored = BTreeMap::new();
    let mut ranks = Vec::new();
    for (rank, found) in newest {
        if let Some(found) = found {
            restored.insert(rank, (found.snapshot, found.step));
            ranks.push((rank, found.state));
        }
    }
    run.engines.restore(&run.config.name, ranks).await?;
    let steps = restored.iter().map(|(r, (_, step))| (*r, *step)).collect();
    note_restored(state, run, &steps);
    Ok(restored)
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
        // Each rank from the snapshot holding its newest state (a spread
        // run's nodes each write their own ranks' `state` snapshots).
        let restored = restore_held(state, &run).await;
        match super::verify::noted(&state.events, &state.metrics, "restore", restored) {
            Ok(restored) => {
                for (rank, (snapshot, step)) in &restored {
                    tracing::info!(run = %run.config.name, rank, step, snapshot = %snapshot, "rank resumed from snapshot");
                }
                let mut by_snapshot: BTreeMap<&str, BTreeMap<u32, u64>> = BTreeMap::new();
                for (rank, (snapshot, step)) in &restored {
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
        FileRow {
            rank,
            part: "c".into(),
            path: String::new(),
            sha256: String::new(),
            bytes: 0,
            step,
            state: String::new(),
            fence: fence.map(|(node, epoch, at)| Fence {
                node_id: node.into(),
                epoch,
                captured_at_ms: at,
            }),
        }
    }

    /// Each rank's state comes from the newest epoch, then the newest
    /// capture, never from the order snapshots completed in.
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
            // capture after the resume is the newest state.
            ("before-resume", part(2, 80, Some(("a", 1, 40)))),
            ("after-resume", part(2, 7, Some(("a", 1, 55)))),
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
