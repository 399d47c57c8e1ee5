//! This server as its operator sees it: the facts `/livez` and `/readyz`
//! report, whether the catalog, the engines and the object store answer,
//! the gauges refreshed at each scrape of `/metrics`, and the rereading of
//! every snapshot part (`POST /v1/admin/verify`).

use std::time::Duration;

use super::snapshots::{self, verify, Snaps};
use super::{Context, ServiceError};

/// Whether the data dir's disk counts as full: less free than the
/// reserve, or nothing free at all (a reserve of 0).
fn below_reserve(free: u64, reserve: u64) -> bool {
    free < reserve || free == 0
}

/// How long readiness waits for the object store.
const OBJECTS_PING: Duration = Duration::from_secs(5);

/// Liveness, readiness, the scrape's gauges and verification.
pub struct Ops {
    ctx: Context,
    /// The data dir's free space is the snapshot service's gauge.
    snaps: Snaps,
}

/// What a health answer reports besides its status.
pub struct Facts {
    pub uptime_seconds: f64,
    pub runs: usize,
    /// Free bytes on the data dir's filesystem (`None` when it cannot be
    /// asked).
    pub disk_free_bytes: Option<u64>,
    /// `--disk-reserve`.
    pub disk_reserve_bytes: u64,
    /// The catalog database: `sqlite` or `postgres`.
    pub catalog: &'static str,
    /// The object store of snapshot parts: `file` or `s3`.
    pub store: &'static str,
}

/// Whether this server can take work, and if not, why.
pub enum Readiness {
    Ready,
    /// The catalog cannot be reached or an engine stopped: nothing works.
    Unavailable(String),
    /// The object store cannot be reached, the data dir's disk is below
    /// `--disk-reserve`, or the catalog's disk is full: pushes and reads of
    /// live EMA go on, snapshots wait or fail.
    Degraded(String),
}

impl Ops {
    pub fn new(ctx: &Context, snaps: &Snaps) -> Self {
        Ops {
            ctx: ctx.clone(),
            snaps: snaps.clone(),
        }
    }

    pub fn facts(&self) -> Facts {
        let ctx = &self.ctx;
        Facts {
            uptime_seconds: ctx.started.elapsed().as_secs_f64(),
            runs: ctx.registry.len(),
            disk_free_bytes: snapshots::disk::refresh_gauge(&self.snaps),
            disk_reserve_bytes: ctx.args.disk_reserve.0,
            catalog: ctx.store.kind().name(),
            store: ctx.objects.kind(),
        }
    }

    /// Asks the catalog (within `--catalog-timeout-secs`: a probe sees a
    /// quick answer, never a hang, while the catalog is away or holds every
    /// connection), then every engine, then whether the catalog's disk is
    /// full (after a write it refused for lack of space), then the object
    /// store, then the data dir's free space.
    pub async fn readiness(&self) -> Readiness {
        let ctx = &self.ctx;
        let wait = Duration::from_secs_f64(ctx.args.catalog_timeout_secs);
        let ping = match tokio::time::timeout(wait, ctx.store.ping()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("no answer within {:.1} s", wait.as_secs_f64())),
        };
        if let Some(e) = ping {
            return Readiness::Unavailable(format!("catalog ({}): {e}", ctx.store.kind().name()));
        }
        if !self.engines_answer().await {
            return Readiness::Unavailable("an engine thread stopped".into());
        }
        if let Ok(Some(full)) = tokio::time::timeout(wait, ctx.store.disk_full()).await {
            return Readiness::Degraded(format!(
                "catalog ({}): {full}; what needs a catalog write (snapshots, run changes) \
                 answers 503 catalog_unavailable",
                ctx.store.kind().name()
            ));
        }
        let failed = match tokio::time::timeout(OBJECTS_PING, ctx.objects.ping()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some("no answer within 5 s".to_string()),
        };
        if let Some(e) = failed {
            return Readiness::Degraded(format!("store ({}): {e}", ctx.objects.kind()));
        }
        let reserve = ctx.args.disk_reserve.0;
        match snapshots::disk::refresh_gauge(&self.snaps) {
            Some(free) if below_reserve(free, reserve) => Readiness::Degraded(format!(
                "disk: {free} bytes free on the data dir's filesystem, under --disk-reserve \
                 ({reserve} bytes): snapshots and state writes are refused"
            )),
            _ => Readiness::Ready,
        }
    }

    /// Whether every engine thread still takes work.
    async fn engines_answer(&self) -> bool {
        for engine in self.ctx.registry.engines() {
            if engine.ping().await.is_err() {
                return false;
            }
        }
        true
    }

    /// Rereads every part of every complete snapshot (of `run`, or of every
    /// run); each part found changed is also a `snapshot_corrupt` event.
    pub async fn verify(&self, run: Option<&str>) -> Result<verify::VerifyReport, ServiceError> {
        let ctx = &self.ctx;
        let report = verify::verify_store(&ctx.store, &ctx.objects, run).await?;
        for bad in report.bad.iter().filter(|b| b.problem == "mismatch") {
            let m = crate::snapshot::source::PartMismatch {
                key: bad.key.clone(),
                what: bad.detail.clone(),
            };
            verify::report_mismatch(&ctx.events, &ctx.metrics, &m, "verify");
        }
        Ok(report)
    }

    /// The Prometheus text exposition, its sampled gauges (engine queues,
    /// free disk, lease age, catalog figures) refreshed first.
    pub fn exposition(&self) -> String {
        let ctx = &self.ctx;
        let metrics = &ctx.metrics;
        for engine in ctx.registry.engines() {
            metrics
                .engine_queue
                .with_label_values(&[engine.label()])
                .set(engine.queued() as i64);
            for (kind, n) in engine.queued_by_kind() {
                metrics
                    .engine_queue_by_kind
                    .with_label_values(&[engine.label(), kind.as_str()])
                    .set(n as i64);
            }
        }
        snapshots::disk::refresh_gauge(&self.snaps);
        metrics.lease_age_ms.set(ctx.lease.age().as_millis() as i64);
        let writer = crate::store::writer::counts();
        metrics.sync_catalog_counts(
            crate::store::query_counts(),
            crate::telemetry::WriterFigures {
                flushes: writer.flushes,
                failures: writer.failures,
                dropped: writer.dropped,
                held: writer.held,
            },
        );
        metrics.render()
    }
}

#[cfg(test)]
mod tests {
    use super::below_reserve;

    #[test]
    fn a_disk_under_its_reserve_or_full_is_degraded() {
        assert!(below_reserve(10, 11));
        assert!(!below_reserve(11, 11));
        assert!(below_reserve(0, 0));
        assert!(!below_reserve(1, 0));
    }
}
