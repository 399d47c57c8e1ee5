//! A run's ranks spread over engines.
//!
//! Each rank lives on one engine (chosen when the run is installed, see
//! [`crate::registry`]); per-rank work goes to that engine alone, and the
//! few run-wide requests (the ranks' steps, a cut, a state capture, a
//! comparison's exports, dropping the run) go to each of the run's engines
//! at once and their answers are merged here.

use std::sync::Arc;

use futures::future::join_all;

use super::capture::{RankCapture, RestoredRank};
use super::shared::RunShared;
use super::{CutScheduled, EmaExport, Engine, EngineError, EngineHandle};

/// The engines of one run on this node, and which holds each rank (ranks
/// another node holds have none here).
#[derive(Clone)]
pub struct RunEngines {
    handles: Vec<EngineHandle>,
    /// Per rank: its engine's index in `handles`; `None` off this node.
    by_rank: Vec<Option<usize>>,
    shared: Arc<RunShared>,
}

impl RunEngines {
    /// `by_rank[r]` indexes `handles`; every handle holds at least one rank.
    pub fn new(
        handles: Vec<EngineHandle>,
        by_rank: Vec<Option<usize>>,
        shared: Arc<RunShared>,
    ) -> Self {
        debug_assert!(by_rank.iter().flatten().all(|&i| i < handles.len()));
        RunEngines {
            handles,
            by_rank,
            shared,
        }
    }

    /// The engine holding `rank`; `None` when another node holds it.
    pub fn of(&self, rank: u32) -> Option<&EngineHandle> {
        let i = (*self.by_rank.get(rank as usize)?)?;
        self.handles.get(i)
    }

    /// Whether an engine here holds `rank`.
    pub fn holds(&self, rank: u32) -> bool {
        self.of(rank).is_some()
    }

    pub fn all(&self) -> &[EngineHandle] {
        &self.handles
    }

    /// The ranks the `i`-th engine holds.
    pub fn ranks_of(&self, i: usize) -> Vec<u32> {
        (0..self.by_rank.len() as u32)
            .filter(|&r| self.by_rank[r as usize] == Some(i))
            .collect()
    }

    /// Per rank, the label of its engine (`cpu#0`, `cuda:1`); `None` for
    /// ranks another node holds.
    pub fn labels(&self) -> Vec<Option<&str>> {
        self.by_rank
            .iter()
            .map(|i| i.map(|i| self.handles[i].label()))
            .collect()
    }

    pub fn shared(&self) -> &Arc<RunShared> {
        &self.shared
    }

    /// Runs `f` on every engine of the run (waiting for room in the
    /// queues), all at once; the answers in engine order.
    pub async fn call_all<R, F>(&self, f: F) -> Result<Vec<R>, EngineError>
    where
        R: Send + 'static,
        F: Fn(&mut Engine) -> R + Clone + Send + 'static,
    {
        join_all(self.handles.iter().map(|h| h.call(f.clone())))
            .await
            .into_iter()
            .collect()
    }

    /// [`Self::call_all`], refused at once when a queue is full.
    pub async fn try_call_all<R, F>(&self, f: F) -> Result<Vec<R>, EngineError>
    where
        R: Send + 'static,
        F: Fn(&mut Engine) -> R + Clone + Send + 'static,
    {
        join_all(self.handles.iter().map(|h| h.try_call(f.clone())))
            .await
            .into_iter()
            .collect()
    }

    /// Per rank: the last applied step (`None`: no data).
    pub async fn rank_steps(&self, run: &str) -> Result<Vec<Option<u64>>, EngineError> {
        let name = run.to_string();
        let per_engine = self.call_all(move |e| e.rank_steps(&name)).await?;
        let mut out = vec![None; self.by_rank.len()];
        for steps in per_engine {
            for (slot, step) in out.iter_mut().zip(steps?) {
                *slot = (*slot).or(step);
            }
        }
        Ok(out)
    }

