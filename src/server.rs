//! Wires the pieces together: checks the configuration, opens the catalog,
//! loads the runs, starts the engines, and serves until shutdown.

use std::future::Future;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::net::TcpListener;

use crate::config::ServeArgs;
use crate::engine::device;
use crate::http::conn::ConnLimits;
use crate::objstore::ObjectStore;
use crate::state::{AppInner, AppState};
use crate::store::writer::CatalogWriter;
use crate::store::Store;

/// `polyak serve`: binds, prints the address, serves until Ctrl-C/SIGTERM.
pub async fn serve(mut args: ServeArgs) -> anyhow::Result<()> {
    if let Err(reason) = args.validate() {
        bail!(reason);
    }
    let gpus = device::visible_gpus(args.devices.as_deref()).map_err(anyhow::Error::msg)?;
    let default_device = (
        device::canonical(&args.device, &gpus).map_err(anyhow::Error::msg)?,
        gpus,
    );
    let listener = TcpListener::bind(args.bind)
        .await
        .with_context(|| format!("binding {}", args.bind))?;
    let addr = listener.local_addr()?;
    let metrics_listener = match args.metrics_bind {
        Some(bind) => Some(
            TcpListener::bind(bind)
                .await
                .with_context(|| format!("binding {bind} for /metrics"))?,
        ),
        None => None,
    };
    let data_dir = args.data_dir.clone();
    let store = open_catalog(&args).await?;
    crate::node::resolve(&mut args, addr).context("naming this node")?;
    let store_kind = store.kind().name();
    let objects = open_objects(&args)?;
    let objects_kind = objects.kind();
    let node_id = crate::node::identity(&args).0;
    let (catalog, writer) = CatalogWriter::spawn(store.clone(), node_id);
    let (state, captures) = AppInner::open(args, default_device, catalog, store, objects).await?;
    crate::services::snapshots::recover(state.snapshots())
        .await
        .context("recovering from the last run's snapshots")?;
    state
        .nodes()
        .register()
        .await
        .map_err(|e| anyhow::anyhow!("registering this node in the catalog: {e}"))?;
    let tasks = Tasks::spawn(&state, captures);
    tracing::info!(
        %addr,
        device = %state.registry().default_device(),
        node = %state.args().node_id.as_deref().unwrap_or_default(),
        data_dir = %data_dir.display(),
        catalog = store_kind,
        store = objects_kind,
        runs = state.registry().len(),
        "polyak ready"
    );
    // Tests and scripts read this line to learn the port.
    println!("polyak listening on http://{addr}");
    let metrics = match metrics_listener {
        Some(listener) => Some(MetricsListener::start(listener, &state)?),
        None => None,
    };
    // On SIGTERM the final state write starts at once, beside the drain of
    // the requests in flight, and live event streams end: a stop finishes
    // well inside a 30 s grace period (Kubernetes' default) whatever the
    // clients hold open.
    // The whole stop is bounded by --shutdown-timeout-secs from the
    // signal on, whatever the object store does: what could not be written
    // by then is logged and left for the restart, never waited on forever.
    let grace = Duration::from_secs(state.args().shutdown_timeout_secs);
    let (stopping, mut stopped) = tokio::sync::watch::channel(None);
    let signal = {
        let state = state.clone();
        async move {
            shutdown_signal().await;
            tracing::info!("stopping: the final state write starts; live streams close");
            state.events().close_streams();
            stopping.send_replace(Some(tokio::time::Instant::now() + grace));
        }
    };
    let first_write = {
        let snapshots = state.snapshots().clone();
        tokio::spawn(async move {
            let deadline = match stopped.wait_for(|s| s.is_some()).await {
                Ok(at) => (*at).unwrap_or_else(tokio::time::Instant::now),
                Err(_) => return None,
            };
            crate::services::snapshots::persist_all_until(&snapshots, deadline).await;
            Some(deadline)
        })
    };
    run(listener, state.clone(), signal).await?;
    if let Some(metrics) = metrics {
        metrics.stop().await;
    }
    // Requests in flight are done: persist what they applied after the
    // first write took its copy (runs that did not change are skipped),
    // then stop the services' tasks, all before the deadline.
    let deadline = first_write
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| tokio::time::Instant::now() + grace);
    crate::services::snapshots::persist_all_until(state.snapshots(), deadline).await;
    if tokio::time::timeout_at(deadline, tasks.stop())
        .await
        .is_err()
    {
        tracing::error!("the services' tasks did not stop within the shutdown timeout");
    }
    drop(state);
    // Every catalog sender is gone once the state is dropped; the writer
    // flushes what it holds and ends (a few seconds at most past the
    // deadline: the catalog, not the object store).
    let flush = deadline
        .saturating_duration_since(tokio::time::Instant::now())
        .max(Duration::from_secs(2))
        .min(Duration::from_secs(10));
    let _ = tokio::time::timeout(flush, writer).await;
    tracing::info!("stopped");
    Ok(())
}

