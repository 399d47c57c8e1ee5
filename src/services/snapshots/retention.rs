//! Deleting snapshots and a deleted run's files, and the run's retention.

#[allow(unused_imports)]
use super::*;

/// After a run is deleted: fails its pending snapshots and removes every
/// file it had (`runs/<run>/`), so a deleted run's disk space comes back at
/// once, not at the next start.
pub async fn remove_run_files(state: &Snaps, run: &str) -> Result<(), SnapshotError> {
    let pending = state.pending.pending_of(run);
    for id in pending {
        fail(state, &id, "the run was deleted").await;
    }
    state.pending.forget_run(run);
    let prefix = files::run_rel_dir(run);
    state
        .objects
        .delete_prefix(&prefix.to_string_lossy())
        .await?;
    let dir = state.pending.data_dir.join(prefix);
    tokio::task::spawn_blocking(move || match std::fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    })
    .await
    .map_err(|e| SnapshotError::Worker(e.to_string()))??;
    Ok(())
}

pub(super) async fn remove_files(state: &Snaps, run: &str, id: &str) {
    let prefix = files::snapshot_rel_dir(run, id);
    let prefix = prefix.to_string_lossy();
    if let Err(e) = state.objects.delete_prefix(&prefix).await {
        tracing::warn!(prefix = %prefix, error = %e, "removing snapshot parts failed");
    }
    if let Some(dir) = state.objects.local_path(&prefix) {
        // The emptied directory itself.
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Deletes a snapshot: the catalog row first (so a crash never leaves a
/// complete snapshot without files), then the files; then says so on the
/// event stream (`reason`: why, when not asked for).
pub async fn delete(
    state: &Snaps,
    run: &str,
    id: &str,
    reason: Option<&'static str>,
) -> Result<bool, SnapshotError> {
    if state.pending.is_pending(id) {
        fail(state, id, "deleted while pending").await;
    }
    let existed = state.store.delete_snapshot(id).await?;
    remove_files(state, run, id).await;
    state.events.emit(
        run,
        None,
        None,
        Event::Snapshot(SnapshotEvent::Deleted {
            id: id.to_string(),
            reason,
        }),
    );
    Ok(existed)
}

/// Applies the run's retention to complete manual and periodic snapshots,
/// and keeps the newest state snapshots.
pub(super) async fn apply_retention(state: &Snaps, run: &str) -> Result<(), SnapshotError> {
    let Some(handle) = state.run(run) else {
        return Ok(());
    };
    let retention = handle.config.retention.clone();
    let all = state.store.snapshots(run).await?;
    let mut doomed = Vec::new();
    let mut states: Vec<&SnapshotRow> = all
        .iter()
        .filter(|s| s.kind == SnapshotKind::State && s.status == SnapshotStatus::Complete)
        .collect();
    states.sort_by_key(|s| std::cmp::Reverse(s.completed_at_ms));
    // Each rank keeps its newest state snapshots: with a run spread over
    // nodes, each node's state snapshots hold only its own ranks, and the
    // newest of one node must not push out the only ones of another.
    let mut kept: HashMap<String, usize> = HashMap::new();
    for s in states {
        let ranks: Vec<String> = match s.detail["rank_steps"].as_object() {
            Some(steps) if !steps.is_empty() => steps.keys().cloned().collect(),
            _ => vec!["*".into()],
        };
        let mut keep = false;
        for rank in ranks {
            let n = kept.entry(rank).or_default();
            if *n < STATE_KEEP {
                *n += 1;
                keep = true;
            }
        }
        if !keep {
            doomed.push(s.id.clone());
        }
    }
    if retention.keep_last > 0 {
        let mut cuts: Vec<&SnapshotRow> = all
            .iter()
            .filter(|s| s.kind.is_cut() && s.status == SnapshotStatus::Complete)
            .collect();
        cuts.sort_by_key(|s| std::cmp::Reverse((s.step, s.created_at_ms)));
        for s in cuts.iter().skip(retention.keep_last as usize) {
            if retention.keep_every > 0 && s.step % retention.keep_every == 0 {
                continue;
            }
            doomed.push(s.id.clone());
        }
    }
    for id in doomed {
        delete(state, run, &id, Some("retention")).await?;
    }
    Ok(())
}
