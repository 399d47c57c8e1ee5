//! Batched catalog writes for per-push bookkeeping.
//!
//! Rank counters change on every push and events arrive at push rate; a
//! transaction per push would make SQLite the bottleneck. The writer task
//! collects updates for a short interval, keeps only the newest row per
//! rank, and writes the batch in one transaction.
//!
//! A batch the catalog refuses (a database briefly unreachable, locked, or
//! failing over) is kept and written again, with later updates merged into
//! it, after a backoff that doubles up to [`MAX_BACKOFF`]: the events a node
//! emitted while it could not reach the catalog are stored once it can, in
//! their order, each once (an event whose commit was only not confirmed is
//! not stored twice). At most [`MAX_HELD_EVENTS`] events are held; past that
//! the oldest are dropped and counted, so a catalog that stays away does not
//! exhaust memory. A batch a catalog that answers refuses again and again
//! (something in it cannot be stored, as opposed to a catalog restarting or
//! busy: [`StoreError::is_unavailable`]) is written update by update, and
//! only what is refused on its own is given up. Rank rows are written only
//! by the rank's holder in the catalog's placement, so a batch held across
//! a failover does not turn a rank's row back. Closing the channel writes what is left (retried a few
//! times) and ends the task.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::{Store, StoreError, StoredEvent, StoredRank};

/// How long the writer gathers updates into one transaction.
const GATHER: Duration = Duration::from_millis(200);
/// The longest wait before a failed batch is written again.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Events held for the catalog at most (the oldest are dropped past it).
pub const MAX_HELD_EVENTS: usize = 100_000;
/// Refusals in a row of one batch by a catalog that answers (not an
/// unreachable one) after which its updates are written one by one.
const POISONED_AFTER: u32 = 5;
/// The longest one flush may take before it counts as failed (a catalog
/// whose link went silent rather than refusing).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts at the held batch once the channel is closed (shutdown).
const FINAL_ATTEMPTS: u32 = 3;

/// One change for the catalog.
#[derive(Debug, Clone)]
pub enum CatalogUpdate {
    /// The newest state of a rank's row (the layout only when it changed).
    Rank {
        run: String,
        row: StoredRank,
        layout_json: Option<String>,
    },
    Event(StoredEvent),
}

/// Sender side; cheap to clone.
#[derive(Clone)]
pub struct CatalogWriter {
    tx: mpsc::UnboundedSender<CatalogUpdate>,
}

impl CatalogWriter {
    /// Starts the writer task; `node` is recorded with the events.
    pub fn spawn(store: Store, node: String) -> (Self, JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(write_loop(store, node, rx));
        (CatalogWriter { tx }, task)
    }

    pub fn send(&self, update: CatalogUpdate) {
        // The writer only stops at shutdown, after every sender is gone.
        let _ = self.tx.send(update);
    }
}

/// What the writer holds for the catalog: the newest row of each rank and
/// the events in emission order.
#[derive(Default)]
struct Batch {
    ranks: HashMap<(String, u32), (StoredRank, Option<String>)>,
    events: VecDeque<StoredEvent>,
}

impl Batch {
    fn add(&mut self, update: CatalogUpdate) {
        match update {
            CatalogUpdate::Rank {
                run,
                row,
                layout_json,
            } => {
                let key = (run, row.rank);
                let layout = match self.ranks.remove(&key) {
                    Some((_, earlier)) => layout_json.or(earlier),
                    None => layout_json,
                };
                self.ranks.insert(key, (row, layout));
            }
            CatalogUpdate::Event(e) => {
                if self.events.len() == MAX_HELD_EVENTS {
                    self.events.pop_front();
                    STATS.dropped.fetch_add(1, Ordering::Relaxed);
                }
                self.events.push_back(e);
            }
        }
    }

    /// Takes what arrives until `deadline`; `false` once the channel is
    /// closed (shutdown) and empty.
    async fn gather(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<CatalogUpdate>,
        deadline: tokio::time::Instant,
    ) -> bool {
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return true,
                update = rx.recv() => match update {
                    Some(update) => self.add(update),
                    None => return false,
                },
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.ranks.is_empty() && self.events.is_empty()
    }

