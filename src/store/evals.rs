//! Catalog rows of evaluations: one per snapshot, profile and evaluator,
//! read back joined with the snapshot they evaluate.

use std::collections::BTreeMap;

use sqlx::Row;

use super::{Store, StoreError};
use crate::contract::SnapshotKind;

/// An evaluation as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalRow {
    pub snapshot: String,
    /// A profile of the snapshot, or `online` (its mirror).
    pub profile: String,
    /// `""` when the poster named none.
    pub evaluator: String,
    pub metrics: BTreeMap<String, f64>,
    pub at_ms: i64,
}

/// An evaluation with what its snapshot says of the candidate.
#[derive(Debug, Clone)]
pub struct StoredEval {
    pub id: i64,
    pub row: EvalRow,
    pub step: u64,
    pub kind: SnapshotKind,
    /// The snapshot's `detail` (post-hoc: `sigma_rel`, `residual`, sources).
    pub detail: serde_json::Value,
}

const COLUMNS: &str = "e.id, e.snapshot, e.profile, e.evaluator, e.metrics, e.at_ms, \
                       s.step, s.kind, s.detail";

fn stored_eval(row: sqlx::any::AnyRow) -> Result<StoredEval, StoreError> {
    Ok(StoredEval {
        id: row.get("id"),
        row: EvalRow {
            snapshot: row.get("snapshot"),
            profile: row.get("profile"),
            evaluator: row.get("evaluator"),
            metrics: serde_json::from_str(row.get::<&str, _>("metrics"))?,
            at_ms: row.get("at_ms"),
        },
        step: row.get::<i64, _>("step").max(0) as u64,
        kind: row.get::<&str, _>("kind").parse()?,
        detail: serde_json::from_str(row.get::<&str, _>("detail"))?,
    })
}

impl Store {
    /// Stores an evaluation of a snapshot of `run` unless one of the same
    /// snapshot, profile and evaluator is stored; true when this call
    /// stored it. Nothing is stored when the snapshot is gone (deleted
    /// meanwhile): the caller tells the two apart with [`Store::eval_of`].
    pub async fn insert_eval(&self, run: &str, e: &EvalRow) -> Result<bool, StoreError> {
        let done = sqlx::query(&self.sql(
            "INSERT INTO evals (run, snapshot, profile, evaluator, metrics, at_ms) \
             SELECT ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM snapshots WHERE id = ? AND run = ?) \
             ON CONFLICT (snapshot, profile, evaluator) DO NOTHING",
        ))
        .bind(run)
        .bind(&e.snapshot)
        .bind(&e.profile)
        .bind(&e.evaluator)
        .bind(serde_json::to_string(&e.metrics)?)
        .bind(e.at_ms)
        .bind(&e.snapshot)
        .bind(run)
        .execute(self.pool())
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// The stored evaluation of one candidate by one evaluator.
    pub async fn eval_of(
        &self,
        run: &str,
        snapshot: &str,
        profile: &str,
        evaluator: &str,
    ) -> Result<Option<StoredEval>, StoreError> {
        let row = sqlx::query(&self.sql(&format!(
            "SELECT {COLUMNS} FROM evals e JOIN snapshots s ON s.id = e.snapshot \
             WHERE e.run = ? AND e.snapshot = ? AND e.profile = ? AND e.evaluator = ?"
        )))
        .bind(run)
        .bind(snapshot)
        .bind(profile)
        .bind(evaluator)
        .fetch_optional(self.pool())
        .await?;
        row.map(stored_eval).transpose()
    }

    /// How many evaluations `run` holds.
    pub async fn eval_count(&self, run: &str) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(&self.sql("SELECT COUNT(*) FROM evals WHERE run = ?"))
            .bind(run)
            .fetch_one(self.pool())
            .await?;
        Ok(n.max(0) as u64)
    }

    /// At most `limit` evaluations of a run in the listing's order (the
    /// candidate's step, then the order they were stored), starting after
    /// the one at `after` (`(step, id)`; `None`: the first).
    pub async fn evals_page(
        &self,
        run: &str,
        after: Option<(u64, i64)>,
        limit: u32,
    ) -> Result<Vec<StoredEval>, StoreError> {
        let (step, id) = after.map_or((-1, 0), |(s, id)| (s.min(i64::MAX as u64) as i64, id));
        let rows = sqlx::query(&self.sql(&format!(
            "SELECT {COLUMNS} FROM evals e JOIN snapshots s ON s.id = e.snapshot \
             WHERE e.run = ? AND (s.step > ? OR (s.step = ? AND e.id > ?)) \
             ORDER BY s.step, e.id LIMIT ?"
        )))
        .bind(run)
        .bind(step)
        .bind(step)
        .bind(id)
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?;
        rows.into_iter().map(stored_eval).collect()
    }

