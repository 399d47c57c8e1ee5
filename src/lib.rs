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
//! Data flows one way: `http` -> `engine` -> `snapshot` -> `store`.
//!
//! - [`config`]: the `polyak serve` flags (every one also an environment variable).
//! - [`sigma_rel`]: EDM2's `sigma_rel` <-> power exponent (a leaf).
//! - [`run`]: a run's configuration (profiles, `update_every`, dtypes, policies)
//!   and its validation, field by field.
//! - [`wire`]: the push body (safetensors, parsed in place), shard metadata,
//!   non-finite scans, and the safetensors writer used for responses.
//! - [`engine`]: the thread (one per device) that owns every tensor; decay
//!   schedules ([`engine::schedule`]), per-rank flat EMA buffers and the update
//!   kernels.
//! - [`snapshot`]: consistent cuts, durable files, downloads (full,
//!   sharded, HF shards), compare, resume and crash recovery.
//! - [`store`]: the catalog (runs, ranks, events, snapshot rows) on SQLite
//!   or PostgreSQL, migrations under `migrations/sqlite/` and
//!   `migrations/postgres/`.
//! - [`objstore`]: the object store for snapshot parts (local files or an
//!   S3-compatible service): streamed multipart uploads, ranged reads.
//! - [`monitor`]: series the server records (EMA drift, per tensor too, ingest rate).
//! - [`alerts`]: per-run alert rules evaluated on the server, webhooks.
//! - [`telemetry`]: logging set-up and the Prometheus registry.
//! - [`hugepages`]: transparent huge pages for the large host buffers.
//! - [`http`]: routes, handlers, the one error type that maps every failure
//!   to a status and a JSON body, auth, OpenAPI.
//! - [`state`]: what handlers share: the run registry, engines, event bus.
//! - [`server`]: wires everything together; `run(listener, state, shutdown)` is
//!   what `main` and the integration tests call.

pub mod clock;
pub mod config;
pub mod engine;
pub mod events;
pub mod http;
pub mod hugepages;
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
