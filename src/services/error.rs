//! The error services answer with: a status class and a stable code, so
//! that the HTTP edge renders it without knowing the service's internals,
//! and the ingest service can record a rejection with the same code the
//! client sees. The tables mapping the lower layers' errors live here, once.

use crate::engine::EngineError;
use crate::run::FieldError;
use crate::snapshot::assemble::AssembleError;
use crate::snapshot::meta::MetaError;
use crate::store::StoreError;
use crate::wire::codec::CodecError;
use crate::wire::WireError;

/// Whose fault a failure is and what the caller can do about it: each
/// kind is answered with one HTTP status, by [`ErrorKind::status`] (the one
/// table), so no service picks a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request is malformed (400).
    BadRequest,
    /// What it names does not exist (404).
    NotFound,
    /// The client sent its body too slowly (408).
    Timeout,
    /// It contradicts the state it met (409).
    Conflict,
    /// Too many bytes (413).
    TooLarge,
    /// A `Content-Encoding` the server does not read (415).
    UnsupportedMedia,
    /// Well-formed, but a value is out of its domain (422).
    Unprocessable,
    /// The server is at its bound: retry after `retry_after` (429).
    Busy,
    /// The server's fault (500).
    Internal,
    /// Another node did not answer, or answered with a fault (502).
    PeerFailed,
    /// A dependency (catalog, object store, the lease) is out for now (503).
    Unavailable,
    /// Writing it would pass the disk reserve (507).
    NoSpace,
}

impl ErrorKind {
    /// Every kind, for the table's test.
    pub const ALL: &'static [ErrorKind] = &[
        ErrorKind::BadRequest,
        ErrorKind::NotFound,
        ErrorKind::Timeout,
        ErrorKind::Conflict,
        ErrorKind::TooLarge,
        ErrorKind::UnsupportedMedia,
        ErrorKind::Unprocessable,
        ErrorKind::Busy,
        ErrorKind::Internal,
        ErrorKind::PeerFailed,
        ErrorKind::Unavailable,
        ErrorKind::NoSpace,
    ];

    /// The HTTP status it is answered with: 4xx the caller's mistake (the
    /// request changed nothing), 5xx the server's.
    pub const fn status(self) -> u16 {
        match self {
            ErrorKind::BadRequest => 400,
            ErrorKind::NotFound => 404,
            ErrorKind::Timeout => 408,
            ErrorKind::Conflict => 409,
            ErrorKind::TooLarge => 413,
            ErrorKind::UnsupportedMedia => 415,
            ErrorKind::Unprocessable => 422,
            ErrorKind::Busy => 429,
            ErrorKind::Internal => 500,
            ErrorKind::PeerFailed => 502,
            ErrorKind::Unavailable => 503,
            ErrorKind::NoSpace => 507,
        }
    }

    /// A client sends the same request again after it (busy, its body too
    /// slow, the server's fault); any other answer is final.
    pub const fn retried(self) -> bool {
        matches!(self, ErrorKind::Busy | ErrorKind::Timeout) || self.status() >= 500
    }
}

#[derive(Debug)]
pub struct ServiceError {
    /// Whose fault, and so the HTTP status it is answered with.
    pub kind: ErrorKind,
    /// Stable machine-readable code, e.g. `step_conflict`.
    pub code: &'static str,
    pub message: String,
    /// The configuration field at fault, when there is one.
    pub field: Option<String>,
    /// Seconds the client should wait before retrying (429).
    pub retry_after: Option<u64>,
}

impl ServiceError {
    pub fn new(kind: ErrorKind, code: &'static str, message: impl Into<String>) -> Self {
        ServiceError {
            kind,
            code,
            message: message.into(),
            field: None,
            retry_after: None,
        }
    }

