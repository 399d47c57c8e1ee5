//! Alerts: per-run rules evaluated on the server, from the event stream
//! (rejections, pushes, snapshots, metric posts) and a one-second tick
//! (stale ranks, free disk space). An alert fires once per condition (its
//! `key`) and resolves when the condition clears; both transitions become
//! `alert` events, move the `polyak_alerts_firing` gauge and, when the run
//! names a webhook, are POSTed to it (retried, with a timeout).
//!
//! The service owns its state and its tasks: the evaluator (started by
//! [`spawn`]) and the webhook sender behind a bounded queue.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};
use utoipa::ToSchema;

use super::Context;
use crate::clock::now_ms;
use crate::contract::{AlertKind, AlertState, EventKind, SnapshotEventStatus};
use crate::events::Event;
use crate::events::EventBus;
use crate::registry::Registry;
use crate::registry::RunHandle;
use crate::run::alerts::{AlertRules, Goal, MetricRule};
use crate::store::StoredEvent;
use crate::telemetry::Metrics;

/// One alert: fired when its condition began, resolved when it cleared.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Alert {
    /// Unique over the service (drawn from the event ids of the node that
    /// fired it).
    pub id: u64,
    /// The node that judged the condition (a rank's alerts: the node
    /// holding the rank; a run's: the node that received what fired it).
    pub node: String,
    /// The condition: `stale_rank:R`, `nonfinite:R`, `metric_above:NAME`,
    /// `metric_below:NAME`, `no_improvement:NAME`, `disk_full`, `snapshot_failed`,
    /// `snapshot_failed:state` (a `state` snapshot),
    /// `snapshot_corrupt:SNAPSHOT`, `steps_lost:RANK:STEP` (the step its
    /// trainer resumed at).
    pub key: String,
    pub kind: AlertKind,
    pub rank: Option<u32>,
    pub metric: Option<String>,
    pub state: AlertState,
    pub message: String,
    pub fired_at_ms: i64,
    pub fired_step: Option<u64>,
    pub resolved_at_ms: Option<i64>,
    pub resolved_step: Option<u64>,
    pub acknowledged: bool,
}

/// Resolved alerts kept per run (firing ones are always kept).
const RESOLVED_KEPT: usize = 200;
/// Webhook deliveries waiting to be sent, at most.
const WEBHOOK_QUEUE: usize = 256;
/// Attempts per webhook delivery, and the timeout of each.
const WEBHOOK_ATTEMPTS: u32 = 4;
const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(5);

/// A metric rule's memory: the best value so far and its step.
#[derive(Debug, Clone, Copy)]
struct Best {
    value: f64,
    step: u64,
}

#[derive(Default)]
struct Book {
    alerts: Vec<Alert>,
    best: HashMap<usize, Best>,
}

impl Book {
    fn firing(&self, key: &str) -> Option<&Alert> {
        self.alerts
            .iter()
            .find(|a| a.key == key && a.state == AlertState::Firing)
    }
}

/// A transition to announce.
struct Transition {
    run: String,
    alert: Alert,
}

struct Delivery {
    url: String,
    body: serde_json::Value,
}

/// The alert service: every run's alerts and the webhook queue.
pub struct Alerts {
    books: Mutex<HashMap<String, Book>>,
    /// This node's id, and where alert ids come from (unique over the
    /// service, so an acknowledgement reaches one alert from any node).
    node: String,
    ids: Box<dyn Fn() -> u64 + Send + Sync>,
    webhooks: mpsc::Sender<Delivery>,
}

impl Alerts {
    /// Creates the service of node `node`, numbering alerts with `ids`,
    /// and starts its webhook sender (it ends when the service is dropped).
    pub fn new(node: String, ids: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        let (tx, rx) = mpsc::channel(WEBHOOK_QUEUE);
        tokio::spawn(send_webhooks(rx));
        Alerts {
            books: Mutex::new(HashMap::new()),
            node,
            ids: Box::new(ids),
            webhooks: tx,
        }
    }

