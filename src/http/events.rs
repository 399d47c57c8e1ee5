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
use crate::store::StoredEvent;

#[derive(Debug, Deserialize, IntoParams)]
pub struct EventsQuery {
    /// Only events with a larger id (SSE also reads `Last-Event-ID`).
    pub since: Option<i64>,
    /// Most events in a JSON answer (default 1000).
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
    let since = q.since.or(last_event_id).unwrap_or(0);
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
        Some(n) => (n.clamp(1, 100_000), true),
        None => (q.limit.unwrap_or(1000).clamp(1, 100_000), false),
    };
    // Subscribe before reading the history, so nothing falls in between.
    let live = state.events().subscribe();
    let history = history(&state, &name, since, &filter, limit, newest).await?;
    if json {
        let list: Vec<StoredEvent> = history
            .iter()
            .take(limit as usize)
            .map(|e| (**e).clone())
            .collect();
        return Ok(Json(list).into_response());
    }
    let replayed_to = history.last().map(|e| e.id).unwrap_or(since);
    // Other nodes' events (relayed from the catalog) carry ids of their
    // own blocks: those already replayed are known by id.
    let replayed: std::collections::HashSet<i64> = history.iter().map(|e| e.id).collect();
    let run_name = name.clone();
    // A subscriber that falls behind is ended; EventSource reconnects with
    // `Last-Event-ID` and replays what it missed from the catalog.
    let live = BroadcastStream::new(live)
        .take_while(|item| futures::future::ready(item.is_ok()))
        .filter_map(move |item| {
            let keep = match item {
                Ok(e)
                    if e.run == run_name
                        && (e.id > replayed_to || e.relayed)
                        && !replayed.contains(&e.id)
                        && filter.wants(&e) =>
                {
                    Some(e)
                }
                _ => None,
            };
            futures::future::ready(keep)
        });
    let stream = futures::stream::iter(history)
        .chain(live)
        .map(|e| Ok::<_, Infallible>(sse_event(&e)));
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

/// The run's events after `since` that the catalog and memory hold, oldest
/// first: the first `limit` (or with `newest` the last `limit`), within
/// the events retained.
async fn history(
    state: &AppState,
    name: &str,
    since: i64,
    filter: &KindFilter,
    limit: i64,
    newest: bool,
) -> Result<Vec<Arc<StoredEvent>>, ApiError> {
    let mut history: BTreeMap<i64, Arc<StoredEvent>> = BTreeMap::new();
    for e in state
        .store()
        .events(name, since, filter.0.as_deref(), limit, newest)
        .await?
    {
        history.insert(e.id, Arc::new(e));
    }
    for e in state.events().recent(name, since) {
        if filter.wants(&e) {
            history.insert(e.id, e);
        }
    }
    if newest {
        // The newest `limit` of what the catalog and memory hold.
        let keep = history.len().saturating_sub(limit as usize);
        let cut: Vec<i64> = history.keys().take(keep).copied().collect();
        for id in cut {
            history.remove(&id);
        }
    }
    // Retention applies to what is still in memory too.
    let retained = state.args().events_retained as usize;
    let skip = history.len().saturating_sub(retained);
    Ok(history
        .into_values()
        .skip(skip)
        .filter(|e| filter.wants(e))
        .collect())
}

fn sse_event(e: &StoredEvent) -> Event {
    Event::default()
        .id(e.id.to_string())
        .event(e.kind.as_str())
        .data(serde_json::to_string(e).unwrap_or_default())
}
