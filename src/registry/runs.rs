//! The run table: runs installed on their engines, looked up, removed.

use std::sync::{Arc, Mutex, RwLock};

use super::handle::{IngestWindow, RunHandle, RunTokens};
use super::summary::RankSummary;
use super::Registry;
use crate::engine::shared::RunShared;
use crate::engine::spread::RunEngines;
use crate::engine::EngineError;
use crate::node::Owner;
use crate::run::RunConfig;
use crate::store::StoredRank;

impl Registry {
    /// Registers a run in the registry, with the ranks `owners` gives this
    /// node on its engines.
    pub async fn install_run(
        &self,
        config: Arc<RunConfig>,
        created_at_ms: i64,
        tokens: Option<RunTokens>,
        stored_ranks: Vec<StoredRank>,
        owners: Vec<Owner>,
    ) -> Result<Arc<RunHandle>, EngineError> {
        let owned: Vec<bool> = owners.iter().map(|o| o.node_id == self.node_id).collect();
        let (handles, by_rank) = self
            .place(&config.device, config.world_size, &owned)
            .map_err(|_| EngineError::Stopped)?;
        let shared = if owned.iter().all(|&o| o) {
            RunShared::new(config.world_size)
        } else {
            RunShared::spread(config.world_size, &config.name, created_at_ms)
        };
        let engines = RunEngines::new(handles, by_rank, shared);
        for (i, engine) in engines.all().iter().enumerate() {
            let (for_engine, owned) = (config.clone(), engines.ranks_of(i));
            let shared = engines.shared().clone();
            engine.add_run(for_engine, owned, shared).await?;
        }
        let mut ranks: Vec<RankSummary> = (0..config.world_size)
            .map(|_| RankSummary::default())
            .collect();
        for row in stored_ranks {
            if let Some(slot) = ranks.get_mut(row.rank as usize) {
                *slot = RankSummary::from_stored(row);
            }
        }
        let mut owners = owners;
        for (rank, label) in engines.labels().iter().enumerate() {
            if let (Some(owner), Some(label)) = (owners.get_mut(rank), label) {
                owner.engine = Some(label.clone());
            }
        }
        let handle = Arc::new(RunHandle {
            config: config.clone(),
            created_at_ms,
            engines,
            placement: RwLock::new(owners),
            tokens,
            ranks: ranks.into_iter().map(Mutex::new).collect(),
            ingest: Mutex::new(IngestWindow::default()),
            meta: Mutex::new(crate::store::meta::RunMeta::default()),
            alerts_firing: Default::default(),
            losses_unacknowledged: Default::default(),
            finished: Mutex::new(None),
            deleted: Default::default(),
        });
        let mut runs = self.runs.write().expect("runs lock");
        runs.insert(config.name.clone(), handle.clone());
        self.runs_gauge.set(runs.len() as i64);
        Ok(handle)
    }

    /// Every run, for the periodic jobs that visit them all.
    pub fn all_runs(&self) -> Vec<Arc<RunHandle>> {
        self.runs
            .read()
            .expect("runs lock")
            .values()
            .cloned()
            .collect()
    }

    pub fn len(&self) -> usize {
        self.runs.read().expect("runs lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn run(&self, name: &str) -> Option<Arc<RunHandle>> {
        self.runs.read().expect("runs lock").get(name).cloned()
    }

    /// Whether some run holds this token hash (read or write).
    pub fn token_known(&self, hash: &str) -> bool {
        self.runs.read().expect("runs lock").values().any(|r| {
            r.tokens
                .as_ref()
                .is_some_and(|t| t.read_hash == hash || t.write_hash == hash)
        })
    }

    pub fn remove_run(&self, name: &str) -> Option<Arc<RunHandle>> {
        let mut runs = self.runs.write().expect("runs lock");
        let removed = runs.remove(name);
        self.runs_gauge.set(runs.len() as i64);
        drop(runs);
        if let Some(run) = &removed {
            run.deleted
                .store(true, std::sync::atomic::Ordering::Release);
            self.unplace(run);
        }
        removed
    }
}