    /// A run's alerts, newest first.
    pub fn list(&self, run: &str) -> Vec<Alert> {
        let books = self.books.lock().expect("alerts lock");
        let mut out = books.get(run).map(|b| b.alerts.clone()).unwrap_or_default();
        out.reverse();
        out
    }

    /// Marks an alert acknowledged; `None` when the run has no such alert.
    /// A `steps_lost` alert has no condition that clears: acknowledging it
    /// resolves it (someone has read what the EMA lost).
    pub fn acknowledge(&self, run: &str, id: u64) -> Option<Alert> {
        let mut books = self.books.lock().expect("alerts lock");
        let alert = books.get_mut(run)?.alerts.iter_mut().find(|a| a.id == id)?;
        alert.acknowledged = true;
        if alert.kind == AlertKind::StepsLost && alert.state == AlertState::Firing {
            alert.state = AlertState::Resolved;
            alert.resolved_at_ms = Some(now_ms());
        }
        Some(alert.clone())
    }

    /// `steps_lost` alerts of `run` firing and not acknowledged.
    fn losses_unacknowledged(&self, run: &str) -> usize {
        let books = self.books.lock().expect("alerts lock");
        books.get(run).map_or(0, |b| {
            b.alerts
                .iter()
                .filter(|a| {
                    a.kind == AlertKind::StepsLost
                        && a.state == AlertState::Firing
                        && !a.acknowledged
                })
                .count()
        })
    }

    /// Forgets a deleted run.
    pub fn forget(&self, run: &str) {
        self.books.lock().expect("alerts lock").remove(run);
    }

    /// Fires `key` unless it is already firing.
    #[allow(clippy::too_many_arguments)]
    fn fire(
        &self,
        out: &mut Vec<Transition>,
        run: &str,
        key: String,
        kind: AlertKind,
        rank: Option<u32>,
        metric: Option<&str>,
        step: Option<u64>,
        message: String,
    ) {
        let mut books = self.books.lock().expect("alerts lock");
        let book = books.entry(run.to_string()).or_default();
        if book.firing(&key).is_some() {
            return;
        }
        let alert = Alert {
            id: (self.ids)(),
            node: self.node.clone(),
            key,
            kind,
            rank,
            metric: metric.map(str::to_string),
            state: AlertState::Firing,
            message,
            fired_at_ms: now_ms(),
            fired_step: step,
            resolved_at_ms: None,
            resolved_step: None,
            acknowledged: false,
        };
        book.alerts.push(alert.clone());
        let resolved = book
            .alerts
            .iter()
            .filter(|a| a.state != AlertState::Firing)
            .count();
        if resolved > RESOLVED_KEPT {
            if let Some(i) = book
                .alerts
                .iter()
                .position(|a| a.state != AlertState::Firing)
            {
                book.alerts.remove(i);
            }
        }
        out.push(Transition {
            run: run.to_string(),
            alert,
        });
    }

    /// Resolves `key` if it is firing.
    fn resolve(&self, out: &mut Vec<Transition>, run: &str, key: &str, step: Option<u64>) {
        let mut books = self.books.lock().expect("alerts lock");
        let Some(book) = books.get_mut(run) else {
            return;
        };
        if let Some(alert) = book
            .alerts
            .iter_mut()
            .find(|a| a.key == key && a.state == AlertState::Firing)
        {
            alert.state = AlertState::Resolved;
            alert.resolved_at_ms = Some(now_ms());
            alert.resolved_step = step;
            out.push(Transition {
                run: run.to_string(),
                alert: alert.clone(),
            });
        }
    }

