//! The capture writer: what the engines capture is serialised and written
//! durably off the async threads, and a snapshot completes when every rank
//! is on disk, or fails (late, out of space, a write error).

#[allow(unused_imports)]
use super::*;
use crate::store::snapshots::PartOutcome;
use crate::store::uploads::OpenUpload;

pub(super) async fn on_event(state: &Snaps, event: CaptureEvent) {
    match event {
        CaptureEvent::PeriodicOpened {
            snapshot,
            run,
            step,
            profiles,
            backlog,
        } => periodic_opened(state, snapshot, run, step, profiles, backlog).await,
        CaptureEvent::PeriodicSkipped {
            run,
            step,
            held,
            bytes,
        } => periodic_skipped(state, &run, step, held, bytes),
        CaptureEvent::Captured(capture) => {
            let fence = fence_of(state, &capture);
            write_capture(state.clone(), *capture, fence)
        }
        CaptureEvent::Failed { snapshot, reason } => fail(state, &snapshot, &reason).await,
    }
}

/// An engine opened a periodic cut: registered as pending (this node's
/// ranks, until its deadline), recorded once in the catalog, announced.
async fn periodic_opened(
    state: &Snaps,
    snapshot: String,
    run: String,
    step: u64,
    profiles: Vec<String>,
    backlog: Backlog,
) {
    let Some(handle) = state.run(&run) else {
        return;
    };
    let timeout = Duration::from_secs(handle.config.snapshot_timeout_secs.max(1));
    // This node's ranks; on a run spread over nodes, the others
    // open the same cut (same id) for theirs.
    state.pending.register(
        &snapshot,
        &run,
        SnapshotKind::Periodic,
        (
            handle.held_ranks().into_iter().collect(),
            handle.config.world_size,
        ),
        Some(Instant::now() + timeout),
        Some(backlog),
    );
    let row = SnapshotRow {
        deadline_ms: Some(now_ms() + timeout.as_millis() as i64),
        ..SnapshotRow::pending(&snapshot, &run, step, SnapshotKind::Periodic, profiles)
    };
    let recorded = state.store.insert_snapshot_once(&row).await;
    // The push that opened it is answered now (it waits a moment for this,
    // so that a cut at an acknowledged step is listed).
    handle.engines.shared().cut_recorded(step);
    match recorded {
        Ok(true) => {}
        // Another node of the service recorded it first.
        Ok(false) => return,
        Err(e) => {
            tracing::error!(run = %run, error = %e, "recording a periodic snapshot failed")
        }
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

/// An engine skipped a periodic cut (the backlog was full): counted and
/// announced.
fn periodic_skipped(state: &Snaps, run: &str, step: u64, held: u64, bytes: u64) {
    let limit = state.args.periodic_backlog.0;
    let reason = format!(
        "earlier periodic snapshots still hold {held} captured bytes not yet written; \
         this one ({bytes} bytes) would pass the backlog of {limit} bytes"
    );
    tracing::warn!(run = %run, step, "periodic snapshot skipped: {reason}");
    state
        .metrics
        .snapshots_skipped
        .with_label_values(&[run])
        .inc();
    state.events.emit(
        run,
        None,
        Some(step),
        Event::Snapshot(SnapshotEvent::Skipped {
            kind: SnapshotKind::Periodic,
            reason,
        }),
    );
}

/// Serialises one rank's capture and uploads its parts to the object store
/// (a blocking thread builds each part; its bytes stream to the store),
/// each part carrying `fence` (see [`fence_of`]).
pub(super) fn write_capture(state: Snaps, capture: RankCapture, fence: Fence) {
    write_capture_holding(state, capture, fence, ())
}

/// [`write_capture`], holding `hold` until the rank is written or failed
/// (a state write's share of its backlog, see `persist::copy_and_write`).
pub(super) fn write_capture_holding(
    state: Snaps,
    capture: RankCapture,
    fence: Fence,
    hold: impl Send + 'static,
) {
    let id = capture.snapshot.clone();
    let rank = capture.rank;
    if !state.pending.start_writing(&id, rank) {
        return; // failed or deleted meanwhile
    }
    tokio::spawn(async move {
        let _hold = hold;
        if let Err(e) = disk::check(&state, capture_bytes(&capture)) {
            fail(&state, &id, &format!("rank {rank} not written: {e}")).await;
            return;
        }
        match write_rank(&state, capture, fence).await {
            Ok(files) => rank_written(&state, &id, rank, files).await,
            Err(e) => fail(&state, &id, &format!("writing rank {rank} failed: {e}")).await,
        }
    });
}

/// The fencing token a capture's parts carry: this node and the epoch this
/// node holds the rank in as far as it knows, read as soon as the capture
/// arrives. A rank this node does not think it holds gets epoch 0, which
/// no placement has: the catalog refuses it.
pub(super) fn fence_of(state: &Snaps, capture: &RankCapture) -> Fence {
    let me = state.registry.node_id();
    let epoch = state
        .run(&capture.run)
        .and_then(|run| run.owner(capture.rank))
        .filter(|owner| owner.node_id == me)
        .map_or(0, |owner| owner.epoch);
    Fence {
        node_id: me.to_string(),
        epoch,
        captured_at_ms: capture.captured_at_ms,
    }
}

/// Bytes of tensor data a capture writes (headers aside).
pub(super) fn capture_bytes(capture: &RankCapture) -> u64 {
    let bytes = |t: &tch::Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
    let profiles: u64 = capture.profiles.iter().map(|(_, t)| bytes(t)).sum();
    let copied: u64 = capture.copied.iter().map(bytes).sum();
    let mirror: u64 = capture.mirror.iter().flatten().map(bytes).sum();
    profiles + copied * capture.profiles.len() as u64 + mirror
}

/// On the host and contiguous (a no-op for CPU captures).
fn host(t: tch::Tensor) -> Result<tch::Tensor, SnapshotError> {
    t.f_to_device(tch::Device::Cpu)
        .and_then(|t| t.f_contiguous())
        .map_err(|e| SnapshotError::Engine(e.into()))
}

/// Runs `f`, a step of writing snapshot `id`, on a blocking thread; its CPU
/// time (with its hashing threads') is counted to `id` when that is a
/// metered `state` write (see `persist::PERSIST_BUSY_SHARE`).
async fn blocking<T: Send + 'static>(
    state: &Snaps,
    id: &str,
    f: impl FnOnce() -> Result<T, SnapshotError> + Send + 'static,
) -> Result<T, SnapshotError> {
    let (out, cpu) = tokio::task::spawn_blocking(move || {
        let start = files::write_cpu();
        let out = f();
        (out, files::write_cpu().saturating_sub(start))
    })
    .await
    .map_err(|e| SnapshotError::Worker(e.to_string()))?;
    state.pending.add_write_cpu(id, cpu);
    out
}

/// Writes every part of a rank, one part at a time (a device capture is
/// copied to the host a part at a time); returns their catalog rows.
pub(super) async fn write_rank(
    state: &Snaps,
    mut capture: RankCapture,
    fence: Fence,
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
    let layout = capture.layout.clone();
    let copied: Vec<tch::Tensor> = {
        let copied: Vec<tch::Tensor> = capture.copied.iter().map(|t| t.shallow_clone()).collect();
        blocking(state, &capture.snapshot, move || {
            copied.into_iter().map(host).collect()
        })
        .await?
    };
    // The parts own the captured tensors: each is freed on the blocking
    // thread that wrote it (counted with the write, off the async threads).
    let mut parts: Vec<(String, Vec<tch::Tensor>)> = std::mem::take(&mut capture.profiles)
        .into_iter()
        .map(|(name, ema)| (name, vec![ema]))
        .collect();
    if let Some(mirror) = capture.mirror.take() {
        parts.push((MIRROR_PART.to_string(), mirror));
    }
    let mut rows = Vec::new();
    for (name, tensors) in parts {
        let meta = base_meta(&name);
        let copies: Vec<tch::Tensor> = copied.iter().map(|t| t.shallow_clone()).collect();
        let layout = layout.clone();
        let mirror = name == MIRROR_PART;
        let part = blocking(state, &capture.snapshot, move || {
            let tensors: Vec<tch::Tensor> =
                tensors.into_iter().map(host).collect::<Result<_, _>>()?;
            Ok(if mirror {
                convert::mirror_part(&layout, tensors, meta)
            } else {
                let ema = tensors.into_iter().next().expect("one EMA tensor");
                convert::profile_part(&layout, ema, copies, meta)
            })
        })
        .await?;
        let key = dir.join(files::part_file_name(capture.rank, &name));
        let key = key.to_string_lossy();
        let uploaded = upload_part(state, &capture.snapshot, &key, part).await?;
        rows.push(FileRow {
            rank: capture.rank,
            part: name,
            path: uploaded.key,
            sha256: uploaded.sha256,
            bytes: uploaded.bytes,
            step: capture.step,
            state: meta_json.clone(),
            fence: Some(fence.clone()),
            blocks: uploaded.blocks,
        });
    }
    Ok(rows)
}

/// Streams one part to the store under `key`. An S3 upload's id is in the
/// catalog while it is open, so a crash's leftover is aborted at the next
/// start; a failed upload is aborted at once.
pub(super) async fn upload_part(
    state: &Snaps,
    snapshot: &str,
    key: &str,
    part: format::PartFile,
) -> Result<crate::objstore::Uploaded, SnapshotError> {
    if let Some(root) = state.objects.local_path("") {
        // A directory: written from the tensors' own bytes on a blocking
        // thread (no copy into upload buffers), fsynced, renamed, the
        // directory fsynced.
        let rel = std::path::PathBuf::from(key);
        let w = blocking(state, snapshot, move || {
            let w = files::write_part(&root, &rel, &part)?;
            if let Some(dir) = root.join(&rel).parent() {
                files::sync_dir(dir)?;
            }
            Ok(w)
        })
        .await?;
        return Ok(crate::objstore::Uploaded {
            key: w.path,
            bytes: w.bytes,
            sha256: w.sha256,
            blocks: Some(w.blocks),
        });
    }
    let mut upload = state.objects.begin_upload(key).await?;
    let open = upload.id().map(|id| OpenUpload {
        upload_id: id.to_string(),
        key: key.to_string(),
        snapshot: snapshot.to_string(),
    });
    if let Some(open) = &open {
        if let Err(e) = state.store.record_upload(open, now_ms()).await {
            let _ = upload.abort().await;
            return Err(e.into());
        }
    }
    let mut written = upload.write(part.header.bytes()).await;
    for block in &part.blocks {
        if written.is_err() {
            break;
        }
        written = upload.write(block).await;
    }
    let done = match written {
        Ok(()) => upload.finish().await,
        Err(e) => {
            let _ = upload.abort().await;
            Err(e)
        }
    };
    if let Some(open) = &open {
        // An upload finished or aborted needs no abort at the next start;
        // a row left behind only costs that start an abort of nothing.
        if let Err(e) = state.store.forget_upload(&open.upload_id).await {
            tracing::warn!(upload = %open.upload_id, error = %e, "forgetting a finished upload failed");
        }
    }
    Ok(done?)
}

pub(super) async fn rank_written(state: &Snaps, id: &str, rank: u32, rows: Vec<FileRow>) {
    match state.pending.rank_written(id, rank, rows) {
        // Failed, or its run deleted, while this rank was being written.
        RankWritten::Gone(rows) => discard_files(state, &rows).await,
        RankWritten::More => {}
        RankWritten::Last(p) => finalize(state, id, p).await,
    }
}

pub(super) async fn finalize(state: &Snaps, id: &str, p: Pending) {
    match state
        .store
        .add_snapshot_part(id, &p.written, p.needed, now_ms())
        .await
    {
        Ok(PartOutcome::Complete { step, bytes }) => {
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
        Ok(PartOutcome::Waiting { ranks }) => {
            // Other nodes write the rest: whoever writes the last part
            // completes it; those waiting here learn it from the catalog.
            tracing::info!(run = %p.run, snapshot = %id, ranks, needed = p.needed,
                "this node's part of the snapshot is recorded");
            if !p.waiters.is_empty() {
                let (state, id) = (state.clone(), id.to_string());
                tokio::spawn(
                    async move { settle_from_catalog(&state, &p.run, &id, p.waiters).await },
                );
            }
        }
        Ok(PartOutcome::Fenced { rank, epoch, now }) => {
            // Captured in an epoch the rank's placement has left (this
            // node was paused or cut off past its lease): none of it may
            // be listed, and the snapshot cannot complete.
            let now = match now {
                Some((node, e)) => format!("node `{node}` holds it in epoch {e}"),
                None => "it is not placed".to_string(),
            };
            let reason = format!(
                "fenced: rank {rank} was captured by node `{}` in placement epoch {epoch}; {now}",
                state.registry.node_id()
            );
            state.metrics.snapshot_parts_fenced.inc();
            fail_taken(state, id, p, &reason).await;
        }
        Ok(PartOutcome::Gone) => {
            // Deleted or failed meanwhile: its files go.
            remove_files(state, &p.run, id).await;
            for w in p.waiters {
                let _ = w.send(Finished::Failed("deleted".into()));
            }
        }
        Err(e) => {
            // The catalog did not take it (its disk full, an outage).
            tracing::error!(snapshot = %id, error = %e, "completing a snapshot failed");
            let reason = format!("the catalog did not record its completion: {e}");
            completion_refused(state, id, p, &reason).await;
        }
    }
}

/// A snapshot whose completion the catalog did not take fails like one
/// whose write failed, recorded once the catalog takes it
/// ([`record_failure`]), so it never stays `pending`. Its files go only
/// once the catalog says it turned it from pending to failed: a commit
/// whose answer was lost may have completed it after all. (Those of a
/// failure recorded later by the ticker go at the next start.)
async fn completion_refused(state: &Snaps, id: &str, p: Pending, reason: &str) {
    tracing::warn!(run = %p.run, snapshot = %id, "snapshot failed: {reason}");
    let recorded = record_failure(state, id, reason).await;
    if recorded == Some(true) {
        remove_files(state, &p.run, id).await;
    }
    announce_failed(state, id, p, reason, recorded != Some(false));
}

/// Tells the waiters of a failed snapshot, and the run's event stream
/// (`emit`: unless the catalog said it was not pending any more).
fn announce_failed(state: &Snaps, id: &str, p: Pending, reason: &str, emit: bool) {
    if emit {
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
    }
    for w in p.waiters {
        let _ = w.send(Finished::Failed(reason.to_string()));
    }
}

/// Tells `waiters` how a snapshot other nodes complete ends, as the catalog
/// says (polled until it is no longer pending, at most ten minutes).
async fn settle_from_catalog(
    state: &Snaps,
    run: &str,
    id: &str,
    waiters: Vec<oneshot::Sender<Finished>>,
) {
    let until = Instant::now() + Duration::from_secs(600);
    let outcome = loop {
        match state.store.snapshot(run, id).await {
            Ok(Some(row)) if row.status == SnapshotStatus::Complete => break Finished::Complete,
            Ok(Some(row)) if row.status == SnapshotStatus::Failed => {
                break Finished::Failed(row.reason.unwrap_or_default())
            }
            Ok(None) => break Finished::Failed("deleted".into()),
            _ if Instant::now() >= until => break Finished::Failed("no answer in time".into()),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    for w in waiters {
        let _ = w.send(outcome.clone());
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
    fail_taken(state, id, p, reason).await;
}

/// [`fail`] for a snapshot already taken out of the registry.
async fn fail_taken(state: &Snaps, id: &str, p: Pending, reason: &str) {
    tracing::warn!(run = %p.run, snapshot = %id, "snapshot failed: {reason}");
    if let Some(run) = state.run(&p.run) {
        run.engines.cancel_cut(&p.run, id).await;
    }
    remove_files(state, &p.run, id).await;
    record_failure(state, id, reason).await;
    announce_failed(state, id, p, reason, true);
}

/// Attempts at recording a failure before it is left to the ticker.
pub(super) const RECORD_ATTEMPTS: u32 = 4;

/// Marks a snapshot failed in the catalog, retrying with backoff; what
/// still does not go through is kept and retried every second
/// ([`retry_unrecorded`]), and a stop leaves the row `pending`, which the
/// next start fails ([`recover`]). Whether the catalog turned it from
/// pending to failed (`false`: it was not pending), `None` when that is
/// left to the retries.
pub async fn record_failure(state: &Snaps, id: &str, reason: &str) -> Option<bool> {
    let mut delay = Duration::from_millis(50);
    for attempt in 1..=RECORD_ATTEMPTS {
        match state.store.fail_snapshot(id, reason, now_ms()).await {
            Ok(changed) => return Some(changed),
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
    None
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

pub(super) async fn discard_files(state: &Snaps, rows: &[FileRow]) {
    for row in rows {
        if let Err(e) = state.objects.delete(&row.path).await {
            tracing::warn!(key = %row.path, error = %e, "removing an orphaned snapshot part failed");
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
