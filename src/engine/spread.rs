//! A run's ranks spread over engines.
//!
//! Each rank lives on one engine (chosen when the run is installed, see
//! [`crate::registry`]); per-rank work goes to that engine alone, and the
//! few run-wide commands (the ranks' steps, a cut, a state capture, a
//! comparison's exports, dropping the run) go to each of the run's engines
//! at once and their answers are merged here.

use std::future::Future;
use std::sync::{Arc, RwLock};

use futures::future::join_all;

use super::capture::{RankCapture, RestoredRank};
use super::shared::RunShared;
use super::{CutScheduled, EmaExport, EngineError, EngineHandle};

/// What a run's `state` snapshot covers ([`RunEngines::state_plan`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunStatePlan {
    /// Per engine: the mark of the pushes it had applied.
    pub covered: Vec<u64>,
    /// The ranks holding data, in order, each with its last step then.
    pub ranks: Vec<(u32, u64)>,
}

/// The engines of one run on this node, and which holds each rank (ranks
/// another node holds have none here). Ranks are added when this node
/// takes them over from a node that is gone, and released when another
/// node took them; engines are only ever appended, so an index into
/// [`Self::all`] stays valid.
#[derive(Clone)]
pub struct RunEngines {
    layout: Arc<RwLock<Layout>>,
    shared: Arc<RunShared>,
}

struct Layout {
    handles: Vec<EngineHandle>,
    /// Per rank: its engine's index in `handles`; `None` off this node.
    by_rank: Vec<Option<usize>>,
}

