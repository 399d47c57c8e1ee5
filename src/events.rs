//! The event bus: numbered events, broadcast to live subscribers (SSE),
//! kept in a recent-events ring for replay, and stored through the catalog
//! writer. What may be emitted is [`Event`]: one variant per event kind,
//! each with its payload, serialised to the event's `detail`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

use serde::Serialize;

use crate::clock::now_ms;
use crate::contract::{CutKind, EventKind, SnapshotEventStatus, SnapshotKind};
use crate::store::writer::{CatalogUpdate, CatalogWriter};
use crate::store::{Store, StoredEvent};

/// Events: numbered, broadcast to live subscribers (SSE), kept in a
/// recent-events ring (for replay before the catalog has them), and stored.
pub struct EventBus {
    ids: Arc<Mutex<EventIds>>,
    store: Option<Store>,
    /// Every event this node emits, at once (alerts follow it).
    tx: broadcast::Sender<Arc<StoredEvent>>,
    /// On a catalog that orders events over nodes: the live stream in the
    /// catalog's order (every node's stored events as the relay reads them,
    /// and this node's transient ones). `None`: the stream is `tx`.
    ordered: Option<broadcast::Sender<Arc<StoredEvent>>>,
    recent: Mutex<std::collections::VecDeque<Arc<StoredEvent>>>,
    /// On an ordered bus: the newest of this node's events the relay has
    /// read back from the catalog (this node numbers in increasing order,
    /// so every one of its events up to it is stored).
    relayed_own: std::sync::atomic::AtomicI64,
    catalog: CatalogWriter,
    /// Turned true when the server stops: live streams end at once, so an
    /// open `/events` never holds a graceful stop (and its final state
    /// write) for the whole shutdown timeout.
    closing: tokio::sync::watch::Sender<bool>,
}

/// Events kept in memory for replay.
const RECENT_EVENTS: usize = 8192;

/// Event ids a node reserves at a time (see [`Store::reserve_event_ids`]).
pub const EVENT_ID_BLOCK: i64 = 1 << 20;

/// The ids this node may number events with: the current block, and the
/// next one, reserved once half of the current is used.
struct EventIds {
    next: i64,
    end: i64,
    spare: Option<(i64, i64)>,
    asking: bool,
}

impl EventBus {
    /// A bus numbering events from `block` (ids reserved in the catalog);
    /// with `store`, it reserves the next block before this one runs out.
    /// `ordered`: the live stream follows the catalog's order of events
    /// (fed by [`EventBus::relay`]) rather than this node's emits.
    pub fn new(
        block: (i64, i64),
        catalog: CatalogWriter,
        store: Option<Store>,
        ordered: bool,
    ) -> Self {
        let (tx, _) = broadcast::channel(4096);
        EventBus {
            ids: Arc::new(Mutex::new(EventIds {
                next: block.0,
                end: block.1,
                spare: None,
                asking: false,
            })),
            store,
            tx,
            ordered: ordered.then(|| broadcast::channel(4096).0),
            recent: Mutex::new(std::collections::VecDeque::with_capacity(RECENT_EVENTS)),
            relayed_own: std::sync::atomic::AtomicI64::new(0),
            catalog,
            closing: tokio::sync::watch::channel(false).0,
        }
    }

    /// Ends every live stream (the server is stopping); later ones end at
    /// once too.
    pub fn close_streams(&self) {
        self.closing.send_replace(true);
    }

