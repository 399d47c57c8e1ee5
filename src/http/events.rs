//! `GET /v1/runs/{run}/events`: pushes, registrations, rejections and
//! snapshots as Server-Sent Events (each with its id, so `Last-Event-ID`
//! resumes), or as a JSON list with `Accept: application/json`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde::Deserialize;
use tokio_stream::wrappers::BroadcastStream;
use utoipa::IntoParams;

use super::auth::Caller;
use super::error::ApiError;
use super::extract::{run_named, ApiQuery};
use crate::state::AppState;
use crate::store::{EventCursor, EventPlace, StoredEvent};

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Only events after the one with this id, in the stream's order (SSE
    /// also reads `Last-Event-ID`, and prefers it).
    pub since: Option<i64>,
    /// Most events in a JSON answer (default 1000); a stream replays all.
    pub limit: Option<i64>,
    /// Start from the newest N events (after `since`) instead of the oldest.
    pub tail: Option<i64>,
    /// Only these kinds, comma separated (e.g. `snapshot,rejection`).
    pub kinds: Option<String>,
}

/// Stream (SSE) or list (JSON) a run's events.
#[utoipa::path(get, path = "/v1/runs/{run}/events", tag = "monitoring",
    params(("run" = String, Path), EventsQuery),
    responses((status = 200,
               description = "Server-Sent Events (`event:` the kind, `id:` the event id, `data:` the event as JSON), \
                              or a JSON list with Accept: application/json",
               content((String = "text/event-stream"), (Vec<StoredEvent> = "application/json")))))]
pub async fn events(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<EventsQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let run = run_named(&state, &name)?;
    caller.require_read(&run)?;
    let last_event_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i64>().ok());
    // A reconnecting EventSource sends the URL it first opened (its
    // `since`) and `Last-Event-ID`, the newer of the two.
    let since = last_event_id.or(q.since).unwrap_or(0);
    let filter = KindFilter(
        q.kinds
            .as_ref()
            .map(|k| k.split(',').map(|s| s.trim().to_string()).collect()),
    );
    let json = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/json"));
    let (limit, newest) = match q.tail {
        Some(n) => (Some(n.clamp(1, 100_000)), true),
        None if json => (Some(q.limit.unwrap_or(1000).clamp(1, 100_000)), false),
        // A stream replays everything after `since` before going live.
        None => (None, false),
    };
    // Subscribe before reading the history, so nothing falls in between.
    let live = state.events().stream();
    let cursor = cursor_after(&state, &name, since).await?;
    let history = history(&state, &name, cursor, &filter, (limit, newest), json).await?;
    if json {
        let list: Vec<StoredEvent> = history.iter().map(|e| (**e).clone()).collect();
        return Ok(Json(list).into_response());
    }
    let run_name = name.clone();
    let replayed_to = match cursor {
        // One node: ids grow in the order events are emitted.
        EventCursor::Id(after) => EventCursor::Id(history.last().map_or(after, |e| e.id)),
        // Several nodes: the stream is in the catalog's order, and every
        // stored event in it has its place; transient ones have none.
        EventCursor::Seq(after) => {
            EventCursor::Seq(history.iter().filter_map(|e| e.seq).max().unwrap_or(after))
        }
    };
    let live = live_after(live, run_name, filter, move |e| match replayed_to {
        EventCursor::Id(to) => e.id > to,
        EventCursor::Seq(to) => e.seq.is_none_or(|seq| seq > to),
    });
    // A stopping server ends the stream (the client reconnects with
    // Last-Event-ID to whichever node serves next).
    let stream = futures::stream::iter(history)
        .chain(live)
        .map(|e| Ok::<_, Infallible>(sse_event(&e)))
        .take_until(state.events().closed());
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// `?kinds=`: the kinds asked for (all when `None`).
struct KindFilter(Option<Vec<String>>);

impl KindFilter {
    fn wants(&self, e: &StoredEvent) -> bool {
        self.0
            .as_ref()
            .is_none_or(|k| k.iter().any(|k| k == e.kind.as_str()))
    }
}

/// The live part of a stream: `run`'s events that `new` keeps (those not
/// replayed) and the filter wants. A subscriber that falls behind is
/// ended; EventSource reconnects with `Last-Event-ID` and replays what it
/// missed from the catalog.
fn live_after(
    live: tokio::sync::broadcast::Receiver<Arc<StoredEvent>>,
    run: String,
    filter: KindFilter,
    new: impl Fn(&StoredEvent) -> bool + Send + 'static,
) -> impl futures::Stream<Item = Arc<StoredEvent>> + Send {
    BroadcastStream::new(live)
        .take_while(|item| futures::future::ready(item.is_ok()))
        .filter_map(move |item| {
            let keep = match item {
                Ok(e) if e.run == run && new(&e) && filter.wants(&e) => Some(e),
                _ => None,
            };
            futures::future::ready(keep)
        })
}

