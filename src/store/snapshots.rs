//! Catalog rows of snapshots and their files.

use std::collections::HashSet;

use serde::Serialize;
use sqlx::Row;
use utoipa::ToSchema;

use super::{Store, StoreError};
use crate::contract::{SnapshotKind, SnapshotStatus};

/// A snapshot as listed.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SnapshotRow {
    pub id: String,
    pub run: String,
    pub step: u64,
    pub kind: SnapshotKind,
    pub label: Option<String>,
    pub profiles: Vec<String>,
    pub status: SnapshotStatus,
    pub reason: Option<String>,
    pub created_at_ms: i64,
    pub completed_at_ms: Option<i64>,
    pub deadline_ms: Option<i64>,
    /// Bytes of all files.
    pub bytes: u64,
    #[schema(value_type = Object)]
    pub detail: serde_json::Value,
}

impl SnapshotRow {
    /// A new `pending` row (no label, deadline or detail yet; callers set
    /// the fields their kind needs).
    pub fn pending(
        id: &str,
        run: &str,
        step: u64,
        kind: SnapshotKind,
        profiles: Vec<String>,
    ) -> Self {
        SnapshotRow {
            id: id.to_string(),
            run: run.to_string(),
            step,
            kind,
            label: None,
            profiles,
            status: SnapshotStatus::Pending,
            reason: None,
            created_at_ms: crate::clock::now_ms(),
            completed_at_ms: None,
            deadline_ms: None,
            bytes: 0,
            detail: serde_json::json!({}),
        }
    }
}

/// One stored file of a complete snapshot.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FileRow {
    pub rank: u32,
    /// Profile name, or `__mirror__`.
    pub part: String,
    /// Relative to the data dir.
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
    /// The rank's step in this file.
    pub step: u64,
    /// Step bookkeeping and layout needed to restore the rank (JSON).
    #[serde(skip)]
    pub state: String,
}

fn row_to_snapshot(row: sqlx::any::AnyRow) -> Result<SnapshotRow, StoreError> {
    Ok(SnapshotRow {
        id: row.get("id"),
        run: row.get("run"),
        step: row.get::<i64, _>("step") as u64,
        kind: row.get::<&str, _>("kind").parse()?,
        label: row.get("label"),
        profiles: serde_json::from_str(row.get::<&str, _>("profiles"))?,
        status: row.get::<&str, _>("status").parse()?,
        reason: row.get("reason"),
        created_at_ms: row.get("created_at_ms"),
        completed_at_ms: row.get("completed_at_ms"),
        deadline_ms: row.get("deadline_ms"),
        bytes: row.get::<i64, _>("bytes") as u64,
        detail: serde_json::from_str(row.get::<&str, _>("detail"))?,
    })
}

const COLUMNS: &str = "id, run, step, kind, label, profiles, status, reason, created_at_ms, completed_at_ms, deadline_ms, bytes, detail";

/// What [`Store::add_snapshot_part`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartOutcome {
    /// This part was the last: the snapshot is complete.
    Complete { step: u64, bytes: u64 },
    /// Ranks with files so far; other nodes' parts are still to come.
    Waiting { ranks: u32 },
    /// Failed or deleted meanwhile: nothing lists these files.
    Gone,
}

impl Store {
    pub async fn insert_snapshot(&self, s: &SnapshotRow) -> Result<(), StoreError> {
        self.insert_snapshot_row(s, "").await.map(|_| ())
    }

    /// Records a pending snapshot unless a row of that id exists (another
    /// node of the service opened the same periodic cut first); true when
    /// this call inserted it.
    pub async fn insert_snapshot_once(&self, s: &SnapshotRow) -> Result<bool, StoreError> {
        self.insert_snapshot_row(s, " ON CONFLICT (id) DO NOTHING")
            .await
    }

