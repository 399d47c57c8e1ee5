"""Typed views of the answers people read most: a run, a rank, a snapshot,
an evaluation, the best candidate, and a row of a post-hoc search.

Each is a frozen dataclass with typed fields (statuses and kinds as the
:mod:`polyak.contract` enums, which equal their JSON strings) and also a
read-only mapping over the JSON it was made from, so ``snap.step`` and
``snap["step"]`` read the same value and code written against the plain
dicts keeps working. ``view.raw`` is the whole answer, keys the fields do
not name included; ``dict(view)`` is a copy of it. A status or kind a newer
server sends that this client does not know stays the plain string.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from .contract import (
    BestMode,
    CandidateKind,
    RankStatus,
    RunHealth,
    SnapshotKind,
    SnapshotStatus,
)

__all__ = [
    "Best",
    "Evaluation",
    "PosthocResult",
    "Progress",
    "RankInfo",
    "RunInfo",
    "SnapshotFile",
    "SnapshotInfo",
    "plain",
]

E = TypeVar("E", bound=Enum)


def _member(cls: type[E], value: Any) -> E | str:
    """The enum member spelled ``value``, or the string itself when this
    client does not know it."""
    try:
        return cls(value)
    except ValueError:
        return str(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True, eq=False)
class _View(Mapping[str, Any]):
    """A typed answer that still reads as its JSON mapping."""

    raw: dict[str, Any] = field(repr=False)

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


def plain(value: Any) -> Any:
    """``value`` with every view in it turned back into its JSON (for
    ``json.dumps``)."""
    if isinstance(value, _View):
        return plain(value.raw)
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


@dataclass(frozen=True, eq=False)
class RankInfo(_View):
    """One rank (``GET .../ranks/{rank}``)."""

    rank: int
    status: RankStatus | str
    #: The node and the engine holding it.
    node: str
    engine: str
    last_step: int | None
    pushes: int
    rejections: int
    resident_bytes: int
    last_push_at_ms: int | None
    #: Steps behind the furthest rank of the run.
    lag: int | None
    #: Seconds since the last push, and after which it counts as stale.
    age_seconds: float | None
    stale_after_seconds: float
    #: The latest ``||EMA - online|| / ||online||`` per profile.
    drift: Mapping[str, float]
    #: Its last failover, if its node ever failed.
    failover: Mapping[str, Any] | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankInfo:
        return cls(
            raw=dict(data),
            rank=int(data["rank"]),
            status=_member(RankStatus, data["status"]),
            node=str(data.get("node", "")),
            engine=str(data.get("engine", "")),
            last_step=_int(data.get("last_step")),
            pushes=int(data.get("pushes", 0)),
            rejections=int(data.get("rejections", 0)),
            resident_bytes=int(data.get("resident_bytes", 0)),
            last_push_at_ms=_int(data.get("last_push_at_ms")),
            lag=_int(data.get("lag")),
            age_seconds=_float(data.get("age_seconds")),
            stale_after_seconds=float(data.get("stale_after_seconds", 0.0)),
            drift={str(k): float(v) for k, v in (data.get("drift") or {}).items()},
            failover=data.get("failover"),
        )


@dataclass(frozen=True, eq=False)
class RunInfo(_View):
    """A run as the server sees it now (``GET /v1/runs[/{run}]``)."""

    name: str
    health: RunHealth | str
    config: Mapping[str, Any]
    created_at_ms: int
    #: Highest and lowest last step over the ranks that pushed.
    last_step: int | None
    min_step: int | None
    ranks_seen: int
    resident_bytes: int
    alerts_firing: int
    tags: tuple[str, ...]
    note: str
    #: ``{at_ms, step, snapshot}`` once finished.
    finished: Mapping[str, Any] | None
    #: With the single-run view; ``None`` in a listing.
    ranks: tuple[RankInfo, ...] | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunInfo:
        ranks = data.get("ranks")
        return cls(
            raw=dict(data),
            name=str(data["name"]),
            health=_member(RunHealth, data["health"]),
            config=dict(data.get("config") or {}),
            created_at_ms=int(data.get("created_at_ms", 0)),
            last_step=_int(data.get("last_step")),
            min_step=_int(data.get("min_step")),
            ranks_seen=int(data.get("ranks_seen", 0)),
            resident_bytes=int(data.get("resident_bytes", 0)),
            alerts_firing=int(data.get("alerts_firing", 0)),
            tags=tuple(str(t) for t in data.get("tags") or ()),
            note=str(data.get("note") or ""),
            finished=data.get("finished"),
            ranks=None if ranks is None else tuple(RankInfo.from_json(r) for r in ranks),
        )


@dataclass(frozen=True)
class SnapshotFile:
    """One stored file of a complete snapshot."""

    rank: int
    #: A profile's name, or ``__mirror__``.
    part: str
    path: str
    sha256: str
    bytes: int
    step: int


@dataclass(frozen=True)
class Progress:
    """A derived snapshot's source bytes read, of the total."""

    done: int
    total: int