    /// Every evaluation of a run, by the candidate's step, then in the
    /// order they were stored.
    pub async fn evals(&self, run: &str) -> Result<Vec<StoredEval>, StoreError> {
        let rows = sqlx::query(&self.sql(&format!(
            "SELECT {COLUMNS} FROM evals e JOIN snapshots s ON s.id = e.snapshot \
             WHERE e.run = ? ORDER BY s.step, e.id"
        )))
        .bind(run)
        .fetch_all(self.pool())
        .await?;
        rows.into_iter().map(stored_eval).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::placement::tests::store_with_run;
    use crate::store::snapshots::SnapshotRow;

    #[tokio::test]
    async fn an_evaluation_is_stored_once_and_goes_with_its_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_run(dir.path()).await;
        let snap = SnapshotRow::pending("s1", "r", 4, SnapshotKind::Manual, vec!["a".into()]);
        store.insert_snapshot(&snap).await.unwrap();
        let row = EvalRow {
            snapshot: "s1".into(),
            profile: "a".into(),
            evaluator: "".into(),
            metrics: BTreeMap::from([("loss".to_string(), 0.1 + 0.2)]),
            at_ms: 7,
        };
        assert!(store.insert_eval("r", &row).await.unwrap());
        assert!(!store.insert_eval("r", &row).await.unwrap());
        let got = store.eval_of("r", "s1", "a", "").await.unwrap().unwrap();
        // Values round-trip exactly (an idempotent repost compares equal).
        assert_eq!(got.row, row);
        assert_eq!((got.step, got.kind), (4, SnapshotKind::Manual));
        // Another run's snapshot id, or one that is gone: nothing stored.
        let other = EvalRow {
            snapshot: "s9".into(),
            ..row.clone()
        };
        assert!(!store.insert_eval("r", &other).await.unwrap());
        assert!(!store.insert_eval("x", &row).await.unwrap());
        assert!(store.delete_snapshot("s1").await.unwrap());
        assert!(store.evals("r").await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn pages_follow_the_listing_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_run(dir.path()).await;
        // Stored out of step order: the listing is by step, then id.
        for (id, step) in [("s9", 9), ("s2", 2), ("s5", 5)] {
            let snap = SnapshotRow::pending(id, "r", step, SnapshotKind::Manual, vec!["a".into()]);
            store.insert_snapshot(&snap).await.unwrap();
            for evaluator in ["x", "y"] {
                let row = EvalRow {
                    snapshot: id.into(),
                    profile: "a".into(),
                    evaluator: evaluator.into(),
                    metrics: BTreeMap::from([("loss".to_string(), 1.0)]),
                    at_ms: 0,
                };
                assert!(store.insert_eval("r", &row).await.unwrap());
            }
        }
        assert_eq!(store.eval_count("r").await.unwrap(), 6);
        assert_eq!(store.eval_count("other").await.unwrap(), 0);
        let all: Vec<_> = store.evals("r").await.unwrap();
        let mut paged = Vec::new();
        let mut after = None;
        loop {
            let page = store.evals_page("r", after, 4).await.unwrap();
            let Some(last) = page.last() else { break };
            after = Some((last.step, last.id));
            paged.extend(page);
        }
        let key = |e: &StoredEval| (e.step, e.id);
        assert_eq!(
            paged.iter().map(key).collect::<Vec<_>>(),
            all.iter().map(key).collect::<Vec<_>>()
        );
        assert_eq!(
            all.iter().map(|e| e.step).collect::<Vec<_>>(),
            [2, 2, 5, 5, 9, 9]
        );
    }

    #[tokio::test]
    async fn a_row_whose_snapshot_is_gone_is_a_404_not_a_fault() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_run(dir.path()).await;
        // Past the insert's own existence check, the foreign key refuses it
        // (as PostgreSQL's does when a delete commits under the insert).
        let err = sqlx::query(&store.sql(
            "INSERT INTO evals (run, snapshot, profile, evaluator, metrics, at_ms) \
             VALUES ('r', 'gone', 'a', '', '{}', 0)",
        ))
        .execute(store.pool())
        .await
        .map_err(StoreError::from)
        .unwrap_err();
        // The service layer's error table answers this 404 (tested end to
        // end in tests/python/test_hardening4.py, on both catalogs).
        assert!(
            matches!(&err, StoreError::Sql(sqlx::Error::Database(db)) if db.is_foreign_key_violation()),
            "{err}"
        );
    }
}
