//! Trainer metrics: `POST /v1/runs/{run}/metrics` stores scalars (loss,
//! lr, grad norm, ...) by step; `GET` returns series, including the ones
//! the server records (`ema_drift/<profile>`, `ingest/...`).

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::error::{ApiError, ErrorBody};
use super::extract::{bounded_step, run_named, ApiJson, ApiQuery};
use crate::run::alerts::valid_metric_name;
use crate::services::monitor::Scalars;
use crate::state::AppState;

/// One step's scalars.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MetricsPost {
    pub step: u64,
    /// Name -> value; values must be finite numbers.
    pub values: BTreeMap<String, f64>,
    /// The rank that measured them; absent for run-level values.
    pub rank: Option<u32>,
}

/// One post, or several at once.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MetricsBody {
    One(MetricsPost),
    Many(Vec<MetricsPost>),
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MetricsAccepted {
    pub accepted: usize,
}

/// Store trainer scalars.
#[utoipa::path(post, path = "/v1/runs/{run}/metrics", tag = "monitoring",
    params(("run" = String, Path)), request_body = MetricsBody,
    responses((status = 202, body = MetricsAccepted), (status = 422, body = ErrorBody)))]
pub async fn post(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiJson(body): ApiJson<MetricsBody>,
) -> Result<(StatusCode, Json<MetricsAccepted>), ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    let posts = match body {
        MetricsBody::One(p) => vec![p],
        MetricsBody::Many(v) => v,
    };
    for (i, p) in posts.iter().enumerate() {
        bounded_step(&format!("[{i}].step"), p.step)?;
        if let Some(rank) = p.rank {
            if rank >= run.config.world_size {
                return Err(ApiError::unprocessable(
                    "invalid_metrics",
                    format!(
                        "[{i}].rank: {rank} is not below world_size {}",
                        run.config.world_size
                    ),
                ));
            }
        }
        for (metric, &value) in &p.values {
            if !valid_metric_name(metric) {
                return Err(ApiError::unprocessable(
                    "invalid_metrics",
                    format!("[{i}].values: `{metric}` is not a metric name (1-128 printable characters)"),
                ));
            }
            if !value.is_finite() {
                return Err(ApiError::unprocessable(
                    "invalid_metrics",
                    format!("[{i}].values.{metric}: must be a finite number"),
                ));
            }
        }
    }
    let posts: Vec<Scalars> = posts
        .into_iter()
        .map(|p| Scalars {
            step: p.step,
            rank: p.rank,
            values: p.values,
        })
        .collect();
    let accepted = state.monitor().record_metrics(&name, &posts).await?;
    Ok((StatusCode::ACCEPTED, Json(MetricsAccepted { accepted })))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct MetricsQuery {
    /// Comma-separated series names (default: all).
    pub names: Option<String>,
    /// Only points with `step >= since_step`.
    #[param(maximum = 9223372036854775807_i64)]
    pub since_step: Option<u64>,
    /// `run` for run-level points only, or a rank number.
    pub rank: Option<String>,
    /// Newest points kept per series (default 10000).
    pub limit: Option<i64>,
}

/// One series: `points` are `[step, value, at_ms]`, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct Series {
    pub name: String,
    pub rank: Option<u32>,
    pub points: Vec<(u64, f64, i64)>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MetricsResponse {
    /// Every series name of the run.
    pub names: Vec<String>,
    pub series: Vec<Series>,
}

/// Read series.
#[utoipa::path(get, path = "/v1/runs/{run}/metrics", tag = "monitoring",
    params(("run" = String, Path), MetricsQuery),
    responses((status = 200, body = MetricsResponse)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<MetricsQuery>,
) -> Result<Json<MetricsResponse>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let names: Option<Vec<String>> = q.names.as_ref().map(|n| {
        n.split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    });
    let rank = match q.rank.as_deref() {
        None => None,
        Some("run") => Some(None),
        Some(r) => Some(Some(r.parse::<u32>().map_err(|_| {
            ApiError::bad_request("invalid_rank", format!("rank `{r}`: a number or `run`"))
        })?)),
    };
    // Steps are stored as SQLite integers (i64): a larger bound would wrap.
    if q.since_step.is_some_and(|s| s > i64::MAX as u64) {
        return Err(ApiError::bad_request(
            "invalid_query",
            format!("since_step: at most {}", i64::MAX),
        ));
    }
    let limit = q.limit.unwrap_or(10_000).clamp(1, 1_000_000);
    let (points, names) = state
        .monitor()
        .series(&name, names.as_deref(), q.since_step, rank, limit)
        .await?;
    let mut series: Vec<Series> = Vec::new();
    for p in points {
        match series.last_mut() {
            Some(s) if s.name == p.name && s.rank == p.rank => {
                s.points.push((p.step, p.value, p.at_ms))
            }
            _ => series.push(Series {
                name: p.name,
                rank: p.rank,
                points: vec![(p.step, p.value, p.at_ms)],
            }),
        }
    }
    Ok(Json(MetricsResponse { names, series }))
}
