//! Who owns each rank of a run, as the catalog records it, after this node
//! took the ranks nobody may hold.

use super::Registry;
use crate::clock::now_ms;
use crate::node::Owner;
use crate::store::nodes::NodeRow;
use crate::store::placement::Placed;
use crate::store::{Store, StoreError};

impl Registry {
    /// The owner of every rank of `run`, as the catalog records them, after
    /// this node took the ranks nobody may hold: ranks never placed (a run
    /// from before placement), and ranks of a node that left or whose lease
    /// expired. Each is taken at its epoch plus one, only if no other node
    /// took it first.
    pub async fn settle_placement(
        &self,
        store: &Store,
        nodes: &[NodeRow],
        run: &str,
        world_size: u32,
    ) -> Result<Vec<Owner>, StoreError> {
        let mut placed: Vec<Option<Placed>> = vec![None; world_size as usize];
        for p in store.placement(run).await? {
            if let Some(slot) = placed.get_mut(p.rank as usize) {
                *slot = Some(p);
            }
        }
        let live = |id: &str| {
            id == self.node_id
                || nodes
                    .iter()
                    .any(|n| n.info.node_id == id && n.status == crate::contract::NodeStatus::Live)
        };
        let orphans: Vec<(u32, Option<u64>)> = placed
            .iter()
            .enumerate()
            .filter_map(|(r, p)| match p {
                None => Some((r as u32, None)),
                Some(p) if !live(&p.node_id) => Some((r as u32, Some(p.epoch))),
                Some(_) => None,
            })
            .collect();
        if !orphans.is_empty() {
            let won = store
                .claim_ranks(run, &self.node_id, &orphans, now_ms())
                .await?;
            if !won.is_empty() {
                tracing::info!(run, ranks = ?won.iter().map(|p| p.rank).collect::<Vec<_>>(),
                    "took the ranks of a node that is gone");
            }
            // Whoever won, the catalog says who holds them now.
            placed = vec![None; world_size as usize];
            for p in store.placement(run).await? {
                if let Some(slot) = placed.get_mut(p.rank as usize) {
                    *slot = Some(p);
                }
            }
        }
        Ok(placed
            .into_iter()
            .map(|p| match p {
                Some(p) => self.owner_of(nodes, p),
                // Placed by nobody even now (the catalog refused the claim):
                // held here, so the rank is served.
                None => self.me(1),
            })
            .collect())
    }

    /// A placement row as an owner, with the node's URL.
    fn owner_of(&self, nodes: &[NodeRow], p: Placed) -> Owner {
        let url = if p.node_id == self.node_id {
            self.node_url.clone()
        } else {
            nodes
                .iter()
                .find(|n| n.info.node_id == p.node_id)
                .map(|n| n.info.url.clone())
                .unwrap_or_default()
        };
        Owner {
            node_id: p.node_id,
            url,
            epoch: p.epoch,
            engine: p.engine,
        }
    }
}
