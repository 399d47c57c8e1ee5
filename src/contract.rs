//! The closed sets of values the contract names (`docs/contract.md`):
//! snapshot kinds and statuses, how a manual cut chose its step, the kinds
//! of events, run health, rank and node statuses, alert kinds and states,
//! and download layouts. Each is a serde enum whose JSON (and catalog) spelling
//! is the documented string; the catalog, the event bus, the API and the
//! OpenAPI schema all use these types, and `clients/python/polyak/contract.py`
//! names the same values (a test compares the two).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// A text the catalog (or a request) holds that names no value of the set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{value}` is not a {what} (expected one of {expected})")]
pub struct UnknownValue {
    pub what: &'static str,
    pub value: String,
    pub expected: String,
}

/// The string enums of the contract: each variant's spelling, every
/// variant, `Display` and `FromStr`.
macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident, $what:literal { $($(#[$vmeta:meta])* $variant:ident = $text:tt,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, ToSchema)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant,)*
        }

        impl $name {
            /// Every value, in the documented order.
            pub const ALL: &'static [$name] = &[$($name::$variant),*];

            /// The JSON (and catalog) spelling.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)*
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownValue;

            fn from_str(s: &str) -> Result<Self, UnknownValue> {
                match s {
                    $($text => Ok($name::$variant),)*
                    _ => Err(UnknownValue {
                        what: $what,
                        value: s.to_string(),
                        expected: [$($text),*].join(", "),
                    }),
                }
            }
        }
    };
}

string_enum! {
    /// A snapshot's `kind`.
    SnapshotKind, "snapshot kind" {
        /// Requested (`POST .../snapshots`) or the final one of a finished run.
        Manual = "manual",
        /// Taken every `snapshot_every` steps.
        Periodic = "periodic",
        /// Crash-recovery persistence; its ranks may sit at different steps.
        State = "state",
        /// Computed from stored snapshots for other `sigma_rel`s.
        Posthoc = "posthoc",
        /// A merged checkpoint computed from stored snapshots.
        Merge = "merge",
    }
}

impl SnapshotKind {
    /// Computed by the server from stored snapshots (never restored from,
    /// never a source of another derived snapshot).
    pub const fn is_derived(self) -> bool {
        matches!(self, SnapshotKind::Posthoc | SnapshotKind::Merge)
    }

    /// A cut of the live EMA at one step on every rank (`manual` or
    /// `periodic`): what post-hoc and merges read.
    pub const fn is_cut(self) -> bool {
        matches!(self, SnapshotKind::Manual | SnapshotKind::Periodic)
    }
}

string_enum! {
    /// A snapshot row's `status`.
    SnapshotStatus, "snapshot status" {
        /// Scheduled or being written; a derived one also has `progress`.
        Pending = "pending",
        /// Every rank's files are stored and in the catalog.
        Complete = "complete",
        /// Will never complete; the row's `reason` says why.
        Failed = "failed",
    }
}

string_enum! {
    /// The `status` of a `snapshot` event: a row's statuses, plus what only
    /// the event stream reports.
    SnapshotEventStatus, "snapshot event status" {
        Pending = "pending",
        Complete = "complete",
        Failed = "failed",
        /// A derived snapshot's progress (`done`, `total` source bytes).
        Running = "running",
        /// A due periodic cut skipped (the write backlog is full).
        Skipped = "skipped",
        /// Deleted (by a request, or by retention).
        Deleted = "deleted",
    }
}

string_enum! {
    /// `detail.cut` of a manual snapshot: how its step was chosen.
    CutKind, "cut" {
        /// Every rank had applied the ranks' current step: cut at once.
        Current = "current",
        /// The next update step after the furthest rank.
        NextUpdate = "next_update",
        /// The step the request named.
        Requested = "requested",
        /// The final snapshot of a finished run.
        Final = "final",
    }
}

string_enum! {
    /// The `kind` of an event on `GET /v1/runs/{run}/events`.
    EventKind, "event kind" {
        RunCreated = "run_created",
        RankRegistered = "rank_registered",
        Push = "push",
        Rejection = "rejection",
        /// A keyframe found the mirror diverged from the client's copy.
        MirrorMismatch = "mirror_mismatch",
        Snapshot = "snapshot",
        Finished = "finished",
        Resumed = "resumed",
        Restored = "restored",
        /// A rank was taken over from a node that was gone, or restored by
        /// its own node after a restart (and, at its next push, the steps
        /// its EMA lost).
        Failover = "failover",
        Annotated = "annotated",
        /// A stored part read back other than it was written (size or
        /// sha256): the read was refused.
        SnapshotCorrupt = "snapshot_corrupt",
        Alert = "alert",
        /// Metric posts, for live subscribers only (not stored).
        Metrics = "metrics",
        /// An evaluation of a candidate was stored.
        Eval = "eval",
    }
}

string_enum! {
    /// What an evaluated candidate is: which weights of a snapshot.
    CandidateKind, "candidate kind" {
        /// A live profile's EMA, as a cut (`manual` or `periodic`) stored it.
        Ema = "ema",
        /// The online weights (the run's mirror) stored with a cut.
        Online = "online",
        /// A post-hoc EMA synthesised for one `sigma_rel`.
        Posthoc = "posthoc",
        /// A merged checkpoint.
        Merge = "merge",
    }
}

string_enum! {
    /// Which end of a metric is best (`GET .../best?mode=`).
    BestMode, "mode" {
        /// Lowest wins (a loss, an FID).
        Min = "min",
        /// Highest wins (an accuracy).
        Max = "max",
    }
}