    fn firing_keys(&self, run: &str) -> Vec<String> {
        let books = self.books.lock().expect("alerts lock");
        books
            .get(run)
            .map(|b| {
                b.alerts
                    .iter()
                    .filter(|a| a.state == AlertState::Firing)
                    .map(|a| a.key.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Counts of firing alerts per kind, for the gauge.
    fn firing_by_kind(&self, run: &str) -> BTreeMap<AlertKind, i64> {
        let books = self.books.lock().expect("alerts lock");
        let mut out = BTreeMap::new();
        for a in books.get(run).map(|b| b.alerts.as_slice()).unwrap_or(&[]) {
            if a.state == AlertState::Firing {
                *out.entry(a.kind).or_insert(0) += 1;
            }
        }
        out
    }

    /// Evaluates a metric point against the run's rules.
    fn on_metric(
        &self,
        out: &mut Vec<Transition>,
        run: &str,
        rules: &AlertRules,
        rank: Option<u32>,
        step: u64,
        values: &serde_json::Map<String, serde_json::Value>,
    ) {
        for (i, rule) in rules.metrics.iter().enumerate() {
            if rule.rank != rank {
                continue;
            }
            let Some(v) = values.get(&rule.metric).and_then(|v| v.as_f64()) else {
                continue;
            };
            self.check_bounds(out, run, rule, step, v);
            if let Some(patience) = rule.patience {
                self.check_patience(out, run, (i, rule), patience, step, v);
            }
        }
    }

    /// `metric_above` / `metric_below`: fired while `v` is past the
    /// rule's bound, resolved once it is back.
    fn check_bounds(
        &self,
        out: &mut Vec<Transition>,
        run: &str,
        rule: &MetricRule,
        step: u64,
        v: f64,
    ) {
        let name = rule.metric.as_str();
        for (kind, side, limit, crossed) in [
            (
                AlertKind::MetricAbove,
                "above",
                rule.above,
                rule.above.is_some_and(|a| v > a),
            ),
            (
                AlertKind::MetricBelow,
                "below",
                rule.below,
                rule.below.is_some_and(|b| v < b),
            ),
        ] {
            let Some(limit) = limit else { continue };
            let key = format!("{kind}:{name}");
            if crossed {
                self.fire(
                    out,
                    run,
                    key,
                    kind,
                    rule.rank,
                    Some(name),
                    Some(step),
                    format!("{name} = {v} at step {step}, {side} {limit}"),
                );
            } else {
                self.resolve(out, run, &key, Some(step));
            }
        }
    }

    /// `no_improvement`: fired when the best value (the `i`th rule's) is
    /// `patience` steps old, resolved by a better one.
    fn check_patience(
        &self,
        out: &mut Vec<Transition>,
        run: &str,
        (i, rule): (usize, &MetricRule),
        patience: u64,
        step: u64,
        v: f64,
    ) {
        let name = rule.metric.as_str();
        let improved = {
            let mut books = self.books.lock().expect("alerts lock");
            let book = books.entry(run.to_string()).or_default();
            let better = |b: &Best| match rule.mode {
                Goal::Min => v < b.value,
                Goal::Max => v > b.value,
            };
            match book.best.get(&i) {
                Some(b) if !better(b) => Err(*b),
                _ => {
                    book.best.insert(i, Best { value: v, step });
                    Ok(())
                }
            }
        };
        let key = format!("no_improvement:{name}");
        match improved {
            Ok(()) => self.resolve(out, run, &key, Some(step)),
            Err(best) if step.saturating_sub(best.step) >= patience => self.fire(
                out,
                run,
                key,
                AlertKind::NoImprovement,
                rule.rank,
                Some(name),
                Some(step),
                format!(
                    "{name} has not improved on {} (step {}) for {} steps",
                    best.value,
                    best.step,
                    step - best.step
                ),
            ),
            Err(_) => {}
        }
    }
}

/// The alerts service: what it reaches of the layers below (the runs, the
/// event bus, the metrics, the data dir whose free space it watches), and
/// every run's alerts.
pub struct AlertService {
    registry: Arc<Registry>,
    events: Arc<EventBus>,
    metrics: Arc<Metrics>,
    data_dir: PathBuf,
    /// `--webhook-allow`: where webhooks may go (empty: anywhere).
    webhook_allow: Vec<String>,
    pub alerts: Alerts,
}

/// How the alerts service is held.
pub type AlertsSvc = std::sync::Arc<AlertService>;

impl AlertService {
    pub fn new(ctx: &Context) -> AlertsSvc {
        Arc::new(AlertService {
            registry: ctx.registry.clone(),
            events: ctx.events.clone(),
            metrics: ctx.metrics.clone(),
            data_dir: ctx.args.data_dir.clone(),
            webhook_allow: ctx.args.webhook_allow.clone(),
            alerts: {
                let bus = ctx.events.clone();
                Alerts::new(ctx.registry.node_id().to_string(), move || {
                    bus.take_id() as u64
                })
            },
        })
    }

    fn run(&self, name: &str) -> Option<Arc<RunHandle>> {
        self.registry.run(name)
    }

    /// Acknowledges alert `id` of `run` (see [`Alerts::acknowledge`]) and
    /// brings the run's counts and the gauge up to date.
    pub fn acknowledge(&self, run: &str, id: u64) -> Option<Alert> {
        let alert = self.alerts.acknowledge(run, id)?;
        self.recount(run, alert.kind);
        Some(alert)
    }

    /// The firing gauge of `kind` and the run's own counts, from its book.
    fn recount(&self, run: &str, kind: AlertKind) {
        let by_kind = self.alerts.firing_by_kind(run);
        self.metrics
            .alerts_firing
            .with_label_values(&[run, kind.as_str()])
            .set(by_kind.get(&kind).copied().unwrap_or(0));
        if let Some(handle) = self.run(run) {
            handle
                .alerts_firing
                .store(by_kind.values().sum::<i64>() as usize, Ordering::Relaxed);
            handle
                .losses_unacknowledged
                .store(self.alerts.losses_unacknowledged(run), Ordering::Relaxed);
        }
    }

    fn all_runs(&self) -> Vec<Arc<RunHandle>> {
        self.registry.all_runs()
    }
}

impl AlertService {
    /// Starts the evaluator (the event bus and a one-second tick); it stops
    /// when `stop` turns true.
    pub fn spawn(
        self: &Arc<Self>,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        evaluate(self.clone(), stop)
    }
}

fn evaluate(
    state: AlertsSvc,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let mut events = state.events.subscribe();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            let mut out = Vec::new();
            tokio::select! {
                event = events.recv() => match event {
                    Ok(event) => on_event(&state, &event, &mut out),
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "alert evaluation fell behind the event stream");
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                },
                _ = tick.tick() => {
                    let state = state.clone();
                    // statvfs and the per-run scan stay off the async workers.
                    match tokio::task::spawn_blocking(move || {
                        let mut out = Vec::new();
                        on_tick(&state, &mut out);
                        out
                    }).await {
                        Ok(found) => out = found,
                        Err(e) => tracing::warn!(error = %e, "alert tick failed"),
                    }
                },
                _ = stop.changed() => break,
            }
            announce(&state, out);
        }
    })
}

