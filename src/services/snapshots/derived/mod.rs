//! Derived snapshots: weights the server computes from stored snapshots
//! rather than captures.
//!
//! - `posthoc`: EDM2 post-hoc EMA. `plan` finds the run's stored power
//!   profiles and solves for the weights ([`posthoc`](crate::snapshot::posthoc));
//!   `posthoc` writes one derived snapshot per requested `sigma_rel`, all in
//!   one pass over the sources.
//! - `merge`: checkpoint averaging of the online weights (the mirror) of
//!   stored snapshots, uniform, linear or exponential in their age.
//!
//! Both are catalog rows inserted `pending` (`start`: the sources looked up
//! and verified first), filled by one background job (`job`) that streams
//! the sources through [`combine`](crate::snapshot::combine) rank by rank
//! (`write`) and completes every output together. Progress (source bytes
//! read of the total, `progress`) is kept in memory for
//! `GET .../snapshots/{id}` and sent as transient `snapshot` events.

mod job;
mod merge;
mod plan;
mod posthoc;
mod progress;
mod start;
mod write;

pub use merge::{merge, merge_weights, MergeSelection, MergeWeights, MAX_MERGE};
pub use plan::{plan, Plan, PlannedTarget, PosthocMethod, PowerSource, MAX_SWEEP};
pub use posthoc::{posthoc, SourceDtype, Synthesis};
pub use progress::{progress_of, Progress};

use super::SnapshotError;
use crate::contract::{SnapshotKind, SnapshotStatus};
use crate::registry::RunHandle;
use crate::snapshot::format::MIRROR_PART;
use crate::store::snapshots::{FileRow, SnapshotRow};
use crate::wire::DType;

/// One part of one stored snapshot that a job reads.
#[derive(Debug, Clone)]
struct JobSource {
    snapshot: String,
    part: String,
}

/// One derived snapshot a job writes.
#[derive(Debug, Clone)]
struct JobOutput {
    id: String,
    /// The profile name it is stored under.
    profile: String,
    weights: Vec<f64>,
}

/// Derived snapshots just recorded, and the source bytes their job reads.
#[derive(Debug)]
pub struct Started {
    /// Pending rows, in request order.
    pub rows: Vec<SnapshotRow>,
    pub total: u64,
}

/// What the background job reads and writes, fixed when it starts.
struct Job {
    run: String,
    kind: SnapshotKind,
    step: u64,
    out_dtype: DType,
    /// Per source: its files of the part read (one per rank).
    files: Vec<Vec<FileRow>>,
    base: usize,
    outputs: Vec<JobOutput>,
    total: u64,
    /// Sources rounded to this dtype before they are weighted.
    round_to: Option<DType>,
}

/// Complete manual and periodic snapshots hold a consistent cut of the
/// online weights; the others do not.
fn mergeable(r: &SnapshotRow) -> bool {
    r.status == SnapshotStatus::Complete && r.kind.is_cut()
}

fn profile_name(name: Option<String>, default: &str) -> Result<String, SnapshotError> {
    let name = name.unwrap_or_else(|| default.to_string());
    if !crate::run::valid_name(&name) || name == MIRROR_PART {
        return Err(SnapshotError::Invalid(format!(
            "name: `{name}` is not a valid profile name"
        )));
    }
    if crate::run::reserved_profile(&name) {
        return Err(SnapshotError::Invalid(format!(
            "name: `{name}` is reserved (`online` names the mirror in downloads and comparisons)"
        )));
    }
    Ok(name)
}

fn derived_row(
    run: &RunHandle,
    id: &str,
    kind: SnapshotKind,
    step: u64,
    label: String,
    profile: &str,
    detail: serde_json::Value,
) -> SnapshotRow {
    SnapshotRow {
        label: Some(label),
        detail,
        ..SnapshotRow::pending(id, &run.config.name, step, kind, vec![profile.to_string()])
    }
}