    /// The HTTP status of its kind.
    pub const fn status(&self) -> u16 {
        self.kind.status()
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadRequest, code, message)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, code, message)
    }

    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Conflict, code, message)
    }

    pub fn unprocessable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unprocessable, code, message)
    }

    pub fn too_large(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::TooLarge, code, message)
    }

    /// 429 `busy` with a `Retry-After` of `retry_after` seconds.
    pub fn busy(message: impl Into<String>, retry_after: u64) -> Self {
        ServiceError {
            retry_after: Some(retry_after),
            ..Self::new(ErrorKind::Busy, "busy", message)
        }
    }

    /// A server fault with a code of its own (the cause, for operators and
    /// retries); the detail is logged, the answer says `what` failed.
    pub fn fault(
        kind: ErrorKind,
        code: &'static str,
        what: &str,
        detail: impl std::fmt::Display,
    ) -> Self {
        tracing::error!(code, error = %detail, "{what}");
        Self::new(kind, code, format!("{what}; the server log has the detail"))
    }

    /// A 500 whose detail is logged, not sent.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        tracing::error!(error = %detail, "internal error");
        Self::new(
            ErrorKind::Internal,
            "internal",
            "internal error; the server log has the detail",
        )
    }

    /// A blocking worker that panicked or was cancelled.
    pub fn worker_failed(detail: impl std::fmt::Display) -> Self {
        Self::fault(
            ErrorKind::Internal,
            "worker_failed",
            "a server worker failed",
            detail,
        )
    }

    /// Reading or writing stored snapshot bytes failed.
    pub fn snapshot_io(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::NotConnected {
            // The object store is down (see `snapshot::source`).
            return ServiceError {
                retry_after: Some(5),
                ..Self::fault(
                    ErrorKind::Unavailable,
                    "store_unavailable",
                    "the object store cannot be reached",
                    e,
                )
            };
        }
        if let Some(m) = crate::snapshot::source::PartMismatch::of(&e) {
            // Naming the part is what an operator needs to act on it.
            return Self::new(ErrorKind::Internal, "snapshot_corrupt", m.to_string());
        }
        let code = if e.kind() == std::io::ErrorKind::NotFound {
            "snapshot_part_missing"
        } else {
            "snapshot_io"
        };
        Self::fault(
            ErrorKind::Internal,
            code,
            "stored snapshot data could not be read",
            e,
        )
    }

    /// A stored snapshot part that does not parse.
    fn snapshot_corrupt(detail: impl std::fmt::Display) -> Self {
        Self::fault(
            ErrorKind::Internal,
            "snapshot_corrupt",
            "a stored snapshot part cannot be read back",
            detail,
        )
    }
}

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status(), self.code, self.message)
    }
}

impl std::error::Error for ServiceError {}

impl From<FieldError> for ServiceError {
    fn from(e: FieldError) -> Self {
        ServiceError {
            field: Some(e.field.clone()),
            ..Self::unprocessable("invalid_config", e.to_string())
        }
    }
}

impl From<WireError> for ServiceError {
    fn from(e: WireError) -> Self {
        let message = e.to_string();
        match e {
            WireError::Invalid(_) => Self::bad_request("invalid_safetensors", message),
            WireError::HeaderTooLarge { .. } => Self::too_large("header_too_large", message),
            WireError::UnsupportedDtype { .. } => Self::unprocessable("unsupported_dtype", message),
            WireError::InvalidShards(_) => Self::unprocessable("invalid_shards", message),
            WireError::InvalidMetadata(_) => Self::unprocessable("invalid_metadata", message),
            WireError::Nonfinite { .. } => Self::unprocessable("nonfinite", message),
            WireError::Empty => Self::unprocessable("empty_push", message),
        }
    }
}

impl From<CodecError> for ServiceError {
    fn from(e: CodecError) -> Self {
        let message = e.to_string();
        match e {
            CodecError::Corrupt(_) => Self::bad_request("invalid_encoding", message),
            CodecError::TooLarge { .. } => Self::too_large("body_too_large", message),
        }
    }
}

impl From<EngineError> for ServiceError {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        match e {
            EngineError::QueueFull => Self::busy(message, 1),
            EngineError::RunNotFound(_) => Self::not_found("run_not_found", message),
            EngineError::NoData { .. } => Self::not_found("no_data", message),
            EngineError::StepConflict(_) => Self::conflict("step_conflict", message),
            EngineError::RunFinished(_) => Self::conflict("run_finished", message),
            EngineError::Finishing(_) => ServiceError {
                retry_after: Some(1),
                ..Self::new(ErrorKind::Unavailable, "run_finishing", message)
            },
            EngineError::LayoutMismatch(_) => Self::conflict("layout_mismatch", message),
            EngineError::NeedsKeyframe(_) => Self::conflict("needs_keyframe", message),
            EngineError::Nonfinite(_) => Self::unprocessable("nonfinite", message),
            EngineError::UnknownProfile(_) => Self::not_found("profile_not_found", message),
            EngineError::Stopped | EngineError::Torch(_) | EngineError::NotHere { .. } => {
                Self::internal(message)
            }
        }
    }
}

