//! Stored parts held to what the catalog recorded of them: how a part that
//! does not match is reported (an event, which fires an alert, and
//! `polyak_snapshot_corrupt_total`), and the store-wide check behind
//! `polyak verify` and `POST /v1/admin/verify`.

use std::sync::atomic::AtomicBool;

use serde::Serialize;
use utoipa::ToSchema;

use super::{SnapshotError, SnapshotStatus};
use crate::events::{self, Event, EventBus};
use crate::objstore::ObjectStore;
use crate::snapshot::source::PartMismatch;
use crate::store::Store;
use crate::telemetry::Metrics;

impl SnapshotError {
    /// The stored part that did not match its record, if that is the error.
    pub fn mismatch(&self) -> Option<&PartMismatch> {
        match self {
            SnapshotError::Io(e) => PartMismatch::of(e),
            _ => None,
        }
    }
}

/// Tells the run's event stream (and through it the alerts) and the
/// metrics that `during` found a part that does not match.
pub fn report_mismatch(
    events: &EventBus,
    metrics: &Metrics,
    m: &PartMismatch,
    during: &'static str,
) {
    let (run, snapshot) = m.snapshot().unwrap_or(("", ""));
    tracing::error!(part = %m.key, during, "{m}");
    metrics.snapshot_corrupt.with_label_values(&[run]).inc();
    if run.is_empty() {
        return;
    }
    events.emit(
        run,
        None,
        None,
        Event::SnapshotCorrupt(events::SnapshotCorrupt {
            snapshot: snapshot.to_string(),
            part: m.key.clone(),
            reason: m.what.clone(),
            during,
        }),
    );
}

/// Reports the mismatch `result` failed with, if it did; hands it back.
pub fn noted<T>(
    events: &EventBus,
    metrics: &Metrics,
    during: &'static str,
    result: Result<T, SnapshotError>,
) -> Result<T, SnapshotError> {
    if let Err(e) = &result {
        if let Some(m) = e.mismatch() {
            report_mismatch(events, metrics, m, during);
        }
    }
    result
}

/// One part that does not match (or could not be read).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct BadPart {
    pub run: String,
    pub snapshot: String,
    pub rank: u32,
    /// The profile, or `__mirror__`.
    pub part: String,
    /// The part's key in the store.
    pub key: String,
    /// `mismatch` (size, a block or sha256 not the recorded ones),
    /// `missing`, or `unreadable`.
    pub problem: String,
    pub detail: String,
}

/// What a store-wide check found.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct VerifyReport {
    /// Complete snapshots whose parts were reread.
    pub snapshots: u64,
    pub parts: u64,
    /// Bytes reread and hashed.
    pub bytes: u64,
    /// True when every part matched.
    pub clean: bool,
    pub bad: Vec<BadPart>,
}

/// Rereads every part of every complete snapshot (of `run`, or of every
/// run) and reports those whose size, blocks or sha256 are not the
/// recorded ones (each part read once, its blocks checked and its sha256
/// computed in the same pass). Parts are read one at a time, on a
/// blocking thread.
pub async fn verify_store(
    store: &Store,
    objects: &ObjectStore,
    run: Option<&str>,
) -> Result<VerifyReport, SnapshotError> {
    let runs: Vec<String> = match run {
        Some(r) => vec![r.to_string()],
        None => store
            .list_runs()
            .await?
            .into_iter()
            .map(|r| r.config.name)
            .collect(),
    };
    let mut report = VerifyReport::default();
    for run in runs {
        for row in store.snapshots(&run).await? {
            if row.status != SnapshotStatus::Complete {
                continue;
            }
            report.snapshots += 1;
            for f in store.snapshot_files(&row.id).await? {
                let loc = crate::services::snapshots::stored_part(objects, &f);
                let checked =
                    tokio::task::spawn_blocking(move || loc.verify(&AtomicBool::new(false)))
                        .await
                        .map_err(|e| SnapshotError::Worker(e.to_string()))?;
                report.parts += 1;
                let e = match checked {
                    Ok(()) => {
                        report.bytes += f.bytes;
                        continue;
                    }
                    // An outage says nothing about the parts: give up.
                    Err(e) if e.kind() == std::io::ErrorKind::NotConnected => {
                        return Err(SnapshotError::Io(e))
                    }
                    Err(e) => e,
                };
                let problem = if PartMismatch::of(&e).is_some() {
                    "mismatch"
                } else if e.kind() == std::io::ErrorKind::NotFound {
                    "missing"
                } else {
                    "unreadable"
                };
                let detail = match PartMismatch::of(&e) {
                    Some(m) => m.what.clone(),
                    None => e.to_string(),
                };
                report.bad.push(BadPart {
                    run: run.clone(),
                    snapshot: row.id.clone(),
                    rank: f.rank,
                    part: f.part.clone(),
                    key: f.path.clone(),
                    problem: problem.into(),
                    detail,
                });
            }
        }
    }
    report.clean = report.bad.is_empty();
    Ok(report)
}
