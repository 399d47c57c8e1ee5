//! Logging set-up and the Prometheus metrics (all prefixed `polyak_`).

use prometheus::{
    CounterVec, Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};
use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Logs go to stderr; `RUST_LOG` overrides the default filter. Colours
/// only on a terminal, and never with `NO_COLOR` set (no-color.org): a log
/// written to a file or a collector holds no escape codes.
pub fn init_logging(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("polyak=info,tower_http=warn"));
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal() && !no_color)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    /// Pushes by run and outcome (`applied`, `duplicate`, `not_update_step`, `rejected`).
    pub pushes: IntCounterVec,
    /// Body bytes received by run.
    pub push_bytes: IntCounterVec,
    /// Body bytes of the applied pushes (not duplicates), by run: the
    /// run's `wire.wire_bytes`.
    pub push_wire_bytes: IntCounterVec,
    /// Bytes the applied pushes stand for, uncompressed and unquantised,
    /// by run (with `push_wire_bytes`: the wire ratio).
    pub push_logical_bytes: IntCounterVec,
    /// Codec seconds by run and stage (`encode`: reported by the client,
    /// `decode`: the server's).
    pub codec_seconds: CounterVec,
    /// Keyframes that found the mirror other than the client held it.
    pub mirror_mismatches: IntCounterVec,
    /// Seconds per push, by stage (`receive`, `validate`, `queue_and_apply`, `apply`).
    pub push_seconds: HistogramVec,
    /// Rejected requests by run and error code.
    pub rejections: IntCounterVec,
    /// Bytes of EMA, copied tensors and mirror resident on the device, by run.
    pub resident_bytes: IntGaugeVec,
    /// Jobs waiting in each engine's queue.
    pub engine_queue: IntGaugeVec,
    /// The same, per kind of command (`push`, `export`, `schedule_cut`...).
    pub engine_queue_by_kind: IntGaugeVec,
    /// Catalog queries, by where they were made (`push`: while answering
    /// a push; `other`), and the batched writer's flushes.
    pub catalog_queries: IntCounterVec,
    pub catalog_flushes: IntCounter,
    /// The writer's flushes the catalog refused (their updates kept and
    /// written again), events it gave up, and updates it holds now.
    pub catalog_write_failures: IntCounter,
    pub catalog_events_dropped: IntCounter,
    pub catalog_writer_held: IntGauge,
    /// Pushes refused because this node's lease was too old to be sure it
    /// still held the rank (`503 lease_lost`), and the lease's age.
    pub pushes_fenced: IntCounter,
    pub lease_age_ms: IntGauge,
    /// Runs in the catalog.
    pub runs: IntGauge,
    /// Push body bytes currently held in memory (received, not yet applied).
    pub inflight_bytes: IntGauge,
    /// Latest `||EMA - online|| / ||online||` by run and profile.
    pub drift: GaugeVec,
    /// Trainer metric points received, by run.
    pub metric_points: IntCounterVec,
    /// Periodic snapshots skipped because the run's backlog was full, by run.
    pub snapshots_skipped: IntCounterVec,
    /// Due state snapshots skipped because the run's last one was still
    /// being written, or the server's capture backlog had no room, by run.
    pub state_persist_skipped: IntCounterVec,
    /// How long each run's last `state` write took, capture to commit (the
    /// next one waits for its share, see `persist::PERSIST_BUSY_SHARE`).
    pub state_write_seconds: GaugeVec,
    pub state_write_held_bytes: IntGaugeVec,
    /// Snapshot parts the catalog refused: captured in a placement epoch
    /// the rank had left (a node paused or cut off past its lease).
    pub snapshot_parts_fenced: IntCounter,
    /// Ranks this node took over from a node that was gone, by run, and the
    /// update steps their EMA lost (known at each rank's next push).
    pub failover_ranks: IntCounterVec,
    pub failover_steps_lost: IntCounterVec,
    /// Alerts firing now, per run and kind (see `alerts`).
    pub alerts_firing: IntGaugeVec,
    /// Client connections being served.
    pub connections: IntGauge,
    /// Free bytes on the data dir's filesystem (for unprivileged writers).
    pub disk_free_bytes: IntGauge,
    /// The configured reserve: snapshot and state writes stop above it.
    pub disk_reserve_bytes: IntGauge,
    /// Snapshot failures not yet recorded in the catalog (retried).
    pub unrecorded_failures: IntGauge,
    /// Reads of a stored part whose size or sha256 is not the recorded
    /// one, by run.
    pub snapshot_corrupt: IntCounterVec,
    /// Downloads being sent (each on a connection of its own, outside
    /// `--max-connections`).
    pub downloads: IntGauge,
}