    /// Resolves once [`Self::close_streams`] was called.
    pub fn closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.closing.subscribe();
        async move {
            let _ = rx.wait_for(|closing| *closing).await;
        }
    }

    /// The next event id: from this node's block, moving to the spare block
    /// when it is used up, and asking for a new spare halfway through.
    fn next_id(&self) -> i64 {
        let mut ids = self.ids.lock().expect("event ids lock");
        if ids.next >= ids.end {
            match ids.spare.take() {
                Some((start, end)) => (ids.next, ids.end) = (start, end),
                None => {
                    // Not reserved in time: numbered on past the block (a
                    // node sharing the catalog may reuse these ids).
                    tracing::error!(id = ids.next, "event ids ran past the reserved block");
                    ids.end = ids.next + 1;
                }
            }
        }
        let half_used = ids.end - ids.next < EVENT_ID_BLOCK / 2;
        if half_used && ids.spare.is_none() && !ids.asking {
            if let (Some(store), Ok(rt)) = (&self.store, tokio::runtime::Handle::try_current()) {
                ids.asking = true;
                let (store, shared) = (store.clone(), self.ids.clone());
                rt.spawn(async move {
                    let block = store.reserve_event_ids(EVENT_ID_BLOCK).await;
                    let mut ids = shared.lock().expect("event ids lock");
                    ids.asking = false;
                    match block {
                        Ok(block) => ids.spare = Some(block),
                        Err(e) => tracing::warn!(error = %e, "reserving event ids failed; retried"),
                    }
                });
            }
        }
        let id = ids.next;
        ids.next += 1;
        id
    }

    /// Numbers `event`, publishes it to live subscribers and, unless it is
    /// transient (see [`Event::is_stored`]), keeps it for replay and stores
    /// it. The one way an event enters the bus.
    pub fn emit(
        &self,
        run: &str,
        rank: Option<u32>,
        step: Option<u64>,
        event: Event,
    ) -> Arc<StoredEvent> {
        let stored = event.is_stored();
        let (kind, detail) = event.into_parts();
        // Numbering and publishing under one lock keeps ids in order on
        // every subscriber.
        let mut recent = self.recent.lock().expect("events lock");
        let event = Arc::new(StoredEvent {
            id: self.next_id(),
            run: run.to_string(),
            at_ms: now_ms(),
            kind,
            rank,
            step,
            detail,
            seq: None,
            relayed: false,
            transient: !stored,
        });
        if stored {
            if recent.len() == RECENT_EVENTS {
                recent.pop_front();
            }
            recent.push_back(event.clone());
            self.catalog.send(CatalogUpdate::Event((*event).clone()));
        } else if let Some(ordered) = &self.ordered {
            // Transient: never stored, so the relay never sees it.
            let _ = ordered.send(event.clone());
        }
        let _ = self.tx.send(event.clone());
        event
    }

    /// An id from this node's event ids that no event will carry: unique
    /// over the service, for something else to be known by (an alert).
    pub fn take_id(&self) -> i64 {
        self.next_id()
    }

    /// Whether the live stream follows the catalog's order of events (a
    /// catalog several nodes share): stream ids are then resolved to
    /// places in that order.
    pub fn is_ordered(&self) -> bool {
        self.ordered.is_some()
    }

    /// This node's recent events of `run` that the live stream of an
    /// ordered bus has not carried yet (the writer stores them within its
    /// batching interval, then the relay reads them back), oldest first.
    pub fn pending(&self, run: &str) -> Vec<Arc<StoredEvent>> {
        let done = self.relayed_own.load(std::sync::atomic::Ordering::Acquire);
        self.recent
            .lock()
            .expect("events lock")
            .iter()
            .filter(|e| e.run == run && e.id > done)
            .cloned()
            .collect()
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

    /// Publishes an event read from the catalog (with its place in the
    /// catalog's order) to the live stream of an ordered bus; it is neither
    /// numbered nor stored again. Another node's events are marked
    /// `relayed`; this node's come back through here so the stream has
    /// every node's events in one order.
    pub fn relay(&self, event: Arc<StoredEvent>) {
        if let Some(ordered) = &self.ordered {
            if !event.relayed {
                self.relayed_own
                    .fetch_max(event.id, std::sync::atomic::Ordering::AcqRel);
            }
            let _ = ordered.send(event);
        }
    }

    /// This node's events as they are emitted (alerts follow these).
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<StoredEvent>> {
        self.tx.subscribe()
    }

    /// The live stream for subscribers (SSE): in the catalog's order on an
    /// ordered bus, else this node's events as they are emitted.
    pub fn stream(&self) -> broadcast::Receiver<Arc<StoredEvent>> {
        match &self.ordered {
            Some(ordered) => ordered.subscribe(),
            None => self.tx.subscribe(),
        }
    }
}

/// An event as emitted: its kind (the variant) and its `detail` (the
/// payload, serialised as the event's JSON `detail`).
#[derive(Debug, Clone)]
pub enum Event {
    RunCreated(RunCreated),
    RankRegistered(RankRegistered),
    Push(PushApplied),
    Rejection(Rejection),
    MirrorMismatch(MirrorMismatch),
    Snapshot(SnapshotEvent),
    Finished(Finished),
    Resumed(Resumed),
    Restored(Restored),
    /// One rank's failover (the event's rank is set).
    Failover(crate::node::Failover),
    Annotated(Annotated),
    /// A stored part read back other than it was written.
    SnapshotCorrupt(SnapshotCorrupt),
    /// The alert as the alerts service lists it.
    Alert(serde_json::Value),
    Metrics(Metrics),
    Eval(EvalRecorded),
}

