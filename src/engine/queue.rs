//! The engine's queue: typed commands, one variant per kind of work, each
//! carrying its reply channel, sent to the engine thread through a bounded
//! channel. The thread runs each command against its [`Engine`] and sends
//! the answer back; the handle counts the commands waiting, per kind.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use tch::Device;
use tokio::sync::{mpsc, oneshot};

use super::capture::{CaptureEvent, RankCapture, RestoredRank};
use super::error::EngineError;
use super::rank::PushOutcome;
use super::shared::RunShared;
use super::{CutScheduled, EmaExport, Engine, StatePlan, KERNEL_THREADS};
use crate::run::RunConfig;
use crate::wire::ParsedPush;

/// Where a command's answer goes.
type Reply<T> = oneshot::Sender<T>;

/// The kinds of engine work, as the queue-depth gauge labels them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandKind {
    AddRun,
    Adopt,
    Release,
    DropRun,
    Push,
    ScheduleCut,
    CancelCut,
    StatePlan,
    CaptureState,
    MarkPersisted,
    Restore,
    Dirty,
    RankSteps,
    Export,
    Ping,
}

impl CommandKind {
    pub const ALL: [CommandKind; 15] = [
        CommandKind::AddRun,
        CommandKind::Adopt,
        CommandKind::Release,
        CommandKind::DropRun,
        CommandKind::Push,
        CommandKind::ScheduleCut,
        CommandKind::CancelCut,
        CommandKind::StatePlan,
        CommandKind::CaptureState,
        CommandKind::MarkPersisted,
        CommandKind::Restore,
        CommandKind::Dirty,
        CommandKind::RankSteps,
        CommandKind::Export,
        CommandKind::Ping,
    ];

    /// The gauge's `kind` label.
    pub fn as_str(self) -> &'static str {
        match self {
            CommandKind::AddRun => "add_run",
            CommandKind::Adopt => "adopt",
            CommandKind::Release => "release",
            CommandKind::DropRun => "drop_run",
            CommandKind::Push => "push",
            CommandKind::ScheduleCut => "schedule_cut",
            CommandKind::CancelCut => "cancel_cut",
            CommandKind::StatePlan => "state_plan",
            CommandKind::CaptureState => "capture_state",
            CommandKind::MarkPersisted => "mark_persisted",
            CommandKind::Restore => "restore",
            CommandKind::Dirty => "dirty",
            CommandKind::RankSteps => "rank_steps",
            CommandKind::Export => "export",
            CommandKind::Ping => "ping",
        }
    }
}

/// One piece of work for the engine thread, with the channel its answer
/// goes back on.
pub enum Command {
    /// A run installed here (created, or loaded at start) with the ranks
    /// this engine holds.
    AddRun {
        config: Arc<RunConfig>,
        owned: Vec<u32>,
        shared: Arc<RunShared>,
        reply: Reply<()>,
    },
    /// Ranks taken over from a node that is gone.
    Adopt {
        config: Arc<RunConfig>,
        shared: Arc<RunShared>,
        ranks: Vec<(u32, Option<RestoredRank>)>,
        reply: Reply<Result<(), EngineError>>,
    },
    /// Ranks another node took: freed here.
    Release {
        run: String,
        ranks: Vec<u32>,
        reply: Reply<()>,
    },
    /// Every tensor of a run freed.
    DropRun { run: String, reply: Reply<bool> },
    /// A validated push; `hold` (the push's share of the in-flight byte
    /// budget) is dropped as soon as the engine is done with the body.
    Push {
        run: String,
        rank: u32,
        step: u64,
        push: ParsedPush,
        hold: Box<dyn Any + Send>,
        reply: Reply<Result<PushOutcome, EngineError>>,
    },
    ScheduleCut {
        run: String,
        snapshot: String,
        step: u64,
        profiles: Vec<usize>,
        reply: Reply<Result<CutScheduled, EngineError>>,
    },
    CancelCut {
        run: String,
        snapshot: String,
        reply: Reply<bool>,
    },
    StatePlan {
        run: String,
        reply: Reply<Result<StatePlan, EngineError>>,
    },
    CaptureState {
        run: String,
        snapshot: String,
        rank: u32,
        reply: Reply<Result<Option<RankCapture>, EngineError>>,
    },
    MarkPersisted {
        run: String,
        covered: u64,
        reply: Reply<()>,
    },
    Restore {
        run: String,
        ranks: Vec<(u32, RestoredRank)>,
        reply: Reply<Result<(), EngineError>>,
    },
    /// Applied pushes not yet covered by a state snapshot.
    Dirty { run: String, reply: Reply<u64> },
    RankSteps {
        run: String,
        reply: Reply<Result<Vec<Option<u64>>, EngineError>>,
    },
    /// One rank's EMA of one profile, copied on the device.
    ExportEma {
        run: String,
        rank: u32,
        profile: String,
        reply: Reply<Result<EmaExport, EngineError>>,
    },
    /// One profile of every rank holding data, copied on the device.
    ExportAll {
        run: String,
        profile: String,
        reply: Reply<Result<Vec<(u32, EmaExport)>, EngineError>>,
    },
    /// Nothing: answers when the thread takes work.
    Ping { reply: Reply<()> },
}