fn rules_of(run: &RunHandle) -> AlertRules {
    run.meta.lock().expect("meta lock").alerts.clone()
}

/// The `status` of a `snapshot` event.
fn snapshot_status(event: &StoredEvent) -> Option<SnapshotEventStatus> {
    event.detail["status"].as_str()?.parse().ok()
}

fn on_event(state: &AlertsSvc, event: &StoredEvent, out: &mut Vec<Transition>) {
    // Another node's events are its own alerts' to evaluate.
    if event.kind == EventKind::Alert || event.relayed {
        return;
    }
    let Some(run) = state.run(&event.run) else {
        return;
    };
    let rules = rules_of(&run);
    let alerts = &state.alerts;
    let name = event.run.as_str();
    match event.kind {
        EventKind::Rejection if event.detail["code"] == "nonfinite" && rules.nonfinite => {
            let rank = event.rank.unwrap_or(0);
            alerts.fire(
                out,
                name,
                format!("nonfinite:{rank}"),
                AlertKind::Nonfinite,
                Some(rank),
                None,
                event.step,
                format!(
                    "rank {rank} pushed non-finite values at step {}: {}",
                    event.step.unwrap_or(0),
                    event.detail["message"].as_str().unwrap_or("")
                ),
            );
        }
        EventKind::Push if event.detail["applied"] == true => {
            if let Some(rank) = event.rank {
                alerts.resolve(out, name, &format!("nonfinite:{rank}"), event.step);
                alerts.resolve(out, name, &format!("stale_rank:{rank}"), event.step);
            }
        }
        EventKind::Snapshot => {
            // `state` snapshots (every few seconds) have a key of their own:
            // one completing says the crash-recovery state is durable again,
            // not that a failed cut (manual, periodic, derived) was taken.
            let key = if event.detail["kind"] == "state" {
                "snapshot_failed:state"
            } else {
                "snapshot_failed"
            };
            match snapshot_status(event) {
                Some(SnapshotEventStatus::Failed) if rules.snapshot_failed => alerts.fire(
                    out,
                    name,
                    key.into(),
                    AlertKind::SnapshotFailed,
                    None,
                    None,
                    event.step,
                    format!(
                        "snapshot {} failed: {}",
                        event.detail["id"].as_str().unwrap_or("?"),
                        event.detail["reason"].as_str().unwrap_or("")
                    ),
                ),
                Some(SnapshotEventStatus::Complete) => alerts.resolve(out, name, key, event.step),
                _ => {}
            }
        }
        EventKind::SnapshotCorrupt => {
            let snapshot = event.detail["snapshot"].as_str().unwrap_or("?");
            alerts.fire(
                out,
                name,
                format!("snapshot_corrupt:{snapshot}"),
                AlertKind::SnapshotCorrupt,
                None,
                None,
                event.step,
                format!(
                    "snapshot {snapshot}: stored part `{}` does not match its record ({}), found by {}",
                    event.detail["part"].as_str().unwrap_or("?"),
                    event.detail["reason"].as_str().unwrap_or(""),
                    event.detail["during"].as_str().unwrap_or("?"),
                ),
            );
        }
        EventKind::Failover => {
            // The first push after a restart or a failover made the loss
            // known: said until acknowledged.
            let lost = event.detail["lost_steps"].as_u64().unwrap_or(0);
            if let (Some(rank), true) = (event.rank, lost > 0) {
                let f = &event.detail;
                let resumed = f["resumed_step"].as_u64().unwrap_or(0);
                let cause = if f["restart"] == true {
                    "its node restarted".to_string()
                } else {
                    format!(
                        "it was taken over from node {}",
                        f["from_node"].as_str().unwrap_or("?")
                    )
                };
                let restored = match f["restored_step"].as_u64() {
                    Some(step) => format!(
                        "restored at step {step} (snapshot {})",
                        f["snapshot"].as_str().unwrap_or("?")
                    ),
                    None => "no stored state of it read back".to_string(),
                };
                alerts.fire(
                    out,
                    name,
                    format!("steps_lost:{rank}:{resumed}"),
                    AlertKind::StepsLost,
                    Some(rank),
                    None,
                    Some(resumed),
                    format!(
                        "rank {rank} lost {lost} update step{} of its EMA: {cause}, {restored}; \
                         its trainer resumed at step {resumed} and the EMA bridged the gap with \
                         one interval of decay",
                        if lost == 1 { "" } else { "s" }
                    ),
                );
            }
        }
        EventKind::Metrics => {
            if let (Some(step), Some(values)) = (event.step, event.detail["values"].as_object()) {
                alerts.on_metric(out, name, &rules, event.rank, step, values);
            }
        }
        _ => {}
    }
}

