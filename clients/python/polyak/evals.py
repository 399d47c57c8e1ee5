"""Evaluations of EMA candidates (posted, listed and ranked through
:class:`polyak.client.Run`): evaluate every candidate of a run as it appears (:class:`EvalWorker`), and
choose an EMA length by evaluating a post-hoc sweep (:func:`posthoc_search`),
post metrics computed on the live EMA (:func:`post_live_eval`). Both
evaluating paths also write each evaluation to TensorBoard or W&B
(``log_to=``, :mod:`polyak.trackers`).

A *candidate* is the weights of one profile of one complete snapshot (an
EMA profile of a cut, ``online`` for the mirror stored with it, a
``posthoc`` or ``merge`` result). The server keeps one evaluation per
snapshot, profile and evaluator, so posting again is safe: the same
numbers are accepted, other numbers refused (``eval_conflict``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, Any, Protocol, TypeVar

import httpx
import torch

from ._transport import Transport
from .contract import BestMode, SnapshotKind, SnapshotStatus
from .errors import PolyakError
from .views import Evaluation, PosthocResult, RunInfo, SnapshotInfo

__all__ = [
    "POORLY_FITTED",
    "EvalWorker",
    "load_weights",
    "post_live_eval",
    "posthoc_search",
]

#: The label of a snapshot :func:`post_live_eval` takes for an evaluation.
LIVE_EVAL_LABEL = "live-eval"

#: A post-hoc length whose fit residual is above this is flagged (the
#: stored snapshots are too sparse or too short to synthesise it well).
POORLY_FITTED = 0.05

#: The profile name of a snapshot's online weights (its mirror).
ONLINE = "online"

Metrics = Mapping[str, float]
T = TypeVar("T")

log = logging.getLogger("polyak")


class Run(Protocol):
    """What evaluating needs of a run: a :class:`polyak.client.Run` (this
    module sits below the client, which offers :func:`posthoc_search` as
    ``Run.posthoc_search``)."""

    name: str
    path: str
    read_token: str | None
    #: The run's fields as last read (``snapshot_every`` among them).
    config: dict[str, Any]

    @property
    def profiles(self) -> list[str]: ...

    @property
    def transport(self) -> Transport: ...

    def refresh(self) -> RunInfo: ...

    def snapshots(
        self, *, kind: str | None = None, status: str | None = None
    ) -> list[SnapshotInfo]: ...

    def get_snapshot(self, snapshot: str | int | Mapping[str, Any]) -> SnapshotInfo: ...

    def snapshot(
        self,
        step: int | None = None,
        *,
        profiles: Sequence[str] | None = None,
        label: str | None = None,
        wait: bool = True,
        timeout: float = 600.0,
    ) -> SnapshotInfo: ...

    def wait_snapshot(
        self, snapshot: str | int | Mapping[str, Any], *, timeout: float = 600.0
    ) -> SnapshotInfo: ...

    def download(
        self,
        snapshot: str | int | Mapping[str, Any],
        profile: str | None = None,
        *,
        progress: bool | IO[str] = True,
    ) -> dict[str, torch.Tensor]: ...

    def posthoc(
        self,
        sigma_rel: float | Sequence[float],
        *,
        step: int | None = None,
        profiles: Sequence[str] | None = None,
        name: str | None = None,
        timeout: float = 600.0,
    ) -> Any: ...

    def post_eval(
        self,
        snapshot: str | int | Mapping[str, Any],
        profile: str,
        metrics: Mapping[str, float],
        *,
        evaluator: str | None = None,
    ) -> Evaluation: ...

    def evals(self, *, evaluator: str | None = None) -> list[Evaluation]: ...


def load_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """Loads downloaded weights into ``model``: every tensor must be one of
    the model's, and every parameter must be there (buffers the run did not
    push keep the model's own values)."""
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    params = {name for name, _ in model.named_parameters()}
    lacking = [m for m in missing if m in params]
    if unexpected or lacking:
        raise PolyakError(
            f"the weights do not fit the model: unexpected {sorted(unexpected)}, "
            f"missing parameters {sorted(lacking)}",
            code="weights_mismatch",
        )
    return model


