//! Ranks changing hands: taken over from a node that is gone (restored on
//! this node's engines), or given up to the node that took them.

use std::collections::BTreeMap;

use super::handle::RunHandle;
use super::Registry;
use crate::engine::capture::RestoredRank;
use crate::engine::{EngineError, EngineHandle};

impl Registry {
    /// Ranks of `run` this node took over at `epoch` (their node is gone):
    /// each goes to the least loaded engine of the run's device, restored
    /// from `ranks`' state (or empty), and this node is their owner from now.
    pub async fn adopt_ranks(
        &self,
        run: &RunHandle,
        ranks: Vec<(u32, Option<RestoredRank>)>,
        epoch_of: &BTreeMap<u32, u64>,
    ) -> Result<(), EngineError> {
        type Part = Vec<(u32, Option<RestoredRank>)>;
        let mut per_engine: Vec<(EngineHandle, Part)> = Vec::new();
        for (rank, restored) in ranks {
            let (handle, _) = self
                .place(&run.config.device, 1, &[true])
                .map_err(|_| EngineError::Stopped)?;
            let handle = handle.into_iter().next().ok_or(EngineError::Stopped)?;
            match per_engine
                .iter_mut()
                .find(|(h, _)| h.label() == handle.label())
            {
                Some((_, part)) => part.push((rank, restored)),
                None => per_engine.push((handle, vec![(rank, restored)])),
            }
        }
        for (handle, part) in per_engine {
            let label = handle.label().to_string();
            let taken: Vec<u32> = part.iter().map(|(r, _)| *r).collect();
            run.engines.adopt(run.config.clone(), handle, part).await?;
            let mut owners = run.placement.write().expect("placement lock");
            for rank in taken {
                if let Some(slot) = owners.get_mut(rank as usize) {
                    let mut me = self.me(epoch_of.get(&rank).copied().unwrap_or(1));
                    me.engine = Some(label.clone());
                    *slot = me;
                }
            }
        }
        Ok(())
    }

    /// Ranks of `run` another node holds now (it took them over while this
    /// node was cut off): freed here, so pushes for them go to the owner.
    pub async fn release_ranks(&self, run: &RunHandle, ranks: &[u32]) {
        let freed = run.engines.release(&run.config.name, ranks).await;
        let mut engines = self.engines.lock().expect("engines lock");
        for label in freed {
            if let Some((_, held)) = engines.get_mut(&label) {
                *held = held.saturating_sub(1);
            }
        }
    }
}
