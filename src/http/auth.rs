//! Bearer tokens. With `--token` unset every caller may do everything (the
//! server binds loopback by default). With it set: the admin token may do
//! everything; a run's write token may push to and read that run; its read
//! token may read it. Browsers' `EventSource` and download links cannot set
//! headers, so `?access_token=` is accepted too, but only on the `GET`
//! endpoints a browser opens by itself ([`query_token_allowed`]): a token in
//! a URL ends up in histories and proxy logs, and nothing else needs it.
//! A token that is neither the admin's nor any run's is 401, like none.
//! Both are refused before a handler looks anything up, so a caller
//! without a valid token cannot tell a run that exists from one that does
//! not (every route that takes a [`Caller`] needs some token).

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, Method, StatusCode};

use super::error::ApiError;
use crate::registry::{token_hash, RunHandle};
use crate::state::AppState;

/// Who is calling.
#[derive(Debug, Clone)]
pub enum Caller {
    /// Auth is off.
    Open,
    Admin,
    /// A run's read or write token (sha256 hex).
    Token(String),
    /// No token.
    Anonymous,
    /// A token no run and not the admin holds.
    Unknown,
}

impl Caller {
    pub fn is_admin(&self) -> bool {
        matches!(self, Caller::Open | Caller::Admin)
    }

    pub fn require_admin(&self) -> Result<(), ApiError> {
        match self {
            Caller::Open | Caller::Admin => Ok(()),
            Caller::Anonymous => Err(unauthenticated()),
            Caller::Unknown => Err(invalid_token()),
            Caller::Token(_) => Err(forbidden("this needs the admin token")),
        }
    }

    pub fn can_read(&self, run: &RunHandle) -> bool {
        match self {
            Caller::Open | Caller::Admin => true,
            Caller::Anonymous | Caller::Unknown => false,
            Caller::Token(hash) => run
                .tokens
                .as_ref()
                .is_some_and(|t| *hash == t.read_hash || *hash == t.write_hash),
        }
    }

    pub fn require_read(&self, run: &RunHandle) -> Result<(), ApiError> {
        match self {
            Caller::Anonymous => Err(unauthenticated()),
            Caller::Unknown => Err(invalid_token()),
            _ if self.can_read(run) => Ok(()),
            _ => Err(forbidden("this token may not read this run")),
        }
    }

    pub fn require_write(&self, run: &RunHandle) -> Result<(), ApiError> {
        match self {
            Caller::Open | Caller::Admin => Ok(()),
            Caller::Anonymous => Err(unauthenticated()),
            Caller::Unknown => Err(invalid_token()),
            Caller::Token(hash) => {
                if run.tokens.as_ref().is_some_and(|t| *hash == t.write_hash) {
                    Ok(())
                } else {
                    Err(forbidden("this needs the run's write token"))
                }
            }
        }
    }
}

fn unauthenticated() -> ApiError {
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthenticated",
        "this server needs a bearer token (Authorization: Bearer ...)",
    )
}

fn invalid_token() -> ApiError {
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "invalid_token",
        "this token is not the admin's nor any run's",
    )
}

fn forbidden(message: &str) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
}

/// Whether `?access_token=` may stand in for the header: only on the `GET`
/// endpoints a browser opens without script (event streams, downloads of
/// snapshots and of a rank's live EMA).
pub fn query_token_allowed(method: &Method, path: &str) -> bool {
    if method != Method::GET && method != Method::HEAD {
        return false;
    }
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    matches!(
        segments.as_slice(),
        ["v1", "runs", _, "events"]
            | ["v1", "runs", _, "snapshots", _, "download"]
            | ["v1", "runs", _, "ranks", _, "ema"]
    )
}

/// The token a request carries; an empty one counts as none.
fn bearer(parts: &Parts) -> Option<String> {
    let token = if let Some(value) = parts.headers.get(header::AUTHORIZATION) {
        let value = value.to_str().ok()?;
        value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(|t| t.trim().to_string())
    } else if query_token_allowed(&parts.method, parts.uri.path()) {
        parts.uri.query().and_then(|q| {
            q.split('&')
                .find_map(|kv| kv.strip_prefix("access_token="))
                .map(|t| t.to_string())
        })
    } else {
        None
    };
    token.filter(|t| !t.is_empty())
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let Some(admin) = &state.args().token else {
            return Ok(Caller::Open);
        };
        let caller = match bearer(parts) {
            None => Caller::Anonymous,
            Some(token) => {
                // Compare hashes: equal-length digests, no early exit on the
                // secret's own bytes.
                let hash = token_hash(&token);
                if hash == token_hash(admin) {
                    Caller::Admin
                } else if state.registry().token_known(&hash) {
                    Caller::Token(hash)
                } else {
                    Caller::Unknown
                }
            }
        };
        // No valid token may do anything (see `require_*`): answer 401 now,
        // before the handler looks the run up and a 404 tells it apart.
        match caller {
            Caller::Anonymous => Err(unauthenticated()),
            Caller::Unknown => Err(invalid_token()),
            known => Ok(known),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_tokens_only_where_browsers_need_them() {
        let get = Method::GET;
        for path in [
            "/v1/runs/r/events",
            "/v1/runs/r/snapshots/abc/download",
            "/v1/runs/r/ranks/0/ema",
        ] {
            assert!(query_token_allowed(&get, path), "{path}");
            assert!(!query_token_allowed(&Method::POST, path), "{path}");
        }
        for path in [
            "/v1/runs",
            "/v1/runs/r",
            "/v1/runs/r/ranks/0/steps/3",
            "/v1/runs/r/snapshots",
            "/metrics",
            "/v1/runs/r/events/x",
        ] {
            assert!(!query_token_allowed(&get, path), "{path}");
        }
        assert!(!query_token_allowed(
            &Method::PUT,
            "/v1/runs/r/ranks/0/steps/3"
        ));
        assert!(!query_token_allowed(&Method::DELETE, "/v1/runs/r"));
    }
}