@dataclass(frozen=True, eq=False)
class SnapshotInfo(_View):
    """A snapshot row (``GET .../snapshots/{id}``, and what creating one,
    a post-hoc synthesis or a merge answers)."""

    id: str
    run: str
    step: int
    kind: SnapshotKind | str
    status: SnapshotStatus | str
    label: str | None
    profiles: tuple[str, ...]
    #: Why it failed.
    reason: str | None
    created_at_ms: int
    completed_at_ms: int | None
    bytes: int
    #: Kind-specific: how a cut chose its step, a derived snapshot's
    #: sources, weights and fit ``residual``.
    detail: Mapping[str, Any]
    #: With a single snapshot's view; empty in a listing.
    files: tuple[SnapshotFile, ...]
    #: While a derived snapshot is written.
    progress: Progress | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SnapshotInfo:
        progress = data.get("progress")
        return cls(
            raw=dict(data),
            id=str(data["id"]),
            run=str(data.get("run", "")),
            step=int(data["step"]),
            kind=_member(SnapshotKind, data["kind"]),
            status=_member(SnapshotStatus, data["status"]),
            label=data.get("label"),
            profiles=tuple(str(p) for p in data.get("profiles") or ()),
            reason=data.get("reason"),
            created_at_ms=int(data.get("created_at_ms", 0)),
            completed_at_ms=_int(data.get("completed_at_ms")),
            bytes=int(data.get("bytes", 0)),
            detail=dict(data.get("detail") or {}),
            files=tuple(
                SnapshotFile(
                    rank=int(f["rank"]),
                    part=str(f["part"]),
                    path=str(f.get("path", "")),
                    sha256=str(f.get("sha256", "")),
                    bytes=int(f.get("bytes", 0)),
                    step=int(f.get("step", data["step"])),
                )
                for f in data.get("files") or ()
            ),
            progress=None
            if not progress
            else Progress(done=int(progress["done"]), total=int(progress["total"])),
        )


@dataclass(frozen=True, eq=False)
class Evaluation(_View):
    """An evaluation of one candidate (``POST`` / ``GET .../evals``)."""

    id: int
    #: The candidate: a profile (or ``online``) of a snapshot.
    snapshot: str
    profile: str
    evaluator: str
    metrics: Mapping[str, float]
    at_ms: int
    #: The candidate's step, kind, EMA length and fit residual.
    step: int
    kind: CandidateKind | str
    sigma_rel: float | None
    residual: float | None
    #: The snapshots a derived candidate was computed from.
    sources: tuple[str, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Evaluation:
        return cls(
            raw=dict(data),
            id=int(data["id"]),
            snapshot=str(data["snapshot"]),
            profile=str(data["profile"]),
            evaluator=str(data.get("evaluator") or ""),
            metrics={str(k): float(v) for k, v in (data.get("metrics") or {}).items()},
            at_ms=int(data.get("at_ms", 0)),
            step=int(data["step"]),
            kind=_member(CandidateKind, data["kind"]),
            sigma_rel=_float(data.get("sigma_rel")),
            residual=_float(data.get("residual")),
            sources=tuple(str(s) for s in data.get("sources") or ()),
        )


@dataclass(frozen=True, eq=False)
class Best(_View):
    """The best evaluated candidate of a metric (``GET .../best``)."""

    metric: str
    mode: BestMode | str
    value: float
    evaluation: Evaluation
    #: The path of its weights on the server.
    download: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Best:
        return cls(
            raw=dict(data),
            metric=str(data["metric"]),
            mode=_member(BestMode, data["mode"]),
            value=float(data["value"]),
            evaluation=Evaluation.from_json(data["evaluation"]),
            download=str(data["download"]),
        )


@dataclass(frozen=True, eq=False)
class PosthocResult(_View):
    """One length of a post-hoc search (``Run.posthoc_search``)."""

    sigma_rel: float
    metrics: Mapping[str, float]
    #: The fit's residual, and whether it is above ``POORLY_FITTED``.
    residual: float
    poorly_fitted: bool
    snapshot: str
    profile: str
    step: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PosthocResult:
        return cls(
            raw=dict(data),
            sigma_rel=float(data["sigma_rel"]),
            metrics={str(k): float(v) for k, v in data["metrics"].items()},
            residual=float(data["residual"]),
            poorly_fitted=bool(data["poorly_fitted"]),
            snapshot=str(data["snapshot"]),
            profile=str(data["profile"]),
            step=int(data["step"]),
        )