    fn len(&self) -> usize {
        self.ranks.len() + self.events.len()
    }
}

async fn write_loop(store: Store, node: String, mut rx: mpsc::UnboundedReceiver<CatalogUpdate>) {
    let mut batch = Batch::default();
    let mut backoff = GATHER;
    let mut failing_since: Option<std::time::Instant> = None;
    let mut in_a_row = 0;
    let mut open = true;
    while open {
        if batch.is_empty() {
            let Some(first) = rx.recv().await else { break };
            batch.add(first);
        }
        // What arrives in the next moment (or while backing off after a
        // failure) goes into the same transaction.
        open = batch
            .gather(&mut rx, tokio::time::Instant::now() + backoff)
            .await;
        STATS.held.store(batch.len() as u64, Ordering::Relaxed);
        match flush(&store, &node, &batch).await {
            Ok(()) => {
                if let Some(since) = failing_since.take() {
                    tracing::warn!(
                        after_secs = since.elapsed().as_secs_f64(),
                        events = batch.events.len(),
                        "catalog writes work again; the held updates are stored"
                    );
                    store.recovered().await;
                }
                batch = Batch::default();
                backoff = GATHER;
                in_a_row = 0;
            }
            Err(e) => {
                STATS.failures.fetch_add(1, Ordering::Relaxed);
                failing_since.get_or_insert_with(std::time::Instant::now);
                in_a_row += 1;
                if in_a_row >= POISONED_AFTER && !e.is_unavailable() {
                    // The catalog answers but refuses this batch again and
                    // again: something in it cannot be stored. Each update
                    // goes on its own; only those refused are given up.
                    tracing::error!(error = %e, held = batch.len(),
                        "the catalog keeps refusing a batch; writing its updates one by one");
                    batch = salvage(&store, &node, std::mem::take(&mut batch)).await;
                    in_a_row = 0;
                    if batch.is_empty() {
                        backoff = GATHER;
                    }
                } else {
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    tracing::error!(error = %e, held = batch.len(), retry_in_secs = backoff.as_secs_f64(),
                        "catalog write failed; the updates are kept and written again");
                }
            }
        }
        STATS.held.store(batch.len() as u64, Ordering::Relaxed);
    }
    // Shutdown: what is left, tried a few times.
    for attempt in 1..=FINAL_ATTEMPTS {
        if batch.is_empty() {
            break;
        }
        match flush(&store, &node, &batch).await {
            Ok(()) => batch = Batch::default(),
            Err(e) => {
                STATS.failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, attempt, held = batch.len(), "catalog write failed at shutdown");
                tokio::time::sleep(GATHER * attempt).await;
            }
        }
    }
    if !batch.is_empty() {
        STATS
            .dropped
            .fetch_add(batch.events.len() as u64, Ordering::Relaxed);
        tracing::error!(
            events = batch.events.len(),
            ranks = batch.ranks.len(),
            "the catalog stayed unreachable; updates not stored at shutdown"
        );
    }
    STATS.held.store(0, Ordering::Relaxed);
}

