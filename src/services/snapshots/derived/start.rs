//! Starting a derived job: every source looked up and verified, room on
//! disk checked, then the pending rows recorded and announced.

use super::job::spawn_job;
use super::{Job, JobOutput, JobSource, Started};
use crate::contract::SnapshotKind;
use crate::events::{Event, SnapshotEvent};
use crate::registry::RunHandle;
use crate::services::snapshots::{disk, verify, Snaps, SnapshotError};
use crate::snapshot::source::PartLoc;
use crate::store::snapshots::{FileRow, SnapshotRow};
use crate::wire::DType;

/// Inserts the pending rows and starts the job that fills them.
pub(super) async fn start(
    state: &Snaps,
    run: &RunHandle,
    rows: Vec<SnapshotRow>,
    sources: Vec<JobSource>,
    base: usize,
    outputs: Vec<JobOutput>,
    round_to: Option<DType>,
) -> Result<Started, SnapshotError> {
    let Some(kind) = rows.first().map(|r| r.kind) else {
        return Err(SnapshotError::Internal(
            "no derived snapshot to write".into(),
        ));
    };
    // Every source's files are looked up and verified before anything is
    // recorded, so a request that cannot run changes nothing.
    let files = source_files(state, &sources).await?;
    verify_sources(state, &files, kind).await?;
    let total: u64 = files.iter().flatten().map(|f| f.bytes).sum();
    // Each output is about the size of one source: refuse early rather than
    // fail on a full disk halfway.
    let per_output = total / files.len().max(1) as u64;
    disk::check(state, per_output * outputs.len() as u64)?;
    record_pending(state, run, &rows, &outputs, total).await?;
    let job = Job {
        run: run.config.name.clone(),
        kind,
        step: rows.first().map(|r| r.step).unwrap_or(0),
        out_dtype: if run.config.ema_dtype.kind() == tch::Kind::Double {
            DType::F64
        } else {
            DType::F32
        },
        files,
        base,
        outputs,
        total,
        round_to,
    };
    spawn_job(state.clone(), job);
    Ok(Started { rows, total })
}

/// Per source, its files of the part read (one per rank).
async fn source_files(
    state: &Snaps,
    sources: &[JobSource],
) -> Result<Vec<Vec<FileRow>>, SnapshotError> {
    let mut files = Vec::with_capacity(sources.len());
    for s in sources {
        let rows: Vec<FileRow> = state
            .store
            .snapshot_files(&s.snapshot)
            .await?
            .into_iter()
            .filter(|f| f.part == s.part)
            .collect();
        if rows.is_empty() {
            return Err(SnapshotError::Internal(format!(
                "complete snapshot `{}` holds no `{}` part",
                s.snapshot, s.part
            )));
        }
        files.push(rows);
    }
    Ok(files)
}

/// Every source part is reread and held to its recorded size and sha256:
/// a corrupt source refuses the request (500 snapshot_corrupt) instead of
/// being averaged in.
async fn verify_sources(
    state: &Snaps,
    files: &[Vec<FileRow>],
    kind: SnapshotKind,
) -> Result<(), SnapshotError> {
    let sources_read: Vec<std::sync::Arc<PartLoc>> = files
        .iter()
        .flatten()
        .map(|f| crate::services::snapshots::stored_part(&state.objects, f))
        .collect();
    let checked = tokio::task::spawn_blocking(move || {
        let cancel = std::sync::atomic::AtomicBool::new(false);
        sources_read.iter().try_for_each(|p| p.verify(&cancel))
    })
    .await
    .map_err(|e| SnapshotError::Worker(e.to_string()))?;
    let during = if kind == SnapshotKind::Merge {
        "merge"
    } else {
        "posthoc"
    };
    verify::noted(
        &state.events,
        &state.metrics,
        during,
        checked.map_err(SnapshotError::Io),
    )
}

/// Inserts the pending rows, starts their progress and announces them.
async fn record_pending(
    state: &Snaps,
    run: &RunHandle,
    rows: &[SnapshotRow],
    outputs: &[JobOutput],
    total: u64,
) -> Result<(), SnapshotError> {
    for row in rows {
        state.store.insert_snapshot(row).await?;
    }
    state
        .pending
        .progress_start(outputs.iter().map(|o| o.id.as_str()), total);
    for row in rows {
        state.events.emit(
            &run.config.name,
            None,
            Some(row.step),
            Event::Snapshot(SnapshotEvent::Pending {
                id: row.id.clone(),
                kind: row.kind,
                cut: None,
            }),
        );
    }
    Ok(())
}