def _metrics_of(result: Any) -> dict[str, float]:
    if isinstance(result, Mapping):
        return {str(k): float(v) for k, v in result.items()}
    raise PolyakError(
        f"evaluate(model) must return a dict of metric name -> number, got {type(result).__name__}",
        code="invalid_eval",
    )


def _evaluate(
    run: Run,
    model: torch.nn.Module,
    evaluate: Callable[[torch.nn.Module], Any],
    snapshot: str,
    profile: str,
    device: torch.device | str | None,
) -> dict[str, float]:
    state = run.download(snapshot, profile, progress=False)
    load_weights(model, state)
    if device is not None:
        model.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _metrics_of(evaluate(model))
    finally:
        model.train(was_training)


class EvalWorker:
    """Evaluates every candidate of a run that this evaluator has not
    evaluated: each profile of every complete snapshot (``profiles``: only
    these; derived snapshots' profiles included) and, with
    ``include_online``, the online weights stored with each cut.

    For each, it downloads the weights, loads them into the model
    ``build_model()`` made (once), calls ``evaluate(model)`` (in eval mode,
    without gradients) for a dict of metrics, and posts them. It never
    touches the training job: it reads the run's snapshots like any client.

    ``run(follow=True)`` catches up on what is there, then follows the
    run's event stream (reconnecting with ``Last-Event-ID``) and evaluates
    each new complete snapshot; with ``until_finished`` it returns once the
    run is finished and every complete snapshot is evaluated. SIGTERM (and
    :meth:`stop`) stops it after the evaluation under way is posted.
    Restarting it, or running two, repeats nothing: what this evaluator
    has posted is skipped.

    A server that goes away (a restart, a crash) does not end it: a read
    that finds no server or a server fault (a 5xx) is logged once as a
    warning and tried again with backoff (up to 10 s apart), for as long as
    it follows the run, or ``retry_for`` seconds in a single pass (default
    60); an evaluation cut off half way is done again.

    ``log_to``: a ``torch.utils.tensorboard.SummaryWriter``, a wandb run
    (or a list of them) that each posted evaluation is written to as well,
    tagged by candidate (see :mod:`polyak.trackers`).
    """

    def __init__(
        self,
        run: Run,
        build_model: Callable[[], torch.nn.Module],
        evaluate: Callable[[torch.nn.Module], Any],
        profiles: Sequence[str] | None = None,
        include_online: bool = True,
        device: torch.device | str | None = None,
        *,
        evaluator: str | None = None,
        progress: bool | IO[str] | None = None,
        log_to: Any = None,
        retry_for: float = 60.0,
    ) -> None:
        from .trackers import trackers_for

        self.retry_for = float(retry_for)
        self.run_ = run
        self.trackers = trackers_for(log_to)
        self.build_model = build_model
        self.evaluate = evaluate
        self.profiles = None if profiles is None else list(profiles)
        self.include_online = include_online
        self.device = device
        self.evaluator = evaluator or ""
        self.progress = progress
        self.evaluated = 0
        self._model: torch.nn.Module | None = None
        self._stop = threading.Event()
        self._wake: queue.Queue[str] = queue.Queue()
        self._last_event_id: int | None = None
        self._mirror: dict[str, bool] = {}

    def stop(self) -> None:
        """Stops after the evaluation under way is posted."""
        self._stop.set()
        self._wake.put("stop")

    # -- what is to do -----------------------------------------------------

    def _has_mirror(self, snap: Mapping[str, Any]) -> bool:
        sid = str(snap["id"])
        if sid not in self._mirror:
            files = self.run_.get_snapshot(sid).get("files", [])
            self._mirror[sid] = any(f.get("part") == "__mirror__" for f in files)
        return self._mirror[sid]

    def _candidates(self, snap: Mapping[str, Any]) -> list[tuple[str, str]]:
        sid = str(snap["id"])
        out = [
            (sid, str(p))
            for p in snap.get("profiles", [])
            if self.profiles is None or p in self.profiles
        ]
        cut = snap.get("kind") in (SnapshotKind.MANUAL, SnapshotKind.PERIODIC)
        if self.include_online and cut and self._has_mirror(snap):
            out.append((sid, ONLINE))
        return out

    def pending(self) -> tuple[list[tuple[str, str, int]], bool]:
        """The candidates still to evaluate (snapshot, profile, step), by
        step; and whether a snapshot is still being written."""
        snaps = self.run_.snapshots()
        done = {
            (e["snapshot"], e["profile"])
            for e in self.run_.evals(evaluator=self.evaluator or None)
            if e["evaluator"] == self.evaluator
        }
        todo: list[tuple[str, str, int]] = []
        writing = False
        for snap in snaps:
            if snap.get("kind") == SnapshotKind.STATE:
                continue
            if snap.get("status") == SnapshotStatus.PENDING:
                writing = True
                continue
            if snap.get("status") != SnapshotStatus.COMPLETE:
                continue
            for sid, profile in self._candidates(snap):
                if (sid, profile) not in done:
                    todo.append((sid, profile, int(snap["step"])))
        todo.sort(key=lambda c: c[2])
        return todo, writing

    def _finished(self) -> bool:
        return bool(self.run_.refresh().get("finished"))

    # -- doing it ----------------------------------------------------------

    def evaluate_one(self, snapshot: str, profile: str) -> dict[str, Any] | None:
        """Evaluates one candidate and posts it; the stored evaluation
        (``None`` when another evaluation with other numbers was there)."""
        if self._model is None:
            self._model = self.build_model()
            if self.device is not None:
                self._model.to(self.device)
        metrics = _evaluate(self.run_, self._model, self.evaluate, snapshot, profile, self.device)
        try:
            stored = self.run_.post_eval(snapshot, profile, metrics, evaluator=self.evaluator)
        except PolyakError as e:
            if e.code in ("eval_conflict", "snapshot_not_found"):
                # Posted by a twin with other numbers, or deleted meanwhile.
                warnings.warn(f"{snapshot} {profile}: {e.message}", stacklevel=2)
                return None
            raise
        self.evaluated += 1
        for tracker in self.trackers:
            tracker.evaluation(stored)
        return stored

    def catch_up(self, bar: Any = None) -> bool:
        """Evaluates every pending candidate (until stopped); true when a
        snapshot is still being written."""
        todo, writing = self.pending()
        if bar is not None:
            bar.total = bar.n + len(todo)
            bar.refresh()
        for sid, profile, step in todo:
            if self._stop.is_set():
                break
            if bar is not None:
                bar.set_postfix_str(f"step {step} {profile}")
            self.evaluate_one(sid, profile)
            if bar is not None:
                bar.update(1)
        return writing

    def _follow_events(self) -> None:
        """Reads the run's event stream on a thread of its own, waking the
        worker at each complete snapshot and at the run's end; reconnects
        after the last event id it saw."""
        kinds = "snapshot,finished"
        while not self._stop.is_set():
            headers = {"Accept": "text/event-stream"}
            params: dict[str, Any] = {"kinds": kinds}
            if self._last_event_id is not None:
                headers["Last-Event-ID"] = str(self._last_event_id)
            else:
                # Nothing to replay: a first pass catches up from the lists.
                params["tail"] = 1
            try:
                # A streamed httpx.Response is closed, not entered.
                with contextlib.closing(
                    self.run_.transport.stream(
                        f"{self.run_.path}/events",
                        params=params,
                        token=self.run_.read_token,
                        headers=headers,
                    )
                ) as r:
                    self._wake.put("connected")
                    block: dict[str, str] = {}
                    for line in r.iter_lines():
                        if self._stop.is_set():
                            return
                        if line:
                            if not line.startswith(":"):
                                key, _, value = line.partition(":")
                                block[key] = value.lstrip()
                            continue
                        if "id" in block:
                            self._last_event_id = int(block["id"])
                        if block.get("event") in ("snapshot", "finished"):
                            self._wake.put(block["event"])
                        block = {}
            except (httpx.HTTPError, PolyakError, OSError, ValueError):
                pass  # a break in the stream: reconnect after the last id seen
            self._wake.put("reconnect")
            self._stop.wait(1.0)

    def _patiently(self, fn: Callable[[], T], retry_for: float | None) -> T | None:
        """``fn()``, tried again with backoff while the server is away
        (``retry_for`` seconds at most; ``None``: until stopped); ``None``
        when stopped meanwhile."""
        delay, since, warned = 0.5, time.monotonic(), False
        while True:
            try:
                result = fn()
            except PolyakError as e:
                if not _server_away(e):
                    raise
                if retry_for is not None and time.monotonic() - since >= retry_for:
                    raise
                if not warned:
                    warned = True
                    log.warning(
                        "polyak: evaluating run %s: the server is away (%s); trying again",
                        self.run_.name,
                        e,
                    )
                if self._stop.wait(delay):
                    return None
                delay = min(delay * 2, 10.0)
                continue
            if warned:
                log.warning("polyak: evaluating run %s: the server answers again", self.run_.name)
            return result

    def run(self, follow: bool = True, *, until_finished: bool = False) -> int:
        """Evaluates what is pending; with ``follow``, keeps following the
        run (see the class). Returns how many evaluations it posted."""
        from tqdm.auto import tqdm

        show = self.progress
        if show is None:
            show = sys.stderr.isatty()
        restore = None
        if threading.current_thread() is threading.main_thread():
            restore = signal.signal(signal.SIGTERM, lambda *_: self.stop())
        bar = tqdm(
            total=0,
            unit="eval",
            desc=f"{self.run_.name} evals",
            disable=show is False,
            file=None if isinstance(show, bool) else show,
        )
        reader = None
        patience = None if follow else self.retry_for
        try:
            if follow:
                reader = threading.Thread(target=self._follow_events, daemon=True)
                reader.start()
            while not self._stop.is_set():
                writing = self._patiently(lambda: self.catch_up(bar), patience)
                if not follow or self._stop.is_set():
                    break
                if until_finished and not writing and self._patiently(self._finished, patience):
                    # Snapshots completed while the last pass ran are in
                    # the next one.
                    if not self._patiently(lambda: self.pending()[0], patience):
                        break
                    continue
                # Something changed (or a minute passed: a missed wake-up
                # costs at most that).
                try:
                    self._wake.get(timeout=60.0)
                except queue.Empty:
                    pass
                while not self._wake.empty():
                    self._wake.get_nowait()
        finally:
            self._stop.set()
            bar.close()
            if restore is not None:
                signal.signal(signal.SIGTERM, restore)
        return self.evaluated