string_enum! {
    /// A run's `health`, from its ranks' statuses.
    RunHealth, "run health" {
        /// Every rank pushed recently.
        Healthy = "healthy",
        /// Some rank is stale, or known from the catalog and not restored.
        Degraded = "degraded",
        /// Some ranks pushed, others never did.
        Waiting = "waiting",
        /// No rank pushed yet.
        Idle = "idle",
        /// Ended by `POST .../finish`.
        Finished = "finished",
    }
}

string_enum! {
    /// A rank's `status`.
    RankStatus, "rank status" {
        /// Pushing recently.
        Live = "live",
        /// No push for longer than its `stale_after_seconds`.
        Stale = "stale",
        /// Never pushed.
        NeverSeen = "never_seen",
        /// Known from the catalog; its EMA is not in memory since a restart.
        NotRestored = "not_restored",
        /// Its run is finished.
        Finished = "finished",
    }
}

string_enum! {
    /// A node's `status` (`GET /v1/nodes`).
    NodeStatus, "node status" {
        /// Its lease is held.
        Live = "live",
        /// Its lease was not renewed in time.
        Expired = "expired",
        /// It stopped gracefully.
        Left = "left",
    }
}

string_enum! {
    /// An alert's `kind`: the condition it watches.
    AlertKind, "alert kind" {
        /// A rank without a push for longer than the rule allows.
        StaleRank = "stale_rank",
        /// A rank pushed non-finite values.
        Nonfinite = "nonfinite",
        MetricAbove = "metric_above",
        MetricBelow = "metric_below",
        /// A metric without a new best for `patience` steps.
        NoImprovement = "no_improvement",
        /// The data directory's free space under the rule's fraction.
        DiskFull = "disk_full",
        SnapshotFailed = "snapshot_failed",
        /// A stored part read back other than it was written.
        SnapshotCorrupt = "snapshot_corrupt",
        /// A rank's EMA lost update steps (restored after a restart or a
        /// failover short of the steps its trainer pushed); until
        /// acknowledged.
        StepsLost = "steps_lost",
    }
}

string_enum! {
    /// An alert's `state`.
    AlertState, "alert state" {
        /// Its condition holds.
        Firing = "firing",
        /// Its condition cleared.
        Resolved = "resolved",
    }
}

string_enum! {
    /// `layout=` of a snapshot download.
    DownloadLayout, "download layout" {
        /// One safetensors file of whole tensors.
        Full = "full",
        /// One file per rank, for `torch.distributed.checkpoint`.
        Sharded = "sharded",
        /// HF-style shards with their index.
        Hf = "hf",
        /// One stored file as it is (`rank=`).
        Rank = "rank",
    }
}

/// A hidden buffer a `bema` profile keeps beside its served weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BemaBuffer {
    /// `w0`, the weights BEMA's bias correction is taken from.
    Start,
    /// The plain EMA the served weights are corrected from.
    Ema,
}

/// The part name of a `bema` profile's hidden buffer: a profile part (its
/// averaged tensors in the EMA dtype) under a name no profile can have
/// (profile names start with a letter or digit), so it is captured and
/// restored with the profile and never offered as one.
pub fn bema_part(profile: &str, buffer: BemaBuffer) -> String {
    match buffer {
        BemaBuffer::Start => format!("__bema_w0__.{profile}"),
        BemaBuffer::Ema => format!("__bema_ema__.{profile}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip_through_serde_and_from_str() {
        fn check<T>(all: &[T])
        where
            T: Copy + PartialEq + std::fmt::Debug + std::fmt::Display,
            T: Serialize + for<'a> Deserialize<'a> + std::str::FromStr<Err = UnknownValue>,
        {
            for v in all {
                let text = v.to_string();
                assert_eq!(serde_json::to_value(v).unwrap(), serde_json::json!(text));
                assert_eq!(
                    serde_json::from_value::<T>(serde_json::json!(text)).unwrap(),
                    *v
                );
                assert_eq!(text.parse::<T>().unwrap(), *v);
            }
        }
        check(SnapshotKind::ALL);
        check(SnapshotStatus::ALL);
        check(SnapshotEventStatus::ALL);
        check(CutKind::ALL);
        check(EventKind::ALL);
        check(CandidateKind::ALL);
        check(BestMode::ALL);
        check(RunHealth::ALL);
        check(RankStatus::ALL);
        check(NodeStatus::ALL);
        check(AlertKind::ALL);
        check(AlertState::ALL);
        check(DownloadLayout::ALL);
        assert_eq!(EventKind::MirrorMismatch.as_str(), "mirror_mismatch");
        assert_eq!(CutKind::NextUpdate.as_str(), "next_update");
    }

    #[test]
    fn unknown_text_is_a_clear_error() {
        let err = "completed".parse::<SnapshotStatus>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "`completed` is not a snapshot status (expected one of pending, complete, failed)"
        );
        assert!("Manual".parse::<SnapshotKind>().is_err());
    }

    #[test]
    fn derived_and_cut_kinds() {
        let derived: Vec<_> = SnapshotKind::ALL
            .iter()
            .filter(|k| k.is_derived())
            .collect();
        assert_eq!(derived, [&SnapshotKind::Posthoc, &SnapshotKind::Merge]);
        let cuts: Vec<_> = SnapshotKind::ALL.iter().filter(|k| k.is_cut()).collect();
        assert_eq!(cuts, [&SnapshotKind::Manual, &SnapshotKind::Periodic]);
    }
}
