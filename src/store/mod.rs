//! The catalog: SQLite (the embedded default) or PostgreSQL, through
//! sqlx's `Any` driver so one set of queries serves both. The schema lives
//! in `migrations/sqlite/` and `migrations/postgres/` (the same tables,
//! each in its dialect) and is applied at start.
//!
//! Queries are written with `?` placeholders; [`Store::sql`] turns them
//! into PostgreSQL's `$1, $2, ...` when the catalog is PostgreSQL.
//!
//! The HTTP layer writes run creation and deletion directly (they are
//! acknowledged only once stored); per-push bookkeeping (rank counters,
//! events) goes through [`writer::CatalogWriter`], which batches it into
//! one transaction every few hundred milliseconds.

pub mod evals;
pub mod meta;
pub mod nodes;
pub mod placement;
pub mod snapshots;
pub mod uploads;
pub mod writer;

use std::borrow::Cow;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, Executor, Row};

use crate::contract::EventKind;
use crate::run::RunConfig;

/// How a `runs` row says the run finished (its `finished_*` columns).
fn finish_of(row: &sqlx::any::AnyRow) -> Option<RunFinish> {
    row.get::<Option<i64>, _>("finished_at_ms")
        .map(|at_ms| RunFinish {
            at_ms,
            step: row.get::<Option<i64>, _>("finished_step").map(|s| s as u64),
            snapshot: row.get("finished_snapshot"),
        })
}

/// A run's finish lock across nodes (see [`Store::lock_finish`]).
pub struct FinishLock {
    conn: sqlx::AnyConnection,
}

