//! polyak: a network-served EMA service for PyTorch training.
//!
//! Training ranks push their parameter shards over HTTP; polyak keeps the EMA
//! copies of those shards resident on its own device and serves them back.
//! The contract (HTTP surface, wire format, step semantics) is written down
//! in `docs/contract.md`, and how this crate implements it (layers, threads,
//! the path of a push and of a download) in `docs/architecture.md`.
//!
//! # Layout
//!
//! Modules only use modules of lower layers (`tests/layers.rs` checks it):
//! `server` -> `http` -> `state` -> `services` -> {`registry`, `events`} ->
//! {`snapshot`, `store`, `telemetry`} -> `engine` -> {`wire`, `node`} ->
//! `run` -> leaves.
//!
//! - Leaves: [`clock`] (wall-clock milliseconds), [`config`] (the
//!   `polyak serve` flags, each also an environment variable), [`contract`]
//!   (the contract's closed sets: snapshot kinds and statuses, cut kinds,
//!   event kinds, as serde enums), [`sigma_rel`]
//!   (EDM2's `sigma_rel` <-> power exponent), [`hugepages`] (transparent huge
//!   pages for the large host buffers).
//! - [`run`]: a run's configuration (profiles, `update_every`, dtypes,
//!   policies, alert rules) and its validation, field by field.
//! - [`node`]: this server's node id (kept in the data dir) and advertised
//!   URL, as placement answers name them.
//! - [`wire`]: the push body (safetensors, parsed in place), shard metadata,
//!   non-finite scans, and the safetensors writer used for responses.
//! - [`engine`]: the threads (one per GPU, `--engines` on the CPU) that own
//!   every tensor, a run's ranks spread over them ([`engine::spread`]); decay
//!   schedules ([`engine::schedule`]), per-rank flat EMA buffers and the update
//!   kernels.
//! - [`snapshot`]: the on-disk format of a snapshot part, durable files,
//!   downloads as streamed recipes (full, sharded, HF shards), compare, the
//!   post-hoc arithmetic.
//! - [`store`]: the catalog (runs, ranks, snapshots, events, metrics) on
//!   SQLite or PostgreSQL, migrations under `migrations/sqlite/` and
//!   `migrations/postgres/`.
//! - [`objstore`]: the object store for snapshot parts (local files or an
//!   S3-compatible service): streamed multipart uploads, ranged reads.
//! - [`telemetry`]: logging set-up and the Prometheus registry.
//! - [`registry`]: the runs, their ranks' summaries, the engine of each device.
//! - [`events`]: the event bus (numbered, broadcast to SSE, stored).
//! - [`services`]: the domain work handlers call, one struct per service
//!   owning its state and tasks: ingest, the snapshot lifecycle (and
//!   derived snapshots), monitoring series, alerts, evaluations, runs,
//!   nodes, the cluster, operations (health, readiness, verify).
//! - [`state`]: `AppState`, handles to the services and nothing else.
//! - [`http`]: routes, handlers (extract, one service call, render), the one
//!   error type that maps every failure to a status and a JSON body, auth,
//!   OpenAPI.
//! - [`server`]: wires everything together; `run(listener, state, shutdown)` is
//!   what `main` and the integration tests call.

pub mod clock;
pub mod config;
pub mod contract;
pub mod engine;
pub mod events;
pub mod http;
pub mod hugepages;
pub mod node;
pub mod objstore;
pub mod registry;
pub mod run;
pub mod server;
pub mod services;
pub mod sigma_rel;
pub mod snapshot;
pub mod state;
pub mod store;
pub mod telemetry;
pub mod wire;
