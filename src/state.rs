//! The state every handler shares: the run registry, the engines, the
//! catalog, the event bus and the metrics. No tensor lives here.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::sync::{broadcast, Semaphore};

use crate::config::ServeArgs;
use crate::engine::capture::CaptureEvent;
use crate::engine::rank::RankLayout;
use crate::engine::FinishedAt;
use crate::engine::{device, EngineHandle};
use crate::run::RunConfig;
use crate::snapshot::Snapshots;
use crate::store::writer::{CatalogUpdate, CatalogWriter};
use crate::store::{RunFinish, Store, StoreError, StoredEvent, StoredRank};
use crate::telemetry::Metrics;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// sha256 hex of a token; only hashes are stored.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// What the server knows of a rank without asking the engine.
#[derive(Debug, Clone, Default)]
pub struct RankSummary {
    pub last_step: Option<u64>,
    pub pushes: u64,
    pub duplicates: u64,
    pub bytes_received: u64,
    pub rejections: u64,
    pub resident_bytes: u64,
    pub last_push_at_ms: Option<i64>,
    pub last_apply_seconds: Option<f64>,
    /// The registered layout (JSON), once the rank pushed.
    pub layout: Option<Arc<serde_json::Value>>,
    /// Number of tensors and elements in the layout.
    pub tensors: usize,
    pub numel: u64,
    /// The rank's EMA is held by the engine (false after a restart until
    /// the rank pushes again or its state is restored).
    pub live: bool,
    /// Exponentially weighted mean of push latency (request start to answer).
    pub push_seconds_ewma: Option<f64>,
    /// Recent pushes `(at_ms, bytes)`, for the rank's throughput.
    pub recent: std::collections::VecDeque<(i64, u64)>,
    /// Latest drift sample per profile: `(||EMA - online||^2, ||online||^2)`.
    pub drift: BTreeMap<String, (f64, f64)>,
    /// The step of that sample.
    pub drift_step: Option<u64>,
    /// Wire bytes against logical bytes, codec time.
    pub wire: crate::wire::stats::WireStats,
}

/// Pushes remembered per rank for its throughput.
const RECENT_PUSHES: usize = 32;

impl RankSummary {
    /// Records an applied push's size and latency.
    pub fn note_push(&mut self, bytes: u64, seconds: f64) {
        let now = now_ms();
        self.push_seconds_ewma = Some(match self.push_seconds_ewma {
            None => seconds,
            Some(prev) => 0.8 * prev + 0.2 * seconds,
        });
        if self.recent.len() == RECENT_PUSHES {
            self.recent.pop_front();
        }
        self.recent.push_back((now, bytes));
    }

    /// Milliseconds without a push after which this rank counts as stale:
    /// [`STALE_AFTER_MS`], or three times its usual interval between pushes
    /// (the median over the remembered ones) when that is longer, so a run
    /// that pushes every few minutes is not shown stale between pushes.
    pub fn stale_after_ms(&self) -> i64 {
        let times: Vec<i64> = self.recent.iter().map(|(t, _)| *t).collect();
        if times.len() < 3 {
            return STALE_AFTER_MS;
        }
        let mut gaps: Vec<i64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        gaps.sort_unstable();
        STALE_AFTER_MS.max(3 * gaps[gaps.len() / 2])
    }

    /// Bytes per second over the remembered pushes.
    pub fn bytes_per_second(&self) -> Option<f64> {
        let (first, _) = *self.recent.front()?;
        let (last, _) = *self.recent.back()?;
        if self.recent.len() < 2 || last <= first {
            return None;
        }
        let bytes: u64 = self.recent.iter().skip(1).map(|(_, b)| b).sum();
        Some(bytes as f64 / ((last - first) as f64 / 1000.0))
    }
}

impl RankSummary {
    fn from_stored(row: StoredRank) -> Self {
        let (tensors, numel) = row.layout.as_ref().map(layout_counts).unwrap_or_default();
        RankSummary {
            last_step: row.last_step,
            pushes: row.pushes,
            duplicates: 0,
            bytes_received: row.bytes_received,
            rejections: row.rejections,
            resident_bytes: 0,
            last_push_at_ms: row.last_push_at_ms,
            last_apply_seconds: None,
            layout: row.layout.map(Arc::new),
            tensors,
            numel,
            live: false,
            ..Default::default()
        }
    }