def _server_away(e: PolyakError) -> bool:
    """No server answered, or it failed (a 5xx, 408, 429): worth another
    try, unlike a refusal of what was asked."""
    return e.status is None or e.status >= 500 or e.status in (408, 429)


def posthoc_search(
    run: Run,
    sigma_rel: Iterable[float],
    evaluate: Callable[[torch.nn.Module], Any],
    model: torch.nn.Module,
    step: int | None = None,
    profiles: Sequence[str] | None = None,
    *,
    metric: str | None = None,
    mode: str = BestMode.MIN.value,
    evaluator: str | None = None,
    name: str | None = None,
    device: torch.device | str | None = None,
    timeout: float = 600.0,
    log_to: Any = None,
) -> list[PosthocResult]:
    """Synthesises one post-hoc EMA per ``sigma_rel`` (one sweep, one pass
    over the stored power-profile snapshots), evaluates each in ``model``,
    posts the evaluations, and returns the rows best first by ``metric``
    (default the first metric ``evaluate`` returns; ``mode`` ``min`` or
    ``max``): ``{sigma_rel, metrics, residual, poorly_fitted, snapshot,
    profile, step}``. A length whose fit residual is above
    :data:`POORLY_FITTED` is flagged ``poorly_fitted`` and warned about.

    ``log_to`` (a ``SummaryWriter``, a wandb run, or a list): each length's
    metrics and residual are written there too, as
    ``posthoc/<metric>/step_<S>`` against sigma_rel (see
    :mod:`polyak.trackers`)."""
    from .trackers import trackers_for

    trackers = trackers_for(log_to)
    sigmas = [float(s) for s in sigma_rel]
    rows = run.posthoc(sigmas, step=step, profiles=profiles, name=name, timeout=timeout)
    out: list[dict[str, Any]] = []
    for sigma, snap in zip(sigmas, rows, strict=True):
        profile = str(snap["profiles"][0])
        metrics = _evaluate(run, model, evaluate, str(snap["id"]), profile, device)
        stored = run.post_eval(snap, profile, metrics, evaluator=evaluator)
        for tracker in trackers:
            tracker.evaluation(stored)
        residual = float(snap["detail"]["residual"])
        row = {
            "sigma_rel": sigma,
            "metrics": metrics,
            "residual": residual,
            "poorly_fitted": residual > POORLY_FITTED,
            "snapshot": str(snap["id"]),
            "profile": profile,
            "step": int(snap["step"]),
        }
        if row["poorly_fitted"]:
            warnings.warn(
                f"sigma_rel={sigma:g}: fit residual {residual:.3g} > {POORLY_FITTED} "
                "(too few or too short stored power snapshots to synthesise it well)",
                stacklevel=2,
            )
        out.append(row)
    if not out:
        return []
    key = metric or next(iter(out[0]["metrics"]))
    sign = 1.0 if BestMode(mode) == BestMode.MIN else -1.0

    def rank(row: dict[str, Any]) -> tuple[float, float]:
        value = row["metrics"].get(key, math.nan)
        return (math.inf if math.isnan(value) else sign * value, row["sigma_rel"])

    out.sort(key=rank)
    return [PosthocResult.from_json(row) for row in out]


