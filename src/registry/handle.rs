//! A run as services and handlers see it: its config, engines, owners,
//! tokens and the summaries of its ranks.

use std::sync::{Arc, Mutex, RwLock};

use sha2::{Digest, Sha256};

use super::summary::RankSummary;
use crate::engine::spread::RunEngines;
use crate::node::Owner;
use crate::run::RunConfig;
use crate::store::RunFinish;

/// sha256 hex of a token; only hashes are stored.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Token hashes of a run (auth on).
#[derive(Debug, Clone)]
pub struct RunTokens {
    pub write_hash: String,
    pub read_hash: String,
}

/// Pushes since the last ingest sample of a run.
#[derive(Debug, Default, Clone, Copy)]
pub struct IngestWindow {
    pub pushes: u64,
    pub bytes: u64,
    pub seconds: f64,
}

/// A run as services and handlers see it.
pub struct RunHandle {
    pub config: Arc<RunConfig>,
    pub created_at_ms: i64,
    /// The engines holding the ranks this node owns.
    pub engines: RunEngines,
    /// Per rank, the node that owns it (this one or another).
    pub placement: RwLock<Vec<Owner>>,
    pub tokens: Option<RunTokens>,
    pub ranks: Vec<Mutex<RankSummary>>,
    /// Ingest since the last sample (see `monitor`).
    pub ingest: Mutex<IngestWindow>,
    /// Tags, note and alert rules (editable while the run lives).
    pub meta: Mutex<crate::store::meta::RunMeta>,
    /// Alerts firing now (kept by `alerts`).
    pub alerts_firing: std::sync::atomic::AtomicUsize,
    /// `steps_lost` alerts firing and not yet acknowledged (kept by
    /// `alerts`): the run's health is `degraded` while there are any.
    pub losses_unacknowledged: std::sync::atomic::AtomicUsize,
    /// Set once the run is finished (`POST .../finish`).
    pub finished: Mutex<Option<RunFinish>>,
    /// Set when the run leaves the registry (deleted): a request or job
    /// still holding the handle then knows its failures come from that.
    pub deleted: std::sync::atomic::AtomicBool,
}

impl RunHandle {
    pub fn rank(&self, rank: u32) -> Option<RankSummary> {
        self.ranks
            .get(rank as usize)
            .map(|r| r.lock().expect("rank summary lock").clone())
    }

    /// Reads one field of a rank's summary without copying the summary.
    pub fn rank_with<R>(&self, rank: u32, f: impl FnOnce(&RankSummary) -> R) -> Option<R> {
        self.ranks
            .get(rank as usize)
            .map(|r| f(&r.lock().expect("rank summary lock")))
    }

    /// Updates a rank's summary and returns the new value.
    pub fn update_rank(&self, rank: u32, f: impl FnOnce(&mut RankSummary)) -> RankSummary {
        let mut guard = self.ranks[rank as usize].lock().expect("rank summary lock");
        f(&mut guard);
        guard.clone()
    }

    /// Bytes `rank` keeps resident here (0 when another node holds it).
    pub fn rank_resident_bytes(&self, rank: u32) -> u64 {
        if !self.holds(rank) {
            return 0;
        }
        self.ranks
            .get(rank as usize)
            .map_or(0, |s| s.lock().expect("rank summary lock").resident_bytes)
    }

    /// Who owns `rank`.
    pub fn owner(&self, rank: u32) -> Option<Owner> {
        self.placement
            .read()
            .expect("placement lock")
            .get(rank as usize)
            .cloned()
    }

    /// Every rank's owner.
    pub fn owners(&self) -> Vec<Owner> {
        self.placement.read().expect("placement lock").clone()
    }

    /// Whether this node holds `rank` (its EMA lives on an engine here).
    pub fn holds(&self, rank: u32) -> bool {
        self.engines.holds(rank)
    }

    /// The ranks this node holds.
    pub fn held_ranks(&self) -> Vec<u32> {
        (0..self.config.world_size)
            .filter(|&r| self.holds(r))
            .collect()
    }

    /// Whether other nodes hold some of the run's ranks.
    pub fn is_spread(&self) -> bool {
        (0..self.config.world_size).any(|r| !self.holds(r))
    }

    pub fn finished(&self) -> Option<RunFinish> {
        self.finished.lock().expect("run finish lock").clone()
    }

    /// Whether the run was deleted (removed from the registry).
    pub fn is_deleted(&self) -> bool {
        self.deleted.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Bytes the ranks this node holds keep resident (what its cuts and
    /// state snapshots write).
    pub fn resident_bytes(&self) -> u64 {
        self.ranks
            .iter()
            .enumerate()
            .filter(|(r, _)| self.holds(*r as u32))
            .map(|(_, s)| s.lock().expect("rank summary lock").resident_bytes)
            .sum()
    }
}
