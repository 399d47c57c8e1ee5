//! The one error type at the HTTP edge. Every failure becomes a status and
//! `{"error": {"code", "message"[, "field"]}}`; 500s log their detail and
//! answer a generic message.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::engine::EngineError;
use crate::run::FieldError;
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
        tracing::error!(error = %detail, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error; the server log has the detail",
        )
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

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> Self {
        ApiError {
            field: Some(e.field.clone()),
            ..Self::unprocessable("invalid_config", e.to_string())
        }
    }
}

impl From<WireError> for ApiError {
    fn from(e: WireError) -> Self {
        let message = e.to_string();
        match e {
            WireError::Invalid(_) => Self::bad_request("invalid_safetensors", message),
            WireError::HeaderTooLarge { .. } => {
                Self::new(StatusCode::PAYLOAD_TOO_LARGE, "header_too_large", message)
            }
            WireError::UnsupportedDtype { .. } => Self::unprocessable("unsupported_dtype", message),
            WireError::InvalidShards(_) => Self::unprocessable("invalid_shards", message),
            WireError::InvalidMetadata(_) => Self::unprocessable("invalid_metadata", message),
            WireError::Nonfinite { .. } => Self::unprocessable("nonfinite", message),
            WireError::Empty => Self::unprocessable("empty_push", message),
        }
    }
}

impl From<crate::wire::codec::CodecError> for ApiError {
    fn from(e: crate::wire::codec::CodecError) -> Self {
        use crate::wire::codec::CodecError;
        let message = e.to_string();
        match e {
            CodecError::Corrupt(_) => Self::bad_request("invalid_encoding", message),
            CodecError::TooLarge { .. } => {
                Self::new(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", message)
            }
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        match e {
            EngineError::QueueFull => Self::too_many(message, 1),
            EngineError::RunNotFound(_) => Self::not_found("run_not_found", message),
            EngineError::NoData { .. } => Self::not_found("no_data", message),
            EngineError::StepConflict(_) => Self::conflict("step_conflict", message),
            EngineError::RunFinished(_) => Self::conflict("run_finished", message),
            EngineError::LayoutMismatch(_) => Self::conflict("layout_mismatch", message),
            EngineError::NeedsKeyframe(_) => Self::conflict("needs_keyframe", message),
            EngineError::Nonfinite(_) => Self::unprocessable("nonfinite", message),
            EngineError::UnknownProfile(_) => Self::not_found("profile_not_found", message),
            EngineError::Stopped | EngineError::Torch(_) => Self::internal(message),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::RunExists(name) => {
                Self::conflict("run_exists", format!("run `{name}` already exists"))
            }
            other => Self::internal(other),
        }
    }
}

impl From<tokio::task::JoinError> for ApiError {
    fn from(e: tokio::task::JoinError) -> Self {
        Self::internal(e)
    }
}