/// Fraction of the disk holding `path` that is free (for unprivileged users).
pub fn disk_free_fraction(path: &Path) -> Option<f64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable struct.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 || st.f_blocks == 0 {
        return None;
    }
    Some(st.f_bavail as f64 / st.f_blocks as f64)
}

fn on_tick(state: &AlertsSvc, out: &mut Vec<Transition>) {
    let runs = state.all_runs();
    let free = disk_free_fraction(&state.data_dir);
    let now = now_ms();
    for run in runs {
        let rules = rules_of(&run);
        let name = run.config.name.as_str();
        let alerts = &state.alerts;
        // A finished run's ranks stopped on purpose, and a deleted one's
        // are gone (the tick may hold its handle still): never stale.
        let stopped = run.finished().is_some() || run.is_deleted();
        for r in 0..run.config.world_size {
            let key = format!("stale_rank:{r}");
            // A rank's staleness is its owner's to judge (once over the
            // service); a rank another node took over resolves here.
            if stopped || !run.holds(r) {
                alerts.resolve(out, name, &key, None);
                continue;
            }
            let Some(s) = run.rank(r) else { continue };
            let threshold = rules
                .stale_after_seconds
                .unwrap_or(s.stale_after_ms() as f64 / 1000.0);
            let age = s.last_push_at_ms.map(|t| (now - t).max(0) as f64 / 1000.0);
            match age {
                Some(age) if s.live && threshold > 0.0 && age > threshold => alerts.fire(
                    out,
                    name,
                    key,
                    AlertKind::StaleRank,
                    Some(r),
                    None,
                    s.last_step,
                    format!(
                        "rank {r} has not pushed for {age:.1} s (threshold {threshold} s; last step {})",
                        s.last_step.map_or("-".into(), |v| v.to_string())
                    ),
                ),
                _ => alerts.resolve(out, name, &key, s.last_step),
            }
        }
        match free {
            Some(f) if f < rules.disk_free_below => alerts.fire(
                out,
                name,
                "disk_full".into(),
                AlertKind::DiskFull,
                None,
                None,
                None,
                format!(
                    "the data directory's disk is {:.1}% free (threshold {:.1}%)",
                    f * 100.0,
                    rules.disk_free_below * 100.0
                ),
            ),
            Some(_) => alerts.resolve(out, name, "disk_full", None),
            None => {}
        }
        // Rules that were turned off resolve what they had fired.
        for key in alerts.firing_keys(name) {
            let off = (key.starts_with("nonfinite:") && !rules.nonfinite)
                || (key.starts_with("snapshot_failed") && !rules.snapshot_failed)
                || ((key.starts_with("metric_") || key.starts_with("no_improvement:"))
                    && !rules
                        .metrics
                        .iter()
                        .any(|m| key.ends_with(&format!(":{}", m.metric))));
            if off {
                alerts.resolve(out, name, &key, None);
            }
        }
    }
}

