//! Prometheus series of the object store: request latency by operation,
//! errors by operation, bytes written and read. Registered into the
//! server's registry by [`StoreMetrics::register`].

use std::time::Duration;

use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry};

#[derive(Clone)]
pub struct StoreMetrics {
    /// `polyak_store_seconds{op}`: latency of each store request.
    pub seconds: HistogramVec,
    /// `polyak_store_errors_total{op}`: requests that failed.
    pub errors: IntCounterVec,
    /// `polyak_store_written_bytes_total`.
    pub written_bytes: IntCounter,
    /// `polyak_store_read_bytes_total`.
    pub read_bytes: IntCounter,
}

impl StoreMetrics {
    pub fn new() -> Self {
        StoreMetrics {
            seconds: HistogramVec::new(
                HistogramOpts::new("polyak_store_seconds", "Seconds per object store request")
                    .buckets(vec![
                        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    ]),
                &["op"],
            )
            .expect("valid metric"),
            errors: IntCounterVec::new(
                Opts::new(
                    "polyak_store_errors_total",
                    "Object store requests that failed",
                ),
                &["op"],
            )
            .expect("valid metric"),
            written_bytes: IntCounter::new(
                "polyak_store_written_bytes_total",
                "Bytes written to the object store",
            )
            .expect("valid metric"),
            read_bytes: IntCounter::new(
                "polyak_store_read_bytes_total",
                "Bytes read from the object store",
            )
            .expect("valid metric"),
        }
    }

    pub fn observe(&self, op: &str, took: Duration, ok: bool) {
        self.seconds
            .with_label_values(&[op])
            .observe(took.as_secs_f64());
        if !ok {
            self.errors.with_label_values(&[op]).inc();
        }
    }

    /// Adds the series to `registry` (once per server).
    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.seconds.clone()))?;
        registry.register(Box::new(self.errors.clone()))?;
        registry.register(Box::new(self.written_bytes.clone()))?;
        registry.register(Box::new(self.read_bytes.clone()))?;
        Ok(())
    }
}

impl Default for StoreMetrics {
    fn default() -> Self {
        Self::new()
    }
}