impl FinishLock {
    /// Ends the session that holds the lock (PostgreSQL releases it).
    pub async fn release(self) {
        use sqlx::Connection;
        if let Err(e) = self.conn.close().await {
            tracing::debug!(error = %e, "closing the finish lock's session failed; it ends with the socket");
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("run `{0}` already exists")]
    RunExists(String),
    #[error("catalog: {0}")]
    Sql(sqlx::Error),
    #[error("catalog migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("catalog holds invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("catalog holds {0}")]
    Value(#[from] crate::contract::UnknownValue),
    #[error("data dir: {0}")]
    Io(#[from] std::io::Error),
    #[error("catalog URL `{0}`: expected sqlite://PATH or postgres://...")]
    Url(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        sqlite_trouble::note(&e);
        catalog_space::note(&e);
        StoreError::Sql(e)
    }
}

/// PostgreSQL's disk after a statement it refused for lack of space
/// (SQLSTATE 53100, `disk_full`: a data file, or a temporary file, that
/// could not grow; PostgreSQL goes on). The last such refusal is kept
/// until [`Store::disk_full`] finds room again, so readiness says the
/// catalog's disk is full while it is, not only while a write happens to
/// fail. (SQLite's file is in the data dir, whose free space readiness
/// asks directly.)
mod catalog_space {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::Instant;

    /// When the last refusal was, in microseconds after [`origin`], plus one
    /// (0: none since room was last found).
    static LAST: AtomicU64 = AtomicU64::new(0);

    fn origin() -> Instant {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        *ORIGIN.get_or_init(Instant::now)
    }

    pub(super) fn is_disk_full(code: &str) -> bool {
        code == "53100"
    }

    pub(super) fn note(e: &sqlx::Error) {
        if let sqlx::Error::Database(db) = e {
            if db.code().is_some_and(|c| is_disk_full(&c)) {
                let at = origin().elapsed().as_micros() as u64 + 1;
                LAST.fetch_max(at, Ordering::AcqRel);
            }
        }
    }

    /// The last refusal since room was last found (an opaque mark).
    pub(super) fn refused() -> Option<u64> {
        match LAST.load(Ordering::Acquire) {
            0 => None,
            at => Some(at),
        }
    }

    /// Room was found after the refusal `mark`; a later one stays.
    pub(super) fn room_after(mark: u64) {
        let _ = LAST.compare_exchange(mark, 0, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// SQLite after a full disk or an I/O error: a statement that failed may
/// leave its connection inside a transaction SQLite did or did not roll
/// back (its docs: "the transaction may or may not be rolled back
/// automatically"; a COMMIT that fails leaves it open), and such a
/// connection, back in the pool, holds the write lock: every other writer
/// then answers "database is locked" until a restart. So every connection
/// that existed when such an error happened is closed the next time it
/// would be handed out (closing rolls back and releases the lock), a new
/// one takes its place, and once writes work again the WAL is
/// checkpointed (see [`Store::recovered`]).
mod sqlite_trouble {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    fn origin() -> Instant {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        *ORIGIN.get_or_init(Instant::now)
    }

    /// Microseconds after [`origin`] of the last such error, plus one (0:
    /// none yet).
    static LAST: AtomicU64 = AtomicU64::new(0);

    /// SQLite's primary result codes of a full disk (SQLITE_FULL, 13) and
    /// an I/O error (SQLITE_IOERR, 10), whatever their extended codes.
    pub(super) fn is_trouble(code: &str) -> bool {
        // SQLite's codes are numbers of at most four digits (PostgreSQL's
        // SQLSTATEs have five characters).
        code.len() < 5
            && code
                .parse::<u32>()
                .is_ok_and(|n| matches!(n & 0xff, 10 | 13))
    }

    pub(super) fn note(e: &sqlx::Error) {
        if let sqlx::Error::Database(db) = e {
            if db.code().is_some_and(|c| is_trouble(&c)) {
                let at = origin().elapsed().as_micros() as u64 + 1;
                LAST.fetch_max(at, Ordering::AcqRel);
            }
        }
    }

    /// Whether a connection `age` old existed at the last such error.
    pub(super) fn outlived_by(age: Duration) -> bool {
        match LAST.load(Ordering::Acquire) {
            0 => false,
            at => {
                let since = origin()
                    .elapsed()
                    .saturating_sub(Duration::from_micros(at - 1));
                age >= since
            }
        }
    }
}

impl StoreError {
    /// True when the catalog could not be reached (as opposed to a query
    /// or its data being wrong): callers answer 503 and retry later.
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::Sql(
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::Tls(_)
                | sqlx::Error::WorkerCrashed,
            ) => true,
            StoreError::Sql(sqlx::Error::Database(e)) => e
                .code()
                .is_some_and(|code| unavailable_code(&code) || sqlite_trouble::is_trouble(&code)),
            _ => false,
        }
    }
}

impl StoreError {
    /// Whether the database refused the statement for lack of space
    /// (PostgreSQL's 53100).
    pub fn is_disk_full(&self) -> bool {
        match self {
            StoreError::Sql(sqlx::Error::Database(e)) => {
                e.code().is_some_and(|c| catalog_space::is_disk_full(&c))
            }
            _ => false,
        }
    }

    /// Whether the database gave up the statement for another one it ran
    /// at the same time (PostgreSQL's deadlock 40P01 or serialization
    /// failure 40001): the same statement again may well go through.
    pub fn is_contention(&self) -> bool {
        match self {
            StoreError::Sql(sqlx::Error::Database(e)) => e
                .code()
                .is_some_and(|c| matches!(c.as_ref(), "40P01" | "40001")),
            _ => false,
        }
    }
}

/// Whether a database error code says the catalog is there but cannot
/// take queries now, rather than that the query or its data is wrong:
/// PostgreSQL's SQLSTATEs (five characters) of a connection exception
/// (class 08), a server shutting down or starting up (57P01, 57P02,
/// 57P03) or out of connections (53300); SQLite's result codes (numbers)
/// BUSY and LOCKED, with their extended codes.
fn unavailable_code(code: &str) -> bool {
    if code.len() == 5 {
        // 53100: PostgreSQL's disk is full (it answers again once space is
        // back).
        return code.starts_with("08")
            || matches!(code, "57P01" | "57P02" | "57P03" | "53300" | "53100");
    }
    code.parse::<u32>().is_ok_and(|n| matches!(n & 0xff, 5 | 6))
}

/// How long a query waits for a PostgreSQL connection unless the server
/// says otherwise (`--catalog-timeout-secs`).
const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(2);

/// Which database holds the catalog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CatalogKind {
    Sqlite,
    Postgres,
}

impl CatalogKind {
    pub fn name(self) -> &'static str {
        match self {
            CatalogKind::Sqlite => "sqlite",
            CatalogKind::Postgres => "postgres",
        }
    }
}

/// A run as stored.
#[derive(Debug, Clone)]
pub struct StoredRun {
    pub config: RunConfig,
    pub created_at_ms: i64,
    pub write_token_hash: Option<String>,
    pub read_token_hash: Option<String>,
    pub finished: Option<RunFinish>,
}

/// How a finished run ended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct RunFinish {
    pub at_ms: i64,
    /// The furthest rank's last step when the run was finished (`None`:
    /// nothing was pushed); pushes past it are refused.
    pub step: Option<u64>,
    /// The final snapshot (`None` when nothing was pushed).
    pub snapshot: Option<String>,
}

/// A rank's row.
#[derive(Debug, Clone, Default)]
pub struct StoredRank {
    pub rank: u32,
    pub layout: Option<serde_json::Value>,
    pub last_step: Option<u64>,
    pub pushes: u64,
    pub bytes_received: u64,
    pub rejections: u64,
    pub resident_bytes: u64,
    pub last_push_at_ms: Option<i64>,
    /// The rank's last failover (see [`crate::node::Failover`]).
    pub failover: Option<serde_json::Value>,
    /// The rank's wire figures (see [`crate::wire::stats::WireStats`]).
    pub wire: Option<serde_json::Value>,
}

/// Where a reading of a run's events starts: after an event id, or after
/// a place in the catalog's order of events (`seq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventCursor {
    Id(i64),
    Seq(i64),
}

