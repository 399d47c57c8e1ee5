//! The nodes of one service: every server sharing this catalog registers
//! itself at start and renews a lease. Lease times are the catalog's own
//! clock (one clock for every node, whatever theirs say).

use sqlx::Row;

use super::{CatalogKind, Store, StoreError};
use crate::contract::NodeStatus;

/// What a node says of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub node_id: String,
    pub url: String,
    /// Its engines (`cpu#0`, `cuda:1`, ...).
    pub engines: Vec<String>,
    /// Bytes of EMA state it may hold (its memory, or the GPUs').
    pub memory_budget: u64,
    pub lease_ms: i64,
}

/// A node as the catalog knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRow {
    pub info: NodeInfo,
    pub started_at_ms: i64,
    pub renewed_at_ms: i64,
    /// Milliseconds since the last renewal, by the catalog's clock.
    pub lease_age_ms: i64,
    pub ranks: u64,
    pub resident_bytes: u64,
    /// Lease held, not renewed in time, or stopped gracefully.
    pub status: NodeStatus,
}

impl Store {
    /// The catalog's clock in milliseconds since the epoch, as SQL.
    pub(crate) fn now_sql(&self) -> &'static str {
        match self.kind() {
            CatalogKind::Sqlite => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS BIGINT)",
            CatalogKind::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        }
    }

    /// Registers this node (again, after a restart) and takes its lease.
    pub async fn register_node(&self, node: &NodeInfo) -> Result<(), StoreError> {
        let now = self.now_sql();
        let sql = format!(
            "INSERT INTO nodes (node_id, url, engines, memory_budget, started_at_ms, renewed_at_ms, \
             lease_ms, ranks, resident_bytes, state) \
             VALUES (?, ?, ?, ?, {now}, {now}, ?, 0, 0, 'live') \
             ON CONFLICT (node_id) DO UPDATE SET url = excluded.url, engines = excluded.engines, \
             memory_budget = excluded.memory_budget, started_at_ms = excluded.started_at_ms, \
             renewed_at_ms = excluded.renewed_at_ms, lease_ms = excluded.lease_ms, \
             ranks = 0, resident_bytes = 0, state = 'live'"
        );
        sqlx::query(&self.sql(&sql))
            .bind(&node.node_id)
            .bind(&node.url)
            .bind(serde_json::to_string(&node.engines)?)
            .bind(node.memory_budget as i64)
            .bind(node.lease_ms)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Renews this node's lease and records what it holds.
    pub async fn renew_node(
        &self,
        node_id: &str,
        ranks: u64,
        resident_bytes: u64,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE nodes SET renewed_at_ms = {}, ranks = ?, resident_bytes = ?, state = 'live' \
             WHERE node_id = ?",
            self.now_sql()
        );
        let done = sqlx::query(&self.sql(&sql))
            .bind(ranks as i64)
            .bind(resident_bytes as i64)
            .bind(node_id)
            .execute(self.pool())
            .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::Io(std::io::Error::other(format!(
                "node `{node_id}` is not registered"
            ))));
        }
        Ok(())
    }

    /// Marks this node as gone (a graceful stop): its lease is given up.
    pub async fn leave_node(&self, node_id: &str) -> Result<(), StoreError> {
        sqlx::query(&self.sql("UPDATE nodes SET state = 'left' WHERE node_id = ?"))
            .bind(node_id)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Every node, by id.
    pub async fn list_nodes(&self) -> Result<Vec<NodeRow>, StoreError> {
        let sql = format!(
            "SELECT node_id, url, engines, memory_budget, started_at_ms, renewed_at_ms, lease_ms, \
             ranks, resident_bytes, state, {} - renewed_at_ms AS age_ms FROM nodes ORDER BY node_id",
            self.now_sql()
        );
        let rows = sqlx::query(&self.sql(&sql)).fetch_all(self.pool()).await?;
        rows.into_iter()
            .map(|r| {
                let engines: String = r.get("engines");
                let lease_ms: i64 = r.get("lease_ms");
                let age_ms: i64 = r.get("age_ms");
                let state: String = r.get("state");
                let status = if state == "left" {
                    NodeStatus::Left
                } else if age_ms > lease_ms {
                    NodeStatus::Expired
                } else {
                    NodeStatus::Live
                };
                Ok(NodeRow {
                    info: NodeInfo {
                        node_id: r.get("node_id"),
                        url: r.get("url"),
                        engines: serde_json::from_str(&engines)?,
                        memory_budget: r.get::<i64, _>("memory_budget").max(0) as u64,
                        lease_ms,
                    },
                    started_at_ms: r.get("started_at_ms"),
                    renewed_at_ms: r.get("renewed_at_ms"),
                    lease_age_ms: age_ms.max(0),
                    ranks: r.get::<i64, _>("ranks").max(0) as u64,
                    resident_bytes: r.get::<i64, _>("resident_bytes").max(0) as u64,
                    status,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_node_registers_renews_and_leaves_by_the_catalogs_clock() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::connect(&Store::default_url(dir.path()))
            .await
            .unwrap();
        let node = NodeInfo {
            node_id: "a".into(),
            url: "http://127.0.0.1:1".into(),
            engines: vec!["cpu#0".into(), "cpu#1".into()],
            memory_budget: 1 << 30,
            lease_ms: 150,
        };
        store.register_node(&node).await.unwrap();
        store.renew_node("a", 3, 4096).await.unwrap();
        let rows = store.list_nodes().await.unwrap();
        assert_eq!(rows.len(), 1);
        let a = &rows[0];
        assert_eq!(a.info, node);
        assert_eq!(
            (a.ranks, a.resident_bytes, a.status),
            (3, 4096, NodeStatus::Live)
        );
        assert!(a.lease_age_ms < 150, "{}", a.lease_age_ms);
        // Not renewed within the lease: expired.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let a = &store.list_nodes().await.unwrap()[0];
        assert_eq!(a.status, NodeStatus::Expired);
        // SQLite's clock (`julianday`, a float of days) may round a
        // millisecond away.
        assert!(a.lease_age_ms >= 299, "{}", a.lease_age_ms);
        // Renewed: live again; a graceful stop: left.
        store.renew_node("a", 3, 4096).await.unwrap();
        assert_eq!(
            store.list_nodes().await.unwrap()[0].status,
            NodeStatus::Live
        );
        store.leave_node("a").await.unwrap();
        assert_eq!(
            store.list_nodes().await.unwrap()[0].status,
            NodeStatus::Left
        );
        // A restart registers again.
        store.register_node(&node).await.unwrap();
        let a = &store.list_nodes().await.unwrap()[0];
        assert_eq!((a.status, a.ranks), (NodeStatus::Live, 0));
        assert!(store.renew_node("nobody", 0, 0).await.is_err());
    }
}