impl Metrics {
    pub fn new() -> Self {
        let r = Registry::new();
        Metrics {
            pushes: int_counters(
                &r,
                "polyak_pushes_total",
                "Pushes by run and outcome",
                &["run", "outcome"],
            ),
            push_bytes: int_counters(
                &r,
                "polyak_push_bytes_total",
                "Push body bytes received",
                &["run"],
            ),
            push_wire_bytes: int_counters(
                &r,
                "polyak_push_wire_bytes_total",
                "Body bytes of the applied pushes, as they came over the wire",
                &["run"],
            ),
            push_logical_bytes: int_counters(
                &r,
                "polyak_push_logical_bytes_total",
                "Bytes the applied pushes stand for, uncompressed and unquantised",
                &["run"],
            ),
            codec_seconds: register(
                &r,
                CounterVec::new(
                    Opts::new(
                        "polyak_push_codec_seconds_total",
                        "Seconds spent encoding (client-reported) and decoding push bodies",
                    ),
                    &["run", "stage"],
                ),
            ),
            mirror_mismatches: int_counters(
                &r,
                "polyak_mirror_mismatches_total",
                "Keyframes whose mirror checksum did not match the server's mirror",
                &["run"],
            ),
            push_seconds: register(
                &r,
                HistogramVec::new(
                    HistogramOpts::new("polyak_push_seconds", "Seconds per push stage")
                        .buckets(PUSH_SECONDS_BUCKETS.to_vec()),
                    &["stage"],
                ),
            ),
            rejections: int_counters(
                &r,
                "polyak_rejections_total",
                "Rejected requests by run and error code",
                &["run", "code"],
            ),
            resident_bytes: int_gauges(
                &r,
                "polyak_resident_bytes",
                "EMA, copied and mirror bytes on the device",
                &["run"],
            ),
            engine_queue: int_gauges(
                &r,
                "polyak_engine_queue_depth",
                "Jobs waiting in each engine's queue (label: the engine, `cpu#1` with several CPU engines)",
                &["device"],
            ),
            engine_queue_by_kind: int_gauges(
                &r,
                "polyak_engine_queue_depth_by_kind",
                "Commands waiting in each engine's queue, by kind of work",
                &["device", "kind"],
            ),
            runs: int_gauge(&r, "polyak_runs", "Runs in the catalog"),
            catalog_queries: int_counters(
                &r,
                "polyak_catalog_queries_total",
                "Catalog queries and transactions (path: `push` while answering a push, none by design; `other`)",
                &["path"],
            ),
            catalog_flushes: register(
                &r,
                IntCounter::new(
                    "polyak_catalog_writer_flushes_total",
                    "Batches of rank rows and events the catalog writer flushed (one transaction each)",
                ),
            ),
            catalog_write_failures: register(
                &r,
                IntCounter::new(
                    "polyak_catalog_write_failures_total",
                    "Catalog writer flushes the catalog refused; their rank rows and events are kept and written again",
                ),
            ),
            catalog_events_dropped: register(
                &r,
                IntCounter::new(
                    "polyak_catalog_events_dropped_total",
                    "Events the catalog writer gave up on: past its bound while the catalog was away, or still held at shutdown",
                ),
            ),
            catalog_writer_held: int_gauge(
                &r,
                "polyak_catalog_writer_held",
                "Rank rows and events the catalog writer holds for the catalog now (a batch being written, or waiting to be written again)",
            ),
            pushes_fenced: register(
                &r,
                IntCounter::new(
                    "polyak_pushes_fenced_total",
                    "Pushes refused (503 lease_lost) while this node's lease was too old to be sure it held the rank",
                ),
            ),
            lease_age_ms: int_gauge(
                &r,
                "polyak_lease_age_milliseconds",
                "Since the last lease renewal the catalog took was sent",
            ),
            inflight_bytes: int_gauge(
                &r,
                "polyak_inflight_push_bytes",
                "Push bytes received and not yet applied",
            ),
            drift: register(
                &r,
                GaugeVec::new(
                    Opts::new(
                        "polyak_ema_drift",
                        "Relative distance of the EMA from the online weights",
                    ),
                    &["run", "profile"],
                ),
            ),
            metric_points: int_counters(
                &r,
                "polyak_metric_points_total",
                "Trainer metric points received",
                &["run"],
            ),
            snapshots_skipped: int_counters(
                &r,
                "polyak_periodic_snapshots_skipped_total",
                "Periodic snapshots skipped while earlier ones were still being written",
                &["run"],
            ),
            state_persist_skipped: int_counters(
                &r,
                "polyak_state_persist_skipped_total",
                "Due state snapshots skipped while the run's last one was still being written or the capture backlog was full",
                &["run"],
            ),
            state_write_seconds: register(
                &r,
                GaugeVec::new(
                    Opts::new(
                        "polyak_state_write_seconds",
                        "Seconds the run's last state snapshot took from capture to commit",
                    ),
                    &["run"],
                ),
            ),
            state_write_held_bytes: register(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "polyak_state_write_held_bytes",
                        "Most bytes of copies the run's last state snapshot held at once (its ranks are copied as earlier ones are written, within --capture-backlog; one rank is always allowed)",
                    ),
                    &["run"],
                ),
            ),
            snapshot_parts_fenced: register(
                &r,
                IntCounter::new(
                    "polyak_snapshot_parts_fenced_total",
                    "Snapshot parts refused because their rank's placement epoch had moved on since the capture",
                ),
            ),
            failover_ranks: int_counters(
                &r,
                "polyak_failover_ranks_total",
                "Ranks this node took over from a node whose lease expired, by run",
                &["run"],
            ),
            failover_steps_lost: int_counters(
                &r,
                "polyak_failover_steps_lost_total",
                "Update steps missing from the EMA of ranks taken over (between the restored snapshot and the next push), by run",
                &["run"],
            ),
            alerts_firing: int_gauges(
                &r,
                "polyak_alerts_firing",
                "Alerts firing now, per run and kind",
                &["run", "kind"],
            ),
            connections: int_gauge(&r, "polyak_connections", "Client connections being served"),
            disk_free_bytes: int_gauge(
                &r,
                "polyak_disk_free_bytes",
                "Free bytes on the data directory's filesystem",
            ),
            disk_reserve_bytes: int_gauge(
                &r,
                "polyak_disk_reserve_bytes",
                "Free space kept on the data directory's filesystem (--disk-reserve)",
            ),
            unrecorded_failures: int_gauge(
                &r,
                "polyak_snapshot_failures_unrecorded",
                "Failed snapshots whose failure the catalog has not yet taken (retried)",
            ),
            snapshot_corrupt: int_counters(
                &r,
                "polyak_snapshot_corrupt_total",
                "Reads of a stored snapshot part whose size or sha256 is not the recorded one",
                &["run"],
            ),
            downloads: int_gauge(
                &r,
                "polyak_downloads_open",
                "Snapshot downloads being sent, on connections outside --max-connections",
            ),
            registry: r,
        }
    }

    /// Drops the series of a deleted run.
    pub fn forget_run(&self, run: &str) {
        for outcome in ["applied", "duplicate", "not_update_step", "rejected"] {
            let _ = self.pushes.remove_label_values(&[run, outcome]);
        }
        let _ = self.push_bytes.remove_label_values(&[run]);
        let _ = self.push_wire_bytes.remove_label_values(&[run]);
        let _ = self.push_logical_bytes.remove_label_values(&[run]);
        let _ = self.mirror_mismatches.remove_label_values(&[run]);
        let _ = self.snapshot_corrupt.remove_label_values(&[run]);
        for stage in ["encode", "decode"] {
            let _ = self.codec_seconds.remove_label_values(&[run, stage]);
        }
        let _ = self.resident_bytes.remove_label_values(&[run]);
        let _ = self.metric_points.remove_label_values(&[run]);
        let _ = self.snapshots_skipped.remove_label_values(&[run]);
        let _ = self.state_persist_skipped.remove_label_values(&[run]);
        let _ = self.state_write_seconds.remove_label_values(&[run]);
        let _ = self.state_write_held_bytes.remove_label_values(&[run]);
        let _ = self.failover_ranks.remove_label_values(&[run]);
        let _ = self.failover_steps_lost.remove_label_values(&[run]);
        for kind in crate::run::alerts::KINDS {
            let _ = self.alerts_firing.remove_label_values(&[run, kind]);
        }
    }

    /// The Prometheus text exposition.
    /// Adds the object store's series to this registry.
    pub fn register_store(&self, store: &crate::objstore::StoreMetrics) -> prometheus::Result<()> {
        store.register(&self.registry)
    }

    /// Brings the catalog counters up to the counts the store keeps.
    pub fn sync_catalog_counts(&self, (on_push, elsewhere): (u64, u64), writer: WriterFigures) {
        for (path, count) in [("push", on_push), ("other", elsewhere)] {
            let c = self.catalog_queries.with_label_values(&[path]);
            c.inc_by(count.saturating_sub(c.get()));
        }
        for (counter, total) in [
            (&self.catalog_flushes, writer.flushes),
            (&self.catalog_write_failures, writer.failures),
            (&self.catalog_events_dropped, writer.dropped),
        ] {
            counter.inc_by(total.saturating_sub(counter.get()));
        }
        self.catalog_writer_held.set(writer.held as i64);
    }

    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

/// The catalog writer's figures in this process (see `store::writer`).
#[derive(Debug, Clone, Copy, Default)]
pub struct WriterFigures {
    pub flushes: u64,
    pub failures: u64,
    pub dropped: u64,
    pub held: u64,
}

/// Upper bounds of `polyak_push_seconds`.
const PUSH_SECONDS_BUCKETS: [f64; 15] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A metric made from constant options (so it cannot fail), registered
/// under its unique name.
fn register<C>(registry: &Registry, made: prometheus::Result<C>) -> C
where
    C: prometheus::core::Collector + Clone + 'static,
{
    let metric = made.expect("metric");
    registry
        .register(Box::new(metric.clone()))
        .expect("unique metric");
    metric
}

fn int_counters(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register(registry, IntCounterVec::new(Opts::new(name, help), labels))
}

fn int_gauges(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    register(registry, IntGaugeVec::new(Opts::new(name, help), labels))
}

fn int_gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    register(registry, IntGauge::new(name, help))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
