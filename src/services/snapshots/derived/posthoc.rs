//! `POST /posthoc`: the pending rows of a post-hoc sweep and the job that
//! writes them.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::plan::{plan, PosthocMethod};
use super::start::start;
use super::{derived_row, profile_name, JobOutput, JobSource, Started};
use crate::contract::SnapshotKind;
use crate::engine::snapshot_id;
use crate::registry::RunHandle;
use crate::services::snapshots::{Snaps, SnapshotError};
use crate::wire::DType;

/// The dtype post-hoc sources are rounded to before they are weighted
/// (ema-pytorch's `checkpoint_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SourceDtype {
    Fp16,
    Bf16,
}

impl SourceDtype {
    fn dtype(self) -> DType {
        match self {
            SourceDtype::Fp16 => DType::F16,
            SourceDtype::Bf16 => DType::BF16,
        }
    }
}

/// How `POST /posthoc` solves and reads its sources.
#[derive(Debug, Clone, Copy, Default)]
pub struct Synthesis {
    pub method: PosthocMethod,
    /// Round every source value to this dtype before weighting it.
    pub source_dtype: Option<SourceDtype>,
}

/// `POST /posthoc`: one derived snapshot per `sigma_rel` (kind `posthoc`,
/// one profile `name`), written in one pass over the sources.
pub async fn posthoc(
    state: &Snaps,
    run: &RunHandle,
    sigma_rels: &[f64],
    step: Option<u64>,
    name: Option<String>,
    profiles: Option<&[String]>,
    synthesis: Synthesis,
) -> Result<Started, SnapshotError> {
    let name = profile_name(name, SnapshotKind::Posthoc.as_str())?;
    let plan = plan(state, run, sigma_rels, step, profiles, synthesis.method).await?;
    let sweep_ids: Vec<String> = plan
        .targets
        .iter()
        .map(|_| snapshot_id(SnapshotKind::Posthoc, plan.step))
        .collect();
    let mut rows = Vec::with_capacity(plan.targets.len());
    let mut outputs = Vec::with_capacity(plan.targets.len());
    for (target, id) in plan.targets.iter().zip(&sweep_ids) {
        let detail = serde_json::json!({
            "sigma_rel": target.sigma_rel,
            "gamma": target.gamma,
            "residual": target.residual,
            "sources": plan.sources.iter().zip(&target.weights).map(|(s, w)| serde_json::json!({
                "snapshot": s.snapshot, "profile": s.profile, "step": s.step,
                "gamma": s.gamma, "sigma_rel": s.sigma_rel, "weight": w,
            })).collect::<Vec<_>>(),
            "sweep": sweep_ids,
            "method": synthesis.method,
            "source_dtype": synthesis.source_dtype,
        });
        rows.push(derived_row(
            run,
            id,
            SnapshotKind::Posthoc,
            plan.step,
            format!("sigma_rel={}", target.sigma_rel),
            &name,
            detail,
        ));
        outputs.push(JobOutput {
            id: id.clone(),
            profile: name.clone(),
            weights: target.weights.clone(),
        });
    }
    let sources = plan
        .sources
        .iter()
        .map(|s| JobSource {
            snapshot: s.snapshot.clone(),
            part: s.profile.clone(),
        })
        .collect::<Vec<_>>();
    // The newest source carries the copied tensors (EDM2 copies buffers
    // from its inputs in order, so the last one's stay).
    let base = sources.len() - 1;
    let round_to = synthesis.source_dtype.map(SourceDtype::dtype);
    start(state, run, rows, sources, base, outputs, round_to).await
}
