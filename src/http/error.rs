//! The one error type at the HTTP edge. Every failure becomes a status and
//! `{"error": {"code", "message"[, "field"]}}`; 500s log their detail and
//! answer a generic message. Which status and code a failure gets is
//! decided once, by `ServiceError` (`services/error.rs`); this type only
//! renders it, plus the few refusals only the HTTP edge makes (bad
//! paths, queries, tokens).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::engine::EngineError;
use crate::run::FieldError;
use crate::services::error::SnapshotError;
use crate::services::ServiceError;
use crate::snapshot::assemble::AssembleError;
use crate::store::StoreError;
use crate::wire::WireError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub field: Option<String>,
    pub retry_after: Option<u64>,
}

/// The JSON body of every error.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable machine-readable code, e.g. `step_conflict`.
    pub code: String,
    pub message: String,
    /// The configuration field at fault (422 on run creation).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            field: None,
            retry_after: None,
        }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }

    pub fn unprocessable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, code, message)
    }

    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, message)
    }

    pub fn too_many(message: impl Into<String>, retry_after: u64) -> Self {
        ApiError {
            retry_after: Some(retry_after),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "busy", message)
        }
    }

    /// A 500 whose detail is logged, not sent.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        ServiceError::internal(detail).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_string(),
                message: self.message,
                field: self.field,
            },
        };
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        response
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        ApiError {
            status: StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            code: e.code,
            message: e.message,
            field: e.field,
            retry_after: e.retry_after,
        }
    }
}

// The lower layers' errors are classified once, in `ServiceError`.
macro_rules! through_service_error {
    ($($t:ty),*) => {$(
        impl From<$t> for ApiError {
            fn from(e: $t) -> Self {
                ServiceError::from(e).into()
            }
        }
    )*};
}

through_service_error!(
    FieldError,
    WireError,
    EngineError,
    StoreError,
    SnapshotError,
    AssembleError,
    tokio::task::JoinError
);