impl RunEngines {
    /// `by_rank[r]` indexes `handles`.
    pub fn new(
        handles: Vec<EngineHandle>,
        by_rank: Vec<Option<usize>>,
        shared: Arc<RunShared>,
    ) -> Self {
        debug_assert!(by_rank.iter().flatten().all(|&i| i < handles.len()));
        RunEngines {
            layout: Arc::new(RwLock::new(Layout { handles, by_rank })),
            shared,
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Layout> {
        self.layout.read().expect("run engines lock")
    }

    /// The engine holding `rank`; `None` when another node holds it.
    pub fn of(&self, rank: u32) -> Option<EngineHandle> {
        let layout = self.read();
        let i = (*layout.by_rank.get(rank as usize)?)?;
        layout.handles.get(i).cloned()
    }

    /// Whether an engine here holds `rank`.
    pub fn holds(&self, rank: u32) -> bool {
        self.read()
            .by_rank
            .get(rank as usize)
            .is_some_and(|i| i.is_some())
    }

    /// The run's engines on this node (some may hold no rank any more).
    pub fn all(&self) -> Vec<EngineHandle> {
        self.read().handles.clone()
    }

    /// The ranks the `i`-th engine holds.
    pub fn ranks_of(&self, i: usize) -> Vec<u32> {
        let layout = self.read();
        (0..layout.by_rank.len() as u32)
            .filter(|&r| layout.by_rank[r as usize] == Some(i))
            .collect()
    }

    /// Per rank, the label of its engine (`cpu#0`, `cuda:1`); `None` for
    /// ranks another node holds.
    pub fn labels(&self) -> Vec<Option<String>> {
        let layout = self.read();
        layout
            .by_rank
            .iter()
            .map(|i| i.map(|i| layout.handles[i].label().to_string()))
            .collect()
    }

    /// Ranks this node takes over: `engine` holds `ranks` from now, each
    /// restored from `restored` (or empty, for a rank no snapshot holds).
    /// `config` adds the run to an engine that did not hold it yet.
    pub async fn adopt(
        &self,
        config: Arc<crate::run::RunConfig>,
        engine: EngineHandle,
        ranks: Vec<(u32, Option<RestoredRank>)>,
    ) -> Result<(), EngineError> {
        let taken: Vec<u32> = ranks.iter().map(|(r, _)| *r).collect();
        let shared = self.shared.clone();
        engine.adopt(config, shared, ranks).await??;
        let mut layout = self.layout.write().expect("run engines lock");
        let i = match layout
            .handles
            .iter()
            .position(|h| h.label() == engine.label())
        {
            Some(i) => i,
            None => {
                layout.handles.push(engine);
                layout.handles.len() - 1
            }
        };
        for rank in taken {
            if let Some(slot) = layout.by_rank.get_mut(rank as usize) {
                *slot = Some(i);
            }
        }
        Ok(())
    }

    /// Ranks another node holds now: freed here, and no longer served.
    /// Returns the labels of the engines that held them.
    pub async fn release(&self, run: &str, ranks: &[u32]) -> Vec<String> {
        let mut freed = Vec::new();
        let per_engine: Vec<(EngineHandle, Vec<u32>)> = {
            let mut layout = self.layout.write().expect("run engines lock");
            let mut out: Vec<(EngineHandle, Vec<u32>)> = Vec::new();
            for &rank in ranks {
                let Some(slot) = layout.by_rank.get_mut(rank as usize) else {
                    continue;
                };
                let Some(i) = slot.take() else { continue };
                let handle = layout.handles[i].clone();
                freed.push(handle.label().to_string());
                match out.iter_mut().find(|(h, _)| h.label() == handle.label()) {
                    Some((_, rs)) => rs.push(rank),
                    None => out.push((handle, vec![rank])),
                }
            }
            out
        };
        for (handle, ranks) in per_engine {
            let _ = handle.release(run, ranks).await;
        }
        freed
    }

    pub fn shared(&self) -> &Arc<RunShared> {
        &self.shared
    }

    /// Sends the command `send` makes to every engine of the run, all at
    /// once; the answers in engine order.
    async fn on_all<R, F, Fut>(&self, send: F) -> Result<Vec<R>, EngineError>
    where
        F: Fn(EngineHandle) -> Fut,
        Fut: Future<Output = Result<R, EngineError>>,
    {
        join_all(self.all().into_iter().map(send))
            .await
            .into_iter()
            .collect()
    }

    /// Per rank: the last applied step (`None`: no data).
    pub async fn rank_steps(&self, run: &str) -> Result<Vec<Option<u64>>, EngineError> {
        let per_engine = self
            .on_all(|h| async move { h.rank_steps(run).await })
            .await?;
        let mut out = vec![None; self.read().by_rank.len()];
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
        let answers = self
            .on_all(|h| {
                let profiles = profiles.clone();
                async move { h.schedule_cut(run, snapshot, step, profiles).await }
            })
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
        let _ = self
            .on_all(|h| async move { h.cancel_cut(run, snapshot).await })
            .await;
    }

    /// What a `state` snapshot of the run covers before anything is
    /// copied: every engine's mark of the pushes applied (`covered[i]` is
    /// engine `i`'s) and the ranks holding data. `None` when no engine has
    /// a change to persist (unless `force`). When one engine has, every
    /// rank is written: a state snapshot restores the whole run.
    pub async fn state_plan(
        &self,
        run: &str,
        force: bool,
    ) -> Result<Option<RunStatePlan>, EngineError> {
        let plans = self
            .on_all(|h| async move { h.state_plan(run).await })
            .await?;
        let mut plan = RunStatePlan::default();
        let mut dirty = false;
        for part in plans {
            let part = part?;
            dirty |= part.dirty;
            plan.covered.push(part.mark);
            plan.ranks.extend(part.ranks);
        }
        plan.ranks.sort_unstable();
        Ok((dirty || force).then_some(plan))
    }

    /// One rank's copy for a `state` snapshot, at its own last step; `None`
    /// when no engine here holds it with data (any more).
    pub async fn capture_rank_state(
        &self,
        run: &str,
        snapshot: &str,
        rank: u32,
    ) -> Result<Option<RankCapture>, EngineError> {
        match self.of(rank) {
            Some(h) => h.capture_rank_state(run, snapshot, rank).await?,
            None => Ok(None),
        }
    }

    /// A state snapshot covering the pushes up to mark `covered[i]` of engine `i` is
    /// complete.
    pub async fn mark_persisted(&self, run: &str, covered: Vec<u64>) -> Result<(), EngineError> {
        // Engines are only appended: the first `covered.len()` are the
        // ones that captured.
        for (h, n) in self.all().iter().zip(covered) {
            h.mark_persisted(run, n).await?;
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
        let (handles, by_rank) = {
            let layout = self.read();
            (layout.handles.clone(), layout.by_rank.clone())
        };
        let mut per_engine: Vec<Vec<(u32, RestoredRank)>> =
            (0..handles.len()).map(|_| Vec::new()).collect();
        for (rank, restored) in ranks {
            if let Some(Some(i)) = by_rank.get(rank as usize) {
                per_engine[*i].push((rank, restored));
            }
        }
        self.shared.reset_periodic(furthest);
        let calls = handles
            .iter()
            .zip(per_engine)
            .map(|(h, part)| h.restore(run, part));
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
        let parts = self
            .on_all(|h| async move { h.export_all(run, profile).await })
            .await?;
        let mut out = Vec::new();
        for part in parts {
            out.extend(part?);
        }
        out.sort_by_key(|(rank, _)| *rank);
        Ok(out)
    }

    /// Frees the run's tensors on every engine.
    pub async fn drop_run(&self, run: &str) {
        let _ = self.on_all(|h| async move { h.drop_run(run).await }).await;
    }
}