impl From<StoreError> for ServiceError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::RunExists(name) => {
                Self::conflict("run_exists", format!("run `{name}` already exists"))
            }
            // A row that references one deleted meanwhile (a snapshot, a
            // run): the caller's race with a delete, not a server fault.
            // PostgreSQL checks the key after the statement's own existence
            // test and names the constraint; SQLite serialises writes and
            // names none.
            StoreError::Sql(sqlx::Error::Database(db)) if db.is_foreign_key_violation() => match db
                .constraint()
            {
                Some(c) if c.ends_with("_snapshot_fkey") => Self::not_found(
                    "snapshot_not_found",
                    "the snapshot was deleted while the request ran",
                ),
                _ => Self::not_found("run_not_found", "the run was deleted while the request ran"),
            },
            StoreError::Json(_) | StoreError::Value(_) => Self::fault(
                ErrorKind::Internal,
                "catalog_corrupt",
                "the catalog holds a row the server cannot read",
                e,
            ),
            other if other.is_unavailable() => ServiceError {
                retry_after: Some(1),
                ..Self::fault(
                    ErrorKind::Unavailable,
                    "catalog_unavailable",
                    if other.is_disk_full() {
                        "the catalog's disk is full"
                    } else {
                        "the catalog cannot be reached"
                    },
                    other,
                )
            },
            other => Self::fault(
                ErrorKind::Internal,
                "catalog_error",
                "a catalog query failed",
                other,
            ),
        }
    }
}

impl From<crate::objstore::StoreError> for ServiceError {
    fn from(e: crate::objstore::StoreError) -> Self {
        match e {
            crate::objstore::StoreError::NotFound(_) => Self::fault(
                ErrorKind::Internal,
                "snapshot_part_missing",
                "a stored snapshot part is missing from the object store",
                e,
            ),
            other if other.is_unavailable() => ServiceError {
                retry_after: Some(5),
                ..Self::fault(
                    ErrorKind::Unavailable,
                    "store_unavailable",
                    "the object store cannot be reached",
                    other,
                )
            },
            other => Self::fault(
                ErrorKind::Internal,
                "store_error",
                "an object store request failed",
                other,
            ),
        }
    }
}

impl From<tokio::task::JoinError> for ServiceError {
    fn from(e: tokio::task::JoinError) -> Self {
        Self::worker_failed(e)
    }
}

impl From<SnapshotError> for ServiceError {
    fn from(e: SnapshotError) -> Self {
        match e {
            SnapshotError::Conflict(m) => Self::conflict("snapshot_conflict", m),
            SnapshotError::Peer(m) => ServiceError {
                retry_after: Some(1),
                ..Self::new(ErrorKind::PeerFailed, "node_unreachable", m)
            },
            SnapshotError::NotFound(m) => Self::not_found("snapshot_not_found", m),
            SnapshotError::Invalid(m) => Self::unprocessable("invalid_request", m),
            SnapshotError::Older(m) => Self::conflict("snapshot_older", m),
            SnapshotError::LeaseLost(m) => ServiceError {
                retry_after: Some(1),
                ..Self::new(ErrorKind::Unavailable, "lease_lost", m)
            },
            SnapshotError::Internal(m) => Self::internal(m),
            SnapshotError::Corrupt(m) => Self::snapshot_corrupt(m),
            SnapshotError::WriteFailed(m) => {
                Self::new(ErrorKind::Internal, "snapshot_write_failed", m)
            }
            SnapshotError::Meta(e) => Self::from(e),
            SnapshotError::Worker(m) => Self::worker_failed(m),
            SnapshotError::Engine(e) => e.into(),
            SnapshotError::Store(e) => e.into(),
            SnapshotError::Objects(e) => e.into(),
            SnapshotError::Io(e) => Self::snapshot_io(e),
            SnapshotError::NoSpace(e) => {
                Self::new(ErrorKind::NoSpace, "insufficient_storage", e.to_string())
            }
        }
    }
}

impl From<AssembleError> for ServiceError {
    fn from(e: AssembleError) -> Self {
        match e {
            AssembleError::DoesNotTile(m) => Self::unprocessable("does_not_tile", m),
            AssembleError::Missing(m) => Self::not_found("not_in_snapshot", m),
            AssembleError::Io(e) => Self::snapshot_io(e),
            AssembleError::Malformed(m) => Self::snapshot_corrupt(m),
            AssembleError::Format(e @ MetaError::Newer { .. }) => Self::from(e),
            AssembleError::Format(e) => Self::snapshot_corrupt(e),
        }
    }
}