/// Events, gauge and webhook for each transition.
fn announce(state: &AlertsSvc, out: Vec<Transition>) {
    for t in out {
        let alert = &t.alert;
        tracing::info!(run = %t.run, key = %alert.key, state = %alert.state, "alert: {}", alert.message);
        let detail = serde_json::to_value(alert).unwrap_or_default();
        state.events.emit(
            &t.run,
            alert.rank,
            alert.resolved_step.or(alert.fired_step),
            Event::Alert(detail.clone()),
        );
        state.recount(&t.run, alert.kind);
        let run = state.run(&t.run);
        let webhook = run.and_then(|r| rules_of(&r).webhook);
        // A webhook set before `--webhook-allow` narrowed the list is not
        // sent to either.
        if let Some(url) = webhook.filter(|url| {
            let ok = crate::run::alerts::webhook_allowed(url, &state.webhook_allow);
            if !ok {
                tracing::warn!(run = %t.run, url = %url, "webhook not in --webhook-allow; not sent");
            }
            ok
        }) {
            let body = serde_json::json!({"run": t.run, "alert": detail});
            if state
                .alerts
                .webhooks
                .try_send(Delivery { url, body })
                .is_err()
            {
                tracing::warn!(run = %t.run, "webhook queue full; an alert was not delivered");
            }
        }
    }
}

