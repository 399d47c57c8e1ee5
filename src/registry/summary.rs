//! What the server knows of a rank without asking the engine: its pushes,
//! layout, drift and failover, as the API shows them.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::clock::now_ms;
use crate::engine::rank::RankLayout;
use crate::node::Failover;
use crate::snapshot::meta;
use crate::store::StoredRank;

/// What the server knows of a rank without asking the engine.
#[derive(Debug, Clone, Default)]
pub struct RankSummary {
    pub last_step: Option<u64>,
    pub pushes: u64,
    pub duplicates: u64,
    pub bytes_received: u64,
    pub rejections: u64,
    pub resident_bytes: u64,
    pub last_push_at_ms: Option<i64>,
    pub last_apply_seconds: Option<f64>,
    /// The registered layout (JSON), once the rank pushed.
    pub layout: Option<Arc<serde_json::Value>>,
    /// Number of tensors and elements in the layout.
    pub tensors: usize,
    pub numel: u64,
    /// The rank's EMA is held by the engine (false after a restart until
    /// the rank pushes again or its state is restored).
    pub live: bool,
    /// Exponentially weighted mean of push latency (request start to answer).
    pub push_seconds_ewma: Option<f64>,
    /// Recent pushes `(at_ms, bytes)`, for the rank's throughput.
    pub recent: std::collections::VecDeque<(i64, u64)>,
    /// Latest drift sample per profile: `(||EMA - online||^2, ||online||^2)`.
    pub drift: BTreeMap<String, (f64, f64)>,
    /// The step of that sample.
    pub drift_step: Option<u64>,
    /// Wire bytes against logical bytes, codec time.
    pub wire: crate::wire::stats::WireStats,
    /// The rank's last failover, when its node was ever lost.
    pub failover: Option<Failover>,
}

/// Milliseconds without a push after which a rank counts as stale, at
/// least (see [`RankSummary::stale_after_ms`]).
pub const STALE_AFTER_MS: i64 = 60_000;

/// Pushes remembered per rank for its throughput.
const RECENT_PUSHES: usize = 32;

impl RankSummary {
    /// Records an applied push's size and latency.
    pub fn note_push(&mut self, bytes: u64, seconds: f64) {
        let now = now_ms();
        self.push_seconds_ewma = Some(match self.push_seconds_ewma {
            None => seconds,
            Some(prev) => 0.8 * prev + 0.2 * seconds,
        });
        if self.recent.len() == RECENT_PUSHES {
            self.recent.pop_front();
        }
        self.recent.push_back((now, bytes));
    }

    /// Milliseconds without a push after which this rank counts as stale:
    /// [`STALE_AFTER_MS`], or three times its usual interval between pushes
    /// (the median over the remembered ones) when that is longer, so a run
    /// that pushes every few minutes is not shown stale between pushes.
    pub fn stale_after_ms(&self) -> i64 {
        let times: Vec<i64> = self.recent.iter().map(|(t, _)| *t).collect();
        if times.len() < 3 {
            return STALE_AFTER_MS;
        }
        let mut gaps: Vec<i64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        gaps.sort_unstable();
        STALE_AFTER_MS.max(3 * gaps[gaps.len() / 2])
    }

    /// Bytes per second over the remembered pushes.
    pub fn bytes_per_second(&self) -> Option<f64> {
        let (first, _) = *self.recent.front()?;
        let (last, _) = *self.recent.back()?;
        if self.recent.len() < 2 || last <= first {
            return None;
        }
        let bytes: u64 = self.recent.iter().skip(1).map(|(_, b)| b).sum();
        Some(bytes as f64 / ((last - first) as f64 / 1000.0))
    }
}

