//! The background job of derived snapshots: written on a blocking thread,
//! stored, marked complete, or failed with its files removed.

use std::time::Instant;

use super::progress::report;
use super::write::write_outputs;
use super::Job;
use crate::clock::now_ms;
use crate::events::{Event, SnapshotEvent};
use crate::services::snapshots::{record_failure, remove_files, Snaps, SnapshotError};
use crate::store::snapshots::FileRow;

/// Runs a job on a blocking thread and records how it ended.
pub(super) fn spawn_job(state: Snaps, job: Job) {
    tokio::spawn(async move {
        let started = Instant::now();
        let ids: Vec<String> = job.outputs.iter().map(|o| o.id.clone()).collect();
        let (run, kind, step) = (job.run.clone(), job.kind, job.step);
        let staging = staging_dir(&state);
        let (st, objects, at) = (state.clone(), state.objects.clone(), staging.clone());
        let written = tokio::task::spawn_blocking(move || {
            write_outputs(&at, &objects, &job, &mut |done| report(&st, &job, done))
        })
        .await;
        let written = match written {
            Ok(Ok(per_output)) => publish(&state, &staging, &ids, per_output)
                .await
                .map_err(|e| e.to_string()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(format!("the job panicked: {e}")),
        };
        let result = match written {
            Ok(per_output) => complete(&state, &ids, step, per_output).await,
            Err(e) => Err(e),
        };
        state.pending.progress_end(ids.iter().map(String::as_str));
        match result {
            Ok(bytes) => {
                tracing::info!(run = %run, kind = %kind, snapshots = ?ids, secs = started.elapsed().as_secs_f64(), "derived snapshots written");
                for (id, b) in ids.iter().zip(bytes) {
                    state.events.emit(
                        &run,
                        None,
                        Some(step),
                        Event::Snapshot(SnapshotEvent::Complete {
                            id: id.clone(),
                            kind,
                            bytes: b,
                        }),
                    );
                }
            }
            Err(reason) => {
                tracing::warn!(run = %run, kind = %kind, snapshots = ?ids, "derived snapshots failed: {reason}");
                for id in &ids {
                    // Files first: on a full disk the catalog needs the room.
                    remove_files(&state, &run, id).await;
                    record_failure(&state, id, &reason).await;
                    state.events.emit(
                        &run,
                        None,
                        Some(step),
                        Event::Snapshot(SnapshotEvent::Failed {
                            id: id.clone(),
                            kind: Some(kind),
                            reason: reason.to_string(),
                        }),
                    );
                }
            }
        }
    });
}

/// Marks every output complete; returns their sizes.
async fn complete(
    state: &Snaps,
    ids: &[String],
    step: u64,
    per_output: Vec<Vec<FileRow>>,
) -> Result<Vec<u64>, String> {
    let mut sizes = Vec::with_capacity(ids.len());
    for (id, files) in ids.iter().zip(per_output) {
        sizes.push(files.iter().map(|f| f.bytes).sum());
        let recorded = state
            .store
            .complete_snapshot(id, step, &files, now_ms())
            .await
            .map_err(|e| e.to_string())?;
        if !recorded {
            return Err(format!("snapshot `{id}` was deleted while it was written"));
        }
    }
    Ok(sizes)
}

/// Where derived parts are written before they are stored: the store's
/// own directory when it is one (storing is then a rename in place), else
/// `<data-dir>/staging` (storing uploads each part, then removes it).
fn staging_dir(state: &Snaps) -> std::path::PathBuf {
    state
        .objects
        .local_path("")
        .unwrap_or_else(|| state.pending.data_dir().join("staging"))
}

/// Stores the parts written under `staging`; their rows keep their keys.
async fn publish(
    state: &Snaps,
    staging: &std::path::Path,
    ids: &[String],
    per_output: Vec<Vec<FileRow>>,
) -> Result<Vec<Vec<FileRow>>, SnapshotError> {
    for (rows, id) in per_output.iter().zip(ids) {
        for row in rows {
            let record = async |upload_id: &str| {
                let open = crate::store::uploads::OpenUpload {
                    upload_id: upload_id.to_string(),
                    key: row.path.clone(),
                    snapshot: id.clone(),
                };
                state
                    .store
                    .record_upload(&open, now_ms())
                    .await
                    .map_err(|e| crate::objstore::StoreError::Io(std::io::Error::other(e)))
            };
            let stored = state
                .objects
                .put_file(
                    &row.path,
                    &staging.join(&row.path),
                    Some(&row.sha256),
                    record,
                )
                .await;
            if state.objects.local_path("").is_none() {
                // The upload's id, recorded when it opened, is done with.
                let _ = state.store.forget_uploads_of(&row.path).await;
            }
            stored?;
        }
    }
    Ok(per_output)
}