/// The HTTP client of webhooks. It never follows a redirect: the allow
/// list (`--webhook-allow`) is checked against the URL the admin set, and
/// a `302` or `307` from an allowed host would otherwise make the server
/// GET, or re-POST the alert to, a host the list forbids. A `3xx` answer
/// is a failed delivery, like any other that is not `2xx`.
fn webhook_client() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(WEBHOOK_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .build()
}

async fn send_webhooks(mut rx: mpsc::Receiver<Delivery>) {
    let client = match webhook_client() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "no HTTP client for webhooks");
            return;
        }
    };
    while let Some(d) = rx.recv().await {
        for attempt in 0..WEBHOOK_ATTEMPTS {
            match client.post(&d.url).json(&d.body).send().await {
                Ok(r) if r.status().is_success() => break,
                Ok(r) if r.status().is_redirection() => tracing::warn!(
                    url = %d.url,
                    status = %r.status(),
                    attempt,
                    "webhook answered a redirect; redirects are not followed"
                ),
                Ok(r) => {
                    tracing::warn!(url = %d.url, status = %r.status(), attempt, "webhook refused")
                }
                Err(e) => tracing::warn!(url = %d.url, error = %e, attempt, "webhook failed"),
            }
            if attempt + 1 < WEBHOOK_ATTEMPTS {
                tokio::time::sleep(Duration::from_millis(250 << attempt)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::alerts::MetricRule;
    use std::sync::atomic::AtomicU64;

    fn values(v: f64) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert("loss".into(), v.into());
        m
    }

    #[tokio::test]
    async fn metric_rules_fire_and_clear_at_the_right_step() {
        let next = AtomicU64::new(1);
        let alerts = Alerts::new("n".into(), move || next.fetch_add(1, Ordering::Relaxed));
        let rules = AlertRules {
            metrics: vec![MetricRule {
                metric: "loss".into(),
                rank: None,
                above: Some(2.0),
                below: None,
                patience: Some(3),
                mode: Goal::Min,
            }],
            ..AlertRules::default()
        };
        let mut out = Vec::new();
        let seq = [1.0, 0.5, 3.0, 0.6, 0.7, 0.8, 0.4];
        let mut log = Vec::new();
        for (step, v) in seq.iter().enumerate() {
            alerts.on_metric(&mut out, "r", &rules, None, step as u64, &values(*v));
            for t in out.drain(..) {
                log.push((t.alert.key, t.alert.state, step));
            }
        }
        let want = [
            ("metric_above:loss", AlertState::Firing, 2),
            ("metric_above:loss", AlertState::Resolved, 3),
            ("no_improvement:loss", AlertState::Firing, 4),
            ("no_improvement:loss", AlertState::Resolved, 6),
        ];
        let got: Vec<_> = log.iter().map(|(k, s, n)| (k.as_str(), *s, *n)).collect();
        assert_eq!(got, want);
        assert_eq!(alerts.list("r").len(), 2);
    }

    #[test]
    fn rules_are_validated() {
        let mut rules = AlertRules::default();
        assert!(rules.validate("alerts").is_ok());
        rules.webhook = Some("ftp://x".into());
        assert_eq!(
            rules.validate("alerts").unwrap_err().field,
            "alerts.webhook"
        );
        rules.webhook = Some("http://127.0.0.1:9/hook".into());
        rules.disk_free_below = 2.0;
        assert_eq!(
            rules.validate("alerts").unwrap_err().field,
            "alerts.disk_free_below"
        );
    }
}
