//! The capture writer: what the engines capture is serialised and written
//! durably off the async threads, and a snapshot completes when every rank
//! is on disk, or fails (late, out of space, a write error).

#[allow(unused_imports)]
use super::*;

pub(super) async fn on_event(state: &Snaps, event: CaptureEvent) {
    match event {
        CaptureEvent::PeriodicOpened {
            snapshot,
            run,
            step,
            profiles,
            backlog,
        } => {
            let Some(handle) = state.run(&run) else {
                return;
            };
            let timeout = Duration::from_secs(handle.config.snapshot_timeout_secs.max(1));
            state.pending.register(
                &snapshot,
                &run,
                SnapshotKind::Periodic,
                (0..handle.config.world_size).collect(),
                Some(Instant::now() + timeout),
                Some(backlog),
            );
            let row = SnapshotRow {
                deadline_ms: Some(now_ms() + timeout.as_millis() as i64),
                ..SnapshotRow::pending(&snapshot, &run, step, SnapshotKind::Periodic, profiles)
            };
            if let Err(e) = state.store.insert_snapshot(&row).await {
                tracing::error!(run = %run, error = %e, "recording a periodic snapshot failed");
            }
            state.events.emit(
                &run,
                None,
                Some(step),
                Event::Snapshot(SnapshotEvent::Pending {
                    id: snapshot,
                    kind: SnapshotKind::Periodic,
                    cut: None,
                }),
            );
        }
        CaptureEvent::PeriodicSkipped {
            run,
            step,
            held,
            bytes,
        } => {
            let limit = state.args.periodic_backlog.0;
            let reason = format!(
                "earlier periodic snapshots still hold {held} captured bytes not yet written; \
                 this one ({bytes} bytes) would pass the backlog of {limit} bytes"
            );
            tracing::warn!(run = %run, step, "periodic snapshot skipped: {reason}");
            state
                .metrics
                .snapshots_skipped
                .with_label_values(&[&run])
                .inc();
            state.events.emit(
                &run,
                None,
                Some(step),
                Event::Snapshot(SnapshotEvent::Skipped {
                    kind: SnapshotKind::Periodic,
                    reason,
                }),
            );
        }
        CaptureEvent::Captured(capture) => write_capture(state.clone(), *capture),
        CaptureEvent::Failed { snapshot, reason } => fail(state, &snapshot, &reason).await,
    }
}

/// Serialises and writes one rank's capture off the async threads.
pub(super) fn write_capture(state: Snaps, capture: RankCapture) {
    let id = capture.snapshot.clone();
    let rank = capture.rank;
    if !state.pending.start_writing(&id, rank) {
        return; // failed or deleted meanwhile
    }
    tokio::spawn(async move {
        if let Err(e) = disk::check(&state, capture_bytes(&capture)) {
            fail(&state, &id, &format!("rank {rank} not written: {e}")).await;
            return;
        }
        let data_dir = state.pending.data_dir.clone();
        let written = tokio::task::spawn_blocking(move || write_rank(&data_dir, capture)).await;
        let result = match written {
            Ok(Ok(files)) => Ok(files),
            Ok(Err(e)) => Err(format!("writing rank {rank} failed: {e}")),
            Err(e) => Err(format!("writing rank {rank} panicked: {e}")),
        };
        match result {
            Ok(files) => rank_written(&state, &id, rank, files).await,
            Err(reason) => fail(&state, &id, &reason).await,
        }
    });
}

/// Bytes of tensor data a capture writes (headers aside).
pub(super) fn capture_bytes(capture: &RankCapture) -> u64 {
    let bytes = |t: &tch::Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
    let profiles: u64 = capture.profiles.iter().map(|(_, t)| bytes(t)).sum();
    let copied: u64 = capture.copied.iter().map(bytes).sum();
    let mirror: u64 = capture.mirror.iter().flatten().map(bytes).sum();
    profiles + copied * capture.profiles.len() as u64 + mirror
}

/// Writes every part of a rank; returns their catalog rows.
pub(super) fn write_rank(
    data_dir: &Path,
    capture: RankCapture,
) -> Result<Vec<FileRow>, SnapshotError> {
    let dir = files::snapshot_rel_dir(&capture.run, &capture.snapshot);
    let meta_json = meta::encode_rank_meta(&capture.meta);
    let base_meta = |part: &str| {
        format::part_metadata(
            &capture.run,
            &capture.snapshot,
            capture.rank,
            capture.step,
            part,
        )
    };
    let host = |t: tch::Tensor| -> Result<tch::Tensor, SnapshotError> {
        t.f_to_device(tch::Device::Cpu)
            .and_then(|t| t.f_contiguous())
            .map_err(|e| SnapshotError::Engine(e.into()))
    };
    let copied: Vec<tch::Tensor> = capture
        .copied
        .iter()
        .map(|t| host(t.shallow_clone()))
        .collect::<Result<_, _>>()?;
    let mut rows = Vec::new();
    let mut record = |part: &str, file: &format::PartFile| -> Result<(), SnapshotError> {
        let rel = dir.join(files::part_file_name(capture.rank, part));
        let w = files::write_part(data_dir, &rel, file)?;
        rows.push(FileRow {
            rank: capture.rank,
            part: part.to_string(),
            path: w.path,
            sha256: w.sha256,
            bytes: w.bytes,
            step: capture.step,
            state: meta_json.clone(),
        });
        Ok(())
    };
    for (name, ema) in &capture.profiles {
        let copies = copied.iter().map(|t| t.shallow_clone()).collect();
        let part = format::profile_part(
            &capture.layout,
            host(ema.shallow_clone())?,
            copies,
            base_meta(name),
        );
        record(name, &part)?;
    }
    if let Some(mirror) = &capture.mirror {
        let tensors = mirror
            .iter()
            .map(|t| host(t.shallow_clone()))
            .collect::<Result<_, _>>()?;
        let part = format::mirror_part(&capture.layout, tensors, base_meta(MIRROR_PART));
        record(MIRROR_PART, &part)?;
    }
    files::sync_dir(&data_dir.join(&dir))?;
    Ok(rows)
}