impl Event {
    pub fn kind(&self) -> EventKind {
        match self {
            Event::RunCreated(_) => EventKind::RunCreated,
            Event::RankRegistered(_) => EventKind::RankRegistered,
            Event::Push(_) => EventKind::Push,
            Event::Rejection(_) => EventKind::Rejection,
            Event::MirrorMismatch(_) => EventKind::MirrorMismatch,
            Event::Snapshot(_) => EventKind::Snapshot,
            Event::Finished(_) => EventKind::Finished,
            Event::Resumed(_) => EventKind::Resumed,
            Event::Restored(_) => EventKind::Restored,
            Event::Failover(_) => EventKind::Failover,
            Event::Annotated(_) => EventKind::Annotated,
            Event::SnapshotCorrupt(_) => EventKind::SnapshotCorrupt,
            Event::Alert(_) => EventKind::Alert,
            Event::Metrics(_) => EventKind::Metrics,
            Event::Eval(_) => EventKind::Eval,
        }
    }

    /// False for events only live subscribers see: high-rate ones already
    /// kept elsewhere (metric posts, a derived snapshot's progress).
    pub fn is_stored(&self) -> bool {
        !matches!(
            self,
            Event::Metrics(_) | Event::Snapshot(SnapshotEvent::Running { .. })
        )
    }

    /// The kind and the JSON `detail`.
    pub fn into_parts(self) -> (EventKind, serde_json::Value) {
        fn json(payload: &impl Serialize) -> serde_json::Value {
            serde_json::to_value(payload).unwrap_or_default()
        }
        let kind = self.kind();
        let detail = match &self {
            Event::RunCreated(p) => json(p),
            Event::RankRegistered(p) => json(p),
            Event::Push(p) => json(p),
            Event::Rejection(p) => json(p),
            Event::MirrorMismatch(p) => json(p),
            Event::Snapshot(p) => json(p),
            Event::Finished(p) => json(p),
            Event::Resumed(p) => json(p),
            Event::Restored(p) => json(p),
            Event::Failover(p) => json(p),
            Event::Annotated(p) => json(p),
            Event::SnapshotCorrupt(p) => json(p),
            Event::Alert(v) => v.clone(),
            Event::Metrics(p) => json(p),
            Event::Eval(p) => json(p),
        };
        (kind, detail)
    }
}

/// `run_created`.
#[derive(Debug, Clone, Serialize)]
pub struct RunCreated {
    pub world_size: u32,
    /// How many EMA profiles.
    pub profiles: usize,
}

/// `rank_registered`: a rank's first push registered its layout.
#[derive(Debug, Clone, Serialize)]
pub struct RankRegistered {
    pub tensors: usize,
    pub numel: u64,
    pub resident_bytes: u64,
}

/// `push`: an accepted push.
#[derive(Debug, Clone, Serialize)]
pub struct PushApplied {
    pub applied: bool,
    pub duplicate: bool,
    /// Bytes on the wire.
    pub bytes: u64,
    pub apply_seconds: f64,
    pub seconds: f64,
    /// Tensors skipped for holding NaN/Inf.
    pub skipped: Vec<String>,
}

/// `rejection`: a refused push, with the status and code it was answered.
#[derive(Debug, Clone, Serialize)]
pub struct Rejection {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

/// `snapshot_corrupt`: a stored part whose size or sha256 is not the one
/// recorded when it was written; what read it (`download`, `compare`,
/// `resume`, `restore`, `failover`, `posthoc`, `merge`, `verify`) refused it.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotCorrupt {
    pub snapshot: String,
    /// The part's key in the store.
    pub part: String,
    pub reason: String,
    pub during: &'static str,
}

/// `mirror_mismatch`: a keyframe found the mirror diverged; it was repaired.
#[derive(Debug, Clone, Serialize)]
pub struct MirrorMismatch {
    pub client_crc32: String,
    pub server_crc32: String,
    pub repaired: bool,
}

/// `snapshot`: a snapshot's life, by its `status`.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum SnapshotEvent {
    Pending {
        id: String,
        kind: SnapshotKind,
        /// How a manual snapshot's step was chosen.
        #[serde(skip_serializing_if = "Option::is_none")]
        cut: Option<CutKind>,
    },
    /// A derived snapshot's progress: `done` of `total` source bytes.
    Running {
        ids: Vec<String>,
        kind: SnapshotKind,
        done: u64,
        total: u64,
    },
    Complete {
        id: String,
        kind: SnapshotKind,
        bytes: u64,
    },
    Failed {
        id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        kind: Option<SnapshotKind>,
        reason: String,
    },
    /// A due periodic cut the write backlog had no room for.
    Skipped { kind: SnapshotKind, reason: String },
    Deleted {
        id: String,
        /// `retention` when retention deleted it.
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<&'static str>,
    },
}