    async fn insert_snapshot_row(&self, s: &SnapshotRow, tail: &str) -> Result<bool, StoreError> {
        let sql = format!(
            "INSERT INTO snapshots (id, run, step, kind, label, profiles, status, reason, created_at_ms, deadline_ms, detail) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?){tail}"
        );
        let done = sqlx::query(&self.sql(&sql))
            .bind(&s.id)
            .bind(&s.run)
            .bind(s.step as i64)
            .bind(s.kind.as_str())
            .bind(&s.label)
            .bind(serde_json::to_string(&s.profiles)?)
            .bind(s.status.as_str())
            .bind(&s.reason)
            .bind(s.created_at_ms)
            .bind(s.deadline_ms)
            .bind(s.detail.to_string())
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Records one node's part of a snapshot (the files of the ranks it
    /// holds) and, when with them `needed` ranks have files, marks it
    /// complete: one transaction, whose first statement locks the row, so
    /// the parts of several nodes are counted one after the other and
    /// exactly one of them completes it.
    pub async fn add_snapshot_part(
        &self,
        id: &str,
        files: &[FileRow],
        needed: u32,
        completed_at_ms: i64,
    ) -> Result<PartOutcome, StoreError> {
        let mut tx = self.pool().begin().await?;
        let bytes: u64 = files.iter().map(|f| f.bytes).sum();
        let locked = sqlx::query(&self.sql(
            "UPDATE snapshots SET bytes = COALESCE(bytes, 0) + ? WHERE id = ? AND status = 'pending'",
        ))
        .bind(bytes as i64)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        if locked.rows_affected() == 0 {
            return Ok(PartOutcome::Gone);
        }
        self.insert_files(&mut tx, id, files).await?;
        let row = sqlx::query(&self.sql(
            "SELECT COUNT(DISTINCT rank) AS ranks, MAX(step) AS step, CAST(SUM(bytes) AS BIGINT) AS bytes \
             FROM snapshot_files WHERE snapshot = ?",
        ))
        .bind(id)
        .fetch_one(&mut *tx)
        .await?;
        let ranks = row.get::<i64, _>("ranks").max(0) as u32;
        let outcome = if ranks >= needed {
            let step = row.get::<Option<i64>, _>("step").unwrap_or(0);
            let total = row.get::<Option<i64>, _>("bytes").unwrap_or(0);
            sqlx::query(&self.sql(
                "UPDATE snapshots SET status = 'complete', completed_at_ms = ?, bytes = ?, step = ? WHERE id = ?",
            ))
            .bind(completed_at_ms)
            .bind(total)
            .bind(step)
            .bind(id)
            .execute(&mut *tx)
            .await?;
            PartOutcome::Complete {
                step: step.max(0) as u64,
                bytes: total.max(0) as u64,
            }
        } else {
            PartOutcome::Waiting { ranks }
        };
        tx.commit().await?;
        Ok(outcome)
    }

    /// Records `files` of snapshot `id` in `tx`.
    async fn insert_files(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        id: &str,
        files: &[FileRow],
    ) -> Result<(), StoreError> {
        for f in files {
            sqlx::query(&self.sql("INSERT INTO snapshot_files (snapshot, rank, part, path, sha256, bytes, step, state) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?)"))
            .bind(id)
            .bind(f.rank as i64)
            .bind(&f.part)
            .bind(&f.path)
            .bind(&f.sha256)
            .bind(f.bytes as i64)
            .bind(f.step as i64)
            .bind(&f.state)
            .execute(&mut **tx)
            .await?;
        }
        Ok(())
    }

    /// Marks a pending snapshot complete with its files, in one transaction.
    /// (A snapshot whose ranks several nodes hold completes through
    /// [`Store::add_snapshot_part`].)
    /// Returns false when it was no longer pending (failed or deleted).
    pub async fn complete_snapshot(
        &self,
        id: &str,
        step: u64,
        files: &[FileRow],
        completed_at_ms: i64,
    ) -> Result<bool, StoreError> {
        let mut tx = self.pool().begin().await?;
        let bytes: u64 = files.iter().map(|f| f.bytes).sum();
        let done = sqlx::query(&self.sql(
            "UPDATE snapshots SET status = 'complete', completed_at_ms = ?, bytes = ?, step = ? \
             WHERE id = ? AND status = 'pending'",
        ))
        .bind(completed_at_ms)
        .bind(bytes as i64)
        .bind(step as i64)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        self.insert_files(&mut tx, id, files).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Marks a pending snapshot failed; false when it was not pending.
    pub async fn fail_snapshot(
        &self,
        id: &str,
        reason: &str,
        at_ms: i64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(&self.sql("UPDATE snapshots SET status = 'failed', reason = ?, completed_at_ms = ? WHERE id = ? AND status = 'pending'"))
        .bind(reason)
        .bind(at_ms)
        .bind(id)
        .execute(self.pool())
        .await?;
        Ok(done.rows_affected() > 0)
    }

    pub async fn snapshots(&self, run: &str) -> Result<Vec<SnapshotRow>, StoreError> {
        let rows = sqlx::query(&self.sql(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE run = ? ORDER BY created_at_ms, id"
        )))
        .bind(run)
        .fetch_all(self.pool())
        .await?;
        rows.into_iter().map(row_to_snapshot).collect()
    }

    pub async fn snapshot(&self, run: &str, id: &str) -> Result<Option<SnapshotRow>, StoreError> {
        let row = sqlx::query(&self.sql(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE run = ? AND id = ?"
        )))
        .bind(run)
        .bind(id)
        .fetch_optional(self.pool())
        .await?;
        row.map(row_to_snapshot).transpose()
    }

