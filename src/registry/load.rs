//! The catalog's runs at start: each installed with the ranks this node
//! owns, its finish and the engines it landed on recorded.

use std::sync::Arc;

use super::handle::{RunHandle, RunTokens};
use super::Registry;
use crate::engine::FinishedAt;
use crate::store::nodes::NodeRow;
use crate::store::{Store, StoreError, StoredRun};

impl Registry {
    /// Loads every run of the catalog, with the ranks this node owns on its
    /// engines (taking those never placed, or placed on a node that is
    /// gone: see [`Self::settle_placement`]).
    pub async fn load(&self, store: &Store) -> Result<(), StoreError> {
        let nodes = store.list_nodes().await?;
        for stored in store.list_runs().await? {
            self.load_run(store, &nodes, stored).await?;
        }
        for (name, meta) in store.run_metas().await? {
            if let Some(run) = self.run(&name) {
                *run.meta.lock().expect("meta lock") = meta;
            }
        }
        Ok(())
    }

    /// Installs one stored run; `None` when its engine refused it.
    pub async fn load_run(
        &self,
        store: &Store,
        nodes: &[NodeRow],
        stored: StoredRun,
    ) -> Result<Option<Arc<RunHandle>>, StoreError> {
        let ranks = store.list_ranks(&stored.config.name).await?;
        let name = stored.config.name.clone();
        let owners = self
            .settle_placement(store, nodes, &name, stored.config.world_size)
            .await?;
        let tokens =
            stored
                .write_token_hash
                .zip(stored.read_token_hash)
                .map(|(write_hash, read_hash)| RunTokens {
                    write_hash,
                    read_hash,
                });
        let mut config = stored.config;
        if let Err(e) = self.device_for(&config.device) {
            tracing::error!(run = %name, device = %config.device, "{e}; the run moves to the CPU");
            config.device = "cpu".into();
        }
        let handle = self
            .install_run(
                Arc::new(config),
                stored.created_at_ms,
                tokens,
                ranks,
                owners,
            )
            .await;
        match handle {
            Ok(handle) => {
                if let Some(finish) = stored.finished {
                    let at = FinishedAt(finish.step);
                    handle.engines.shared().set_finished(Some(at));
                    *handle.finished.lock().expect("run finish lock") = Some(finish);
                }
                self.record_engines(store, &handle).await;
                Ok(Some(handle))
            }
            Err(_) => {
                tracing::error!(run = %name, "the engine refused the run");
                Ok(None)
            }
        }
    }

    /// Records in the catalog which engine holds each of this node's ranks
    /// of `run` (what placement answers on every node).
    pub async fn record_engines(&self, store: &Store, run: &RunHandle) {
        let labels = run.engines.labels();
        let engines: Vec<(u32, String)> = labels
            .iter()
            .enumerate()
            .filter_map(|(r, l)| l.clone().map(|l| (r as u32, l)))
            .collect();
        if engines.is_empty() {
            return;
        }
        if let Err(e) = store
            .set_rank_engines(&run.config.name, &self.node_id, &engines)
            .await
        {
            tracing::warn!(run = %run.config.name, error = %e, "recording the ranks' engines failed");
        }
    }
}
