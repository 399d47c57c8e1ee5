//! Batched catalog writes for per-push bookkeeping.
//!
//! Rank counters change on every push and events arrive at push rate; a
//! transaction per push would make SQLite the bottleneck. The writer task
//! collects updates for a short interval, keeps only the newest row per
//! rank, and writes the batch in one transaction. Closing the channel
//! flushes what is left and ends the task.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::{Store, StoreError, StoredEvent, StoredRank};

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

async fn write_loop(store: Store, node: String, mut rx: mpsc::UnboundedReceiver<CatalogUpdate>) {
    loop {
        let Some(first) = rx.recv().await else { break };
        let mut batch = vec![first];
        // Gather what arrives in the next moment into the same transaction.
        tokio::time::sleep(Duration::from_millis(200)).await;
        while let Ok(update) = rx.try_recv() {
            batch.push(update);
        }
        if let Err(e) = flush(&store, &node, batch).await {
            tracing::error!(error = %e, "catalog write failed");
        }
    }
}

/// The PostgreSQL channel a flush that stored events notifies (the
/// payload: the last `seq` it stored).
pub const EVENTS_CHANNEL: &str = "polyak_events";

/// Batches the writer flushed (one transaction each).
static FLUSHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Batches the writer has flushed in this process.
pub fn flushes() -> u64 {
    FLUSHES.load(std::sync::atomic::Ordering::Relaxed)
}

async fn flush(store: &Store, node: &str, batch: Vec<CatalogUpdate>) -> Result<(), StoreError> {
    FLUSHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut ranks: HashMap<(String, u32), (StoredRank, Option<String>)> = HashMap::new();
    let mut events = Vec::new();
    for update in batch {
        match update {
            CatalogUpdate::Rank {
                run,
                row,
                layout_json,
            } => {
                let key = (run, row.rank);
                let layout = match ranks.remove(&key) {
                    Some((_, earlier)) => layout_json.or(earlier),
                    None => layout_json,
                };
                ranks.insert(key, (row, layout));
            }
            CatalogUpdate::Event(e) => events.push(e),
        }
    }
    let mut tx = store.pool().begin().await?;
    for ((run, rank), (row, layout)) in ranks {
        sqlx::query(&store.sql("UPDATE ranks SET last_step = ?, pushes = ?, bytes_received = ?, rejections = ?, \
             resident_bytes = ?, last_push_at_ms = ?, layout = COALESCE(?, layout) WHERE run = ? AND rank = ?"))
        .bind(row.last_step.map(|s| s as i64))
        .bind(row.pushes as i64)
        .bind(row.bytes_received as i64)
        .bind(row.rejections as i64)
        .bind(row.resident_bytes as i64)
        .bind(row.last_push_at_ms)
        .bind(layout)
        .bind(&run)
        .bind(rank as i64)
        .execute(&mut *tx)
        .await?;
    }
    // The events' places in the catalog's order: the counter's row stays
    // locked until this transaction commits, so another node's flush takes
    // the next numbers only after this one is visible.
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
    let any_events = !events.is_empty();
    for e in events {
        // A run deleted meanwhile takes its events with it.
        sqlx::query(&store.sql(
            "INSERT INTO events (id, run, at_ms, kind, rank, step, detail, seq, node) \
             SELECT ?, ?, ?, ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM runs WHERE name = ?)",
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
    if any_events && store.kind() == super::CatalogKind::Postgres {
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
