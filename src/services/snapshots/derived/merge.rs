//! `POST /merge`: checkpoint averaging of the online weights (the mirror)
//! of stored snapshots, uniform, linear or exponential in their age.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::start::start;
use super::{derived_row, mergeable, profile_name, JobOutput, JobSource, Started};
use crate::contract::SnapshotKind;
use crate::engine::snapshot_id;
use crate::registry::RunHandle;
use crate::services::snapshots::{Snaps, SnapshotError};
use crate::snapshot::format::MIRROR_PART;
use crate::store::snapshots::SnapshotRow;

/// The most snapshots one merge may average.
pub const MAX_MERGE: usize = 256;

/// How a merge weighs its snapshots, oldest to newest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MergeWeights {
    /// `1/K` each.
    Uniform,
    /// Proportional to `1, 2, ..., K` (the newest counts most).
    Linear,
    /// Proportional to `alpha^age`, `age` = 0 for the newest.
    Exp,
}

impl MergeWeights {
    pub fn name(self) -> &'static str {
        match self {
            MergeWeights::Uniform => "uniform",
            MergeWeights::Linear => "linear",
            MergeWeights::Exp => "exp",
        }
    }
}

/// The normalised weights of `k` snapshots, oldest first.
pub fn merge_weights(scheme: MergeWeights, k: usize, alpha: f64) -> Vec<f64> {
    let raw: Vec<f64> = (0..k)
        .map(|i| match scheme {
            MergeWeights::Uniform => 1.0,
            MergeWeights::Linear => (i + 1) as f64,
            MergeWeights::Exp => alpha.powi((k - 1 - i) as i32),
        })
        .collect();
    let sum: f64 = raw.iter().sum();
    raw.into_iter().map(|w| w / sum).collect()
}

/// Which snapshots a merge averages.
pub enum MergeSelection {
    Ids(Vec<String>),
    Last(usize),
}

/// `POST /merge`: the weighted average of the online weights (mirror) of
/// stored snapshots, as a derived snapshot of kind `merge` holding one
/// profile `name` at the newest source's step.
pub async fn merge(
    state: &Snaps,
    run: &RunHandle,
    selection: MergeSelection,
    scheme: MergeWeights,
    alpha: Option<f64>,
    name: Option<String>,
) -> Result<Started, SnapshotError> {
    let config = &run.config;
    let name = profile_name(name, "merged")?;
    if !config.mirror {
        return Err(SnapshotError::Invalid(format!(
            "run `{}` keeps no online weights (create it with mirror: true to merge checkpoints)",
            config.name
        )));
    }
    let alpha = merge_alpha(scheme, alpha)?;
    let rows = state.store.snapshots(&config.name).await?;
    // A mirror run captures the mirror in every cut; `start` reads each
    // source's files and refuses one without its part.
    let chosen = choose_merged(&config.name, rows, selection)?;
    let weights = merge_weights(scheme, chosen.len(), alpha);
    let newest = chosen.last().map(|r| r.step).unwrap_or(0);
    let id = snapshot_id(SnapshotKind::Merge, newest);
    let detail = serde_json::json!({
        "weights": scheme,
        "alpha": (scheme == MergeWeights::Exp).then_some(alpha),
        "sources": chosen.iter().zip(&weights).map(|(r, w)| serde_json::json!({
            "snapshot": r.id, "step": r.step, "weight": w,
        })).collect::<Vec<_>>(),
    });
    let label = format!("merge of {} ({})", chosen.len(), scheme.name());
    let row = derived_row(run, &id, SnapshotKind::Merge, newest, label, &name, detail);
    let sources: Vec<JobSource> = chosen
        .iter()
        .map(|r| JobSource {
            snapshot: r.id.clone(),
            part: MIRROR_PART.to_string(),
        })
        .collect();
    let base = sources.len() - 1;
    let output = JobOutput {
        id,
        profile: name,
        weights,
    };
    start(state, run, vec![row], sources, base, vec![output], None).await
}

/// `alpha` of the exp weights (default 0.5); the others take none.
fn merge_alpha(scheme: MergeWeights, alpha: Option<f64>) -> Result<f64, SnapshotError> {
    match (scheme, alpha) {
        (MergeWeights::Exp, None) => Ok(0.5),
        (MergeWeights::Exp, Some(a)) if a.is_finite() && a > 0.0 && a <= 1.0 => Ok(a),
        (MergeWeights::Exp, Some(a)) => Err(SnapshotError::Invalid(format!(
            "alpha: {a} is out of range (0, 1]"
        ))),
        (_, Some(_)) => Err(SnapshotError::Invalid(
            "alpha: only the exp weights take an alpha".into(),
        )),
        (_, None) => Ok(1.0),
    }
}

/// The snapshots a merge averages, oldest first.
fn choose_merged(
    run: &str,
    rows: Vec<SnapshotRow>,
    selection: MergeSelection,
) -> Result<Vec<SnapshotRow>, SnapshotError> {
    let mut chosen = match selection {
        MergeSelection::Last(k) => {
            if k == 0 || k > MAX_MERGE {
                return Err(SnapshotError::Invalid(format!(
                    "last: between 1 and {MAX_MERGE} snapshots"
                )));
            }
            let mut all: Vec<SnapshotRow> = rows.into_iter().filter(mergeable).collect();
            all.sort_by_key(|r| (r.step, r.created_at_ms));
            // One snapshot per step: the online weights of a step are the same.
            all.dedup_by_key(|r| r.step);
            if all.len() < k {
                return Err(SnapshotError::Invalid(format!(
                    "last: {k} snapshots asked for, the run has {} complete ones",
                    all.len()
                )));
            }
            all.split_off(all.len() - k)
        }
        MergeSelection::Ids(ids) => {
            if ids.is_empty() || ids.len() > MAX_MERGE {
                return Err(SnapshotError::Invalid(format!(
                    "snapshots: between 1 and {MAX_MERGE} ids"
                )));
            }
            let mut seen = HashSet::new();
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                if !seen.insert(id.clone()) {
                    return Err(SnapshotError::Invalid(format!(
                        "snapshots: `{id}` is listed twice"
                    )));
                }
                let row = rows.iter().find(|r| r.id == id).ok_or_else(|| {
                    SnapshotError::NotFound(format!("no snapshot `{id}` in run `{run}`"))
                })?;
                if !mergeable(row) {
                    return Err(SnapshotError::Invalid(format!(
                        "snapshots: `{id}` is a {} snapshot that is {}; only complete manual or \
                         periodic snapshots hold a consistent cut of the online weights",
                        row.kind, row.status
                    )));
                }
                out.push(row.clone());
            }
            out
        }
    };
    chosen.sort_by_key(|r| (r.step, r.created_at_ms));
    Ok(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_weights_are_normalised_and_ordered() {
        assert_eq!(merge_weights(MergeWeights::Uniform, 4, 1.0), vec![0.25; 4]);
        let lin = merge_weights(MergeWeights::Linear, 3, 1.0);
        assert!((lin[0] - 1.0 / 6.0).abs() < 1e-15 && (lin[2] - 0.5).abs() < 1e-15);
        let exp = merge_weights(MergeWeights::Exp, 3, 0.5);
        // 0.25 : 0.5 : 1, oldest first.
        assert!((exp[0] - 0.25 / 1.75).abs() < 1e-15 && (exp[2] - 1.0 / 1.75).abs() < 1e-15);
    }
}
