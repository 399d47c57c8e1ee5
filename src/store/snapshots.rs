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
    /// Who captured the rank's state, in which placement epoch (`None`:
    /// parts that claim no rank, as derived snapshots, and parts recorded
    /// before fencing existed).
    #[serde(skip)]
    pub fence: Option<Fence>,
    /// The part's block checksums, which every read of it is checked
    /// against (`None`: a part written before they were recorded; its
    /// whole sha256 is checked instead).
    #[serde(skip)]
    pub blocks: Option<crate::objstore::BlockSums>,
}

/// A part's fencing token: the node that captured the rank and the
/// placement epoch it held the rank in at that moment. The catalog records
/// the part only while that is still the rank's placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub node_id: String,
    pub epoch: u64,
    /// When the rank was captured (the writer's clock): one owner's
    /// captures of a rank in the order they were taken.
    pub captured_at_ms: i64,
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

const FILE_COLUMNS: &str =
    "rank, part, path, sha256, bytes, step, state, node_id, epoch, captured_at_ms, blocks";

fn row_to_file(row: sqlx::any::AnyRow) -> Result<FileRow, StoreError> {
    let node_id: Option<String> = row.get("node_id");
    let epoch: Option<i64> = row.get("epoch");
    let captured: Option<i64> = row.get("captured_at_ms");
    let blocks = row
        .get::<Option<String>, _>("blocks")
        .map(|text| crate::objstore::BlockSums::decode(&text))
        .transpose()
        .map_err(|e| StoreError::Io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
    Ok(FileRow {
        rank: row.get::<i64, _>("rank") as u32,
        part: row.get("part"),
        path: row.get("path"),
        sha256: row.get("sha256"),
        bytes: row.get::<i64, _>("bytes") as u64,
        step: row.get::<i64, _>("step") as u64,
        state: row.get("state"),
        fence: match (node_id, epoch) {
            (Some(node_id), Some(epoch)) => Some(Fence {
                node_id,
                epoch: epoch.max(0) as u64,
                captured_at_ms: captured.unwrap_or(0),
            }),
            _ => None,
        },
        blocks,
    })
}

const COLUMNS: &str = "id, run, step, kind, label, profiles, status, reason, created_at_ms, completed_at_ms, deadline_ms, bytes, detail";

/// What [`Store::add_snapshot_part`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartOutcome {
    /// This part was the last: the snapshot is complete.
    Complete { step: u64, bytes: u64 },
    /// Ranks with files so far; other nodes' parts are still to come.
    Waiting { ranks: u32 },
    /// Failed or deleted meanwhile: nothing lists these files.
    Gone,
    /// A part's fencing token is stale: the rank's placement moved on
    /// (another node, or a later epoch) since it was captured. Nothing was
    /// recorded.
    Fenced {
        rank: u32,
        epoch: u64,
        /// The rank's placement now (`None`: not placed).
        now: Option<(String, u64)>,
    },
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
        if let Some(stale) = self.stale_fence(&mut tx, id, files).await? {
            // Dropping the transaction rolls the byte count back.
            return Ok(stale);
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
            self.settle_rank_steps(&mut tx, id).await?;
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

    /// A `state` snapshot's `detail.rank_steps` as its files have them: its
    /// ranks are copied one after the other while pushes go on, so a rank's
    /// step may be past the one its pending row was recorded with.
    async fn settle_rank_steps(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        id: &str,
    ) -> Result<(), StoreError> {
        let row = sqlx::query(&self.sql("SELECT kind, detail FROM snapshots WHERE id = ?"))
            .bind(id)
            .fetch_one(&mut **tx)
            .await?;
        if row.get::<&str, _>("kind") != SnapshotKind::State.as_str() {
            return Ok(());
        }
        let mut detail: serde_json::Value = serde_json::from_str(row.get::<&str, _>("detail"))?;
        let steps = sqlx::query(&self.sql(
            "SELECT rank, MAX(step) AS step FROM snapshot_files WHERE snapshot = ? GROUP BY rank",
        ))
        .bind(id)
        .fetch_all(&mut **tx)
        .await?;
        let steps: serde_json::Map<String, serde_json::Value> = steps
            .iter()
            .map(|r| {
                (
                    r.get::<i64, _>("rank").to_string(),
                    serde_json::Value::from(r.get::<i64, _>("step").max(0)),
                )
            })
            .collect();
        if !detail.is_object() {
            detail = serde_json::json!({});
        }
        detail["rank_steps"] = serde_json::Value::Object(steps);
        sqlx::query(&self.sql("UPDATE snapshots SET detail = ? WHERE id = ?"))
            .bind(detail.to_string())
            .bind(id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// The first of `files` whose fencing token is not the rank's placement
    /// now, read in `tx` after the snapshot's row is locked. On PostgreSQL
    /// the placement rows are read `FOR SHARE`: a claim of the rank
    /// (`Store::claim_ranks`, which updates them) waits until this
    /// transaction ends, or committed before it and is seen here. On SQLite
    /// the transaction already holds the database's write lock.
    async fn stale_fence(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        id: &str,
        files: &[FileRow],
    ) -> Result<Option<PartOutcome>, StoreError> {
        let mut fences: Vec<(u32, &Fence)> = files
            .iter()
            .filter_map(|f| f.fence.as_ref().map(|fence| (f.rank, fence)))
            .collect();
        fences.sort_by_key(|(rank, _)| *rank);
        fences.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
        if fences.is_empty() {
            return Ok(None);
        }
        let lock = match self.kind() {
            super::CatalogKind::Postgres => " FOR SHARE",
            super::CatalogKind::Sqlite => "",
        };
        let sql = format!(
            "SELECT node_id, epoch FROM placements \
             WHERE run = (SELECT run FROM snapshots WHERE id = ?) AND rank = ?{lock}"
        );
        for (rank, fence) in fences {
            let row = sqlx::query(&self.sql(&sql))
                .bind(id)
                .bind(rank as i64)
                .fetch_optional(&mut **tx)
                .await?;
            let now = row.map(|r| {
                (
                    r.get::<String, _>("node_id"),
                    r.get::<i64, _>("epoch").max(0) as u64,
                )
            });
            let current = now
                .as_ref()
                .is_some_and(|(node, epoch)| *node == fence.node_id && *epoch == fence.epoch);
            if !current {
                return Ok(Some(PartOutcome::Fenced {
                    rank,
                    epoch: fence.epoch,
                    now,
                }));
            }
        }
        Ok(None)
    }

    /// Records `files` of snapshot `id` in `tx`.
    async fn insert_files(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        id: &str,
        files: &[FileRow],
    ) -> Result<(), StoreError> {
        for f in files {
            sqlx::query(&self.sql("INSERT INTO snapshot_files (snapshot, rank, part, path, sha256, bytes, step, state, \
                 node_id, epoch, captured_at_ms, blocks) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"))
            .bind(id)
            .bind(f.rank as i64)
            .bind(&f.part)
            .bind(&f.path)
            .bind(&f.sha256)
            .bind(f.bytes as i64)
            .bind(f.step as i64)
            .bind(&f.state)
            .bind(f.fence.as_ref().map(|x| x.node_id.clone()))
            .bind(f.fence.as_ref().map(|x| x.epoch as i64))
            .bind(f.fence.as_ref().map(|x| x.captured_at_ms))
            .bind(f.blocks.as_ref().map(|b| b.encode()))
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
        let rows = sqlx::query(&self.sql(&format!(
            "SELECT {FILE_COLUMNS} FROM snapshot_files WHERE snapshot = ? ORDER BY rank, part"
        )))
        .bind(id)
        .fetch_all(self.pool())
        .await?;
        rows.into_iter().map(row_to_file).collect()
    }

    /// Every file of the complete snapshots of `run`, with its snapshot's
    /// id: what a restore chooses each rank's state from.
    pub async fn complete_files(&self, run: &str) -> Result<Vec<(String, FileRow)>, StoreError> {
        let rows = sqlx::query(&self.sql(&format!(
            "SELECT f.snapshot, {} FROM snapshot_files f JOIN snapshots s ON s.id = f.snapshot \
             WHERE s.run = ? AND s.status = 'complete' ORDER BY f.snapshot, f.rank, f.part",
            FILE_COLUMNS
                .split(", ")
                .map(|c| format!("f.{c}"))
                .collect::<Vec<_>>()
                .join(", ")
        )))
        .bind(run)
        .fetch_all(self.pool())
        .await?;
        rows.into_iter()
            .map(|row| Ok((row.get::<String, _>("snapshot"), row_to_file(row)?)))
            .collect()
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
            fence: None,
            blocks: None,
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
                other => panic!("the snapshot is pending and unfenced: {other:?}"),
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

    /// A `state` snapshot's ranks are copied one after the other while
    /// pushes go on: its row, recorded with the steps the ranks were at
    /// before, completes with the steps its parts were written at; a cut's
    /// detail is left as it was.
    #[tokio::test]
    async fn a_state_snapshot_completes_with_its_parts_steps() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_run(dir.path()).await;
        let row = SnapshotRow {
            detail: serde_json::json!({"rank_steps": {"0": 8, "1": 8, "2": 7}}),
            ..SnapshotRow::pending("st", "r", 8, SnapshotKind::State, vec!["a".into()])
        };
        store.insert_snapshot(&row).await.unwrap();
        let at = |rank, step| FileRow {
            step,
            ..file(rank, 10)
        };
        let outcome = store
            .add_snapshot_part("st", &[at(0, 8), at(1, 11), at(2, 12)], 3, 5)
            .await
            .unwrap();
        assert!(matches!(
            outcome,
            PartOutcome::Complete {
                step: 12,
                bytes: 30
            }
        ));
        let got = store.snapshot("r", "st").await.unwrap().unwrap();
        assert_eq!(got.step, 12);
        assert_eq!(
            got.detail,
            serde_json::json!({"rank_steps": {"0": 8, "1": 11, "2": 12}})
        );

        let cut = SnapshotRow {
            detail: serde_json::json!({"note": "kept"}),
            ..SnapshotRow::pending("cut", "r", 8, SnapshotKind::Manual, vec!["a".into()])
        };
        store.insert_snapshot(&cut).await.unwrap();
        store
            .add_snapshot_part("cut", &[file(0, 1)], 1, 6)
            .await
            .unwrap();
        let got = store.snapshot("r", "cut").await.unwrap().unwrap();
        assert_eq!(got.detail, serde_json::json!({"note": "kept"}));
    }

    fn fenced(rank: u32, node: &str, epoch: u64) -> FileRow {
        FileRow {
            fence: Some(Fence {
                node_id: node.into(),
                epoch,
                captured_at_ms: 1,
            }),
            ..file(rank, 10)
        }
    }

    /// A part captured in an epoch the rank's placement has left (a node
    /// paused past its lease, whose rank another node claimed) is refused
    /// in the transaction that would record it: nothing of it is kept, and
    /// the new owner's part completes the snapshot.
    #[tokio::test]
    async fn a_part_from_a_stale_epoch_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_run(dir.path()).await;
        let row = SnapshotRow::pending("s1", "r", 8, SnapshotKind::State, vec!["a".into()]);
        store.insert_snapshot(&row).await.unwrap();
        let first = store
            .add_snapshot_part("s1", &[fenced(1, "n2", 1)], 3, 1)
            .await
            .unwrap();
        assert_eq!(first, PartOutcome::Waiting { ranks: 1 });
        // n1 holds no lease: n3 takes rank 0 at epoch 2.
        let won = store
            .claim_ranks("r", "n3", &[(0, Some(1))], 2)
            .await
            .unwrap();
        assert_eq!(won.len(), 1);
        let stale = store
            .add_snapshot_part("s1", &[fenced(0, "n1", 1), fenced(2, "n1", 1)], 3, 3)
            .await
            .unwrap();
        assert_eq!(
            stale,
            PartOutcome::Fenced {
                rank: 0,
                epoch: 1,
                now: Some(("n3".into(), 2))
            }
        );
        // The right epoch on the wrong node is refused too.
        let wrong_node = store
            .add_snapshot_part("s1", &[fenced(0, "n1", 2)], 3, 3)
            .await
            .unwrap();
        assert!(matches!(wrong_node, PartOutcome::Fenced { rank: 0, .. }));
        let got = store.snapshot("r", "s1").await.unwrap().unwrap();
        assert_eq!((got.status, got.bytes), (SnapshotStatus::Pending, 10));
        assert_eq!(store.snapshot_files("s1").await.unwrap().len(), 1);
        let done = store
            .add_snapshot_part("s1", &[fenced(0, "n3", 2), fenced(2, "n1", 1)], 3, 4)
            .await
            .unwrap();
        assert_eq!(done, PartOutcome::Complete { step: 8, bytes: 30 });
        let files = store.complete_files("r").await.unwrap();
        let epochs: Vec<(u32, Option<u64>)> = files
            .iter()
            .map(|(id, f)| {
                assert_eq!(id, "s1");
                (f.rank, f.fence.as_ref().map(|x| x.epoch))
            })
            .collect();
        assert_eq!(epochs, [(0, Some(2)), (1, Some(1)), (2, Some(1))]);
    }
}
