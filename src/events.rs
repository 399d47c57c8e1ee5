//! The event bus: numbered events, broadcast to live subscribers (SSE),
//! kept in a recent-events ring for replay, and stored through the catalog
//! writer.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

use crate::clock::now_ms;
use crate::store::writer::{CatalogUpdate, CatalogWriter};
use crate::store::StoredEvent;

/// Events: numbered, broadcast to live subscribers (SSE), kept in a
/// recent-events ring (for replay before the catalog has them), and stored.
pub struct EventBus {
    next_id: AtomicI64,
    tx: broadcast::Sender<Arc<StoredEvent>>,
    recent: Mutex<std::collections::VecDeque<Arc<StoredEvent>>>,
    catalog: CatalogWriter,
}

/// Events kept in memory for replay.
const RECENT_EVENTS: usize = 8192;

impl EventBus {
    pub fn new(last_id: i64, catalog: CatalogWriter) -> Self {
        let (tx, _) = broadcast::channel(4096);
        EventBus {
            next_id: AtomicI64::new(last_id + 1),
            tx,
            recent: Mutex::new(std::collections::VecDeque::with_capacity(RECENT_EVENTS)),
            catalog,
        }
    }

    pub fn emit(
        &self,
        run: &str,
        kind: &str,
        rank: Option<u32>,
        step: Option<u64>,
        detail: serde_json::Value,
    ) -> Arc<StoredEvent> {
        // Numbering and publishing under one lock keeps ids in order on
        // every subscriber.
        let mut recent = self.recent.lock().expect("events lock");
        let event = Arc::new(StoredEvent {
            id: self.next_id.fetch_add(1, Ordering::SeqCst),
            run: run.to_string(),
            at_ms: now_ms(),
            kind: kind.to_string(),
            rank,
            step,
            detail,
        });
        if recent.len() == RECENT_EVENTS {
            recent.pop_front();
        }
        recent.push_back(event.clone());
        self.catalog.send(CatalogUpdate::Event((*event).clone()));
        let _ = self.tx.send(event.clone());
        event
    }

    /// An event for live subscribers only (not stored: high-rate, already
    /// kept elsewhere, like metric posts).
    pub fn emit_transient(
        &self,
        run: &str,
        kind: &str,
        rank: Option<u32>,
        step: Option<u64>,
        detail: serde_json::Value,
    ) {
        let _guard = self.recent.lock().expect("events lock");
        let event = Arc::new(StoredEvent {
            id: self.next_id.fetch_add(1, Ordering::SeqCst),
            run: run.to_string(),
            at_ms: now_ms(),
            kind: kind.to_string(),
            rank,
            step,
            detail,
        });
        let _ = self.tx.send(event);
    }

    /// Events of `run` with `id > after` still in memory, oldest first.
    pub fn recent(&self, run: &str, after: i64) -> Vec<Arc<StoredEvent>> {
        self.recent
            .lock()
            .expect("events lock")
            .iter()
            .filter(|e| e.run == run && e.id > after)
            .cloned()
            .collect()
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<StoredEvent>> {
        self.tx.subscribe()
    }
}
