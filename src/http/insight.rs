//! What a researcher adds to a run and what only an EMA service can show:
//! tags, note and alert rules (`PATCH /v1/runs/{run}`), alerts and their
//! acknowledgement, per-tensor EMA drift, and each profile's effective
//! averaging window over the run.

use std::collections::BTreeMap;

use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::error::{ApiError, ErrorBody};
use super::extract::{run_named, ApiJson, ApiQuery};
use crate::events::{Annotated, Event};
use crate::run::alerts::AlertRules;
use crate::run::{FieldError, RunSpec};
use crate::services::alerts::Alert;
use crate::services::cluster::FORWARDED;
use crate::services::monitor::{drift_ratio, effective_window};
use crate::state::AppState;
use crate::store::meta::RunMeta;

/// Most tags a run may carry, and the longest tag and note.
const MAX_TAGS: usize = 32;
const MAX_TAG_CHARS: usize = 64;
const MAX_NOTE_CHARS: usize = 8192;

/// Checks tags (trimmed, deduplicated, order kept) and a note.
pub fn checked_meta(
    tags: Vec<String>,
    note: String,
    alerts: AlertRules,
) -> Result<RunMeta, FieldError> {
    let err = |field: String, message: String| FieldError { field, message };
    if tags.len() > MAX_TAGS {
        return Err(err("tags".into(), format!("at most {MAX_TAGS} tags")));
    }
    let mut clean: Vec<String> = Vec::with_capacity(tags.len());
    for (i, t) in tags.into_iter().enumerate() {
        let t = t.trim().to_string();
        if t.is_empty() || t.chars().count() > MAX_TAG_CHARS || t.chars().any(char::is_control) {
            return Err(err(
                format!("tags[{i}]"),
                format!("a tag is 1-{MAX_TAG_CHARS} printable characters"),
            ));
        }
        if !clean.contains(&t) {
            clean.push(t);
        }
    }
    if note.chars().count() > MAX_NOTE_CHARS {
        return Err(err(
            "note".into(),
            format!("at most {MAX_NOTE_CHARS} characters"),
        ));
    }
    alerts.validate("alerts")?;
    Ok(RunMeta {
        tags: clean,
        note,
        alerts,
        model_config: None,
    })
}

/// The annotations of a run being created (checked before it is stored).
pub fn meta_of_spec(spec: &RunSpec) -> Result<RunMeta, FieldError> {
    checked_meta(
        spec.tags.clone(),
        spec.note.clone(),
        spec.alerts.clone().unwrap_or_default(),
    )
}