pub(super) async fn rank_written(state: &Snaps, id: &str, rank: u32, rows: Vec<FileRow>) {
    match state.pending.rank_written(id, rank, rows) {
        // Failed, or its run deleted, while this rank was being written.
        RankWritten::Gone(rows) => discard_files(state, &rows),
        RankWritten::More => {}
        RankWritten::Last(p) => finalize(state, id, p).await,
    }
}

pub(super) async fn finalize(state: &Snaps, id: &str, p: Pending) {
    let step = p.written.iter().map(|f| f.step).max().unwrap_or(0);
    let bytes: u64 = p.written.iter().map(|f| f.bytes).sum();
    match state
        .store
        .complete_snapshot(id, step, &p.written, now_ms())
        .await
    {
        Ok(true) => {
            tracing::info!(run = %p.run, snapshot = %id, step, bytes, "snapshot complete");
            state.events.emit(
                &p.run,
                None,
                Some(step),
                Event::Snapshot(SnapshotEvent::Complete {
                    id: id.to_string(),
                    kind: p.kind,
                    bytes,
                }),
            );
            for w in p.waiters {
                let _ = w.send(Finished::Complete);
            }
            if let Err(e) = apply_retention(state, &p.run).await {
                tracing::warn!(run = %p.run, error = %e, "retention failed");
            }
        }
        Ok(false) => {
            // Deleted or failed meanwhile: its files go.
            remove_files(state, &p.run, id);
            for w in p.waiters {
                let _ = w.send(Finished::Failed("deleted".into()));
            }
        }
        Err(e) => {
            tracing::error!(snapshot = %id, error = %e, "completing a snapshot failed");
            for w in p.waiters {
                let _ = w.send(Finished::Failed(e.to_string()));
            }
        }
    }
}

/// Fails a pending snapshot: files, engine, catalog.
///
/// The partial files go first: when the disk filled up they hold the space
/// the catalog (on the same filesystem) needs to record the failure.
pub async fn fail(state: &Snaps, id: &str, reason: &str) {
    let Some(p) = state.pending.take(id) else {
        return;
    };
    tracing::warn!(run = %p.run, snapshot = %id, "snapshot failed: {reason}");
    if let Some(run) = state.run(&p.run) {
        let (r, s) = (p.run.clone(), id.to_string());
        let _ = run.engine.call(move |e| e.cancel_cut(&r, &s)).await;
    }
    remove_files(state, &p.run, id);
    record_failure(state, id, reason).await;
    state.events.emit(
        &p.run,
        None,
        None,
        Event::Snapshot(SnapshotEvent::Failed {
            id: id.to_string(),
            kind: None,
            reason: reason.to_string(),
        }),
    );
    for w in p.waiters {
        let _ = w.send(Finished::Failed(reason.to_string()));
    }
}

/// Attempts at recording a failure before it is left to the ticker.
pub(super) const RECORD_ATTEMPTS: u32 = 4;

/// Marks a snapshot failed in the catalog, retrying with backoff; what
/// still does not go through is kept and retried every second
/// ([`retry_unrecorded`]), and a stop leaves the row `pending`, which the
/// next start fails ([`recover`]).
pub async fn record_failure(state: &Snaps, id: &str, reason: &str) {
    let mut delay = Duration::from_millis(50);
    for attempt in 1..=RECORD_ATTEMPTS {
        match state.store.fail_snapshot(id, reason, now_ms()).await {
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(snapshot = %id, attempt, error = %e, "recording a snapshot failure failed");
                if attempt < RECORD_ATTEMPTS {
                    tokio::time::sleep(delay).await;
                    delay *= 4;
                }
            }
        }
    }
    let kept = state.pending.keep_unrecorded(id, reason);
    state.metrics.unrecorded_failures.set(kept as i64);
}

/// Retries the failures the catalog did not take.
pub(super) async fn retry_unrecorded(state: &Snaps) {
    let due = state.pending.unrecorded();
    for (id, reason) in due {
        match state.store.fail_snapshot(&id, &reason, now_ms()).await {
            Ok(_) => {
                let left = state.pending.recorded(&id);
                state.metrics.unrecorded_failures.set(left as i64);
                tracing::info!(snapshot = %id, "snapshot failure recorded");
            }
            Err(e) => {
                tracing::debug!(snapshot = %id, error = %e, "recording a snapshot failure failed again");
                return;
            }
        }
    }
}

pub(super) fn discard_files(state: &Snaps, rows: &[FileRow]) {
    for row in rows {
        let path = state.pending.data_dir.join(&row.path);
        if let Err(e) = std::fs::remove_file(&path) {
            tracing::warn!(path = %path.display(), error = %e, "removing an orphaned snapshot file failed");
        }
        if let Some(dir) = path.parent() {
            // Only succeeds once the directory is empty.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

pub(super) async fn fail_late(state: &Snaps) {
    let now = Instant::now();
    let late = state.pending.late(now);
    for (id, missing) in late {
        let reason =
            format!("timed out: rank(s) {missing:?} did not reach the snapshot step in time");
        fail(state, &id, &reason).await;
    }
}