/// Where an event id falls in the catalog's order of events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventPlace {
    /// The event is stored, at this place.
    Exact(i64),
    /// Not stored: the place of the newest event numbered before it.
    Before(Option<i64>),
}

/// An event row.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct StoredEvent {
    pub id: i64,
    pub run: String,
    pub at_ms: i64,
    pub kind: EventKind,
    pub rank: Option<u32>,
    pub step: Option<u64>,
    #[schema(value_type = Object)]
    pub detail: serde_json::Value,
    /// The event's place in the catalog's order of events (over all nodes,
    /// in commit order); `None` until the catalog has it. On a PostgreSQL
    /// catalog the live stream (SSE) is in this order and its `id:` is this
    /// place, so `Last-Event-ID` resumes exactly.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<i64>,
    /// Emitted by another node of the service and relayed here from the
    /// catalog (never stored again, nor evaluated by this node's alerts).
    #[serde(skip)]
    pub relayed: bool,
    /// Never stored (progress, metrics): live only, and not a place a
    /// stream resumes from.
    #[serde(skip)]
    pub transient: bool,
}

tokio::task_local! {
    /// Set while a push is answered (see [`on_push_path`]).
    static ON_PUSH: ();
}

/// Catalog queries made while answering pushes, and elsewhere.
static QUERIES_ON_PUSH: AtomicU64 = AtomicU64::new(0);
static QUERIES_ELSEWHERE: AtomicU64 = AtomicU64::new(0);

/// Runs `f`, the answer to a push: catalog queries it makes (none, by
/// design: a push's rank row and events go through the batched writer) are
/// counted apart, as `polyak_catalog_queries_total{path="push"}`.
pub async fn on_push_path<F: std::future::Future>(f: F) -> F::Output {
    ON_PUSH.scope((), f).await
}

