//! Placement: which node holds each rank of a run, and since which epoch.
//!
//! A run's ranks are placed when it is created (epoch 1, in the same
//! transaction as the run). A rank changes hands only through
//! [`Store::claim_ranks`], which raises the epoch of the rows whose epoch
//! is still the one the claimant read: two nodes racing for a rank cannot
//! both win, so each epoch of a rank has exactly one owner, and
//! `placement_log` keeps every owner of every epoch.

use sqlx::Row;

use super::{CatalogKind, Store, StoreError};

/// One rank's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    pub rank: u32,
    pub node_id: String,
    pub epoch: u64,
    /// The owner's engine for the rank, once it installed the run.
    pub engine: Option<String>,
}

/// One row of the placement history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementLogRow {
    pub rank: u32,
    pub epoch: u64,
    pub node_id: String,
    pub at_ms: i64,
}

impl Store {
    /// The owners of a run's ranks, by rank (ranks never placed are absent).
    pub async fn placement(&self, run: &str) -> Result<Vec<Placed>, StoreError> {
        let rows = sqlx::query(&self.sql(
            "SELECT rank, node_id, epoch, engine FROM placements WHERE run = ? ORDER BY rank",
        ))
        .bind(run)
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| Placed {
                rank: r.get::<i64, _>("rank") as u32,
                node_id: r.get("node_id"),
                epoch: r.get::<i64, _>("epoch") as u64,
                engine: r.get("engine"),
            })
            .collect())
    }

    /// Records the engines `node` put its ranks of `run` on (`(rank, engine)`).
    pub async fn set_rank_engines(
        &self,
        run: &str,
        node: &str,
        engines: &[(u32, String)],
    ) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await?;
        for (rank, engine) in engines {
            sqlx::query(&self.sql(
                "UPDATE placements SET engine = ? WHERE run = ? AND rank = ? AND node_id = ?",
            ))
            .bind(engine)
            .bind(run)
            .bind(*rank as i64)
            .bind(node)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Ranks placed on each node, over every run.
    pub async fn ranks_per_node(
        &self,
    ) -> Result<std::collections::HashMap<String, u64>, StoreError> {
        let rows = sqlx::query(
            &self.sql("SELECT node_id, COUNT(*) AS n FROM placements GROUP BY node_id"),
        )
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| (r.get("node_id"), r.get::<i64, _>("n").max(0) as u64))
            .collect())
    }

    /// Gives `node` the ranks `from` lists, each only if its epoch is still
    /// the one given (`None`: the rank was never placed), at that epoch
    /// plus one; returns the ranks won, with their new epochs. One
    /// transaction: a rank another node claimed first is left to it.
    pub async fn claim_ranks(
        &self,
        run: &str,
        node: &str,
        from: &[(u32, Option<u64>)],
        at_ms: i64,
    ) -> Result<Vec<Placed>, StoreError> {
        let mut tx = self.pool().begin().await?;
        if self.kind() == CatalogKind::Postgres {
            // The owners' lease rows stay locked until the claim commits: a
            // renewal racing it waits, and sees the claim once it is through.
            sqlx::query(
                "SELECT node_id FROM nodes WHERE node_id IN \
                 (SELECT node_id FROM placements WHERE run = $1) FOR UPDATE",
            )
            .bind(run)
            .fetch_all(&mut *tx)
            .await?;
        }
        let live = format!(
            "NOT EXISTS (SELECT 1 FROM nodes n WHERE n.node_id = placements.node_id \
             AND n.state = 'live' AND {} - n.renewed_at_ms <= n.lease_ms)",
            self.now_sql()
        );
        let mut won = Vec::new();
        for &(rank, epoch) in from {
            let done =
                match epoch {
                    None => sqlx::query(&self.sql(
                        "INSERT INTO placements (run, rank, node_id, epoch) VALUES (?, ?, ?, 1) \
                     ON CONFLICT (run, rank) DO NOTHING",
                    ))
                    .bind(run)
                    .bind(rank as i64)
                    .bind(node)
                    .execute(&mut *tx)
                    .await?,
                    Some(e) => {
                        // Only from a node whose lease has expired (or that left).
                        sqlx::query(&self.sql(&format!(
                            "UPDATE placements SET node_id = ?, epoch = epoch + 1, engine = NULL \
                     WHERE run = ? AND rank = ? AND epoch = ? AND {live}"
                        )))
                        .bind(node)
                        .bind(run)
                        .bind(rank as i64)
                        .bind(e as i64)
                        .execute(&mut *tx)
                        .await?
                    }
                };
            if done.rows_affected() == 1 {
                let epoch = epoch.map_or(1, |e| e + 1);
                sqlx::query(&self.sql(
                    "INSERT INTO placement_log (run, rank, epoch, node_id, at_ms) VALUES (?, ?, ?, ?, ?)",
                ))
                .bind(run)
                .bind(rank as i64)
                .bind(epoch as i64)
                .bind(node)
                .bind(at_ms)
                .execute(&mut *tx)
                .await?;
                won.push(Placed {
                    rank,
                    node_id: node.to_string(),
                    epoch,
                    engine: None,
                });
            }
        }
        tx.commit().await?;
        Ok(won)
    }

    /// Every owner every rank of `run` had, by rank and epoch.
    pub async fn placement_log(&self, run: &str) -> Result<Vec<PlacementLogRow>, StoreError> {
        let rows = sqlx::query(&self.sql(
            "SELECT rank, epoch, node_id, at_ms FROM placement_log WHERE run = ? ORDER BY rank, epoch",
        ))
        .bind(run)
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| PlacementLogRow {
                rank: r.get::<i64, _>("rank") as u32,
                epoch: r.get::<i64, _>("epoch") as u64,
                node_id: r.get("node_id"),
                at_ms: r.get("at_ms"),
            })
            .collect())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::run::RunSpec;

    /// A store holding run `r` of 3 ranks, placed on n1, n2 and n1.
    pub(crate) async fn store_with_run(dir: &std::path::Path) -> Store {
        let store = Store::connect(&Store::default_url(dir)).await.unwrap();
        let spec: RunSpec = serde_json::from_value(serde_json::json!({
            "name": "r", "world_size": 3, "profiles": [{"name": "a", "kind": "constant", "beta": 0.9}]
        }))
        .unwrap();
        let config = spec
            .validate("cpu", |d| Ok::<_, String>(d.to_string()))
            .unwrap();
        let owners: Vec<String> = ["n1", "n2", "n1"].map(String::from).to_vec();
        store.insert_run(&config, 1, None, &owners).await.unwrap();
        store
    }

    #[tokio::test]
    async fn a_rank_changes_hands_once_per_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_run(dir.path()).await;
        let placed = store.placement("r").await.unwrap();
        let owners: Vec<(&str, u64)> = placed
            .iter()
            .map(|p| (p.node_id.as_str(), p.epoch))
            .collect();
        assert_eq!(owners, [("n1", 1), ("n2", 1), ("n1", 1)]);
        let counts = store.ranks_per_node().await.unwrap();
        assert_eq!((counts["n1"], counts["n2"]), (2, 1));
        // n2 holds a live lease: its rank is not taken.
        let n2 = crate::store::nodes::NodeInfo {
            node_id: "n2".into(),
            url: "http://n2".into(),
            engines: vec!["cpu".into()],
            memory_budget: 0,
            lease_ms: 60_000,
        };
        store.register_node(&n2).await.unwrap();
        assert!(store
            .claim_ranks("r", "n3", &[(1, Some(1))], 4)
            .await
            .unwrap()
            .is_empty());
        store.leave_node("n2").await.unwrap();
        // Two nodes claim rank 1 from epoch 1: the first wins epoch 2, the
        // second finds the epoch moved and wins nothing.
        let won = store
            .claim_ranks("r", "n3", &[(1, Some(1))], 5)
            .await
            .unwrap();
        assert_eq!(
            won,
            [Placed {
                rank: 1,
                node_id: "n3".into(),
                epoch: 2,
                engine: None
            }]
        );
        store
            .set_rank_engines("r", "n3", &[(1, "cpu#1".into()), (0, "cpu#0".into())])
            .await
            .unwrap();
        let placed = store.placement("r").await.unwrap();
        // Only the owner's rows take its engines.
        assert_eq!(
            (placed[0].engine.as_deref(), placed[1].engine.as_deref()),
            (None, Some("cpu#1"))
        );
        let lost = store
            .claim_ranks("r", "n1", &[(1, Some(1))], 6)
            .await
            .unwrap();
        assert!(lost.is_empty());
        // A rank already placed is not taken by a first placement either.
        assert!(store
            .claim_ranks("r", "n4", &[(0, None)], 7)
            .await
            .unwrap()
            .is_empty());
        let log: Vec<(u32, u64, String)> = store
            .placement_log("r")
            .await
            .unwrap()
            .into_iter()
            .map(|l| (l.rank, l.epoch, l.node_id))
            .collect();
        assert_eq!(
            log,
            [
                (0, 1, "n1".into()),
                (1, 1, "n2".into()),
                (1, 2, "n3".into()),
                (2, 1, "n1".into())
            ]
        );
        // Deleting the run deletes its placement.
        store.delete_run("r").await.unwrap();
        assert!(store.placement("r").await.unwrap().is_empty());
        assert!(store.placement_log("r").await.unwrap().is_empty());
    }
}
