//! Bearer tokens. With `--token` unset every caller may do everything (the
//! server binds loopback by default). With it set: the admin token may do
//! everything; a run's write token may push to and read that run; its read
//! token may read it. Browsers' `EventSource` and download links cannot set
//! headers, so `?access_token=` is accepted too.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, StatusCode};

use super::error::ApiError;
use crate::state::{token_hash, AppState, RunHandle};

/// Who is calling.
#[derive(Debug, Clone)]
pub enum Caller {
    /// Auth is off.
    Open,
    Admin,
    /// A token that is not the admin's (sha256 hex).
    Token(String),
    Anonymous,
}

impl Caller {
    pub fn is_admin(&self) -> bool {
        matches!(self, Caller::Open | Caller::Admin)
    }

    pub fn require_admin(&self) -> Result<(), ApiError> {
        match self {
            Caller::Open | Caller::Admin => Ok(()),
            Caller::Anonymous => Err(unauthenticated()),
            Caller::Token(_) => Err(forbidden("this needs the admin token")),
        }
    }

    pub fn can_read(&self, run: &RunHandle) -> bool {
        match self {
            Caller::Open | Caller::Admin => true,
            Caller::Anonymous => false,
            Caller::Token(hash) => run
                .tokens
                .as_ref()
                .is_some_and(|t| *hash == t.read_hash || *hash == t.write_hash),
        }
    }

    pub fn require_read(&self, run: &RunHandle) -> Result<(), ApiError> {
        match self {
            Caller::Anonymous => Err(unauthenticated()),
            _ if self.can_read(run) => Ok(()),
            _ => Err(forbidden("this token may not read this run")),
        }
    }

    pub fn require_write(&self, run: &RunHandle) -> Result<(), ApiError> {
        match self {
            Caller::Open | Caller::Admin => Ok(()),
            Caller::Anonymous => Err(unauthenticated()),
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

fn forbidden(message: &str) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
}

fn bearer(parts: &Parts) -> Option<String> {
    if let Some(value) = parts.headers.get(header::AUTHORIZATION) {
        let value = value.to_str().ok()?;
        return value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(|t| t.trim().to_string());
    }
    parts.uri.query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("access_token="))
            .map(|t| t.to_string())
    })
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let Some(admin) = &state.args.token else {
            return Ok(Caller::Open);
        };
        Ok(match bearer(parts) {
            None => Caller::Anonymous,
            Some(token) => {
                // Compare hashes: equal-length digests, no early exit on the
                // secret's own bytes.
                let hash = token_hash(&token);
                if hash == token_hash(admin) {
                    Caller::Admin
                } else {
                    Caller::Token(hash)
                }
            }
        })
    }
}
