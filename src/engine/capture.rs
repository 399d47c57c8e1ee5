//! Consistent cuts on the engine side.
//!
//! A pending cut waits for each rank to apply step `S`; right after a rank
//! applies it, the rank's buffers are copied on the device (the only work
//! ingestion waits for) and handed to the snapshot writer, which serialises
//! and persists them elsewhere. A rank that is already past `S`, or that
//! jumps over it, fails the cut with a reason.
//!
//! Periodic cuts are bounded: the bytes a run's periodic cuts have captured
//! and not yet written (its [`Backlog`]) may not pass the server's budget.
//! A cut that would pass it is skipped (one is always allowed), so a disk
//! slower than `snapshot_every` cannot pile copies up in memory.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::rank::{BemaBuffers, RankLayout, RankState};
use super::{deep_copy, EngineError};
use crate::contract::{bema_part, BemaBuffer};
use crate::run::RunConfig;
use crate::wire::check::BodyDigest;

/// A cut the engine is waiting on.
#[derive(Debug, Clone)]
pub struct PendingCut {
    pub snapshot: String,
    pub step: u64,
    /// Profile indices captured.
    pub profiles: Vec<usize>,
    /// Ranks that have not captured yet.
    pub remaining: BTreeSet<u32>,
}

/// The step bookkeeping of a rank that a restore needs, stored as JSON with
/// the snapshot's files.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankMeta {
    pub layout: RankLayout,
    pub last_step: Option<u64>,
    /// The digest of the body applied at `last_step` ([`BodyDigest`]'s
    /// stored form).
    pub last_digest: Option<String>,
    /// Per profile name: pushes averaged (SWA).
    pub swa_n: BTreeMap<String, u64>,
    pub has_keyframe: bool,
    /// The rank's lineage: raised by every `resume` (which goes back to an
    /// older step on purpose), kept by a restore or a failover. A restore
    /// ranks one owner's states by it, then by step: an order the server
    /// controls, never the wall clock.
    pub generation: u64,
}

/// One rank's buffers at one step, copied on the device.
pub struct RankCapture {
    pub snapshot: String,
    pub run: String,
    pub rank: u32,
    pub step: u64,
    pub layout: Arc<RankLayout>,
    /// (profile name, flat EMA copy); a `bema` profile's hidden buffers
    /// follow it under their part names (`contract::bema_part`), written as
    /// profile parts like it.
    pub profiles: Vec<(String, Tensor)>,
    pub copied: Vec<Tensor>,
    pub mirror: Option<Vec<Tensor>>,
    pub meta: RankMeta,
    /// When the copy was taken (wall clock, ms): the order of one owner's
    /// captures of a rank, which a restore follows (a resume goes back to
    /// an older step on purpose, so steps alone do not give it).
    pub captured_at_ms: i64,
}

/// What the engine tells the snapshot manager.
pub enum CaptureEvent {
    /// A rank's part of a cut (or of a state snapshot) is ready to write.
    Captured(Box<RankCapture>),
    /// A cut cannot complete.
    Failed { snapshot: String, reason: String },
    /// The engine opened a periodic cut at `step` (the manager records it
    /// and holds `backlog` until the snapshot completes or fails).
    PeriodicOpened {
        snapshot: String,
        run: String,
        step: u64,
        profiles: Vec<String>,
        backlog: Backlog,
    },
    /// A periodic cut at `step` was not taken: the run's earlier periodic
    /// cuts still held `held` captured bytes, and this one would add `bytes`
    /// past the server's backlog.
    PeriodicSkipped {
        run: String,
        step: u64,
        held: u64,
        bytes: u64,
    },
}

/// Bytes a run's periodic cuts hold between capture and the end of their
/// snapshot. Each open cut owns one of these; dropping it (the snapshot
/// completed, failed or was deleted) gives its bytes back.
pub struct Backlog {
    held: Arc<AtomicU64>,
    bytes: u64,
}

impl Backlog {
    /// Takes `bytes` of the run's backlog `held`, unless the run already
    /// holds some and the sum would pass `limit` (then `Err(held now)`).
    pub fn take(held: &Arc<AtomicU64>, bytes: u64, limit: u64) -> Result<Backlog, u64> {
        held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
            (now == 0 || now.saturating_add(bytes) <= limit).then(|| now + bytes)
        })?;
        Ok(Backlog {
            held: held.clone(),
            bytes,
        })
    }
}

