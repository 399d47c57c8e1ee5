//! Failures of engine work.

/// Failures of engine work. The HTTP layer maps each to a status.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the engine queue is full; retry later")]
    QueueFull,
    #[error("the engine thread stopped")]
    Stopped,
    #[error("run `{0}` is not on this engine")]
    RunNotFound(String),
    #[error("rank {rank} of run `{run}` is held by another engine")]
    NotHere { run: String, rank: u32 },
    #[error("rank {rank} of run `{run}` has not pushed yet")]
    NoData { run: String, rank: u32 },
    #[error("{0}")]
    StepConflict(String),
    #[error("{0}")]
    RunFinished(String),
    #[error("{0}")]
    Finishing(String),
    #[error("layout mismatch: {0}")]
    LayoutMismatch(String),
    #[error("{0}")]
    NeedsKeyframe(String),
    #[error("tensor `{0}` holds NaN or Inf (the run's nonfinite policy is `reject`)")]
    Nonfinite(String),
    #[error("no profile `{0}` in this run")]
    UnknownProfile(String),
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
}