#: Seconds a live evaluation at a step of the run's periodic cuts waits for
#: that cut to be recorded before it takes a snapshot of its own.
PERIODIC_WAIT = 5.0


def post_live_eval(
    run: Run,
    metrics: Mapping[str, float],
    profile: str | None = None,
    *,
    step: int,
    evaluator: str | None = None,
    label: str = LIVE_EVAL_LABEL,
    timeout: float = 600.0,
) -> Evaluation:
    """Posts ``metrics``, computed on the live EMA of ``profile`` (default
    the run's first) after every rank applied ``step``, as the evaluation
    of that candidate: the evaluation belongs to a snapshot, so it goes to
    the complete (or pending) cut of that step holding the profile when
    there is one (a periodic snapshot), else to a new snapshot of that
    profile at ``step`` (labelled ``label``), which it waits for. A step
    some rank has passed is refused (``snapshot_conflict``): the EMA the
    metrics were computed on is gone. Answers the stored evaluation."""
    profile = profile or run.profiles[0]
    step = int(step)

    def cut_of_step() -> Any:
        return next(
            (
                s
                for s in run.snapshots()
                if s.get("kind") in (SnapshotKind.MANUAL, SnapshotKind.PERIODIC)
                and int(s["step"]) == step
                and s.get("status") != SnapshotStatus.FAILED
                and profile in s.get("profiles", [])
            ),
            None,
        )

    snap = cut_of_step()
    every = int(run.config.get("snapshot_every") or 0)
    if snap is None and every and step % every == 0:
        # The server answers a push that opened the periodic cut of its
        # step once the cut is recorded, unless recording it took over 2 s
        # (a slow catalog), and older servers answered before: waited for a
        # little, so the evaluation goes to it rather than to a snapshot of
        # its own (a cut skipped for a full backlog never comes: then one
        # is taken).
        deadline = time.monotonic() + PERIODIC_WAIT
        while snap is None and time.monotonic() < deadline:
            time.sleep(0.05)
            snap = cut_of_step()
    if snap is None:
        snap = run.snapshot(step, profiles=[profile], label=label, wait=False)
    snap = run.wait_snapshot(snap, timeout=timeout)
    return run.post_eval(snap, profile, metrics, evaluator=evaluator)


def format_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """A search's rows as JSON lines (for logs and the CLI)."""
    return "\n".join(json.dumps(dict(r), sort_keys=True) for r in rows)
