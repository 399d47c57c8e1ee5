//! How far a derived job is: kept in memory for `GET .../snapshots/{id}`
//! and sent as transient `snapshot` events.

use serde::Serialize;
use utoipa::ToSchema;

use super::Job;
use crate::events::{Event, SnapshotEvent};
use crate::services::snapshots::Snaps;

/// Progress of a derived snapshot being written.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct Progress {
    /// Source bytes read so far.
    pub done: u64,
    /// Source bytes to read in all.
    pub total: u64,
}

/// How often progress is reported, at most.
pub(super) const REPORT_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// Records progress (at most a few times a second) and tells SSE readers.
pub(super) fn report(state: &Snaps, job: &Job, done: u64) {
    state
        .pending
        .progress_set(job.outputs.iter().map(|o| o.id.as_str()), done);
    state.events.emit(
        &job.run,
        None,
        Some(job.step),
        Event::Snapshot(SnapshotEvent::Running {
            ids: job.outputs.iter().map(|o| o.id.clone()).collect(),
            kind: job.kind,
            done,
            total: job.total,
        }),
    );
}

/// The progress of a derived snapshot still being written.
pub fn progress_of(state: &Snaps, id: &str) -> Option<Progress> {
    state.pending.progress_of(id)
}