impl SnapshotEvent {
    pub fn status(&self) -> SnapshotEventStatus {
        match self {
            SnapshotEvent::Pending { .. } => SnapshotEventStatus::Pending,
            SnapshotEvent::Running { .. } => SnapshotEventStatus::Running,
            SnapshotEvent::Complete { .. } => SnapshotEventStatus::Complete,
            SnapshotEvent::Failed { .. } => SnapshotEventStatus::Failed,
            SnapshotEvent::Skipped { .. } => SnapshotEventStatus::Skipped,
            SnapshotEvent::Deleted { .. } => SnapshotEventStatus::Deleted,
        }
    }
}

/// `finished`: the run was finished; its final snapshot, if anything was pushed.
#[derive(Debug, Clone, Serialize)]
pub struct Finished {
    pub snapshot: Option<String>,
}

/// `resumed`: the run's EMA was restored from a snapshot on request.
#[derive(Debug, Clone, Serialize)]
pub struct Resumed {
    pub snapshot: String,
    pub rank_steps: BTreeMap<u32, u64>,
    pub requested_step: u64,
    pub older: bool,
}

/// `restored`: the run's EMA was restored at start.
#[derive(Debug, Clone, Serialize)]
pub struct Restored {
    pub snapshot: String,
    pub rank_steps: BTreeMap<u32, u64>,
}

/// `annotated`: the run's tags or note changed.
#[derive(Debug, Clone, Serialize)]
pub struct Annotated {
    pub tags: Vec<String>,
    pub note: String,
}

/// `eval`: an evaluation of a candidate was stored (the event's step is
/// the candidate's).
#[derive(Debug, Clone, Serialize)]
pub struct EvalRecorded {
    pub snapshot: String,
    pub profile: String,
    pub evaluator: String,
    pub kind: crate::contract::CandidateKind,
    pub metrics: BTreeMap<String, f64>,
}

/// `metrics`: a metric post (live subscribers only).
#[derive(Debug, Clone, Serialize)]
pub struct Metrics {
    pub values: BTreeMap<String, f64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn payloads_serialise_to_the_documented_details() {
        let pending = Event::Snapshot(SnapshotEvent::Pending {
            id: "a".into(),
            kind: SnapshotKind::Manual,
            cut: Some(CutKind::NextUpdate),
        });
        assert!(pending.is_stored());
        assert_eq!(
            pending.into_parts(),
            (
                EventKind::Snapshot,
                json!({"id": "a", "status": "pending", "kind": "manual", "cut": "next_update"})
            )
        );
        let failed = Event::Snapshot(SnapshotEvent::Failed {
            id: "b".into(),
            kind: None,
            reason: "disk".into(),
        });
        assert_eq!(
            failed.into_parts().1,
            json!({"id": "b", "status": "failed", "reason": "disk"})
        );
        let deleted = Event::Snapshot(SnapshotEvent::Deleted {
            id: "c".into(),
            reason: None,
        });
        assert_eq!(
            deleted.into_parts().1,
            json!({"id": "c", "status": "deleted"})
        );
        let running = Event::Snapshot(SnapshotEvent::Running {
            ids: vec!["d".into()],
            kind: SnapshotKind::Posthoc,
            done: 3,
            total: 9,
        });
        assert!(!running.is_stored());
        assert_eq!(
            running.into_parts().1,
            json!({"ids": ["d"], "status": "running", "kind": "posthoc", "done": 3, "total": 9})
        );
        let resumed = Event::Resumed(Resumed {
            snapshot: "e".into(),
            rank_steps: BTreeMap::from([(0, 4), (1, 4)]),
            requested_step: 5,
            older: false,
        });
        assert_eq!(
            resumed.into_parts(),
            (
                EventKind::Resumed,
                json!({"snapshot": "e", "rank_steps": {"0": 4, "1": 4}, "requested_step": 5, "older": false})
            )
        );
        let metrics = Event::Metrics(Metrics {
            values: BTreeMap::from([("loss".to_string(), 0.5)]),
        });
        assert!(!metrics.is_stored());
        assert_eq!(metrics.kind(), EventKind::Metrics);
    }
}
