//! Logging set-up and the Prometheus metrics (all prefixed `polyak_`).

use prometheus::{
    CounterVec, Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Logs go to stderr; `RUST_LOG` overrides the default filter.
pub fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("polyak=info,tower_http=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
    /// Bytes the applied pushes stand for, uncompressed and unquantised,
    /// by run (with `push_bytes`: the wire ratio).
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
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let pushes = IntCounterVec::new(
            Opts::new("polyak_pushes_total", "Pushes by run and outcome"),
            &["run", "outcome"],
        )
        .expect("metric");
        let push_bytes = IntCounterVec::new(
            Opts::new("polyak_push_bytes_total", "Push body bytes received"),
            &["run"],
        )
        .expect("metric");
        let push_logical_bytes = IntCounterVec::new(
            Opts::new(
                "polyak_push_logical_bytes_total",
                "Bytes the applied pushes stand for, uncompressed and unquantised",
            ),
            &["run"],
        )
        .expect("metric");
        let codec_seconds = CounterVec::new(
            Opts::new(
                "polyak_push_codec_seconds_total",
                "Seconds spent encoding (client-reported) and decoding push bodies",
            ),
            &["run", "stage"],
        )
        .expect("metric");
        let mirror_mismatches = IntCounterVec::new(
            Opts::new(
                "polyak_mirror_mismatches_total",
                "Keyframes whose mirror checksum did not match the server's mirror",
            ),
            &["run"],
        )
        .expect("metric");
        let push_seconds = HistogramVec::new(
            HistogramOpts::new("polyak_push_seconds", "Seconds per push stage").buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0,
            ]),
            &["stage"],
        )
        .expect("metric");
        let rejections = IntCounterVec::new(
            Opts::new(
                "polyak_rejections_total",
                "Rejected requests by run and error code",
            ),
            &["run", "code"],
        )
        .expect("metric");
        let resident_bytes = IntGaugeVec::new(
            Opts::new(
                "polyak_resident_bytes",
                "EMA, copied and mirror bytes on the device",
            ),
            &["run"],
        )
        .expect("metric");
        let engine_queue = IntGaugeVec::new(
            Opts::new(
                "polyak_engine_queue_depth",
                "Jobs waiting in the engine queue",
            ),
            &["device"],
        )
        .expect("metric");
        let runs = IntGauge::new("polyak_runs", "Runs in the catalog").expect("metric");
        let inflight_bytes = IntGauge::new(
            "polyak_inflight_push_bytes",
            "Push bytes received and not yet applied",
        )
        .expect("metric");
        let drift = GaugeVec::new(
            Opts::new(
                "polyak_ema_drift",
                "Relative distance of the EMA from the online weights",
            ),
            &["run", "profile"],
        )
        .expect("metric");
        let metric_points = IntCounterVec::new(
            Opts::new(
                "polyak_metric_points_total",
                "Trainer metric points received",
            ),
            &["run"],
        )
        .expect("metric");
        let snapshots_skipped = IntCounterVec::new(
            Opts::new(
                "polyak_periodic_snapshots_skipped_total",
                "Periodic snapshots skipped while earlier ones were still being written",
            ),
            &["run"],
        )
        .expect("metric");
        let alerts_firing = IntGaugeVec::new(
            Opts::new(
                "polyak_alerts_firing",
                "Alerts firing now, per run and kind",
            ),
            &["run", "kind"],
        )
        .expect("metric");
        let connections =
            IntGauge::new("polyak_connections", "Client connections being served").expect("metric");
        let disk_free_bytes = IntGauge::new(
            "polyak_disk_free_bytes",
            "Free bytes on the data directory's filesystem",
        )
        .expect("metric");
        let disk_reserve_bytes = IntGauge::new(
            "polyak_disk_reserve_bytes",
            "Free space kept on the data directory's filesystem (--disk-reserve)",
        )
        .expect("metric");
        let unrecorded_failures = IntGauge::new(
            "polyak_snapshot_failures_unrecorded",
            "Failed snapshots whose failure the catalog has not yet taken (retried)",
        )
        .expect("metric");
        for m in [
            Box::new(alerts_firing.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(pushes.clone()),
            Box::new(connections.clone()),
            Box::new(disk_free_bytes.clone()),
            Box::new(disk_reserve_bytes.clone()),
            Box::new(unrecorded_failures.clone()),
            Box::new(push_bytes.clone()),
            Box::new(push_logical_bytes.clone()),
            Box::new(codec_seconds.clone()),
            Box::new(mirror_mismatches.clone()),
            Box::new(push_seconds.clone()),
            Box::new(rejections.clone()),
            Box::new(resident_bytes.clone()),
            Box::new(engine_queue.clone()),
            Box::new(runs.clone()),
            Box::new(inflight_bytes.clone()),
            Box::new(drift.clone()),
            Box::new(metric_points.clone()),
            Box::new(snapshots_skipped.clone()),
        ] {
            registry.register(m).expect("unique metric");
        }
        Metrics {
            registry,
            pushes,
            push_bytes,
            push_logical_bytes,
            codec_seconds,
            mirror_mismatches,
            push_seconds,
            rejections,
            resident_bytes,
            engine_queue,
            runs,
            inflight_bytes,
            drift,
            metric_points,
            snapshots_skipped,
            alerts_firing,
            connections,
            disk_free_bytes,
            disk_reserve_bytes,
            unrecorded_failures,
        }
    }

    /// Drops the series of a deleted run.
    pub fn forget_run(&self, run: &str) {
        for outcome in ["applied", "duplicate", "not_update_step", "rejected"] {
            let _ = self.pushes.remove_label_values(&[run, outcome]);
        }
        let _ = self.push_bytes.remove_label_values(&[run]);
        let _ = self.push_logical_bytes.remove_label_values(&[run]);
        let _ = self.mirror_mismatches.remove_label_values(&[run]);
        for stage in ["encode", "decode"] {
            let _ = self.codec_seconds.remove_label_values(&[run, stage]);
        }
        let _ = self.resident_bytes.remove_label_values(&[run]);
        let _ = self.metric_points.remove_label_values(&[run]);
        let _ = self.snapshots_skipped.remove_label_values(&[run]);
        for kind in crate::run::alerts::KINDS {
            let _ = self.alerts_firing.remove_label_values(&[run, kind]);
        }
    }

    /// The Prometheus text exposition.
    /// Adds the object store's series to this registry.
    pub fn register_store(&self, store: &crate::objstore::StoreMetrics) -> prometheus::Result<()> {
        store.register(&self.registry)
    }

    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
