//! A request whose run was deleted (or deleted and created again) while it
//! ran fails in the layers below in ways of their own: a catalog row gone
//! under a foreign key, a file removed under a write, an engine without
//! the run. Those are the caller's race, not a server fault: the answer is
//! `404 run_not_found`, never a 5xx.
//!
//! The handler's run lookup ([`super::extract::run_named`]) notes the
//! handle it found in a task-local slot the layer set up; a 5xx whose
//! noted run is no longer the registry's becomes the 404.

use std::cell::RefCell;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use crate::registry::RunHandle;
use crate::state::AppState;

tokio::task_local! {
    static SEEN: RefCell<Option<Arc<RunHandle>>>;
}

/// Notes the run a request works on (outside the layer: nothing).
pub fn note_run(run: &Arc<RunHandle>) {
    let _ = SEEN.try_with(|seen| *seen.borrow_mut() = Some(run.clone()));
}

/// Turns a 5xx into `404 run_not_found` when the request's run is no
/// longer the one it worked on.
pub async fn run_vanished(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let (resp, seen) = SEEN
        .scope(RefCell::new(None), async move {
            let resp = next.run(req).await;
            (resp, SEEN.with(|seen| seen.borrow_mut().take()))
        })
        .await;
    if !resp.status().is_server_error() {
        return resp;
    }
    let Some(run) = seen else {
        return resp;
    };
    let name = &run.config.name;
    let same = state
        .run(name)
        .is_some_and(|now| Arc::ptr_eq(&now, &run) && !now.is_deleted());
    if same {
        return resp;
    }
    tracing::info!(run = %name, status = %resp.status(), "the run was deleted while a request on it ran");
    ApiError::not_found(
        "run_not_found",
        format!("run `{name}` was deleted while the request ran"),
    )
    .into_response()
}
