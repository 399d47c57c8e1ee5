//! Run annotations (tags, note, alert rules) and per-tensor drift samples.

use sqlx::Row;

use super::{Store, StoreError};
use crate::run::alerts::AlertRules;

/// What a researcher attached to a run; editable at any time.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct RunMeta {
    pub tags: Vec<String>,
    pub note: String,
    pub alerts: AlertRules,
    /// The model's configuration as the client knows it (a transformers
    /// model's `config.to_dict()`): `config.json` of every `hf` download.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_config: Option<serde_json::Value>,
}

/// One rank's per-tensor sums of squares for one profile at one step.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TensorDriftRow {
    pub rank: u32,
    pub step: u64,
    pub names: Vec<String>,
    pub diff_sq: Vec<f64>,
    pub online_sq: Vec<f64>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Sums {
    names: Vec<String>,
    diff_sq: Vec<f64>,
    online_sq: Vec<f64>,
}

impl Store {
    pub async fn put_run_meta(
        &self,
        run: &str,
        meta: &RunMeta,
        at_ms: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(&self.sql("INSERT INTO run_meta (run, tags, note, alert_rules, model_config, updated_at_ms) VALUES (?, ?, ?, ?, ?, ?) \
             ON CONFLICT(run) DO UPDATE SET tags = excluded.tags, note = excluded.note, \
             alert_rules = excluded.alert_rules, model_config = excluded.model_config, \
             updated_at_ms = excluded.updated_at_ms"))
        .bind(run)
        .bind(serde_json::to_string(&meta.tags)?)
        .bind(&meta.note)
        .bind(serde_json::to_string(&meta.alerts)?)
        .bind(meta.model_config.as_ref().map(|c| c.to_string()))
        .bind(at_ms)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Every run's annotations, by run name.
    pub async fn run_metas(&self) -> Result<Vec<(String, RunMeta)>, StoreError> {
        let rows = sqlx::query(
            &self.sql("SELECT run, tags, note, alert_rules, model_config FROM run_meta"),
        )
        .fetch_all(self.pool())
        .await?;
        rows.into_iter()
            .map(|row| {
                Ok((
                    row.get("run"),
                    RunMeta {
                        tags: serde_json::from_str(row.get::<&str, _>("tags"))?,
                        note: row.get("note"),
                        alerts: serde_json::from_str(row.get::<&str, _>("alert_rules"))?,
                        model_config: row
                            .get::<Option<String>, _>("model_config")
                            .map(|c| serde_json::from_str(&c))
                            .transpose()?,
                    },
                ))
            })
            .collect()
    }

    pub async fn insert_tensor_drift(
        &self,
        run: &str,
        profile: &str,
        row: &TensorDriftRow,
    ) -> Result<(), StoreError> {
        let sums = Sums {
            names: row.names.clone(),
            diff_sq: row.diff_sq.clone(),
            online_sq: row.online_sq.clone(),
        };
        sqlx::query(&self.sql(
            "INSERT INTO tensor_drift (run, profile, rank, step, sums) \
             SELECT ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM runs WHERE name = ?)",
        ))
        .bind(run)
        .bind(profile)
        .bind(row.rank as i64)
        .bind(row.step as i64)
        .bind(serde_json::to_string(&sums)?)
        .bind(run)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// The newest `limit` sampled steps of a profile (every rank's rows at
    /// those steps), oldest first.
    pub async fn tensor_drift(
        &self,
        run: &str,
        profile: &str,
        limit: i64,
    ) -> Result<Vec<TensorDriftRow>, StoreError> {
        let rows = sqlx::query(&self.sql("SELECT rank, step, sums FROM tensor_drift WHERE run = ? AND profile = ? AND step IN \
             (SELECT DISTINCT step FROM tensor_drift WHERE run = ? AND profile = ? ORDER BY step DESC LIMIT ?) \
             ORDER BY step, rank"))
        .bind(run)
        .bind(profile)
        .bind(run)
        .bind(profile)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        rows.into_iter()
            .map(|row| {
                let sums: Sums = serde_json::from_str(row.get::<&str, _>("sums"))?;
                Ok(TensorDriftRow {
                    rank: row.get::<i64, _>("rank") as u32,
                    step: row.get::<i64, _>("step") as u64,
                    names: sums.names,
                    diff_sq: sums.diff_sq,
                    online_sq: sums.online_sq,
                })
            })
            .collect()
    }

    /// Keeps the newest `retained` samples of each run, profile and rank.
    pub async fn prune_tensor_drift(&self, retained: u64) -> Result<u64, StoreError> {
        let done = sqlx::query(&self.sql("DELETE FROM tensor_drift WHERE id IN (SELECT id FROM (SELECT id, ROW_NUMBER() OVER \
             (PARTITION BY run, profile, rank ORDER BY step DESC, id DESC) AS n FROM tensor_drift) AS numbered WHERE n > ?)"))
        .bind(retained as i64)
        .execute(self.pool())
        .await?;
        Ok(done.rows_affected())
    }
}