/// Where a reading after event `since` starts. One node: after that id.
/// A catalog several nodes share: after that event's place in the
/// catalog's order (an event of this node the writer has not stored yet
/// is waited for, at most a few of its batching intervals; an id the
/// catalog does not hold is placed after the newest event numbered before
/// it).
async fn cursor_after(state: &AppState, run: &str, since: i64) -> Result<EventCursor, ApiError> {
    if !state.events().is_ordered() {
        return Ok(EventCursor::Id(since));
    }
    if since <= 0 {
        return Ok(EventCursor::Seq(i64::MIN));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        match state.monitor().event_place(run, since).await? {
            EventPlace::Exact(seq) => return Ok(EventCursor::Seq(seq)),
            EventPlace::Before(before) => {
                let waiting = state.events().pending(run).iter().any(|e| e.id == since);
                if !waiting || tokio::time::Instant::now() >= deadline {
                    return Ok(EventCursor::Seq(before.unwrap_or(i64::MIN)));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Rows read from the catalog per query while a stream replays.
const REPLAY_PAGE: i64 = 1000;

/// The run's events after `cursor` that the catalog and memory hold, in
/// the stream's order: the first `limit` (all with `None`), or with
/// `newest` the last `limit`, within the events retained. On one node,
/// the events this node has not stored yet come from memory, in id order
/// with the stored ones; on an ordered catalog a listing (`pending`) has
/// them after the stored ones, and a stream gets them live from the relay.
async fn history(
    state: &AppState,
    name: &str,
    cursor: EventCursor,
    filter: &KindFilter,
    (limit, newest): (Option<i64>, bool),
    pending: bool,
) -> Result<Vec<Arc<StoredEvent>>, ApiError> {
    let kinds = filter.0.as_deref();
    let mut stored: Vec<Arc<StoredEvent>> = Vec::new();
    let mut after = cursor;
    loop {
        let want = limit.map_or(REPLAY_PAGE, |l| l - stored.len() as i64);
        let page = state
            .monitor()
            .stored_events(name, after, kinds, want, newest)
            .await?;
        let full = page.len() as i64 == want;
        after = match (after, page.last()) {
            (EventCursor::Id(_), Some(e)) => EventCursor::Id(e.id),
            (EventCursor::Seq(_), Some(e)) => EventCursor::Seq(e.seq.unwrap_or(i64::MAX)),
            (cursor, None) => cursor,
        };
        stored.extend(page.into_iter().map(Arc::new));
        if limit.is_some() || !full {
            break;
        }
    }
    let mut history: Vec<Arc<StoredEvent>> = match cursor {
        EventCursor::Id(since) => {
            let mut by_id: BTreeMap<i64, Arc<StoredEvent>> =
                stored.into_iter().map(|e| (e.id, e)).collect();
            for e in state.events().recent(name, since) {
                if filter.wants(&e) {
                    by_id.entry(e.id).or_insert(e);
                }
            }
            by_id.into_values().collect()
        }
        EventCursor::Seq(_) if pending => {
            let have: std::collections::HashSet<i64> = stored.iter().map(|e| e.id).collect();
            let pending = state
                .events()
                .pending(name)
                .into_iter()
                .filter(|e| filter.wants(e) && !have.contains(&e.id));
            stored.extend(pending);
            stored
        }
        EventCursor::Seq(_) => stored,
    };
    if let Some(limit) = limit {
        let extra = history.len().saturating_sub(limit as usize);
        if newest {
            // The newest `limit` of what the catalog and memory hold.
            history.drain(..extra);
        } else {
            history.truncate(limit as usize);
        }
    }
    // Retention applies to what is still in memory too.
    let retained = state.args().events_retained as usize;
    let skip = history.len().saturating_sub(retained);
    history.drain(..skip);
    Ok(history)
}

/// An event as SSE: `id:` its id (what `Last-Event-ID` and `since` resume
/// after), except for transient events, which are never replayed and so
/// leave the stream's place where it was.
fn sse_event(e: &StoredEvent) -> Event {
    let event = Event::default()
        .event(e.kind.as_str())
        .data(serde_json::to_string(e).unwrap_or_default());
    if e.transient {
        event
    } else {
        event.id(e.id.to_string())
    }
}