impl RankSummary {
    pub fn from_stored(row: StoredRank) -> Self {
        // The catalog keeps the layout in the stored format; the summary
        // holds the view the API shows (as a live push leaves it).
        let layout = row.layout.and_then(|v| match meta::decode_layout(&v) {
            Ok(layout) => serde_json::to_value(&layout).ok(),
            Err(e) => {
                tracing::warn!(rank = row.rank, error = %e, "a rank's stored layout is unreadable");
                None
            }
        });
        let (tensors, numel) = layout.as_ref().map(layout_counts).unwrap_or_default();
        RankSummary {
            last_step: row.last_step,
            pushes: row.pushes,
            duplicates: 0,
            bytes_received: row.bytes_received,
            rejections: row.rejections,
            resident_bytes: 0,
            last_push_at_ms: row.last_push_at_ms,
            last_apply_seconds: None,
            layout: layout.map(Arc::new),
            tensors,
            numel,
            live: false,
            failover: row.failover.and_then(|f| serde_json::from_value(f).ok()),
            wire: row
                .wire
                .and_then(|w| serde_json::from_value(w).ok())
                .unwrap_or_default(),
            ..Default::default()
        }
    }

    pub fn to_row(&self, rank: u32) -> StoredRank {
        StoredRank {
            rank,
            layout: None,
            last_step: self.last_step,
            pushes: self.pushes,
            bytes_received: self.bytes_received,
            rejections: self.rejections,
            resident_bytes: self.resident_bytes,
            last_push_at_ms: self.last_push_at_ms,
            failover: None,
            wire: serde_json::to_value(&self.wire).ok(),
        }
    }
}

fn layout_counts(layout: &serde_json::Value) -> (usize, u64) {
    let tensors = layout["tensors"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let numel = tensors.iter().filter_map(|t| t["numel"].as_u64()).sum();
    (tensors.len(), numel)
}

/// Counts of a freshly registered layout.
pub fn counts_of(layout: &RankLayout) -> (usize, u64) {
    (
        layout.tensors.len(),
        layout.tensors.iter().map(|t| t.numel as u64).sum(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pushed_at(times: &[i64]) -> RankSummary {
        RankSummary {
            recent: times.iter().map(|&t| (t, 1)).collect(),
            ..RankSummary::default()
        }
    }

    #[test]
    fn a_failover_counts_the_update_steps_between_restore_and_resume() {
        let taken = |restored| Failover {
            from_node: "b".into(),
            restart: false,
            epoch: 2,
            at_ms: 0,
            snapshot: None,
            restored_step: restored,
            last_seen_step: None,
            resumed_step: None,
            lost_steps: None,
        };
        let lost = |restored, step, every| {
            let mut f = taken(restored);
            f.resumed_at(step, every);
            assert_eq!(f.resumed_step, Some(step));
            f.lost_steps.unwrap()
        };
        // Every step updates: 10..=14 lost between 9 and 15.
        assert_eq!(lost(Some(9), 15, 1), 5);
        // Nothing lost: the next step is the one after the restored one.
        assert_eq!(lost(Some(14), 15, 1), 0);
        // Every 5th step: the update steps after 5 and before the push ...
        assert_eq!(lost(Some(5), 20, 5), 2); // 10, 15
        assert_eq!(lost(Some(5), 10, 5), 0);
        // ... and a resume off the update grid counts those before it.
        assert_eq!(lost(Some(5), 17, 5), 2); // 10, 15
                                             // No snapshot held the rank: every update step before the push.
        assert_eq!(lost(None, 7, 1), 7);
        assert_eq!(lost(None, 0, 1), 0);
        assert_eq!(lost(None, 12, 5), 3); // 0, 5, 10
    }

    #[test]
    fn stale_after_follows_the_usual_push_interval() {
        // Too few pushes to tell, or frequent pushes: the floor.
        assert_eq!(pushed_at(&[0, 300_000]).stale_after_ms(), STALE_AFTER_MS);
        assert_eq!(
            pushed_at(&[0, 1_000, 2_000, 3_000]).stale_after_ms(),
            STALE_AFTER_MS
        );
        // Every five minutes, with one long pause: three median intervals.
        let rare = pushed_at(&[0, 300_000, 600_000, 4_000_000, 4_300_000]);
        assert_eq!(rare.stale_after_ms(), 3 * 300_000);
    }
}