/// Stored metadata this server cannot read: written by a newer version
/// (the answer says which format), or a catalog row that does not parse.
impl From<MetaError> for ServiceError {
    fn from(e: MetaError) -> Self {
        match e {
            MetaError::Newer { .. } => Self::new(
                ErrorKind::Internal,
                "snapshot_format_unsupported",
                e.to_string(),
            ),
            MetaError::Malformed(_) => Self::fault(
                ErrorKind::Internal,
                "catalog_corrupt",
                "the catalog holds a row the server cannot read",
                e,
            ),
        }
    }
}

/// What the snapshot service fails with.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    /// Another node holding ranks of the run did not answer (or answered
    /// with a fault): 502 `node_unreachable`, worth a retry.
    #[error("{0}")]
    Peer(String),
    /// `resume` found only a snapshot older than the step asked for.
    #[error("{0}")]
    Older(String),
    /// This node's lease lapsed: another node may hold its ranks now, so
    /// it writes no state for them until it has read the placement again
    /// (503 `lease_lost`, worth a retry).
    #[error("{0}")]
    LeaseLost(String),
    /// The server's fault (a worker that panicked, catalog data that does
    /// not hold together): answered 500, never blamed on the request.
    #[error("{0}")]
    Internal(String),
    /// A stored part could not be read back (truncated, bytes that do not
    /// parse, a part missing for a profile): 500 `snapshot_corrupt`.
    #[error("{0}")]
    Corrupt(String),
    /// A part's metadata (in the catalog) or a part file that this server
    /// cannot read: malformed (500 `catalog_corrupt`), or written in a
    /// newer format (500 `snapshot_format_unsupported`).
    #[error("{0}")]
    Meta(#[from] MetaError),
    /// Writing a snapshot's parts or committing it failed (the reason is
    /// the snapshot's): 500 `snapshot_write_failed`.
    #[error("{0}")]
    WriteFailed(String),
    /// A blocking worker panicked or was cancelled: 500 `worker_failed`.
    #[error("a worker failed: {0}")]
    Worker(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The object store (an outage: 503 `store_unavailable`; a part
    /// missing: 500 `snapshot_part_missing`).
    #[error(transparent)]
    Objects(#[from] crate::objstore::StoreError),
    #[error("snapshot files: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    NoSpace(#[from] NoSpace),
}

/// Why a write was refused before it started.
#[derive(Debug, thiserror::Error)]
#[error(
    "not enough disk space: {need} bytes to write would leave {left} of {free} free bytes, \
     under the reserve of {reserve} bytes (--disk-reserve); free some space (delete snapshots) \
     or lower the reserve"
)]
pub struct NoSpace {
    pub need: u64,
    pub free: u64,
    pub left: i128,
    pub reserve: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_own_status_and_only_the_servers_faults_are_5xx() {
        let statuses: std::collections::HashSet<u16> =
            ErrorKind::ALL.iter().map(|k| k.status()).collect();
        assert_eq!(
            statuses.len(),
            ErrorKind::ALL.len(),
            "two kinds share a status"
        );
        let caller = [
            ErrorKind::BadRequest,
            ErrorKind::NotFound,
            ErrorKind::Timeout,
            ErrorKind::Conflict,
            ErrorKind::TooLarge,
            ErrorKind::UnsupportedMedia,
            ErrorKind::Unprocessable,
            ErrorKind::Busy,
        ];
        for k in ErrorKind::ALL {
            let status = k.status();
            assert!((400..600).contains(&status), "{k:?}");
            assert_eq!(caller.contains(k), status < 500, "{k:?} answers {status}");
        }
        let retried: Vec<_> = ErrorKind::ALL.iter().filter(|k| k.retried()).collect();
        assert_eq!(
            retried,
            [
                &ErrorKind::Timeout,
                &ErrorKind::Busy,
                &ErrorKind::Internal,
                &ErrorKind::PeerFailed,
                &ErrorKind::Unavailable,
                &ErrorKind::NoSpace,
            ]
        );
    }

    #[test]
    fn lower_layers_errors_map_to_their_kinds() {
        let e = ServiceError::from(EngineError::QueueFull);
        assert_eq!(
            (e.kind, e.code, e.retry_after),
            (ErrorKind::Busy, "busy", Some(1))
        );
        let e = ServiceError::from(SnapshotError::LeaseLost("lapsed".into()));
        assert_eq!((e.status(), e.code), (503, "lease_lost"));
        let e = ServiceError::from(StoreError::RunExists("a".into()));
        assert_eq!((e.status(), e.code), (409, "run_exists"));
    }
}