/// `polyak verify`: rereads every complete snapshot's parts, prints the
/// report as JSON; true when every part matched.
pub async fn verify(args: crate::config::VerifyArgs) -> anyhow::Result<bool> {
    let store = open_catalog(&args.serve).await?;
    let objects = open_objects(&args.serve)?;
    let report =
        crate::services::snapshots::verify::verify_store(&store, &objects, args.run.as_deref())
            .await?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(report.clean)
}

/// Opens the object store of `--store` (default: files under the data dir).
fn open_objects(args: &ServeArgs) -> anyhow::Result<ObjectStore> {
    let url = args
        .store
        .clone()
        .filter(|url| !url.is_empty())
        .unwrap_or_else(|| ObjectStore::default_url(&args.data_dir));
    let endpoint = args.s3_endpoint.as_deref().filter(|e| !e.is_empty());
    let timeout = std::time::Duration::from_secs_f64(args.store_timeout_secs);
    ObjectStore::open_with_timeout(&url, endpoint, timeout)
        .with_context(|| format!("opening the object store {url}"))
}

/// Opens the catalog `--catalog` names (default: SQLite in the data dir),
/// creating the data dir first.
async fn open_catalog(args: &ServeArgs) -> anyhow::Result<Store> {
    let data_dir = &args.data_dir;
    // An empty POLYAK_CATALOG (compose passes one through) means the default.
    let catalog_url = args
        .catalog
        .clone()
        .filter(|url| !url.is_empty())
        .unwrap_or_else(|| Store::default_url(data_dir));
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating the data dir {}", data_dir.display()))?;
    let acquire = std::time::Duration::from_secs_f64(args.catalog_timeout_secs);
    Store::connect_with(&catalog_url, acquire)
        .await
        .with_context(|| {
            format!(
                "opening the catalog {}",
                crate::store::redact_url(&catalog_url)
            )
        })
}

/// The services' periodic tasks, and how to stop them.
struct Tasks {
    stop: tokio::sync::watch::Sender<bool>,
    snapshots: tokio::task::JoinHandle<()>,
    others: Vec<tokio::task::JoinHandle<()>>,
}

impl Tasks {
    fn spawn(
        state: &AppState,
        captures: tokio::sync::mpsc::UnboundedReceiver<crate::engine::capture::CaptureEvent>,
    ) -> Self {
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let mut others = vec![
            state.alerts().spawn(stop_rx.clone()),
            state.monitor().spawn(stop_rx.clone()),
            state.ingest().spawn_trim(stop_rx.clone()),
            state.nodes().spawn(stop_rx.clone()),
        ];
        others.extend(state.cluster().spawn(stop_rx.clone()));
        let snapshots = state.snapshots().spawn(captures, stop_rx);
        Tasks {
            stop,
            snapshots,
            others,
        }
    }

    /// Signals every task and waits for it, the snapshot writer first.
    async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.snapshots.await;
        for task in self.others {
            let _ = task.await;
        }
    }
}

/// `/metrics` served on its own listener (`--metrics-bind`), without a token.
struct MetricsListener {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsListener {
    fn start(listener: TcpListener, state: &AppState) -> anyhow::Result<Self> {
        let maddr = listener.local_addr()?;
        tracing::info!(addr = %maddr, "serving /metrics without a token");
        println!("polyak metrics on http://{maddr}/metrics");
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let app = crate::http::metrics_router(state.clone());
        let limits = ConnLimits::from_args(state.args());
        let gauges = crate::http::conn::ConnGauges::of(state.metrics());
        let task = tokio::spawn(crate::http::conn::serve(
            listener,
            app,
            limits,
            gauges,
            async move {
                let _ = rx.await;
            },
            Duration::from_secs(1),
        ));
        Ok(MetricsListener { stop, task })
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// Serves `state` on `listener` until `shutdown` resolves, then waits (up
/// to the configured timeout) for requests in flight.
pub async fn run(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let drain = Duration::from_secs(state.args().shutdown_timeout_secs);
    let limits = ConnLimits::from_args(state.args());
    let app = crate::http::router(state.clone());
    let gauges = crate::http::conn::ConnGauges::of(state.metrics());
    crate::http::conn::serve(listener, app, limits, gauges, shutdown, drain).await;
    drop(state);
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
}