    /// Schedules a cut on every engine. When one refuses (a rank already
    /// past the step), the cut is withdrawn from the others.
    pub async fn schedule_cut(
        &self,
        run: &str,
        snapshot: &str,
        step: u64,
        profiles: Vec<usize>,
    ) -> Result<CutScheduled, EngineError> {
        let (name, sid) = (run.to_string(), snapshot.to_string());
        let answers = self
            .call_all(move |e| e.schedule_cut(&name, &sid, step, profiles.clone()))
            .await?;
        let mut waiting = Vec::new();
        let mut refused = None;
        for answer in answers {
            match answer {
                Ok(CutScheduled::Waiting(ranks)) => waiting.extend(ranks),
                Ok(CutScheduled::Captured) => {}
                Err(e) => refused = refused.or(Some(e)),
            }
        }
        if let Some(e) = refused {
            self.cancel_cut(run, snapshot).await;
            return Err(e);
        }
        waiting.sort_unstable();
        Ok(if waiting.is_empty() {
            CutScheduled::Captured
        } else {
            CutScheduled::Waiting(waiting)
        })
    }

    /// Forgets a pending cut on every engine.
    pub async fn cancel_cut(&self, run: &str, snapshot: &str) {
        let (name, sid) = (run.to_string(), snapshot.to_string());
        let _ = self.call_all(move |e| e.cancel_cut(&name, &sid)).await;
    }

    /// A `state` capture of every rank holding data, each at its own last
    /// step, and the changes each engine's part covers. `None` when no
    /// engine has a change to persist (unless `force`). When one engine
    /// has, every engine captures: a state snapshot restores the whole run.
    pub async fn capture_state(
        &self,
        run: &str,
        snapshot: &str,
        force: bool,
    ) -> Result<Option<(Vec<RankCapture>, Vec<u64>)>, EngineError> {
        let name = run.to_string();
        if !force {
            let dirty = self.call_all(move |e| e.dirty(&name)).await?;
            if dirty.iter().all(|&d| d == 0) {
                return Ok(None);
            }
        }
        let (name, sid) = (run.to_string(), snapshot.to_string());
        let parts = self
            .call_all(move |e| e.capture_state(&name, &sid, true))
            .await?;
        let mut captures = Vec::new();
        let mut covered = Vec::with_capacity(parts.len());
        for part in parts {
            let (c, n) = part?.unwrap_or_default();
            captures.extend(c);
            covered.push(n);
        }
        Ok(Some((captures, covered)))
    }

    /// A state snapshot covering `covered[i]` changes of engine `i` is
    /// complete.
    pub async fn mark_persisted(&self, run: &str, covered: Vec<u64>) -> Result<(), EngineError> {
        for (h, n) in self.handles.iter().zip(covered) {
            let name = run.to_string();
            h.call(move |e| e.mark_persisted(&name, n)).await?;
        }
        Ok(())
    }

    /// Restores the run's ranks, each on its engine; ranks absent from
    /// `ranks` are emptied. Periodic cuts start again after the furthest
    /// restored step.
    pub async fn restore(
        &self,
        run: &str,
        ranks: Vec<(u32, RestoredRank)>,
    ) -> Result<(), EngineError> {
        let furthest = ranks.iter().filter_map(|(_, r)| r.meta.last_step).max();
        let mut per_engine: Vec<Vec<(u32, RestoredRank)>> =
            (0..self.handles.len()).map(|_| Vec::new()).collect();
        for (rank, restored) in ranks {
            if let Some(Some(i)) = self.by_rank.get(rank as usize) {
                per_engine[*i].push((rank, restored));
            }
        }
        self.shared.reset_periodic(furthest);
        let calls = self.handles.iter().zip(per_engine).map(|(h, part)| {
            let name = run.to_string();
            h.call(move |e| e.restore(&name, part))
        });
        for answer in join_all(calls).await {
            answer??;
        }
        Ok(())
    }

    /// Copies one profile of every rank that holds data.
    pub async fn export_all(
        &self,
        run: &str,
        profile: &str,
    ) -> Result<Vec<(u32, EmaExport)>, EngineError> {
        let (name, p) = (run.to_string(), profile.to_string());
        let parts = self.try_call_all(move |e| e.export_all(&name, &p)).await?;
        let mut out = Vec::new();
        for part in parts {
            out.extend(part?);
        }
        out.sort_by_key(|(rank, _)| *rank);
        Ok(out)
    }

    /// Frees the run's tensors on every engine.
    pub async fn drop_run(&self, run: &str) {
        let name = run.to_string();
        let _ = self.call_all(move |e| e.drop_run(&name)).await;
    }
}