/// Refuses a webhook `--webhook-allow` does not list (422
/// `webhook_not_allowed`).
pub fn check_webhook(state: &AppState, alerts: &AlertRules) -> Result<(), ApiError> {
    let allow = &state.args().webhook_allow;
    match &alerts.webhook {
        Some(url) if !crate::run::alerts::webhook_allowed(url, allow) => {
            Err(ApiError::unprocessable(
                "webhook_not_allowed",
                format!(
                    "alerts.webhook `{url}`: the server sends only to {} (--webhook-allow)",
                    allow.join(", ")
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// Fields to change; absent ones keep their value.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MetaPatch {
    pub tags: Option<Vec<String>>,
    pub note: Option<String>,
    pub alerts: Option<AlertRules>,
    /// The model's configuration (a JSON object, at most 1 MiB): written as
    /// `config.json` into `hf` downloads.
    #[schema(value_type = Option<Object>)]
    pub model_config: Option<serde_json::Value>,
}

/// The largest model configuration a run keeps, as JSON.
const MAX_MODEL_CONFIG_BYTES: usize = 1 << 20;

/// Change a run's tags, note or alert rules.
#[utoipa::path(patch, path = "/v1/runs/{run}", tag = "runs",
    params(("run" = String, Path)), request_body = MetaPatch,
    responses((status = 200, body = RunMeta), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
pub async fn patch_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiJson(patch): ApiJson<MetaPatch>,
) -> Result<Json<RunMeta>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    let old = run.meta.lock().expect("meta lock").clone();
    if let Some(alerts) = &patch.alerts {
        // The server POSTs to the webhook: where it sends is the admin's
        // call, not a trainer's (whose write token is on every machine).
        if alerts.webhook != old.alerts.webhook && !caller.is_admin() {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "webhook_needs_admin",
                "setting or changing alerts.webhook needs the admin token",
            ));
        }
        check_webhook(&state, alerts)?;
    }
    let mut meta = checked_meta(
        patch.tags.unwrap_or(old.tags),
        patch.note.unwrap_or(old.note),
        patch.alerts.unwrap_or(old.alerts),
    )?;
    meta.model_config = match patch.model_config {
        None => old.model_config,
        Some(c) if !c.is_object() || c.to_string().len() > MAX_MODEL_CONFIG_BYTES => {
            return Err(FieldError {
                field: "model_config".into(),
                message: "a JSON object of at most 1 MiB".into(),
            }
            .into())
        }
        Some(c) => Some(c),
    };
    state.runs().store_meta(&run, meta.clone()).await?;
    state.events().emit(
        &name,
        None,
        None,
        Event::Annotated(Annotated {
            tags: meta.tags.clone(),
            note: meta.note.clone(),
        }),
    );
    Ok(Json(meta))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AlertList {
    /// Alerts firing now.
    pub firing: usize,
    /// Newest first: firing ones and the last resolved ones, of every live
    /// node of the service (each marked with its `node`).
    pub alerts: Vec<Alert>,
    pub rules: AlertRules,
    /// The nodes whose alerts are listed (1 on a single node).
    pub nodes: usize,
    /// Live nodes that did not answer in time: their alerts are missing.
    pub unreachable: Vec<String>,
}

/// How long a node waits for another's alerts or acknowledgement.
const PEER_ALERTS_TIMEOUT: Duration = Duration::from_secs(5);

/// A request to `url` on another node for the caller, answered within
/// [`PEER_ALERTS_TIMEOUT`].
fn to_peer(method: reqwest::Method, url: &str, headers: &HeaderMap) -> reqwest::RequestBuilder {
    super::route::for_caller(method, url, headers).timeout(PEER_ALERTS_TIMEOUT)
}

/// The other live nodes to ask (none when this request was forwarded:
/// the asking node asks each itself).
async fn peers_to_ask(
    state: &AppState,
    headers: &HeaderMap,
) -> Result<Vec<(String, String)>, ApiError> {
    if headers.contains_key(FORWARDED) {
        return Ok(Vec::new());
    }
    Ok(state.cluster().live_peers().await?)
}

/// A run's alerts, over every node of the service: each node judges the
/// conditions it sees (its ranks, what it receives), and any node lists
/// them all.
#[utoipa::path(get, path = "/v1/runs/{run}/alerts", tag = "monitoring",
    params(("run" = String, Path)), responses((status = 200, body = AlertList)))]
pub async fn list_alerts(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Json<AlertList>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let mut alerts = state.alerts().alerts.list(&name);
    let peers = peers_to_ask(&state, &headers).await?;
    let (theirs, unreachable) = peer_alerts(&name, &peers, &headers).await;
    alerts.extend(theirs);
    alerts.sort_by_key(|a| std::cmp::Reverse((a.fired_at_ms, a.id)));
    let rules = run.meta.lock().expect("meta lock").alerts.clone();
    Ok(Json(AlertList {
        firing: alerts
            .iter()
            .filter(|a| a.state == crate::contract::AlertState::Firing)
            .count(),
        alerts,
        rules,
        nodes: 1 + peers.len() - unreachable.len(),
        unreachable,
    }))
}

/// The alerts of run `name` on each of `peers`, and the nodes that could
/// not be read.
async fn peer_alerts(
    name: &str,
    peers: &[(String, String)],
    headers: &HeaderMap,
) -> (Vec<Alert>, Vec<String>) {
    let path = format!("/v1/runs/{name}/alerts");
    let asks = peers.iter().map(|(node, url)| {
        let req = to_peer(reqwest::Method::GET, &format!("{url}{path}"), headers);
        async move {
            let listed = match req.send().await {
                // A node that does not know the run yet has no alerts of it.
                Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => Ok(Vec::new()),
                Ok(r) => match r.error_for_status() {
                    Ok(r) => r.json::<PeerAlerts>().await.map(|l| l.alerts),
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            (node, listed)
        }
    });
    let mut alerts = Vec::new();
    let mut unreachable = Vec::new();
    for (node, listed) in futures::future::join_all(asks).await {
        match listed {
            Ok(theirs) => alerts.extend(theirs),
            Err(e) => {
                tracing::warn!(peer = %node, error = %e, "a node's alerts could not be read");
                unreachable.push(node.clone());
            }
        }
    }
    (alerts, unreachable)
}

/// Whether another node of the service holds a `steps_lost` alert of run
/// `name` that is firing and not acknowledged (the node that took a rank
/// over fires it; any node's view of the run is `degraded` until someone
/// acknowledged it). Asked within [`LOSSES_ELSEWHERE_WITHIN`] (a catalog
/// or a node that does not answer by then counts as none: the run's view
/// is never held up by them).
pub(super) async fn losses_elsewhere(state: &AppState, name: &str, headers: &HeaderMap) -> bool {
    let ask = async {
        let Ok(peers) = peers_to_ask(state, headers).await else {
            return false;
        };
        if peers.is_empty() {
            return false;
        }
        let (alerts, _) = peer_alerts(name, &peers, headers).await;
        alerts.iter().any(|a| {
            a.kind == crate::contract::AlertKind::StepsLost
                && a.state == crate::contract::AlertState::Firing
                && !a.acknowledged
        })
    };
    tokio::time::timeout(LOSSES_ELSEWHERE_WITHIN, ask)
        .await
        .unwrap_or(false)
}

/// How long a run's view waits for the other nodes' `steps_lost` alerts.
const LOSSES_ELSEWHERE_WITHIN: Duration = Duration::from_secs(1);

/// What this server reads of another node's alert list.
#[derive(Deserialize)]
struct PeerAlerts {
    alerts: Vec<Alert>,
}

/// Acknowledge an alert (it stays listed, marked acknowledged), on any
/// node: one that did not fire it passes the acknowledgement on to the
/// live nodes until the one that did takes it.
#[utoipa::path(post, path = "/v1/runs/{run}/alerts/{id}/ack", tag = "monitoring",
    params(("run" = String, Path), ("id" = u64, Path)),
    responses((status = 200, body = Alert), (status = 404, body = ErrorBody)))]
pub async fn ack_alert(
    State(state): State<AppState>,
    caller: Caller,
    Path((name, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<Alert>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_write(&run)?;
    let not_found = || ApiError::not_found("alert_not_found", format!("no alert `{id}`"));
    let Ok(number) = id.parse::<u64>() else {
        return Err(not_found());
    };
    if let Some(alert) = state.alerts().acknowledge(&name, number) {
        state.events().emit(
            &name,
            alert.rank,
            alert.fired_step,
            Event::Alert(serde_json::to_value(&alert).unwrap_or_default()),
        );
        return Ok(Json(alert));
    }
    let path = format!("/v1/runs/{name}/alerts/{number}/ack");
    for (node, url) in peers_to_ask(&state, &headers).await? {
        let answer = to_peer(reqwest::Method::POST, &format!("{url}{path}"), &headers)
            .send()
            .await;
        match answer {
            Ok(r) if r.status().is_success() => match r.json::<Alert>().await {
                Ok(alert) => return Ok(Json(alert)),
                Err(e) => {
                    tracing::warn!(peer = %node, error = %e, "a node's acknowledgement could not be read")
                }
            },
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {}
            Ok(r) => {
                tracing::warn!(peer = %node, status = %r.status(), "a node refused an acknowledgement")
            }
            Err(e) => {
                tracing::warn!(peer = %node, error = %e, "a node did not answer an acknowledgement")
            }
        }
    }
    Err(not_found())
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TensorDriftQuery {
    /// Profile name; default the run's first profile.
    pub profile: Option<String>,
    /// Newest sampled steps returned (default 200, at most 2000).
    pub limit: Option<i64>,
}

/// Drift per tensor over the sampled steps: `values[i][j]` is
/// `||EMA - online|| / ||online||` of `tensors[i]` at `steps[j]` (the
/// ranks' chunks of a tensor combined by sums of squares), `null` where a
/// rank's sample is missing.
#[derive(Debug, Serialize, ToSchema)]
pub struct TensorDrift {
    pub profile: String,
    pub tensors: Vec<String>,
    pub steps: Vec<u64>,
    pub values: Vec<Vec<Option<f64>>>,
}

/// EMA drift per tensor (a heatmap's rows), for one profile.
#[utoipa::path(get, path = "/v1/runs/{run}/drift/tensors", tag = "monitoring",
    params(("run" = String, Path), TensorDriftQuery),
    responses((status = 200, body = TensorDrift), (status = 404, body = ErrorBody)))]
pub async fn tensor_drift(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<TensorDriftQuery>,
) -> Result<Json<TensorDrift>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let profile = q
        .profile
        .unwrap_or_else(|| run.config.profiles[0].name().to_string());
    if !run.config.profiles.iter().any(|p| p.name() == profile) {
        return Err(ApiError::not_found(
            "profile_not_found",
            format!("run `{name}` has no profile `{profile}`"),
        ));
    }
    let rows = state
        .monitor()
        .tensor_drift(&name, &profile, q.limit.unwrap_or(200).clamp(1, 2000))
        .await?;
    // (tensor, step) -> (diff_sq, online_sq, ranks that contributed).
    let mut sums: BTreeMap<(String, u64), (f64, f64)> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut steps: Vec<u64> = Vec::new();
    // Ranks holding a part of each tensor, and the ranks sampled per step.
    let mut holders: BTreeMap<String, std::collections::BTreeSet<u32>> = BTreeMap::new();
    let mut sampled: BTreeMap<u64, std::collections::BTreeSet<u32>> = BTreeMap::new();
    for row in &rows {
        if steps.last() != Some(&row.step) {
            steps.push(row.step);
        }
        sampled.entry(row.step).or_default().insert(row.rank);
        for ((n, d), o) in row.names.iter().zip(&row.diff_sq).zip(&row.online_sq) {
            if !holders.contains_key(n) {
                order.push(n.clone());
            }
            holders.entry(n.clone()).or_default().insert(row.rank);
            let e = sums.entry((n.clone(), row.step)).or_default();
            e.0 += d;
            e.1 += o;
        }
    }
    let values = order
        .iter()
        .map(|n| {
            steps
                .iter()
                .map(|s| {
                    let complete = holders[n].is_subset(&sampled[s]);
                    sums.get(&(n.clone(), *s))
                        .filter(|_| complete)
                        .map(|(d, o)| drift_ratio(*d, *o))
                })
                .collect()
        })
        .collect();
    Ok(Json(TensorDrift {
        profile,
        tensors: order,
        steps,
        values,
    }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WindowQuery {
    /// Points per profile (default 200, at most 2000).
    pub points: Option<u64>,
    /// Last step drawn (default the run's furthest step).
    pub until: Option<u64>,
}

/// One profile's window: `points` are `[step, beta, half_life_steps]`
/// (`half_life_steps` null for a frozen EMA).
#[derive(Debug, Serialize, ToSchema)]
pub struct ProfileWindow {
    pub profile: String,
    pub kind: String,
    pub points: Vec<(u64, f64, Option<f64>)>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WindowResponse {
    pub update_every: u64,
    pub profiles: Vec<ProfileWindow>,
}

/// Each profile's effective averaging window over the run: its `beta` at
/// evenly spaced update steps and the implied half-life in steps.
#[utoipa::path(get, path = "/v1/runs/{run}/window", tag = "monitoring",
    params(("run" = String, Path), WindowQuery),
    responses((status = 200, body = WindowResponse)))]
pub async fn window(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<WindowQuery>,
) -> Result<Json<WindowResponse>, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let u = run.config.update_every.max(1);
    let furthest = (0..run.config.world_size)
        .filter_map(|r| run.rank(r).and_then(|s| s.last_step))
        .max()
        .unwrap_or(0);
    let until = q.until.unwrap_or(furthest);
    let updates = until / u + 1;
    let points = q.points.unwrap_or(200).clamp(2, 2000).min(updates);
    let steps: Vec<u64> = (0..points)
        .map(|i| {
            let k = if points > 1 {
                i * (updates - 1) / (points - 1)
            } else {
                0
            };
            k * u
        })
        .collect();
    let profiles = run
        .config
        .profiles
        .iter()
        .map(|p| ProfileWindow {
            profile: p.name().to_string(),
            kind: serde_json::to_value(p)
                .ok()
                .and_then(|v| v["kind"].as_str().map(str::to_string))
                .unwrap_or_default(),
            points: steps
                .iter()
                .map(|&s| {
                    let (beta, h) = effective_window(p, s, u);
                    (s, beta, h)
                })
                .collect(),
        })
        .collect();
    Ok(Json(WindowResponse {
        update_every: u,
        profiles,
    }))
}