impl Command {
    pub fn kind(&self) -> CommandKind {
        match self {
            Command::AddRun { .. } => CommandKind::AddRun,
            Command::Adopt { .. } => CommandKind::Adopt,
            Command::Release { .. } => CommandKind::Release,
            Command::DropRun { .. } => CommandKind::DropRun,
            Command::Push { .. } => CommandKind::Push,
            Command::ScheduleCut { .. } => CommandKind::ScheduleCut,
            Command::CancelCut { .. } => CommandKind::CancelCut,
            Command::StatePlan { .. } => CommandKind::StatePlan,
            Command::CaptureState { .. } => CommandKind::CaptureState,
            Command::MarkPersisted { .. } => CommandKind::MarkPersisted,
            Command::Restore { .. } => CommandKind::Restore,
            Command::Dirty { .. } => CommandKind::Dirty,
            Command::RankSteps { .. } => CommandKind::RankSteps,
            Command::ExportEma { .. } | Command::ExportAll { .. } => CommandKind::Export,
            Command::Ping { .. } => CommandKind::Ping,
        }
    }

    /// Does the work and answers. A caller that stopped waiting loses its
    /// answer, nothing else.
    fn run(self, engine: &mut Engine) {
        match self {
            Command::AddRun {
                config,
                owned,
                shared,
                reply,
            } => {
                engine.add_run(config, &owned, shared);
                let _ = reply.send(());
            }
            Command::Adopt {
                config,
                shared,
                ranks,
                reply,
            } => {
                let _ = reply.send(engine.adopt(config, shared, ranks));
            }
            Command::Release { run, ranks, reply } => {
                engine.release(&run, &ranks);
                let _ = reply.send(());
            }
            Command::DropRun { run, reply } => {
                let _ = reply.send(engine.drop_run(&run));
            }
            Command::Push {
                run,
                rank,
                step,
                push,
                hold,
                reply,
            } => {
                let outcome = engine.push(&run, rank, step, push);
                drop(hold);
                let _ = reply.send(outcome);
            }
            Command::ScheduleCut {
                run,
                snapshot,
                step,
                profiles,
                reply,
            } => {
                let _ = reply.send(engine.schedule_cut(&run, &snapshot, step, profiles));
            }
            Command::CancelCut {
                run,
                snapshot,
                reply,
            } => {
                let _ = reply.send(engine.cancel_cut(&run, &snapshot));
            }
            Command::StatePlan { run, reply } => {
                let _ = reply.send(engine.state_plan(&run));
            }
            Command::CaptureState {
                run,
                snapshot,
                rank,
                reply,
            } => {
                let _ = reply.send(engine.capture_rank_state(&run, &snapshot, rank));
            }
            Command::MarkPersisted {
                run,
                covered,
                reply,
            } => {
                engine.mark_persisted(&run, covered);
                let _ = reply.send(());
            }
            Command::Restore { run, ranks, reply } => {
                let _ = reply.send(engine.restore(&run, ranks));
            }
            Command::Dirty { run, reply } => {
                let _ = reply.send(engine.dirty(&run));
            }
            Command::RankSteps { run, reply } => {
                let _ = reply.send(engine.rank_steps(&run));
            }
            Command::ExportEma {
                run,
                rank,
                profile,
                reply,
            } => {
                let _ = reply.send(engine.export_ema(&run, rank, &profile));
            }
            Command::ExportAll {
                run,
                profile,
                reply,
            } => {
                let _ = reply.send(engine.export_all(&run, &profile));
            }
            Command::Ping { reply } => {
                let _ = reply.send(());
            }
        }
    }
}