/// Writes a batch the catalog keeps refusing update by update, giving up
/// (and counting) only those it refuses on their own. A refusal that says
/// the catalog went away meanwhile stops it: what is not written yet is
/// returned, to be written again.
async fn salvage(store: &Store, node: &str, batch: Batch) -> Batch {
    // One update each: the rank rows, then the events in their order.
    let mut pieces: VecDeque<Batch> = VecDeque::new();
    for (key, value) in batch.ranks {
        let mut one = Batch::default();
        one.ranks.insert(key, value);
        pieces.push_back(one);
    }
    for event in batch.events {
        let mut one = Batch::default();
        one.events.push_back(event);
        pieces.push_back(one);
    }
    let (mut lost_rows, mut lost_events) = (0, 0);
    while let Some(one) = pieces.pop_front() {
        match flush(store, node, &one).await {
            Ok(()) => {}
            Err(e) if e.is_unavailable() => {
                pieces.push_front(one);
                break;
            }
            Err(e) => {
                tracing::error!(error = %e, "an update the catalog refuses was given up");
                lost_rows += one.ranks.len();
                lost_events += one.events.len();
            }
        }
    }
    STATS
        .dropped
        .fetch_add(lost_events as u64, Ordering::Relaxed);
    if lost_rows + lost_events > 0 {
        tracing::error!(
            rank_rows = lost_rows,
            events = lost_events,
            "updates the catalog refused were given up"
        );
    }
    let mut rest = Batch::default();
    for one in pieces {
        rest.ranks.extend(one.ranks);
        rest.events.extend(one.events);
    }
    rest
}

/// The PostgreSQL channel a flush that stored events notifies (the
/// payload: the last `seq` it stored).
pub const EVENTS_CHANNEL: &str = "polyak_events";

/// What the writer has done in this process.
struct Stats {
    /// Batches flushed (one transaction each).
    flushes: AtomicU64,
    /// Flushes the catalog refused (their updates were kept).
    failures: AtomicU64,
    /// Events given up: past [`MAX_HELD_EVENTS`], or still held when the
    /// writer stopped.
    dropped: AtomicU64,
    /// Updates held now (a batch being written, or waiting to be again).
    held: AtomicU64,
}

static STATS: Stats = Stats {
    flushes: AtomicU64::new(0),
    failures: AtomicU64::new(0),
    dropped: AtomicU64::new(0),
    held: AtomicU64::new(0),
};

/// The writer's counts in this process (for the metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterCounts {
    pub flushes: u64,
    pub failures: u64,
    pub dropped: u64,
    pub held: u64,
}

/// The writer's counts in this process.
pub fn counts() -> WriterCounts {
    WriterCounts {
        flushes: STATS.flushes.load(Ordering::Relaxed),
        failures: STATS.failures.load(Ordering::Relaxed),
        dropped: STATS.dropped.load(Ordering::Relaxed),
        held: STATS.held.load(Ordering::Relaxed),
    }
}

/// Writes `batch` in one transaction. Safe to repeat after a failure whose
/// commit may have landed: a stored event is not stored again.
async fn flush(store: &Store, node: &str, batch: &Batch) -> Result<(), StoreError> {
    STATS.flushes.fetch_add(1, Ordering::Relaxed);
    match tokio::time::timeout(FLUSH_TIMEOUT, write(store, node, batch)).await {
        Ok(done) => done,
        Err(_) => Err(StoreError::Sql(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("a write took over {}s", FLUSH_TIMEOUT.as_secs()),
        )))),
    }
}

