//! What a run's handlers ask of the engine outside ingest and snapshots:
//! deleting a run everywhere it lives, exporting its live EMA (one rank's,
//! or every rank's for a comparison), and whether every engine answers.
//! The engine closures live here, not in the handlers.

use std::collections::HashMap;
use std::sync::Arc;

use super::alerts::AlertsSvc;
use super::snapshots::{self, Snaps};
use super::{Context, ServiceError};
use crate::engine::rank::RankLayout;
use crate::engine::{EmaExport, EngineError};
use crate::registry::RunHandle;
use crate::snapshot::compare::RankTensors;
use crate::wire::DType;

/// Tries of the catalog delete that met a deadlock, at most.
const DELETE_TRIES: u32 = 6;

/// Deletes a run: out of the registry and the catalog, its EMA freed on
/// its engine, its metrics and alerts forgotten, its files removed.
pub async fn delete(
    ctx: &Context,
    snaps: &Snaps,
    alerts: &AlertsSvc,
    run: &RunHandle,
) -> Result<(), ServiceError> {
    let name = run.config.name.clone();
    ctx.registry.remove_run(&name);
    // The cascade over the run's rows can deadlock with a request on the
    // run inserting a row at the same moment; the run is out of the
    // registry already, so tries again find nothing new to wait for.
    let mut tries = 0;
    loop {
        match ctx.store.delete_run(&name).await {
            Err(e) if e.is_contention() && tries < DELETE_TRIES => {
                tries += 1;
                tracing::info!(run = %name, tries, "deleting the run's rows met another write; again");
                tokio::time::sleep(std::time::Duration::from_millis(20 << tries)).await;
            }
            done => {
                done?;
                break;
            }
        }
    }
    run.engines.drop_run(&name).await;
    ctx.metrics.forget_run(&name);
    alerts.alerts.forget(&name);
    // The catalog no longer lists them: without this they stayed on disk
    // until the next start.
    if let Err(e) = snapshots::remove_run_files(snaps, &name).await {
        tracing::warn!(run = %name, error = %e, "removing a deleted run's files failed");
    }
    tracing::info!(run = %name, "run deleted");
    Ok(())
}

/// One rank's live EMA of `profile`, on the host (cast to `cast` first).
pub async fn rank_ema(
    run: &RunHandle,
    rank: u32,
    profile: &str,
    cast: Option<DType>,
) -> Result<EmaExport, ServiceError> {
    let engine = run.engines.of(rank).ok_or_else(|| EngineError::NotHere {
        run: run.config.name.clone(),
        rank,
    })?;
    let export = engine.export_ema(&run.config.name, rank, profile).await??;
    Ok(tokio::task::spawn_blocking(move || export.to_host(cast.map(DType::kind))).await??)
}

/// Every rank's live EMA of `profile`, as named tensor bytes beside the
/// rank's layout (what a comparison reads).
pub async fn live_tensors(
    run: &RunHandle,
    profile: &str,
) -> Result<HashMap<u32, (Arc<RankLayout>, RankTensors)>, ServiceError> {
    let exports = run.engines.export_all(&run.config.name, profile).await?;
    tokio::task::spawn_blocking(move || -> Result<_, ServiceError> {
        let mut out = HashMap::new();
        for (rank, export) in exports {
            let host = export.to_host(None)?;
            let tensors =
                crate::snapshot::convert::flat_tensors(host.layout.as_ref(), host.ema, host.copied);
            out.insert(rank, (host.layout.clone(), tensors));
        }
        Ok(out)
    })
    .await?
}

/// Whether every engine thread still takes work.
pub async fn engines_answer(ctx: &Context) -> bool {
    for engine in ctx.registry.engines() {
        if engine.ping().await.is_err() {
            return false;
        }
    }
    true
}