/// The engine thread's loop: runs each command in the order it was
/// queued until every handle is gone.
fn serve(mut rx: mpsc::Receiver<Command>, depths: &Depths, mut engine: Engine) {
    while let Some(command) = rx.blocking_recv() {
        let kind = command.kind();
        depths[kind as usize].fetch_sub(1, Ordering::Relaxed);
        // A panicking command loses its reply (the caller sees `Stopped`),
        // not the engine.
        if std::panic::catch_unwind(AssertUnwindSafe(|| command.run(&mut engine))).is_err() {
            tracing::error!(
                kind = kind.as_str(),
                "an engine command panicked; the engine goes on"
            );
        }
    }
}

/// Commands waiting in one engine's queue, per kind (indexed by
/// `CommandKind as usize`).
type Depths = Arc<[AtomicI64; CommandKind::ALL.len()]>;

/// Whether a command waits for room in a full queue or is refused at once.
#[derive(Clone, Copy)]
enum Room {
    /// Control work that must not be refused (creating and dropping runs,
    /// cuts, restores).
    Wait,
    /// Work a client retries ([`EngineError::QueueFull`]: 429 with
    /// `Retry-After`).
    Refuse,
}

/// A cheap, cloneable handle on an engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    device: Device,
    label: Arc<str>,
    depth: usize,
    depths: Depths,
}

impl EngineHandle {
    /// Starts the engine thread `label` for `device` (its fused applies
    /// split over `kernel_threads` threads, 0: torch's intra-op threads),
    /// with a queue of `depth` commands;
    /// captures for snapshots go to `captures`, and a run's periodic cuts
    /// hold at most `periodic_backlog_limit` captured bytes (one always).
    pub fn start(
        device: Device,
        label: &str,
        kernel_threads: usize,
        depth: usize,
        captures: mpsc::UnboundedSender<CaptureEvent>,
        periodic_backlog_limit: u64,
    ) -> std::io::Result<Self> {
        let (handle, rx) = Self::queue(device, label, depth);
        let depths = handle.depths.clone();
        std::thread::Builder::new()
            .name(format!("polyak-engine-{label}"))
            .spawn(move || {
                let _guard = tch::no_grad_guard();
                KERNEL_THREADS.with(|t| t.set(kernel_threads));
                let engine = Engine::new(device, captures, periodic_backlog_limit);
                serve(rx, &depths, engine);
            })?;
        Ok(handle)
    }

    /// A handle and the receiving end of its queue, served by nobody yet.
    fn queue(device: Device, label: &str, depth: usize) -> (Self, mpsc::Receiver<Command>) {
        let (tx, rx) = mpsc::channel::<Command>(depth.max(1));
        let handle = EngineHandle {
            tx,
            device,
            label: label.into(),
            depth: depth.max(1),
            depths: Arc::new(std::array::from_fn(|_| AtomicI64::new(0))),
        };
        (handle, rx)
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The engine's name: its device, and with several engines on one
    /// device its index (`cpu#1`).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Commands waiting in the queue.
    pub fn queued(&self) -> usize {
        self.depth - self.tx.capacity()
    }

    /// Commands of each kind waiting in the queue.
    pub fn queued_by_kind(&self) -> impl Iterator<Item = (CommandKind, usize)> + '_ {
        CommandKind::ALL.into_iter().map(|kind| {
            let n = self.depths[kind as usize].load(Ordering::Relaxed);
            (kind, n.max(0) as usize)
        })
    }

