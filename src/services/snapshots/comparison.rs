//! Comparing two snapshots, or a snapshot and the live EMA: the two sides
//! loaded rank by rank (stored parts read back and held to their records,
//! or every rank's live EMA exported from its engine), per-tensor
//! statistics over whole tensors, and the cache of stored-against-stored
//! results (snapshots do not change once complete).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::{download, parts_of, verify, Snaps, SnapshotError, SnapshotStatus};
use crate::engine::rank::RankLayout;
use crate::registry::RunHandle;
use crate::services::ServiceError;
use crate::snapshot::assemble::StoredPart;
use crate::snapshot::compare::{self, CompareResult, RankTensors};
use crate::snapshot::source::PartMismatch;

/// The side of a comparison that means the live EMA.
pub const LIVE: &str = "live";

/// A comparison's answer: the profiles compared and the statistics.
pub struct Compared {
    pub profile: String,
    pub profile_b: String,
    pub result: Arc<CompareResult>,
}

/// Compares side `a` (a snapshot id) with side `b` (a snapshot id, or
/// [`LIVE`]) of `run`: `profile` of A (default the run's first) against
/// `profile_b` of B (default `profile`). Two stored sides are answered
/// from the cache when asked before.
pub async fn compare(
    snaps: &Snaps,
    run: &RunHandle,
    a: &str,
    b: &str,
    profile: Option<String>,
    profile_b: Option<String>,
) -> Result<Compared, ServiceError> {
    let name = &run.config.name;
    let profile = profile.unwrap_or_else(|| run.config.profiles[0].name().to_string());
    let profile_b = profile_b.unwrap_or_else(|| profile.clone());
    let key = format!("{name}\n{a}\n{b}\n{profile}\n{profile_b}");
    let cached = b != LIVE;
    if cached {
        if let Some(result) = snaps.pending.cached_compare(&key) {
            return Ok(Compared {
                profile,
                profile_b,
                result,
            });
        }
    }
    let side_a = side(snaps, run, a, &profile).await?;
    let side_b = side(snaps, run, b, &profile_b).await?;
    let layouts = side_a.layouts();
    let result = tokio::task::spawn_blocking(move || {
        compare::compare(&layouts, |r| side_a.load(r), |r| side_b.load(r))
    })
    .await?
    .map_err(|e| match e {
        Fail::NotComparable(m) => ServiceError::unprocessable("not_comparable", m),
        Fail::Read(e) => {
            if let Some(m) = PartMismatch::of(&e) {
                verify::report_mismatch(&snaps.events, &snaps.metrics, m, "compare");
            }
            SnapshotError::Io(e).into()
        }
    })?;
    let result = Arc::new(result);
    if cached {
        snaps.pending.cache_compare(key, result.clone());
    }
    Ok(Compared {
        profile,
        profile_b,
        result,
    })
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

/// Why one side of a comparison could not be loaded.
enum Fail {
    /// The two sides do not line up (422).
    NotComparable(String),
    /// A stored part could not be read, or does not match its record.
    Read(std::io::Error),
}

impl From<String> for Fail {
    fn from(m: String) -> Self {
        Fail::NotComparable(m)
    }
}

/// One side of a comparison.
enum Side {
    Stored(Vec<StoredPart>),
    Live(HashMap<u32, (Arc<RankLayout>, RankTensors)>),
}

impl Side {
    fn layouts(&self) -> BTreeMap<u32, RankLayout> {
        match self {
            Side::Stored(parts) => parts
                .iter()
                .map(|p| (p.rank, p.meta.layout.clone()))
                .collect(),
            Side::Live(ranks) => ranks
                .iter()
                .map(|(r, (l, _))| (*r, (**l).clone()))
                .collect(),
        }
    }

    fn load(&self, rank: u32) -> Result<RankTensors, Fail> {
        match self {
            Side::Stored(parts) => {
                let part = parts
                    .iter()
                    .find(|p| p.rank == rank)
                    .ok_or_else(|| format!("rank {rank} has no file"))?;
                Ok(compare::read_part(part).map_err(Fail::Read)??)
            }
            Side::Live(ranks) => Ok(ranks
                .get(&rank)
                .map(|(_, t)| t.clone())
                .ok_or_else(|| format!("rank {rank} holds no live EMA"))?),
        }
    }
}

async fn side(
    snaps: &Snaps,
    run: &RunHandle,
    which: &str,
    profile: &str,
) -> Result<Side, ServiceError> {
    if which == LIVE {
        return Ok(Side::Live(live_tensors(run, profile).await?));
    }
    let row = download::row(snaps, &run.config.name, which).await?;
    if row.status != SnapshotStatus::Complete {
        return Err(ServiceError::conflict(
            "snapshot_not_complete",
            format!("snapshot `{which}` is {}", row.status),
        ));
    }
    let part = download::part_name(&row, Some(profile))?;
    let parts = parts_of(snaps, &row, &part).await?;
    // `online` on a snapshot without a mirror: nothing to compare.
    if parts.is_empty() {
        return Err(ServiceError::not_found(
            "not_in_snapshot",
            format!("snapshot `{which}` holds no `{profile}` files"),
        ));
    }
    Ok(Side::Stored(parts))
}