fn count_query() {
    let counter = if ON_PUSH.try_with(|_| ()).is_ok() {
        &QUERIES_ON_PUSH
    } else {
        &QUERIES_ELSEWHERE
    };
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Catalog queries (and transactions) this process made: while answering
/// pushes, and elsewhere (the batched writer, services, other requests).
pub fn query_counts() -> (u64, u64) {
    (
        QUERIES_ON_PUSH.load(Ordering::Relaxed),
        QUERIES_ELSEWHERE.load(Ordering::Relaxed),
    )
}

#[derive(Clone)]
pub struct Store {
    pool: AnyPool,
    kind: CatalogKind,
}

impl Store {
    /// Opens (creating) the SQLite catalog `data_dir/polyak.db` and applies
    /// the migrations: the embedded default.
    pub async fn open(data_dir: &Path) -> Result<Self, StoreError> {
        Store::connect(&Store::default_url(data_dir)).await
    }

    /// The default catalog URL: SQLite under the data dir.
    pub fn default_url(data_dir: &Path) -> String {
        format!("sqlite://{}", data_dir.join("polyak.db").display())
    }

    /// Opens the catalog at `url` (`sqlite://PATH` or `postgres://...`),
    /// creating a SQLite file (and its directory) when missing, and applies
    /// the migrations of its dialect.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Store::connect_with(url, DEFAULT_ACQUIRE_TIMEOUT).await
    }

    /// [`Store::connect`], waiting at most `acquire` for a PostgreSQL
    /// connection: a query while the catalog is away fails as unavailable
    /// after that (`--catalog-timeout-secs`), so requests answer 503 at
    /// once instead of hanging. (SQLite is a file: it is never away.)
    pub async fn connect_with(url: &str, acquire: Duration) -> Result<Self, StoreError> {
        sqlx::any::install_default_drivers();
        let (kind, pool) = if let Some(path) = url.strip_prefix("sqlite://") {
            let path = path.split('?').next().unwrap_or(path);
            if let Some(dir) = Path::new(path).parent() {
                if !dir.as_os_str().is_empty() {
                    std::fs::create_dir_all(dir)?;
                }
            }
            let pool = AnyPoolOptions::new()
                .max_connections(4)
                // A connection that lived through a full disk or an I/O
                // error is replaced (see `sqlite_trouble`).
                .before_acquire(|_, meta| {
                    Box::pin(async move { Ok(!sqlite_trouble::outlived_by(meta.age)) })
                })
                .after_connect(|conn, _| {
                    Box::pin(async move {
                        // WAL with NORMAL sync: a commit survives a process
                        // crash; readers never wait on the writer.
                        conn.execute(
                            "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
                             PRAGMA busy_timeout = 10000; PRAGMA foreign_keys = ON;",
                        )
                        .await?;
                        Ok(())
                    })
                })
                .connect(&format!("sqlite://{path}?mode=rwc"))
                .await?;
            (CatalogKind::Sqlite, pool)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = AnyPoolOptions::new()
                .max_connections(16)
                .acquire_timeout(acquire)
                .connect(url)
                .await?;
            (CatalogKind::Postgres, pool)
        } else {
            return Err(StoreError::Url(redact_url(url)));
        };
        match kind {
            CatalogKind::Sqlite => sqlx::migrate!("./migrations/sqlite").run(&pool).await?,
            CatalogKind::Postgres => sqlx::migrate!("./migrations/postgres").run(&pool).await?,
        }
        Ok(Store { pool, kind })
    }

    pub fn kind(&self) -> CatalogKind {
        self.kind
    }

    /// `sql` in this catalog's dialect: `?` placeholders become `$1, $2, ...`
    /// on PostgreSQL (none of the queries has a `?` inside a literal).
    pub fn sql<'a>(&self, sql: &'a str) -> Cow<'a, str> {
        match self.kind {
            CatalogKind::Sqlite => Cow::Borrowed(sql),
            CatalogKind::Postgres => Cow::Owned(numbered_placeholders(sql)),
        }
    }

    /// The connection pool; every query goes through here (and is counted:
    /// see [`query_counts`]).
    pub fn pool(&self) -> &AnyPool {
        count_query();
        &self.pool
    }

    /// Writes work again after failing (a full disk, an outage): SQLite's
    /// WAL, which could not be checkpointed meanwhile, is checkpointed and
    /// truncated so it does not keep the space it grew to.
    pub async fn recovered(&self) {
        if self.kind == CatalogKind::Sqlite {
            if let Err(e) = sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
                .execute(self.pool())
                .await
            {
                tracing::warn!(error = %e, "checkpointing the catalog's WAL failed");
            }
        }
    }

    /// Whether the catalog's disk is full: after a statement PostgreSQL
    /// refused for lack of space, a probe asks whether there is room again
    /// (`Some(reason)`: there is not). The probe is a sort of 50,000
    /// numbers in 64 kB of memory, which spills about a megabyte to
    /// temporary files on the disk of the default tablespace and rolls
    /// back: no table and no WAL is written, so it cannot make PostgreSQL
    /// PANIC, and once it goes through the refusal is forgotten. `None`
    /// without a refusal (and always on SQLite).
    pub async fn disk_full(&self) -> Option<String> {
        let mark = catalog_space::refused()?;
        if self.kind != CatalogKind::Postgres {
            catalog_space::room_after(mark);
            return None;
        }
        match self.spill_probe().await {
            Ok(()) => {
                tracing::info!("the catalog's disk has room again");
                catalog_space::room_after(mark);
                None
            }
            Err(e) if e.is_disk_full() => Some(format!("its disk is full: {e}")),
            // Another failure says nothing of the disk: the next ping tells.
            Err(e) => {
                tracing::debug!(error = %e, "the catalog's disk probe failed");
                None
            }
        }
    }

    async fn spill_probe(&self) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await?;
        tx.execute("SET LOCAL work_mem = '64kB'").await?;
        tx.execute(
            "SELECT count(*) FROM \
             (SELECT g FROM generate_series(1, 50000) AS g ORDER BY g DESC) AS spilled",
        )
        .await?;
        tx.rollback().await?;
        Ok(())
    }

    /// A trivial query: the catalog answers.
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query(&self.sql("SELECT 1"))
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Records a new run, its ranks, and where each rank is placed
    /// (`owners[rank]`, epoch 1), in one transaction.
    pub async fn insert_run(
        &self,
        config: &RunConfig,
        created_at_ms: i64,
        token_hashes: Option<(String, String)>,
        owners: &[String],
    ) -> Result<(), StoreError> {
        let (write, read) = token_hashes.unzip();
        let mut tx = self.pool().begin().await?;
        let result = sqlx::query(&self.sql("INSERT INTO runs (name, config, created_at_ms, write_token_hash, read_token_hash) VALUES (?, ?, ?, ?, ?)"))
        .bind(&config.name)
        .bind(serde_json::to_string(config)?)
        .bind(created_at_ms)
        .bind(write)
        .bind(read)
        .execute(&mut *tx)
        .await;
        match result {
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                return Err(StoreError::RunExists(config.name.clone()))
            }
            other => {
                other?;
            }
        }
        for rank in 0..config.world_size {
            sqlx::query(&self.sql("INSERT INTO ranks (run, rank) VALUES (?, ?)"))
                .bind(&config.name)
                .bind(rank as i64)
                .execute(&mut *tx)
                .await?;
        }
        for (rank, node) in owners.iter().enumerate() {
            sqlx::query(
                &self.sql("INSERT INTO placements (run, rank, node_id, epoch) VALUES (?, ?, ?, 1)"),
            )
            .bind(&config.name)
            .bind(rank as i64)
            .bind(node)
            .execute(&mut *tx)
            .await?;
            sqlx::query(&self.sql(
                "INSERT INTO placement_log (run, rank, epoch, node_id, at_ms) VALUES (?, ?, 1, ?, ?)",
            ))
            .bind(&config.name)
            .bind(rank as i64)
            .bind(node)
            .bind(created_at_ms)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    pub async fn list_runs(&self) -> Result<Vec<StoredRun>, StoreError> {
        let rows = sqlx::query(&self.sql(
            "SELECT config, created_at_ms, write_token_hash, read_token_hash, finished_at_ms, \
             finished_step, finished_snapshot FROM runs ORDER BY created_at_ms, name",
        ))
        .fetch_all(self.pool())
        .await?;
        rows.into_iter()
            .map(|row| {
                Ok(StoredRun {
                    config: serde_json::from_str(row.get::<&str, _>("config"))?,
                    created_at_ms: row.get("created_at_ms"),
                    write_token_hash: row.get("write_token_hash"),
                    read_token_hash: row.get("read_token_hash"),
                    finished: finish_of(&row),
                })
            })
            .collect()
    }

    /// Marks a run finished (kept across restarts).
    pub async fn finish_run(&self, name: &str, finish: &RunFinish) -> Result<(), StoreError> {
        sqlx::query(&self.sql("UPDATE runs SET finished_at_ms = ?, finished_step = ?, finished_snapshot = ? WHERE name = ?"))
        .bind(finish.at_ms)
        .bind(finish.step.map(|s| s as i64))
        .bind(finish.snapshot.as_deref())
        .bind(name)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// How the catalog says the run finished, if it did.
    pub async fn run_finish(&self, name: &str) -> Result<Option<RunFinish>, StoreError> {
        let row = sqlx::query(&self.sql(
            "SELECT finished_at_ms, finished_step, finished_snapshot FROM runs WHERE name = ?",
        ))
        .bind(name)
        .fetch_optional(self.pool())
        .await?;
        Ok(row.as_ref().and_then(finish_of))
    }

    /// Holds the run's finish lock across the nodes of a service until the
    /// returned guard is released: on PostgreSQL a session advisory lock
    /// on a connection taken out of the pool (so a guard dropped mid-way,
    /// its request cancelled, closes that session and the lock goes with
    /// it, never left behind on a pooled connection). `None` on SQLite,
    /// where one node is the whole service.
    pub async fn lock_finish(&self, name: &str) -> Result<Option<FinishLock>, StoreError> {
        if self.kind != CatalogKind::Postgres {
            return Ok(None);
        }
        let mut conn = self.pool().acquire().await?.detach();
        sqlx::query("SELECT pg_advisory_lock(hashtext($1))::text")
            .bind(format!("polyak-finish/{name}"))
            .execute(&mut conn)
            .await?;
        Ok(Some(FinishLock { conn }))
    }

    /// Deletes a run and (by cascade) its ranks and events.
    pub async fn delete_run(&self, name: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(&self.sql("DELETE FROM runs WHERE name = ?"))
            .bind(name)
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Records a rank's failover (or restart), for every node to show.
    pub async fn set_rank_failover(
        &self,
        run: &str,
        rank: u32,
        failover: &crate::node::Failover,
    ) -> Result<(), StoreError> {
        let json = serde_json::to_string(failover)?;
        sqlx::query(&self.sql("UPDATE ranks SET failover = ? WHERE run = ? AND rank = ?"))
            .bind(json)
            .bind(run)
            .bind(rank as i64)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// [`Store::set_rank_failover`], a failure logged: the record is also
    /// in the node's memory and its event, and the next one writes it.
    pub async fn note_rank_failover(&self, run: &str, rank: u32, failover: &crate::node::Failover) {
        if let Err(e) = self.set_rank_failover(run, rank, failover).await {
            tracing::warn!(run = %run, rank, error = %e, "recording a rank's failover failed");
        }
    }

    pub async fn list_ranks(&self, run: &str) -> Result<Vec<StoredRank>, StoreError> {
        let rows = sqlx::query(&self.sql("SELECT rank, layout, last_step, pushes, bytes_received, rejections, resident_bytes, last_push_at_ms, failover, wire \
             FROM ranks WHERE run = ? ORDER BY rank"))
        .bind(run)
        .fetch_all(self.pool())
        .await?;
        rows.into_iter()
            .map(|row| {
                let layout: Option<String> = row.get("layout");
                Ok(StoredRank {
                    rank: row.get::<i64, _>("rank") as u32,
                    layout: layout.map(|l| serde_json::from_str(&l)).transpose()?,
                    last_step: row.get::<Option<i64>, _>("last_step").map(|s| s as u64),
                    pushes: row.get::<i64, _>("pushes") as u64,
                    bytes_received: row.get::<i64, _>("bytes_received") as u64,
                    rejections: row.get::<i64, _>("rejections") as u64,
                    resident_bytes: row.get::<i64, _>("resident_bytes") as u64,
                    last_push_at_ms: row.get("last_push_at_ms"),
                    failover: row
                        .get::<Option<String>, _>("failover")
                        .map(|f| serde_json::from_str(&f))
                        .transpose()?,
                    wire: row
                        .get::<Option<String>, _>("wire")
                        .map(|w| serde_json::from_str(&w))
                        .transpose()?,
                })
            })
            .collect()
    }

    /// Events of a run after `after` (by id, or by place in the catalog's
    /// order) and with a kind in `kinds` (all when `None`), oldest first in
    /// the cursor's order: the first `limit`, or with `newest` the last
    /// `limit` of them.
    pub async fn events(
        &self,
        run: &str,
        after: EventCursor,
        kinds: Option<&[String]>,
        limit: i64,
        newest: bool,
    ) -> Result<Vec<StoredEvent>, StoreError> {
        let (column, after) = match after {
            EventCursor::Id(id) => ("id", id),
            EventCursor::Seq(seq) => ("seq", seq),
        };
        let mut sql = format!(
            "SELECT id, run, at_ms, kind, rank, step, detail, seq FROM events \
             WHERE run = ? AND {column} > ?"
        );
        if let Some(kinds) = kinds {
            sql.push_str(" AND kind IN (");
            sql.push_str(&vec!["?"; kinds.len()].join(", "));
            sql.push(')');
        }
        sql.push_str(&if newest {
            format!(" ORDER BY {column} DESC LIMIT ?")
        } else {
            format!(" ORDER BY {column} LIMIT ?")
        });
        let sql = self.sql(&sql).into_owned();
        let mut q = sqlx::query(&sql).bind(run).bind(after);
        for k in kinds.unwrap_or(&[]) {
            q = q.bind(k);
        }
        let rows = q.bind(limit).fetch_all(self.pool()).await?;
        let mut out = rows
            .into_iter()
            .map(|row| event_of(&row, false))
            .collect::<Result<Vec<_>, StoreError>>()?;
        if newest {
            out.reverse();
        }
        Ok(out)
    }

    /// The place in the catalog's order of events of event `id` of `run`;
    /// for an id the catalog does not hold (never stored, or past
    /// retention), the place of the newest of the run's events numbered
    /// before it (`None`: none is).
    pub async fn event_place(&self, run: &str, id: i64) -> Result<EventPlace, StoreError> {
        let exact: Option<Option<i64>> =
            sqlx::query_scalar(&self.sql("SELECT seq FROM events WHERE run = ? AND id = ?"))
                .bind(run)
                .bind(id)
                .fetch_optional(self.pool())
                .await?;
        if let Some(seq) = exact {
            return Ok(EventPlace::Exact(seq.unwrap_or(i64::MIN)));
        }
        let before: Option<i64> =
            sqlx::query_scalar(&self.sql("SELECT MAX(seq) FROM events WHERE run = ? AND id <= ?"))
                .bind(run)
                .bind(id)
                .fetch_one(self.pool())
                .await?;
        Ok(EventPlace::Before(before))
    }

    /// The last place in the catalog's order of events (0: none yet).
    pub async fn last_event_seq(&self) -> Result<i64, StoreError> {
        let next: i64 = sqlx::query_scalar("SELECT next_seq FROM event_seq")
            .fetch_one(self.pool())
            .await?;
        Ok(next - 1)
    }

    /// Events stored after place `seq`, in the catalog's order, at most
    /// `limit`, each marked `relayed` unless node `node` stored it; with the
    /// last place read.
    pub async fn events_after_seq(
        &self,
        seq: i64,
        node: &str,
        limit: i64,
    ) -> Result<(Vec<StoredEvent>, i64), StoreError> {
        let rows = sqlx::query(&self.sql(
            "SELECT id, run, at_ms, kind, rank, step, detail, seq, node FROM events \
             WHERE seq > ? ORDER BY seq LIMIT ?",
        ))
        .bind(seq)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        let mut last = seq;
        let mut out = Vec::new();
        for row in rows {
            last = last.max(row.get::<i64, _>("seq"));
            let mine = row.get::<Option<String>, _>("node").as_deref() == Some(node);
            out.push(event_of(&row, !mine)?);
        }
        Ok((out, last))
    }

    /// The highest event id stored (event ids continue from it).
    /// Reserves `count` event ids for this node: the range `start..end`,
    /// which no other node sharing the catalog is given.
    pub async fn reserve_event_ids(&self, count: i64) -> Result<(i64, i64), StoreError> {
        let end: i64 = sqlx::query_scalar(
            &self.sql("UPDATE event_ids SET next_id = next_id + ? RETURNING next_id"),
        )
        .bind(count)
        .fetch_one(self.pool())
        .await?;
        Ok((end - count, end))
    }
}

/// One point of a scalar series.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct MetricPoint {
    pub name: String,
    pub step: u64,
    /// `None`: a run-level point.
    pub rank: Option<u32>,
    pub value: f64,
    pub at_ms: i64,
}

impl Store {
    pub async fn insert_metrics(
        &self,
        run: &str,
        points: &[MetricPoint],
    ) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await?;
        for p in points {
            sqlx::query(&self.sql(
                "INSERT INTO metrics (run, name, step, rank, value, at_ms) \
                 SELECT ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM runs WHERE name = ?)",
            ))
            .bind(run)
            .bind(&p.name)
            .bind(p.step as i64)
            .bind(p.rank.map(|r| r as i64))
            .bind(p.value)
            .bind(p.at_ms)
            .bind(run)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Points of `run`, ordered by name, rank, step. `names` filters
    /// series; `rank`: `Some(None)` only run-level points, `Some(Some(r))`
    /// only rank r's. `limit` applies per series (the newest points).
    pub async fn metrics(
        &self,
        run: &str,
        names: Option<&[String]>,
        since_step: Option<u64>,
        rank: Option<Option<u32>>,
        limit: i64,
    ) -> Result<Vec<MetricPoint>, StoreError> {
        let mut sql = String::from(
            "SELECT name, step, rank, value, at_ms FROM (SELECT name, step, rank, value, at_ms, id, \
             ROW_NUMBER() OVER (PARTITION BY name, rank ORDER BY step DESC, id DESC) AS n \
             FROM metrics WHERE run = ? AND step >= ?",
        );
        if let Some(names) = names {
            sql.push_str(" AND name IN (");
            sql.push_str(&vec!["?"; names.len()].join(", "));
            sql.push(')');
        }
        match rank {
            Some(None) => sql.push_str(" AND rank IS NULL"),
            Some(Some(_)) => sql.push_str(" AND rank = ?"),
            None => {}
        }
        sql.push_str(") AS numbered WHERE n <= ? ORDER BY name, rank NULLS FIRST, step, id");
        let sql = self.sql(&sql).into_owned();
        let mut q = sqlx::query(&sql)
            .bind(run)
            .bind(since_step.unwrap_or(0) as i64);
        if let Some(names) = names {
            for n in names {
                q = q.bind(n);
            }
        }
        if let Some(Some(r)) = rank {
            q = q.bind(r as i64);
        }
        let rows = q.bind(limit).fetch_all(self.pool()).await?;
        Ok(rows
            .into_iter()
            .map(|row| MetricPoint {
                name: row.get("name"),
                step: row.get::<i64, _>("step") as u64,
                rank: row.get::<Option<i64>, _>("rank").map(|r| r as u32),
                value: row.get("value"),
                at_ms: row.get("at_ms"),
            })
            .collect())
    }

    /// The series names of a run.
    pub async fn metric_names(&self, run: &str) -> Result<Vec<String>, StoreError> {
        let rows =
            sqlx::query(&self.sql("SELECT DISTINCT name FROM metrics WHERE run = ? ORDER BY name"))
                .bind(run)
                .fetch_all(self.pool())
                .await?;
        Ok(rows.into_iter().map(|r| r.get("name")).collect())
    }

    /// Keeps the newest `retained` events of each run.
    pub async fn prune_events(&self, retained: u64) -> Result<u64, StoreError> {
        let done = sqlx::query(&self.sql(
            "DELETE FROM events WHERE id IN (SELECT id FROM (SELECT id, ROW_NUMBER() OVER \
             (PARTITION BY run ORDER BY id DESC) AS n FROM events) AS numbered WHERE n > ?)",
        ))
        .bind(retained as i64)
        .execute(self.pool())
        .await?;
        Ok(done.rows_affected())
    }

    /// Keeps the newest `retained` points of every series.
    pub async fn prune_metrics(&self, retained: u64) -> Result<u64, StoreError> {
        let done = sqlx::query(&self.sql("DELETE FROM metrics WHERE id IN (SELECT id FROM (SELECT id, ROW_NUMBER() OVER \
             (PARTITION BY run, name, rank ORDER BY step DESC, id DESC) AS n FROM metrics) AS numbered WHERE n > ?)"))
        .bind(retained as i64)
        .execute(self.pool())
        .await?;
        Ok(done.rows_affected())
    }
}

/// `?` placeholders numbered `$1, $2, ...` (PostgreSQL's spelling).
fn numbered_placeholders(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut n = 0;
    for c in sql.chars() {
        if c == '?' {
            n += 1;
            out.push('$');
            out.push_str(&n.to_string());
        } else {
            out.push(c);
        }
    }
    out
}

/// A database URL without its password, for messages.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}://{}:***@{}", &url[..scheme], user, &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

/// An `events` row as an event (`relayed`: read for another node's).
fn event_of(row: &sqlx::any::AnyRow, relayed: bool) -> Result<StoredEvent, StoreError> {
    Ok(StoredEvent {
        id: row.get("id"),
        run: row.get("run"),
        at_ms: row.get("at_ms"),
        kind: row.get::<&str, _>("kind").parse()?,
        rank: row.get::<Option<i64>, _>("rank").map(|r| r as u32),
        step: row.get::<Option<i64>, _>("step").map(|s| s as u64),
        detail: serde_json::from_str(row.get::<&str, _>("detail"))?,
        seq: row.get::<Option<i64>, _>("seq"),
        relayed,
        transient: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_catalog_that_cannot_take_queries_now_is_told_from_a_wrong_query() {
        // PostgreSQL: restarting, shutting down, out of connections, a
        // connection exception; not a unique violation or a syntax error.
        for code in ["57P01", "57P02", "57P03", "53300", "08006", "08001"] {
            assert!(unavailable_code(code), "{code}");
        }
        for code in ["23505", "42601", "22P02", "40001"] {
            assert!(!unavailable_code(code), "{code}");
        }
        // SQLite: BUSY, LOCKED and their extended codes; not a constraint
        // (19, 2067) or an I/O error (10).
        for code in ["5", "6", "261", "517", "262"] {
            assert!(unavailable_code(code), "{code}");
        }
        for code in ["19", "2067", "10", "1"] {
            assert!(!unavailable_code(code), "{code}");
        }
    }

    #[test]
    fn a_full_disk_is_told_from_other_refusals() {
        // PostgreSQL's disk_full, not out of memory, out of connections or
        // a SQLite code.
        assert!(catalog_space::is_disk_full("53100"));
        for code in ["53200", "53300", "57P03", "13", "5"] {
            assert!(!catalog_space::is_disk_full(code), "{code}");
        }
    }

    #[test]
    fn placeholders_are_numbered_in_order() {
        assert_eq!(
            numbered_placeholders("UPDATE t SET a = ?, b = COALESCE(?, b) WHERE c IN (?, ?)"),
            "UPDATE t SET a = $1, b = COALESCE($2, b) WHERE c IN ($3, $4)"
        );
        assert_eq!(numbered_placeholders("SELECT 1"), "SELECT 1");
    }

    #[test]
    fn passwords_stay_out_of_messages() {
        assert_eq!(
            redact_url("postgres://polyak:s3cret@db:5432/polyak"),
            "postgres://polyak:***@db:5432/polyak"
        );
        assert_eq!(
            redact_url("sqlite://data/polyak.db"),
            "sqlite://data/polyak.db"
        );
    }
}