    /// Sends the command `make` builds around its reply channel and awaits
    /// the answer. The slot is reserved first, so a command is counted
    /// only once it is in the queue (and uncounted when the thread takes
    /// it).
    async fn send<T>(
        &self,
        room: Room,
        make: impl FnOnce(Reply<T>) -> Command,
    ) -> Result<T, EngineError> {
        let permit = match room {
            Room::Wait => self.tx.reserve().await.map_err(|_| EngineError::Stopped)?,
            Room::Refuse => self.tx.try_reserve().map_err(|e| match e {
                mpsc::error::TrySendError::Full(()) => EngineError::QueueFull,
                mpsc::error::TrySendError::Closed(()) => EngineError::Stopped,
            })?,
        };
        let (tx, rx) = oneshot::channel();
        let command = make(tx);
        self.depths[command.kind() as usize].fetch_add(1, Ordering::Relaxed);
        permit.send(command);
        rx.await.map_err(|_| EngineError::Stopped)
    }

    pub async fn add_run(
        &self,
        config: Arc<RunConfig>,
        owned: Vec<u32>,
        shared: Arc<RunShared>,
    ) -> Result<(), EngineError> {
        self.send(Room::Wait, |reply| Command::AddRun {
            config,
            owned,
            shared,
            reply,
        })
        .await
    }

    pub async fn adopt(
        &self,
        config: Arc<RunConfig>,
        shared: Arc<RunShared>,
        ranks: Vec<(u32, Option<RestoredRank>)>,
    ) -> Result<Result<(), EngineError>, EngineError> {
        self.send(Room::Wait, |reply| Command::Adopt {
            config,
            shared,
            ranks,
            reply,
        })
        .await
    }

    pub async fn release(&self, run: &str, ranks: Vec<u32>) -> Result<(), EngineError> {
        let run = run.to_string();
        self.send(Room::Wait, |reply| Command::Release { run, ranks, reply })
            .await
    }

    pub async fn drop_run(&self, run: &str) -> Result<bool, EngineError> {
        let run = run.to_string();
        self.send(Room::Wait, |reply| Command::DropRun { run, reply })
            .await
    }

    /// Applies a push; refused at once when the queue is full.
    pub async fn push(
        &self,
        run: &str,
        rank: u32,
        step: u64,
        push: ParsedPush,
        hold: Box<dyn Any + Send>,
    ) -> Result<Result<PushOutcome, EngineError>, EngineError> {
        let run = run.to_string();
        self.send(Room::Refuse, |reply| Command::Push {
            run,
            rank,
            step,
            push,
            hold,
            reply,
        })
        .await
    }

    pub async fn schedule_cut(
        &self,
        run: &str,
        snapshot: &str,
        step: u64,
        profiles: Vec<usize>,
    ) -> Result<Result<CutScheduled, EngineError>, EngineError> {
        let (run, snapshot) = (run.to_string(), snapshot.to_string());
        self.send(Room::Wait, |reply| Command::ScheduleCut {
            run,
            snapshot,
            step,
            profiles,
            reply,
        })
        .await
    }

    pub async fn cancel_cut(&self, run: &str, snapshot: &str) -> Result<bool, EngineError> {
        let (run, snapshot) = (run.to_string(), snapshot.to_string());
        self.send(Room::Wait, |reply| Command::CancelCut {
            run,
            snapshot,
            reply,
        })
        .await
    }

    pub async fn state_plan(
        &self,
        run: &str,
    ) -> Result<Result<StatePlan, EngineError>, EngineError> {
        let run = run.to_string();
        self.send(Room::Wait, |reply| Command::StatePlan { run, reply })
            .await
    }

    pub async fn capture_rank_state(
        &self,
        run: &str,
        snapshot: &str,
        rank: u32,
    ) -> Result<Result<Option<RankCapture>, EngineError>, EngineError> {
        let (run, snapshot) = (run.to_string(), snapshot.to_string());
        self.send(Room::Wait, |reply| Command::CaptureState {
            run,
            snapshot,
            rank,
            reply,
        })
        .await
    }

    pub async fn mark_persisted(&self, run: &str, covered: u64) -> Result<(), EngineError> {
        let run = run.to_string();
        self.send(Room::Wait, |reply| Command::MarkPersisted {
            run,
            covered,
            reply,
        })
        .await
    }

    pub async fn restore(
        &self,
        run: &str,
        ranks: Vec<(u32, RestoredRank)>,
    ) -> Result<Result<(), EngineError>, EngineError> {
        let run = run.to_string();
        self.send(Room::Wait, |reply| Command::Restore { run, ranks, reply })
            .await
    }