    pub fn to_row(&self, rank: u32) -> StoredRank {
        StoredRank {
            rank,
            layout: None,
            last_step: self.last_step,
            pushes: self.pushes,
            bytes_received: self.bytes_received,
            rejections: self.rejections,
            resident_bytes: self.resident_bytes,
            last_push_at_ms: self.last_push_at_ms,
        }
    }
}

fn layout_counts(layout: &serde_json::Value) -> (usize, u64) {
    let tensors = layout["tensors"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let numel = tensors.iter().filter_map(|t| t["numel"].as_u64()).sum();
    (tensors.len(), numel)
}

/// Token hashes of a run (auth on).
#[derive(Debug, Clone)]
pub struct RunTokens {
    pub write_hash: String,
    pub read_hash: String,
}

/// Pushes since the last ingest sample of a run.
#[derive(Debug, Default, Clone, Copy)]
pub struct IngestWindow {
    pub pushes: u64,
    pub bytes: u64,
    pub seconds: f64,
}

/// A run as the HTTP layer sees it.
pub struct RunHandle {
    pub config: Arc<RunConfig>,
    pub created_at_ms: i64,
    pub engine: EngineHandle,
    pub tokens: Option<RunTokens>,
    pub ranks: Vec<Mutex<RankSummary>>,
    /// Ingest since the last sample (see `monitor`).
    pub ingest: Mutex<IngestWindow>,
    /// Tags, note and alert rules (editable while the run lives).
    pub meta: Mutex<crate::store::meta::RunMeta>,
    /// Alerts firing now (kept by `alerts`).
    pub alerts_firing: std::sync::atomic::AtomicUsize,
    /// Set once the run is finished (`POST .../finish`).
    pub finished: Mutex<Option<RunFinish>>,
}

impl RunHandle {
    pub fn rank(&self, rank: u32) -> Option<RankSummary> {
        self.ranks
            .get(rank as usize)
            .map(|r| r.lock().expect("rank summary lock").clone())
    }

    /// Updates a rank's summary and returns the new value.
    pub fn update_rank(&self, rank: u32, f: impl FnOnce(&mut RankSummary)) -> RankSummary {
        let mut guard = self.ranks[rank as usize].lock().expect("rank summary lock");
        f(&mut guard);
        guard.clone()
    }

    pub fn finished(&self) -> Option<RunFinish> {
        self.finished.lock().expect("run finish lock").clone()
    }

    pub fn resident_bytes(&self) -> u64 {
        self.ranks
            .iter()
            .map(|r| r.lock().expect("rank summary lock").resident_bytes)
            .sum()
    }
}

/// Events: numbered, broadcast to live subscribers (SSE), kept in a
/// recent-events ring (for replay before the catalog has them), and stored.
pub struct EventBus {
    next_id: AtomicI64,
    tx: broadcast::Sender<Arc<StoredEvent>>,
    recent: Mutex<std::collections::VecDeque<Arc<StoredEvent>>>,
    catalog: CatalogWriter,
}

/// Events kept in memory for replay.
const RECENT_EVENTS: usize = 8192;

impl EventBus {
    pub fn new(last_id: i64, catalog: CatalogWriter) -> Self {
        let (tx, _) = broadcast::channel(4096);
        EventBus {
            next_id: AtomicI64::new(last_id + 1),
            tx,
            recent: Mutex::new(std::collections::VecDeque::with_capacity(RECENT_EVENTS)),
            catalog,
        }
    }

    pub fn emit(
        &self,
        run: &str,
        kind: &str,
        rank: Option<u32>,
        step: Option<u64>,
        detail: serde_json::Value,
    ) -> Arc<StoredEvent> {
        // Numbering and publishing under one lock keeps ids in order on
        // every subscriber.
        let mut recent = self.recent.lock().expect("events lock");
        let event = Arc::new(StoredEvent {
            id: self.next_id.fetch_add(1, Ordering::SeqCst),
            run: run.to_string(),
            at_ms: now_ms(),
            kind: kind.to_string(),
            rank,
            step,
            detail,
        });
        if recent.len() == RECENT_EVENTS {
            recent.pop_front();
        }
        recent.push_back(event.clone());
        self.catalog.send(CatalogUpdate::Event((*event).clone()));
        let _ = self.tx.send(event.clone());
        event
    }

    /// An event for live subscribers only (not stored: high-rate, already
    /// kept elsewhere, like metric posts).
    pub fn emit_transient(
        &self,
        run: &str,
        kind: &str,
        rank: Option<u32>,
        step: Option<u64>,
        detail: serde_json::Value,
    ) {
        let _guard = self.recent.lock().expect("events lock");
        let event = Arc::new(StoredEvent {
            id: self.next_id.fetch_add(1, Ordering::SeqCst),
            run: run.to_string(),
            at_ms: now_ms(),
            kind: kind.to_string(),
            rank,
            step,
            detail,
        });
        let _ = self.tx.send(event);
    }

    /// Events of `run` with `id > after` still in memory, oldest first.
    pub fn recent(&self, run: &str, after: i64) -> Vec<Arc<StoredEvent>> {
        self.recent
            .lock()
            .expect("events lock")
            .iter()
            .filter(|e| e.run == run && e.id > after)
            .cloned()
            .collect()
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<StoredEvent>> {
        self.tx.subscribe()
    }
}

/// Shared by every handler.
pub struct AppInner {
    pub args: ServeArgs,
    pub store: Store,
    pub catalog: CatalogWriter,
    pub runs: RwLock<BTreeMap<String, Arc<RunHandle>>>,
    engines: Mutex<HashMap<String, EngineHandle>>,
    /// The device new runs get when they do not name one (`cpu` or `cuda:N`).
    pub default_device: String,
    pub metrics: Metrics,
    pub events: EventBus,
    pub snapshots: Snapshots,
    /// Alert rules' state and the webhook sender.
    pub alerts: crate::alerts::Alerts,
    /// Where engines send their captures.
    captures: tokio::sync::mpsc::UnboundedSender<CaptureEvent>,
    /// Push bytes that may be held in memory at once, in KiB permits.
    pub inflight: Arc<Semaphore>,
    pub inflight_kib: usize,
    /// Reused receive buffers for push bodies.
    pub bodies: Arc<crate::wire::bodies::BodyPool>,
    /// Pipelined pushes waiting for their predecessors.
    pub pipeline: crate::http::pipeline::Pipeline,
    pub started: Instant,
}

pub type AppState = Arc<AppInner>;

/// Idle push receive buffers kept for reuse: bodies being received while
/// another is applied (two with a pipelining client), a decoded body beside
/// its encoded one, one spare.
const BODY_BUFFERS_KEPT: usize = 4;

impl AppInner {
    /// Opens the catalog and loads every run from it. The receiver gets what
    /// the engines capture for snapshots.
    pub async fn open(
        args: ServeArgs,
        default_device: tch::Device,
        catalog: CatalogWriter,
        store: Store,
    ) -> Result<(AppState, tokio::sync::mpsc::UnboundedReceiver<CaptureEvent>), StoreError> {
        let last_event = store.max_event_id().await?;
        let inflight_kib = (args.inflight_bytes.0 / 1024).max(1) as usize;
        let (captures, captures_rx) = tokio::sync::mpsc::unbounded_channel();
        let state = Arc::new(AppInner {
            default_device: device::name(default_device),
            events: EventBus::new(last_event, catalog.clone()),
            snapshots: Snapshots::new(args.data_dir.clone()),
            alerts: crate::alerts::Alerts::new(),
            captures,
            catalog,
            store,
            runs: RwLock::new(BTreeMap::new()),
            engines: Mutex::new(HashMap::new()),
            metrics: Metrics::new(),
            inflight: Arc::new(Semaphore::new(inflight_kib)),
            inflight_kib,
            bodies: crate::wire::bodies::BodyPool::new(BODY_BUFFERS_KEPT),
            pipeline: crate::http::pipeline::Pipeline::new(
                std::time::Duration::from_secs_f64(args.pipeline_timeout_secs.max(0.0)),
                args.pipeline_depth,
            ),
            started: Instant::now(),
            args,
        });
        for stored in state.store.list_runs().await? {
            let ranks = state.store.list_ranks(&stored.config.name).await?;
            let name = stored.config.name.clone();
            let tokens = stored.write_token_hash.zip(stored.read_token_hash).map(
                |(write_hash, read_hash)| RunTokens {
                    write_hash,
                    read_hash,
                },
            );
            let mut config = stored.config;
            if let Err(e) = device::resolve(&config.device) {
                tracing::error!(run = %name, device = %config.device, "{e}; the run moves to the CPU");
                config.device = "cpu".into();
            }
            let handle = state
                .install_run(Arc::new(config), stored.created_at_ms, tokens, ranks)
                .await;
            match handle {
                Ok(handle) => {
                    if let Some(finish) = stored.finished {
                        let (run, at) = (name.clone(), FinishedAt(finish.step));
                        handle
                            .engine
                            .call(move |e| e.set_finished(&run, Some(at)))
                            .await
                            .map_err(|_| StoreError::Io(std::io::Error::other("engine stopped")))?;
                        *handle.finished.lock().expect("run finish lock") = Some(finish);
                    }
                }
                Err(_) => tracing::error!(run = %name, "the engine refused the run"),
            }
        }
        for (name, meta) in state.store.run_metas().await? {
            if let Some(run) = state.run(&name) {
                *run.meta.lock().expect("meta lock") = meta;
            }
        }
        Ok((state, captures_rx))
    }

    /// The engine of a device, started on first use.
    pub fn engine_for(&self, device_name: &str) -> std::io::Result<EngineHandle> {
        let device = device::parse(device_name)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let key = device::name(device);
        let mut engines = self.engines.lock().expect("engines lock");
        if let Some(engine) = engines.get(&key) {
            return Ok(engine.clone());
        }
        let engine = EngineHandle::start(
            device,
            self.args.queue_depth,
            self.captures.clone(),
            self.args.periodic_backlog.0,
        )?;
        engines.insert(key, engine.clone());
        Ok(engine)
    }

    pub fn engines(&self) -> Vec<EngineHandle> {
        self.engines
            .lock()
            .expect("engines lock")
            .values()
            .cloned()
            .collect()
    }

    /// Registers a run with its engine and in the registry.
    pub async fn install_run(
        &self,
        config: Arc<RunConfig>,
        created_at_ms: i64,
        tokens: Option<RunTokens>,
        stored_ranks: Vec<StoredRank>,
    ) -> Result<Arc<RunHandle>, crate::engine::EngineError> {
        let engine = self
            .engine_for(&config.device)
            .map_err(|_| crate::engine::EngineError::Stopped)?;
        let for_engine = config.clone();
        engine.call(move |e| e.add_run(for_engine)).await?;
        let mut ranks: Vec<RankSummary> = (0..config.world_size)
            .map(|_| RankSummary::default())
            .collect();
        for row in stored_ranks {
            if let Some(slot) = ranks.get_mut(row.rank as usize) {
                *slot = RankSummary::from_stored(row);
            }
        }
        let handle = Arc::new(RunHandle {
            config: config.clone(),
            created_at_ms,
            engine,
            tokens,
            ranks: ranks.into_iter().map(Mutex::new).collect(),
            ingest: Mutex::new(IngestWindow::default()),
            meta: Mutex::new(crate::store::meta::RunMeta::default()),
            alerts_firing: Default::default(),
            finished: Mutex::new(None),
        });
        self.runs
            .write()
            .expect("runs lock")
            .insert(config.name.clone(), handle.clone());
        self.metrics
            .runs
            .set(self.runs.read().expect("runs lock").len() as i64);
        Ok(handle)
    }

    /// Every run, for the periodic jobs that visit them all.
    pub fn all_runs(&self) -> Vec<Arc<RunHandle>> {
        self.runs
            .read()
            .expect("runs lock")
            .values()
            .cloned()
            .collect()
    }

    pub fn run(&self, name: &str) -> Option<Arc<RunHandle>> {
        self.runs.read().expect("runs lock").get(name).cloned()
    }

    /// Whether some run holds this token hash (read or write).
    pub fn token_known(&self, hash: &str) -> bool {
        self.runs.read().expect("runs lock").values().any(|r| {
            r.tokens
                .as_ref()
                .is_some_and(|t| t.read_hash == hash || t.write_hash == hash)
        })
    }

    pub fn remove_run(&self, name: &str) -> Option<Arc<RunHandle>> {
        let removed = self.runs.write().expect("runs lock").remove(name);
        self.metrics
            .runs
            .set(self.runs.read().expect("runs lock").len() as i64);
        removed
    }

    /// Records a registered layout and the new counters of a rank.
    pub fn record_rank(
        &self,
        run: &RunHandle,
        rank: u32,
        summary: &RankSummary,
        layout: Option<&RankLayout>,
    ) {
        let layout_json = layout.and_then(|l| serde_json::to_string(l).ok());
        self.catalog.send(CatalogUpdate::Rank {
            run: run.config.name.clone(),
            row: summary.to_row(rank),
            layout_json,
        });
    }
}

/// JSON view of a rank.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RankView {
    pub rank: u32,
    /// `live` (pushing recently), `stale` (no push for a while),
    /// `never_seen`, or `not_restored` (known from the catalog, EMA not in
    /// memory since a restart).
    pub status: String,
    pub last_step: Option<u64>,
    pub pushes: u64,
    pub duplicates: u64,
    pub bytes_received: u64,
    pub rejections: u64,
    pub resident_bytes: u64,
    pub last_push_at_ms: Option<i64>,
    pub last_apply_seconds: Option<f64>,
    pub tensors: usize,
    pub numel: u64,
    /// Steps behind the furthest rank of the run.
    pub lag: Option<u64>,
    /// Seconds since the last push.
    pub age_seconds: Option<f64>,
    /// Seconds without a push after which the rank counts as stale: 60, or
    /// three times its usual interval between pushes when that is longer.
    pub stale_after_seconds: f64,
    /// Mean push latency (exponentially weighted), seconds.
    pub push_seconds: Option<f64>,
    /// Throughput over the last pushes.
    pub bytes_per_second: Option<f64>,
    /// Latest `||EMA - online|| / ||online||` per profile.
    pub drift: BTreeMap<String, f64>,
    /// Wire bytes against logical bytes, and codec time.
    pub wire: crate::wire::stats::WireStats,
    /// The registered layout (with `?layout=true`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub layout: Option<serde_json::Value>,
}

/// Milliseconds without a push after which a rank counts as stale, at
/// least (see [`RankSummary::stale_after_ms`]).
pub const STALE_AFTER_MS: i64 = 60_000;

impl RankView {
    /// `furthest`: the highest last step over the run's ranks.
    pub fn new(rank: u32, s: &RankSummary, furthest: Option<u64>, with_layout: bool) -> Self {
        let status = if s.pushes == 0 && s.last_step.is_none() {
            "never_seen"
        } else if !s.live {
            "not_restored"
        } else if s
            .last_push_at_ms
            .is_some_and(|t| now_ms() - t > s.stale_after_ms())
        {
            "stale"
        } else {
            "live"
        };
        RankView {
            rank,
            status: status.into(),
            last_step: s.last_step,
            pushes: s.pushes,
            duplicates: s.duplicates,
            bytes_received: s.bytes_received,
            rejections: s.rejections,
            resident_bytes: s.resident_bytes,
            last_push_at_ms: s.last_push_at_ms,
            last_apply_seconds: s.last_apply_seconds,
            tensors: s.tensors,
            numel: s.numel,
            lag: furthest.zip(s.last_step).map(|(f, l)| f.saturating_sub(l)),
            age_seconds: s
                .last_push_at_ms
                .map(|t| (now_ms() - t).max(0) as f64 / 1000.0),
            stale_after_seconds: s.stale_after_ms() as f64 / 1000.0,
            push_seconds: s.push_seconds_ewma,
            bytes_per_second: s.bytes_per_second(),
            drift: s
                .drift
                .iter()
                .map(|(p, (d, o))| (p.clone(), if *o > 0.0 { (d / o).sqrt() } else { d.sqrt() }))
                .collect(),
            wire: s.wire.clone(),
            layout: if with_layout {
                s.layout.as_deref().cloned()
            } else {
                None
            },
        }
    }
}

/// Counts of a freshly registered layout.
pub fn counts_of(layout: &RankLayout) -> (usize, u64) {
    (
        layout.tensors.len(),
        layout.tensors.iter().map(|t| t.numel as u64).sum(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pushed_at(times: &[i64]) -> RankSummary {
        RankSummary {
            recent: times.iter().map(|&t| (t, 1)).collect(),
            ..RankSummary::default()
        }
    }

    #[test]
    fn stale_after_follows_the_usual_push_interval() {
        // Too few pushes to tell, or frequent pushes: the floor.
        assert_eq!(pushed_at(&[0, 300_000]).stale_after_ms(), STALE_AFTER_MS);
        assert_eq!(
            pushed_at(&[0, 1_000, 2_000, 3_000]).stale_after_ms(),
            STALE_AFTER_MS
        );
        // Every five minutes, with one long pause: three median intervals.
        let rare = pushed_at(&[0, 300_000, 600_000, 4_000_000, 4_300_000]);
        assert_eq!(rare.stale_after_ms(), 3 * 300_000);
    }
}
