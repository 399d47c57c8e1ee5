//! A pipelined push (`Polyak-Prev-Step`) waits, validated, for its
//! predecessor's answer; a rank just taken over waits a moment more.

use super::{Ingest, ValidatedPush};
use crate::registry::RankSummary;
use crate::services::ServiceError;

impl Ingest {
    /// A pipelined push waits here, validated, until its predecessor step
    /// was answered (or the rank applied a step at or past it).
    pub(super) async fn wait_for_predecessor(
        &self,
        push: &ValidatedPush,
        prev: u64,
    ) -> Result<(), ServiceError> {
        let (run, rank) = (&push.run, push.rank);
        // A rank taken over from a lost node, until its first push after
        // the failover applies: the predecessor may have been applied on
        // the lost node only. One the catalog saw applied there never comes
        // here, so the push goes on at once; another is given a moment to
        // begin here (pushes resent side by side), else taken as lost. The
        // steps lost are reported.
        let last_seen = run.rank_with(rank, |s| {
            awaits_resumption(s).then(|| s.failover.as_ref().and_then(|f| f.last_seen_step))
        });
        let lost_after = match last_seen.flatten() {
            Some(seen) if seen.is_some_and(|s| prev <= s) => return Ok(()),
            Some(_) => Some(FAILOVER_GRACE),
            None => None,
        };
        let applied = || run.rank_with(rank, |s| s.last_step).flatten();
        self.pipeline
            .wait_for(
                (run.config.name.as_str(), run.created_at_ms),
                rank,
                push.step,
                prev,
                applied,
                self.ctx.args.retry_after_secs,
                lost_after,
            )
            .await
    }
}

/// Whether a rank was taken over from a lost node and has not applied a
/// push since.
pub(super) fn awaits_resumption(s: &RankSummary) -> bool {
    s.failover
        .as_ref()
        .is_some_and(|f| f.resumed_step.is_none())
}

/// How long a push to a rank just taken over waits for its predecessor to
/// begin here before taking it as lost with the node (see
/// [`Ingest::wait_for_predecessor`]).
const FAILOVER_GRACE: std::time::Duration = std::time::Duration::from_secs(1);
