//! A run's life outside ingest and snapshots: creating it (tokens,
//! placement, the catalog, the registry, the peers told), deleting it
//! everywhere it lives, and exporting one rank's live EMA: the [`Runs`]
//! service. The handlers extract and render; the engine closures live
//! here.

use std::sync::Arc;

use super::alerts::AlertsSvc;
use super::cluster;
use super::ingest::Ingest;
use super::snapshots::{self, Snaps};
use super::{Context, ServiceError};
use crate::clock::now_ms;
use crate::engine::{EmaExport, EngineError};
use crate::events::{Event, RunCreated};
use crate::registry::RunHandle;
use crate::registry::{token_hash, RunTokens};
use crate::run::RunConfig;
use crate::store::meta::RunMeta;
use crate::wire::DType;

/// Tries of the catalog delete that met a deadlock, at most.
const DELETE_TRIES: u32 = 6;

/// What a create became.
pub enum Created {
    /// The run exists with this very configuration (`exist_ok`).
    Existing(Arc<RunHandle>),
    /// A new run, with its write and read tokens when the server has an
    /// admin token (shown once, stored hashed).
    New {
        run: Arc<RunHandle>,
        tokens: Option<(String, String)>,
    },
}

/// Creating, annotating, deleting runs and exporting their live EMA.
pub struct Runs {
    ctx: Context,
    /// Deleting a run removes its snapshot files,
    snaps: Snaps,
    /// forgets its alert rules,
    alerts: AlertsSvc,
    /// and its pipelined pushes.
    ingest: Arc<Ingest>,
}

impl Runs {
    pub fn new(ctx: &Context, snaps: &Snaps, alerts: &AlertsSvc, ingest: &Arc<Ingest>) -> Self {
        Runs {
            ctx: ctx.clone(),
            snaps: snaps.clone(),
            alerts: alerts.clone(),
            ingest: ingest.clone(),
        }
    }

    /// Creates a run: its tokens, its ranks placed over the live nodes, its
    /// rows in the catalog, its engines, its annotations, the nodes holding
    /// its other ranks told (before the client pushes to them), an event. A
    /// run of that name already there is `Existing` when `exist_ok` and the
    /// configurations agree, else `409 run_exists` with the differences.
    pub async fn create(
        &self,
        config: RunConfig,
        meta: RunMeta,
        exist_ok: bool,
    ) -> Result<Created, ServiceError> {
        let ctx = &self.ctx;
        // Creators and deleters of one name take turns (see `lock_name`).
        let _name = ctx.registry.lock_name(&config.name).await;
        if let Some(existing) = ctx.run(&config.name) {
            let differences = config_differences(&existing.config, &config);
            if exist_ok && differences.is_empty() {
                return Ok(Created::Existing(existing));
            }
            let message = if differences.is_empty() {
                format!("run `{}` already exists", config.name)
            } else {
                format!(
                    "run `{}` already exists with another configuration: {} (existing != asked)",
                    config.name,
                    differences.join("; ")
                )
            };
            return Err(ServiceError::conflict("run_exists", message));
        }
        let tokens = ctx.args.token.as_ref().map(|_| {
            (
                format!("pkw_{}", random_hex()),
                format!("pkr_{}", random_hex()),
            )
        });
        let hashes = tokens.as_ref().map(|(w, r)| (token_hash(w), token_hash(r)));
        let created = now_ms();
        let owners = cluster::place_new_run(ctx, config.world_size).await?;
        let owner_ids: Vec<String> = owners.iter().map(|o| o.node_id.clone()).collect();
        ctx.store
            .insert_run(&config, created, hashes.clone(), &owner_ids)
            .await?;
        // A create that fails past the catalog row leaves nothing behind
        // (its answer, and with auth on its tokens, would be lost): the
        // annotations are stored before the run is installed, and the row
        // is removed again on a failure.
        if let Err(e) = ctx.store.put_run_meta(&config.name, &meta, created).await {
            self.forget_failed_create(&config.name).await;
            return Err(e.into());
        }
        let installed = ctx
            .registry
            .install_run(
                Arc::new(config.clone()),
                created,
                hashes.map(|(write_hash, read_hash)| RunTokens {
                    write_hash,
                    read_hash,
                }),
                Vec::new(),
                owners,
            )
            .await;
        let run = match installed {
            Ok(run) => run,
            Err(e) => {
                self.forget_failed_create(&config.name).await;
                return Err(e.into());
            }
        };
        let config = run.config.clone();
        ctx.registry.record_engines(&ctx.store, &run).await;
        *run.meta.lock().expect("meta lock") = meta;
        cluster::tell_peers(ctx).await;
        ctx.events.emit(
            &config.name,
            None,
            None,
            Event::RunCreated(RunCreated {
                world_size: config.world_size,
                profiles: config.profiles.len(),
            }),
        );
        tracing::info!(run = %config.name, world_size = config.world_size, device = %config.device, "run created");
        Ok(Created::New { run, tokens })
    }

