//! Open multipart uploads of the object store, so an upload a crash left
//! open is aborted at the next start (an open S3 upload keeps its parts,
//! and their cost, until someone aborts it).

use sqlx::Row;

use super::{Store, StoreError};

/// An upload recorded as open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenUpload {
    pub upload_id: String,
    pub key: String,
    pub snapshot: String,
}

impl Store {
    pub async fn record_upload(&self, upload: &OpenUpload, at_ms: i64) -> Result<(), StoreError> {
        sqlx::query(&self.sql(
            "INSERT INTO uploads (upload_id, object_key, snapshot, started_at_ms) VALUES (?, ?, ?, ?)",
        ))
        .bind(&upload.upload_id)
        .bind(&upload.key)
        .bind(&upload.snapshot)
        .bind(at_ms)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    pub async fn forget_upload(&self, upload_id: &str) -> Result<(), StoreError> {
        sqlx::query(&self.sql("DELETE FROM uploads WHERE upload_id = ?"))
            .bind(upload_id)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Forgets the uploads recorded for `key` (they finished or aborted).
    pub async fn forget_uploads_of(&self, key: &str) -> Result<(), StoreError> {
        sqlx::query(&self.sql("DELETE FROM uploads WHERE object_key = ?"))
            .bind(key)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Every upload recorded as open, oldest first.
    pub async fn open_uploads(&self) -> Result<Vec<OpenUpload>, StoreError> {
        let rows = sqlx::query(&self.sql(
            "SELECT upload_id, object_key, snapshot FROM uploads ORDER BY started_at_ms, upload_id",
        ))
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| OpenUpload {
                upload_id: r.get("upload_id"),
                key: r.get("object_key"),
                snapshot: r.get("snapshot"),
            })
            .collect())
    }
}