async fn write(store: &Store, node: &str, batch: &Batch) -> Result<(), StoreError> {
    let mut tx = store.pool().begin().await?;
    for ((run, rank), (row, layout)) in &batch.ranks {
        // Only the rank's holder writes its row: a batch held while this
        // node was cut off must not turn back the row of a rank another
        // node took over meanwhile.
        sqlx::query(&store.sql("UPDATE ranks SET last_step = ?, pushes = ?, bytes_received = ?, rejections = ?, \
             resident_bytes = ?, last_push_at_ms = ?, layout = COALESCE(?, layout), wire = COALESCE(?, wire) WHERE run = ? AND rank = ? \
             AND NOT EXISTS (SELECT 1 FROM placements p WHERE p.run = ? AND p.rank = ? AND p.node_id <> ?)"))
        .bind(row.last_step.map(|s| s as i64))
        .bind(row.pushes as i64)
        .bind(row.bytes_received as i64)
        .bind(row.rejections as i64)
        .bind(row.resident_bytes as i64)
        .bind(row.last_push_at_ms)
        .bind(layout)
        .bind(row.wire.as_ref().map(|w| w.to_string()))
        .bind(run)
        .bind(*rank as i64)
        .bind(run)
        .bind(*rank as i64)
        .bind(node)
        .execute(&mut *tx)
        .await?;
    }
    // The events' places in the catalog's order: the counter's row stays
    // locked until this transaction commits, so another node's flush takes
    // the next numbers only after this one is visible.
    let events = &batch.events;
    let mut seq = 0;
    if !events.is_empty() {
        let n = events.len() as i64;
        let end: i64 = sqlx::query_scalar(
            &store.sql("UPDATE event_seq SET next_seq = next_seq + ? RETURNING next_seq"),
        )
        .bind(n)
        .fetch_one(&mut *tx)
        .await?;
        seq = end - n;
    }
    let stored_to = seq + events.len() as i64 - 1;
    for e in events {
        // A run deleted meanwhile takes its events with it; an event a
        // commit that was not confirmed stored already stays as it is.
        sqlx::query(&store.sql(
            "INSERT INTO events (id, run, at_ms, kind, rank, step, detail, seq, node) \
             SELECT ?, ?, ?, ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM runs WHERE name = ?) \
             ON CONFLICT (id) DO NOTHING",
        ))
        .bind(e.id)
        .bind(&e.run)
        .bind(e.at_ms)
        .bind(e.kind.as_str())
        .bind(e.rank.map(|r| r as i64))
        .bind(e.step.map(|s| s as i64))
        .bind(e.detail.to_string())
        .bind(seq)
        .bind(node)
        .bind(&e.run)
        .execute(&mut *tx)
        .await?;
        seq += 1;
    }
    if !events.is_empty() && store.kind() == super::CatalogKind::Postgres {
        // Delivered at commit: the other nodes read the new events.
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(EVENTS_CHANNEL)
            .bind(stored_to.to_string())
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::EventKind;
    use crate::store::placement::tests::store_with_run;
    use crate::store::EventCursor;

    fn event(id: i64) -> CatalogUpdate {
        CatalogUpdate::Event(StoredEvent {
            id,
            run: "r".into(),
            at_ms: 1000 + id,
            kind: EventKind::Push,
            rank: Some(0),
            step: Some(id as u64),
            detail: serde_json::json!({"n": id}),
            seq: None,
            relayed: false,
            transient: false,
        })
    }

    fn row(rank: u32, last_step: u64) -> CatalogUpdate {
        CatalogUpdate::Rank {
            run: "r".into(),
            row: StoredRank {
                rank,
                last_step: Some(last_step),
                pushes: last_step + 1,
                ..StoredRank::default()
            },
            layout_json: None,
        }
    }

    async fn stored(store: &Store) -> Vec<(i64, i64)> {
        let events = store
            .events("r", EventCursor::Id(0), None, 1000, false)
            .await
            .unwrap();
        events.iter().map(|e| (e.id, e.seq.unwrap())).collect()
    }

    async fn until<F: std::future::Future<Output = bool>>(
        what: &str,
        mut check: impl FnMut() -> F,
    ) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !check().await {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Makes the catalog refuse to insert events (those matching `when`,
    /// a trigger's `WHEN` clause; all with ""): a flush holding one fails
    /// as a whole, as against a catalog that is away.
    async fn refuse_events(store: &Store, when: &str) {
        sqlx::query(&format!(
            "CREATE TRIGGER refuse BEFORE INSERT ON events {when} \
             BEGIN SELECT RAISE(ABORT, 'the catalog refuses this event'); END"
        ))
        .execute(store.pool())
        .await
        .unwrap();
    }

    /// The catalog refuses every write for a while (a trigger aborts the
    /// events' inserts, so each flush's transaction fails as a whole): the
    /// writer keeps the updates, merges later ones in, and stores them all,
    /// in emission order and each once, when the catalog takes writes again.
    #[tokio::test]
    async fn updates_the_catalog_refused_are_stored_once_it_takes_them() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_run(dir.path()).await;
        refuse_events(&store, "").await;
        let failures = counts().failures;
        let (writer, task) = CatalogWriter::spawn(store.clone(), "n1".into());
        for id in 1..=3 {
            writer.send(event(id));
        }
        writer.send(row(0, 3));
        until("two refused flushes", || async {
            counts().failures >= failures + 2
        })
        .await;
        assert!(stored(&store).await.is_empty());
        let ranks = store.list_ranks("r").await.unwrap();
        assert_eq!(
            ranks[0].last_step, None,
            "the refused batch changed nothing"
        );
        for id in 4..=5 {
            writer.send(event(id));
        }
        writer.send(row(0, 5));
        sqlx::query("DROP TRIGGER refuse")
            .execute(store.pool())
            .await
            .unwrap();
        until("the held events", || async {
            stored(&store).await.len() == 5
        })
        .await;
        let got = stored(&store).await;
        assert_eq!(
            got.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5]
        );
        assert!(
            got.windows(2).all(|w| w[0].1 < w[1].1),
            "places follow emission: {got:?}"
        );
        let ranks = store.list_ranks("r").await.unwrap();
        assert_eq!((ranks[0].last_step, ranks[0].pushes), (Some(5), 6));

        // A batch whose commit landed but was not confirmed, written again:
        // nothing is stored twice.
        let mut again = Batch::default();
        for id in 1..=5 {
            again.add(event(id));
        }
        flush(&store, "n1", &again).await.unwrap();
        assert_eq!(stored(&store).await, got);
        drop(writer);
        task.await.unwrap();
    }

    /// A batch the catalog refuses for what is in it (an event it cannot
    /// store), not for being away: after a few refusals its updates go one
    /// by one, so only the refused event is given up (and counted) and the
    /// writer goes on.
    #[tokio::test]
    async fn a_batch_refused_for_one_update_loses_that_update_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_run(dir.path()).await;
        refuse_events(&store, "WHEN NEW.id = 3").await;
        let dropped = counts().dropped;
        let (writer, task) = CatalogWriter::spawn(store.clone(), "n1".into());
        for id in 1..=5 {
            writer.send(event(id));
        }
        writer.send(row(0, 5));
        until("the storable events", || async {
            stored(&store).await.len() == 4
        })
        .await;
        let ids: Vec<i64> = stored(&store).await.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [1, 2, 4, 5]);
        assert!(counts().dropped > dropped);
        assert_eq!(store.list_ranks("r").await.unwrap()[0].last_step, Some(5));
        // The writer goes on with what comes next.
        writer.send(event(6));
        until("the next event", || async {
            stored(&store).await.len() == 5
        })
        .await;
        drop(writer);
        task.await.unwrap();
    }

    /// A rank's row is written by its holder only: n1's batch with a row
    /// for rank 1 (placed on n2, say taken over while n1 was cut off)
    /// leaves that row as n2 wrote it.
    #[tokio::test]
    async fn a_rank_row_is_written_by_its_holder_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with_run(dir.path()).await;
        let mut n2 = Batch::default();
        n2.add(row(1, 7));
        flush(&store, "n2", &n2).await.unwrap();
        let mut n1 = Batch::default();
        n1.add(row(0, 4));
        n1.add(row(1, 3));
        flush(&store, "n1", &n1).await.unwrap();
        let steps: Vec<Option<u64>> = store
            .list_ranks("r")
            .await
            .unwrap()
            .iter()
            .map(|r| r.last_step)
            .collect();
        assert_eq!(steps, [Some(4), Some(7), None]);
    }

    /// Past the bound, the oldest held events go (counted), the newest stay.
    #[test]
    fn a_batch_holds_at_most_the_bound_of_events() {
        let dropped = counts().dropped;
        let mut batch = Batch::default();
        for id in 0..(MAX_HELD_EVENTS as i64 + 3) {
            batch.add(event(id));
        }
        assert_eq!(batch.events.len(), MAX_HELD_EVENTS);
        assert_eq!(batch.events.front().unwrap().id, 3);
        assert!(counts().dropped >= dropped + 3);
    }
}