    /// Removes the catalog row of a run whose create failed after it was
    /// written (its cascades take what else was stored with it).
    async fn forget_failed_create(&self, name: &str) {
        if let Err(e) = self.ctx.store.delete_run(name).await {
            tracing::warn!(run = %name, error = %e, "removing a run whose create failed");
        }
    }

    /// Stores a run's annotations and installs them on its handle.
    pub async fn store_meta(&self, run: &RunHandle, meta: RunMeta) -> Result<(), ServiceError> {
        self.ctx
            .store
            .put_run_meta(&run.config.name, &meta, now_ms())
            .await?;
        *run.meta.lock().expect("meta lock") = meta;
        Ok(())
    }

    /// Deletes the run called `name`, under the name's lock (creators and
    /// deleters take turns; the run is looked up again under it, another
    /// delete may have won): see `delete_run`; then its ingest state is
    /// forgotten and the peers told.
    pub async fn delete(&self, name: &str) -> Result<(), ServiceError> {
        let ctx = &self.ctx;
        let _name = ctx.registry.lock_name(name).await;
        let run = ctx
            .run(name)
            .ok_or_else(|| ServiceError::not_found("run_not_found", format!("no run `{name}`")))?;
        self.delete_run(&run).await?;
        self.ingest.forget_run(&run.config.name);
        cluster::tell_peers(ctx).await;
        Ok(())
    }

    /// Deletes a run: out of the registry and the catalog, its EMA freed on
    /// its engine, its metrics and alerts forgotten, its files removed.
    async fn delete_run(&self, run: &RunHandle) -> Result<(), ServiceError> {
        let ctx = &self.ctx;
        let name = run.config.name.clone();
        ctx.registry.remove_run(&name);
        // The cascade over the run's rows can deadlock with a request on the
        // run inserting a row at the same moment; the run is out of the
        // registry already, so tries again find nothing new to wait for.
        let mut tries = 0;
        loop {
            match ctx.store.delete_run(&name).await {
                Err(e) if e.is_contention() && tries < DELETE_TRIES => {
                    tries += 1;
                    tracing::info!(run = %name, tries, "deleting the run's rows met another write; again");
                    tokio::time::sleep(std::time::Duration::from_millis(20 << tries)).await;
                }
                done => {
                    done?;
                    break;
                }
            }
        }
        run.engines.drop_run(&name).await;
        ctx.metrics.forget_run(&name);
        self.alerts.alerts.forget(&name);
        // The catalog no longer lists them: without this they stayed on disk
        // until the next start.
        if let Err(e) = snapshots::remove_run_files(&self.snaps, &name).await {
            tracing::warn!(run = %name, error = %e, "removing a deleted run's files failed");
        }
        tracing::info!(run = %name, "run deleted");
        Ok(())
    }

    /// One rank's live EMA of `profile`, on the host (cast to `cast` first).
    pub async fn rank_ema(
        &self,
        run: &RunHandle,
        rank: u32,
        profile: &str,
        cast: Option<DType>,
    ) -> Result<EmaExport, ServiceError> {
        let engine = run.engines.of(rank).ok_or_else(|| EngineError::NotHere {
            run: run.config.name.clone(),
            rank,
        })?;
        let export = engine.export_ema(&run.config.name, rank, profile).await??;
        Ok(tokio::task::spawn_blocking(move || export.to_host(cast.map(DType::kind))).await??)
    }
}

fn random_hex() -> String {
    let bytes: [u8; 24] = rand::random();
    hex::encode(bytes)
}

/// `field: existing != asked` for every configuration value that differs,
/// with dotted paths (`profiles[0].beta`).
pub fn config_differences(existing: &RunConfig, asked: &RunConfig) -> Vec<String> {
    fn walk(path: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
        use serde_json::Value;
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    let sub = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    walk(
                        &sub,
                        x.get(k).unwrap_or(&Value::Null),
                        y.get(k).unwrap_or(&Value::Null),
                        out,
                    );
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (p, q)) in x.iter().zip(y).enumerate() {
                    walk(&format!("{path}[{i}]"), p, q, out);
                }
            }
            _ if a != b => out.push(format!("{path}: {a} != {b}")),
            _ => {}
        }
    }
    let mut out = Vec::new();
    match (serde_json::to_value(existing), serde_json::to_value(asked)) {
        (Ok(a), Ok(b)) => walk("", &a, &b, &mut out),
        _ => out.push("the configurations could not be compared".into()),
    }
    out
}