impl Drop for Backlog {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Copies a rank's buffers for the given profiles (and the mirror).
pub fn capture_rank(
    config: &RunConfig,
    state: &RankState,
    snapshot: &str,
    rank: u32,
    profiles: &[usize],
) -> Result<RankCapture, EngineError> {
    let step = state.last_step.unwrap_or(0);
    Ok(RankCapture {
        snapshot: snapshot.to_string(),
        run: config.name.clone(),
        rank,
        step,
        layout: state.layout.clone(),
        profiles: profiles
            .iter()
            .map(|&p| profile_buffers(config, state, p))
            .collect::<Result<Vec<_>, EngineError>>()?
            .into_iter()
            .flatten()
            .collect(),
        copied: state
            .copied
            .iter()
            .map(deep_copy)
            .collect::<Result<_, _>>()?,
        mirror: match &state.mirror {
            Some(m) => Some(m.iter().map(deep_copy).collect::<Result<_, _>>()?),
            None => None,
        },
        meta: meta_of(config, state),
        captured_at_ms: crate::clock::now_ms(),
    })
}

/// Copies of profile `p`'s buffers under their part names: the served EMA,
/// then a `bema` profile's `w0` and plain EMA.
fn profile_buffers(
    config: &RunConfig,
    state: &RankState,
    p: usize,
) -> Result<Vec<(String, Tensor)>, EngineError> {
    let name = config.profiles[p].name();
    let mut out = vec![(name.to_string(), deep_copy(&state.ema[p])?)];
    if let Some(Some(bufs)) = state.bema.get(p) {
        out.push((bema_part(name, BemaBuffer::Start), deep_copy(&bufs.start)?));
        out.push((bema_part(name, BemaBuffer::Ema), deep_copy(&bufs.ema)?));
    }
    Ok(out)
}

pub fn meta_of(config: &RunConfig, state: &RankState) -> RankMeta {
    RankMeta {
        layout: (*state.layout).clone(),
        last_step: state.last_step,
        last_digest: state.last_digest.map(BodyDigest::to_stored),
        swa_n: config
            .profiles
            .iter()
            .zip(&state.swa_n)
            .map(|(p, &n)| (p.name().to_string(), n))
            .collect(),
        has_keyframe: state.has_keyframe,
        generation: state.generation,
    }
}

/// Tensors read back from a snapshot, to rebuild a rank.
pub struct RestoredRank {
    pub meta: RankMeta,
    /// Per profile index: the flat EMA (ema dtype, on the host).
    pub ema: Vec<Tensor>,
    pub copied: Vec<Tensor>,
    pub mirror: Option<Vec<Tensor>>,
    /// Per profile index: a `bema` profile's `(w0, plain EMA)` (ema dtype,
    /// on the host); empty when the run has none.
    pub bema: Vec<Option<(Tensor, Tensor)>>,
}

impl RestoredRank {
    /// Builds the engine's rank state on `device`.
    pub fn into_state(
        self,
        config: &RunConfig,
        device: tch::Device,
    ) -> Result<RankState, EngineError> {
        // The stored format's reader built the index (snapshot::meta).
        let layout = self.meta.layout;
        let to = |t: Tensor| t.f_to_device(device);
        let swa_n = config
            .profiles
            .iter()
            .map(|p| self.meta.swa_n.get(p.name()).copied().unwrap_or(0))
            .collect();
        let mut hidden = self.bema.into_iter();
        let mut bema = Vec::with_capacity(config.profiles.len());
        for (p, profile) in config.profiles.iter().enumerate() {
            let restored = hidden.next().flatten();
            bema.push(match (profile.is_bema(), restored) {
                (false, _) => None,
                (true, Some((start, ema))) => Some(BemaBuffers {
                    start: to(start)?,
                    ema: to(ema)?,
                }),
                // The snapshot readers refuse a bema profile without its
                // buffers; a caller that built none restarts them from the
                // served weights.
                (true, None) => {
                    tracing::warn!(profile = profile.name(), "a bema profile restored without its w0 and EMA: restarted from its served weights");
                    Some(BemaBuffers {
                        start: deep_copy(&self.ema[p])?.f_to_device(device)?,
                        ema: deep_copy(&self.ema[p])?.f_to_device(device)?,
                    })
                }
            });
        }
        Ok(RankState {
            layout: Arc::new(layout),
            ema: self.ema.into_iter().map(to).collect::<Result<_, _>>()?,
            copied: self.copied.into_iter().map(to).collect::<Result<_, _>>()?,
            mirror: match self.mirror {
                Some(m) => Some(m.into_iter().map(to).collect::<Result<_, _>>()?),
                None => None,
            },
            swa_n,
            bema,
            last_step: self.meta.last_step,
            last_digest: self
                .meta
                .last_digest
                .as_deref()
                .and_then(BodyDigest::from_stored),
            recent: Default::default(),
            has_keyframe: self.meta.has_keyframe,
            generation: self.meta.generation,
            applied: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One cut is always allowed, more only within the limit, and a
    /// dropped share is given back.
    #[test]
    fn backlog_allows_one_cut_and_more_within_the_limit() {
        let held = Arc::new(AtomicU64::new(0));
        let big = Backlog::take(&held, 500, 100).expect("the first cut is always taken");
        assert_eq!(held.load(Ordering::Acquire), 500);
        assert_eq!(Backlog::take(&held, 1, 100).err(), Some(500));
        drop(big);
        assert_eq!(held.load(Ordering::Acquire), 0);
        let a = Backlog::take(&held, 60, 100).expect("within the limit");
        let b = Backlog::take(&held, 40, 100).expect("exactly at the limit");
        assert_eq!(Backlog::take(&held, 1, 100).err(), Some(100));
        drop(a);
        let c = Backlog::take(&held, 60, 100).expect("room again");
        assert_eq!(held.load(Ordering::Acquire), 100);
        drop((b, c));
        assert_eq!(held.load(Ordering::Acquire), 0);
    }
}