    pub async fn snapshot_files(&self, id: &str) -> Result<Vec<FileRow>, StoreError> {
        let rows = sqlx::query(&self.sql("SELECT rank, part, path, sha256, bytes, step, state FROM snapshot_files WHERE snapshot = ? ORDER BY rank, part"))
        .bind(id)
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|row| FileRow {
                rank: row.get::<i64, _>("rank") as u32,
                part: row.get("part"),
                path: row.get("path"),
                sha256: row.get("sha256"),
                bytes: row.get::<i64, _>("bytes") as u64,
                step: row.get::<i64, _>("step") as u64,
                state: row.get("state"),
            })
            .collect())
    }

    /// Deletes a snapshot row (its file rows go with it).
    pub async fn delete_snapshot(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(&self.sql("DELETE FROM snapshots WHERE id = ?"))
            .bind(id)
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// At start: snapshots left pending by a stop are failed. Returns them.
    pub async fn fail_interrupted(&self, at_ms: i64) -> Result<Vec<(String, String)>, StoreError> {
        let rows = sqlx::query(&self.sql("SELECT run, id FROM snapshots WHERE status = 'pending'"))
            .fetch_all(self.pool())
            .await?;
        sqlx::query(&self.sql("UPDATE snapshots SET status = 'failed', reason = 'interrupted: the server stopped before every rank was written', \
             completed_at_ms = ? WHERE status = 'pending'"))
        .bind(at_ms)
        .execute(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| (r.get("run"), r.get("id")))
            .collect())
    }

    /// `(run, id)` of every complete snapshot.
    pub async fn complete_snapshot_ids(&self) -> Result<HashSet<(String, String)>, StoreError> {
        let rows =
            sqlx::query(&self.sql("SELECT run, id FROM snapshots WHERE status = 'complete'"))
                .fetch_all(self.pool())
                .await?;
        Ok(rows
            .into_iter()
            .map(|r| (r.get("run"), r.get("id")))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::placement::tests::store_with_run;

    fn file(rank: u32, bytes: u64) -> FileRow {
        FileRow {
            rank,
            part: "a".into(),
            path: format!("r/s/rank-{rank}-a"),
            sha256: "00".into(),
            bytes,
            step: 8,
            state: "{}".into(),
        }
    }

    /// Three nodes record their parts of one cut at once: exactly one of
    /// them completes it, with every part's bytes; a part recorded after a
    /// failure finds it gone.
    #[tokio::test]
    async fn the_last_part_completes_a_cut_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_run(dir.path()).await;
        let row = SnapshotRow::pending("s1", "r", 8, SnapshotKind::Periodic, vec!["a".into()]);
        assert!(store.insert_snapshot_once(&row).await.unwrap());
        assert!(!store.insert_snapshot_once(&row).await.unwrap());
        let parts = [vec![file(0, 10)], vec![file(1, 20)], vec![file(2, 30)]];
        let outcomes = futures::future::join_all(
            parts
                .iter()
                .map(|p| store.add_snapshot_part("s1", p, 3, 1000)),
        )
        .await;
        let mut complete = 0;
        for outcome in outcomes {
            match outcome.unwrap() {
                PartOutcome::Complete { step, bytes } => {
                    complete += 1;
                    assert_eq!((step, bytes), (8, 60));
                }
                PartOutcome::Waiting { ranks } => assert!(ranks < 3),
                PartOutcome::Gone => panic!("the snapshot is pending"),
            }
        }
        assert_eq!(complete, 1);
        let got = store.snapshot("r", "s1").await.unwrap().unwrap();
        assert_eq!((got.status, got.bytes), (SnapshotStatus::Complete, 60));
        assert_eq!(store.snapshot_files("s1").await.unwrap().len(), 3);

        let row = SnapshotRow::pending("s2", "r", 8, SnapshotKind::Manual, vec!["a".into()]);
        store.insert_snapshot(&row).await.unwrap();
        let first = store
            .add_snapshot_part("s2", &[file(0, 5)], 3, 1)
            .await
            .unwrap();
        assert!(matches!(first, PartOutcome::Waiting { ranks: 1 }));
        store.fail_snapshot("s2", "timed out", 2).await.unwrap();
        let late = store
            .add_snapshot_part("s2", &[file(1, 5)], 3, 3)
            .await
            .unwrap();
        assert!(matches!(late, PartOutcome::Gone));
        let got = store.snapshot("r", "s2").await.unwrap().unwrap();
        assert_eq!(got.status, SnapshotStatus::Failed);
    }
}
