"""The values the server sends and ``docs/contract.md`` documents, in one
place: the client compares against these and never guesses spellings.

Each enum is a ``str`` subclass, so a member equals the JSON string it
stands for (``SnapshotStatus.COMPLETE == "complete"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from .errors import PolyakError

__all__ = [
    "DERIVED_KINDS",
    "WRITTEN_LAYOUTS",
    "AlertKind",
    "AlertState",
    "BestMode",
    "CandidateKind",
    "CutKind",
    "DownloadLayout",
    "EventKind",
    "NodeStatus",
    "RankStatus",
    "RunHealth",
    "SnapshotEventStatus",
    "SnapshotKind",
    "SnapshotStatus",
    "snapshot_done",
    "snapshot_id",
]


class SnapshotStatus(str, Enum):
    """A snapshot row's ``status`` (``GET .../snapshots[/{id}]``)."""

    #: Scheduled or being written; a derived snapshot also has ``progress``.
    PENDING = "pending"
    #: Every rank's files are on disk and in the catalog.
    COMPLETE = "complete"
    #: Will never complete; the row's ``reason`` says why.
    FAILED = "failed"


class SnapshotEventStatus(str, Enum):
    """The ``status`` of a ``snapshot`` event on the event stream: a row's
    statuses, plus what only the stream reports."""

    PENDING = "pending"
    COMPLETE = "complete"
    FAILED = "failed"
    #: A derived snapshot's progress (``done``, ``total`` source bytes).
    RUNNING = "running"
    #: A due periodic cut skipped (the write backlog is full), with ``reason``.
    SKIPPED = "skipped"
    #: Deleted (by a request, or by retention).
    DELETED = "deleted"


class SnapshotKind(str, Enum):
    """A snapshot's ``kind``."""

    MANUAL = "manual"
    PERIODIC = "periodic"
    #: Crash-recovery persistence; its ranks may sit at different steps.
    STATE = "state"
    POSTHOC = "posthoc"
    MERGE = "merge"


#: Kinds the server computes from stored snapshots (never restored from).
DERIVED_KINDS = frozenset({SnapshotKind.POSTHOC, SnapshotKind.MERGE})


class EventKind(str, Enum):
    """The ``kind`` of an event on ``GET /v1/runs/{run}/events``."""

    RUN_CREATED = "run_created"
    RANK_REGISTERED = "rank_registered"
    PUSH = "push"
    REJECTION = "rejection"
    #: A keyframe found the mirror diverged from the client's copy (repaired).
    MIRROR_MISMATCH = "mirror_mismatch"
    SNAPSHOT = "snapshot"
    FINISHED = "finished"
    RESUMED = "resumed"
    RESTORED = "restored"
    #: A rank was taken over from a node that was gone; again at its next
    #: push, with ``lost_steps``.
    FAILOVER = "failover"
    ANNOTATED = "annotated"
    #: A stored part read back other than it was written (size or sha256);
    #: the read was refused.
    SNAPSHOT_CORRUPT = "snapshot_corrupt"
    ALERT = "alert"
    METRICS = "metrics"
    #: An evaluation of a candidate was stored.
    EVAL = "eval"


class CandidateKind(str, Enum):
    """An evaluation's ``kind``: which weights of a snapshot it measured."""

    #: A live profile's EMA, as a cut stored it.
    EMA = "ema"
    #: The online weights (the run's mirror) stored with a cut.
    ONLINE = "online"
    #: A post-hoc EMA synthesised for one ``sigma_rel``.
    POSTHOC = "posthoc"
    #: A merged checkpoint.
    MERGE = "merge"


class BestMode(str, Enum):
    """Which end of a metric is best (``GET .../best?mode=``)."""

    MIN = "min"
    MAX = "max"


class CutKind(str, Enum):
    """``detail.cut`` of a manual snapshot: how its step was chosen."""

    #: Every rank had applied the ranks' current step: cut at once.
    CURRENT = "current"
    #: The next update step after the furthest rank.
    NEXT_UPDATE = "next_update"
    #: The step the request named.
    REQUESTED = "requested"
    #: The final snapshot of a finished run.
    FINAL = "final"


class DownloadLayout(str, Enum):
    """``layout=`` of a snapshot download."""

    #: One safetensors file of whole tensors.
    FULL = "full"
    #: One file per rank, for ``torch.distributed.checkpoint``.
    SHARDED = "sharded"
    #: HF-style shards with their index.
    HF = "hf"
    #: One stored file as it is (with ``rank=``).
    RANK = "rank"


#: The layouts ``Run.download_to`` writes.
WRITTEN_LAYOUTS = frozenset({DownloadLayout.FULL, DownloadLayout.SHARDED, DownloadLayout.HF})


class RunHealth(str, Enum):
    """A run's ``health``, from its ranks' statuses."""

    #: Every rank pushed recently.
    HEALTHY = "healthy"
    #: Some rank is stale, or known from the catalog and not restored.
    DEGRADED = "degraded"
    #: Some ranks pushed, others never did.
    WAITING = "waiting"
    #: No rank pushed yet.
    IDLE = "idle"
    #: Ended by ``Run.finish``.
    FINISHED = "finished"


class RankStatus(str, Enum):
    """A rank's ``status``."""

    LIVE = "live"
    #: No push for longer than its ``stale_after_seconds``.
    STALE = "stale"
    NEVER_SEEN = "never_seen"
    #: Known from the catalog; its EMA is not in memory since a restart.
    NOT_RESTORED = "not_restored"
    #: Its run is finished.
    FINISHED = "finished"


class NodeStatus(str, Enum):
    """A node's ``status`` (``GET /v1/nodes``)."""

    LIVE = "live"
    #: Its lease was not renewed in time.
    EXPIRED = "expired"
    #: It stopped gracefully.
    LEFT = "left"


class AlertKind(str, Enum):
    """An alert's ``kind``: the condition it watches."""

    STALE_RANK = "stale_rank"
    NONFINITE = "nonfinite"
    METRIC_ABOVE = "metric_above"
    METRIC_BELOW = "metric_below"
    NO_IMPROVEMENT = "no_improvement"
    DISK_FULL = "disk_full"
    SNAPSHOT_FAILED = "snapshot_failed"
    SNAPSHOT_CORRUPT = "snapshot_corrupt"
    STEPS_LOST = "steps_lost"


class AlertState(str, Enum):
    """An alert's ``state``."""

    FIRING = "firing"
    RESOLVED = "resolved"


def snapshot_id(snapshot: str | int | Mapping[str, Any]) -> str:
    """A snapshot given by id, or as returned by ``run.snapshot()``."""
    if isinstance(snapshot, Mapping):
        return str(snapshot["id"])
    return str(snapshot)


def snapshot_done(snap: Mapping[str, Any]) -> bool:
    """``True`` when complete, ``False`` while pending; a failed snapshot
    raises ``snapshot_failed`` with the server's reason, and a status the
    contract does not name raises ``unexpected_status``."""
    status = snap.get("status")
    if status == SnapshotStatus.FAILED:
        reason = snap.get("reason") or ""
        raise PolyakError(
            f"snapshot {snap.get('id')} {status}: {reason}".strip().rstrip(":"),
            code="snapshot_failed",
        )
    if status == SnapshotStatus.COMPLETE:
        return True
    if status == SnapshotStatus.PENDING:
        return False
    raise PolyakError(
        f"snapshot {snap.get('id')} has status {status!r}, which the contract does not name "
        f"(expected one of {', '.join(s.value for s in SnapshotStatus)})",
        code="unexpected_status",
    )