    pub async fn dirty(&self, run: &str) -> Result<u64, EngineError> {
        let run = run.to_string();
        self.send(Room::Wait, |reply| Command::Dirty { run, reply })
            .await
    }

    pub async fn rank_steps(
        &self,
        run: &str,
    ) -> Result<Result<Vec<Option<u64>>, EngineError>, EngineError> {
        let run = run.to_string();
        self.send(Room::Wait, |reply| Command::RankSteps { run, reply })
            .await
    }

    /// Copies one rank's EMA of one profile; refused at once when the
    /// queue is full.
    pub async fn export_ema(
        &self,
        run: &str,
        rank: u32,
        profile: &str,
    ) -> Result<Result<EmaExport, EngineError>, EngineError> {
        let (run, profile) = (run.to_string(), profile.to_string());
        self.send(Room::Refuse, |reply| Command::ExportEma {
            run,
            rank,
            profile,
            reply,
        })
        .await
    }

    /// Copies one profile of every rank holding data; refused at once when
    /// the queue is full.
    pub async fn export_all(
        &self,
        run: &str,
        profile: &str,
    ) -> Result<Result<Vec<(u32, EmaExport)>, EngineError>, EngineError> {
        let (run, profile) = (run.to_string(), profile.to_string());
        self.send(Room::Refuse, |reply| Command::ExportAll {
            run,
            profile,
            reply,
        })
        .await
    }

    /// Answers once the thread takes work (waiting for room).
    pub async fn ping(&self) -> Result<(), EngineError> {
        self.send(Room::Wait, |reply| Command::Ping { reply }).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth_of(handle: &EngineHandle, kind: CommandKind) -> usize {
        handle
            .queued_by_kind()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, n)| n)
    }

    /// Commands waiting in a queue nobody serves yet are counted per kind;
    /// a push finding the queue full is refused at once and not counted;
    /// once the engine serves the queue every command is answered in
    /// order and the counts go back to zero.
    #[tokio::test]
    async fn the_queue_counts_what_waits_per_kind() {
        let (handle, rx) = EngineHandle::queue(Device::Cpu, "cpu", 3);
        let ping = tokio::spawn({
            let h = handle.clone();
            async move { h.ping().await }
        });
        let dirty: Vec<_> = (0..2)
            .map(|_| {
                let h = handle.clone();
                tokio::spawn(async move { h.dirty("absent").await })
            })
            .collect();
        while handle.queued() < 3 {
            tokio::task::yield_now().await;
        }
        assert_eq!(depth_of(&handle, CommandKind::Ping), 1);
        assert_eq!(depth_of(&handle, CommandKind::Dirty), 2);
        assert_eq!(depth_of(&handle, CommandKind::Push), 0);
        let header = crate::wire::writer::SafetensorsHeader::new(
            vec![crate::wire::writer::HeaderEntry {
                name: "w".into(),
                dtype: crate::wire::DType::F32,
                shape: vec![1],
                nbytes: 4,
            }],
            Default::default(),
        );
        let mut body = header.bytes().to_vec();
        body.extend_from_slice(&1f32.to_le_bytes());
        let push = crate::wire::parse_push(
            bytes::Bytes::from(body),
            crate::wire::push::WireLimits {
                header_limit: 1 << 20,
            },
            crate::run::NonfinitePolicy::Reject,
        )
        .expect("a one-tensor push");
        let refused = handle.push("absent", 0, 0, push, Box::new(())).await;
        assert!(matches!(refused, Err(EngineError::QueueFull)));
        assert_eq!(depth_of(&handle, CommandKind::Push), 0);

        let (captures, _events) = mpsc::unbounded_channel();
        let depths = handle.depths.clone();
        let thread = std::thread::spawn(move || {
            let _guard = tch::no_grad_guard();
            serve(rx, &depths, Engine::new(Device::Cpu, captures, 0));
        });
        ping.await.unwrap().unwrap();
        for d in dirty {
            assert_eq!(d.await.unwrap().unwrap(), 0);
        }
        assert!(handle.queued_by_kind().all(|(_, n)| n == 0));
        assert_eq!(handle.queued(), 0);
        drop(handle);
        thread.join().unwrap();
    }
}
