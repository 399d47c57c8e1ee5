"""``Pusher``: one rank's stream of pushes, off the training thread.

On the training thread, :meth:`Pusher.push` only finds this rank's tensors
(:mod:`polyak.shards`) and copies them into a reusable host body
(:class:`~polyak.wire.HostBody`: the safetensors header is already there; on
CUDA the memory is pinned and the copies are ``non_blocking`` with an event).
Sender threads (``pipeline`` of them, default 1, each with its own
keep-alive connection) take bodies from a bounded queue in order and PUT
them, retrying what can be retried; each push names the step sent before it
(``Polyak-Prev-Step``), so the server receives the next body while it
applies the previous one and still applies them in step order. With
``codec`` or ``delta`` the sender also encodes each body (in dispatch order,
never on the training thread).

Deferred copies: parameters change only in ``optimizer.step()`` (forward
and backward read them), so a push from :meth:`Pusher.attach` copies at
once only the buffers and whatever else is not a parameter of the
optimizer, and leaves the parameters' copy to a copy thread, which runs
while the next forward and backward do (torch releases the GIL while it
copies). An optimizer pre-step hook waits until those copies are done, so
no step changes a parameter being copied; the wait is counted in
:attr:`PushStats.wait_seconds`. A plain ``push`` copies everything before
it returns unless asked ``defer=True`` (the caller then calls
:meth:`Pusher.wait_copied` before changing the parameters). The copy thread
is not the sender: a slow server delays sending, never the copy the next
step waits for.

Queue and buffers: ``max_queue`` bodies may wait while ``pipeline`` are in
flight, so there are at most ``max_queue + pipeline`` bodies, allocated on first use and
reused; the training thread never writes a body the sender is reading. When
the queue is full, policy ``block`` waits for room and ``drop_oldest`` takes
the buffer of the oldest waiting push (never the one in flight) and counts
it in :attr:`PushStats.dropped`.

Retries: connection errors, timeouts, 429 and 5xx are retried with
exponential backoff and jitter, at least as long as ``Retry-After`` says.
A PUT is idempotent: if a first attempt was applied and only its answer was
lost, the retry carries the same bytes and the server answers
``duplicate: true``. Nothing fails silently: a push the server refuses (4xx)
is reported, and a push that could not be delivered for
``RetryPolicy.report_after`` seconds is reported (and kept, and retried);
either error is raised from the next :meth:`Pusher.push` or
:meth:`Pusher.flush`.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import logging
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote, urlsplit

import torch
from torch import nn

from .encode import Encoded, MirrorEncoder
from .errors import PolyakError, error_from_response, parse_retry_after
from .shards import (
    LocalPart,
    LocalState,
    copy_into_parts,
    local_state,
    matches,
    push_pieces,
    tied_pieces,
)
from .wire import ALIASES_KEY, Chunk, HostBody, TensorSpec, WireLayout

if TYPE_CHECKING:
    from .client import Run

__all__ = ["Attachment", "PushStats", "Pusher", "RetryPolicy"]

log = logging.getLogger("polyak")

#: Answers worth another attempt.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """How the sender retries a push it could not deliver."""

    #: First backoff delay; doubles per attempt up to ``max_delay``.
    base_delay: float = 0.05
    max_delay: float = 10.0
    #: Seconds of failed delivery after which the failure is raised from
    #: ``push``/``flush`` (the push stays queued and is still retried).
    report_after: float = 60.0
    #: Socket timeout of one request (connect, send, answer).
    request_timeout: float = 300.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Exponential backoff with "equal jitter" (half fixed, half random),
        never shorter than the server's ``Retry-After``."""
        cap = min(float(self.max_delay), float(self.base_delay) * 2.0 ** min(attempt, 60))
        d = cap / 2 + random.uniform(0, cap / 2)
        return float(max(d, retry_after or 0.0))


@dataclass(frozen=True)
class PushStats:
    """Counters of one pusher (a consistent copy)."""

    #: ``push`` calls that queued a body.
    pushed: int
    #: ``push`` calls for steps that are not update steps (nothing sent).
    skipped: int
    #: Pushes the server answered 200 (applied or duplicate).
    acknowledged: int
    applied: int
    duplicates: int
    #: Queued pushes replaced by newer ones (policy ``drop_oldest``).
    dropped: int
    #: Pushes the server refused (4xx); each one was raised.
    rejected: int
    #: Attempts that failed and were retried.
    retries: int
    #: Queued plus in flight.
    pending: int
    #: The step being sent now, if any.
    in_flight_step: int | None
    #: Newest step the server acknowledged.
    last_step: int | None
    bytes_sent: int
    #: Time ``push`` spent copying tensors on the calling (training) thread.
    copy_seconds: float
    #: Time ``push`` spent waiting for room in the queue (policy ``block``).
    blocked_seconds: float
    #: Time spent in ``push`` on the calling thread, all of it (finding the
    #: tensors, copying what is copied at once, waiting for room).
    push_seconds: float = 0.0
    #: Time the calling thread waited in :meth:`Pusher.wait_copied` (the
    #: optimizer pre-step hook of ``attach``) for deferred copies to finish.
    wait_seconds: float = 0.0
    #: Calls of ``wait_copied`` that had to wait.
    waits: int = 0
    #: Pushes whose parameter copy was deferred to the copy thread.
    deferred: int = 0
    #: Time the copy thread spent on deferred copies (not the training thread's).
    deferred_copy_seconds: float = 0.0
    #: CPU time the sender thread spent encoding bodies (codec, deltas).
    encode_seconds: float = 0.0
    #: Pushes encoded (``codec`` or ``delta`` set).
    encoded: int = 0
    #: Bytes of the bodies before encoding (with ``bytes_sent``: the ratio).
    logical_bytes: int = 0
    #: Keyframes (full pushes) among the encoded pushes.
    keyframes: int = 0

    @property
    def training_thread_seconds(self) -> float:
        """What the pushes cost the training thread: time in ``push`` plus
        time waiting for deferred copies before ``optimizer.step()``."""
        return self.push_seconds + self.wait_seconds


@dataclass
class _Job:
    step: int
    body: HostBody
    queued_at: float
    #: ``(view indices, sources)`` still to be copied into ``body`` by the
    #: copy thread (deferred parameter copies); ``None`` once the body is full.
    deferred: tuple[list[int], list[torch.Tensor]] | None = None
    #: The body holds every tensor (the sender may read it).
    copied: bool = True
    #: Why the deferred copy failed (the push is then not sent).
    copy_error: PolyakError | None = None


class _Connection:
    """One keep-alive HTTP/1.1 connection for pushes.

    ``http.client`` rather than httpx here: the body is the host buffer
    itself, handed to one ``socket.sendall`` (which releases the GIL for the
    whole transfer); httpx's h11 path would copy it in 64 KiB ``bytes``
    pieces on this thread.
    """

    def __init__(self, base_url: str, timeout: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"server URL must be http(s)://, not {base_url!r}")
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self.conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self.conn = cls(self.host, self.port, timeout=self.timeout)
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def put(
        self, path: str, body: memoryview | bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes, str | None]:
        """Status, body and ``Retry-After`` of one PUT; connection problems
        raise ``OSError`` / ``http.client.HTTPException``."""
        conn = self._connect()
        try:
            try:
                conn.request("PUT", self.prefix + path, body=body, headers=dict(headers))
            except (BrokenPipeError, ConnectionResetError):
                # The server may have answered early (a body over its limit)
                # and closed; its answer is still worth reading.
                resp = conn.getresponse()
            else:
                resp = conn.getresponse()
            data = resp.read()
        except BaseException:
            self.close()
            raise
        if resp.will_close:
            self.close()
        return resp.status, data, resp.getheader("Retry-After")


class Pusher:
    """Pushes one rank's tensors to a run without stalling the training step.

    Options:

    - ``max_queue``: pushes that may wait while others are in flight (host
      memory: ``max_queue + pipeline`` copies of this rank's shard).
    - ``pipeline``: pushes in flight at once, each on its own connection
      (default 1: one at a time; 2 keeps the wire busy while the server
      applies). The server applies them in step
      order and answers each after its own apply.
    - ``policy``: ``"block"`` (``push`` waits for room; nothing is ever
      dropped) or ``"drop_oldest"`` (``push`` never waits; the oldest queued
      push is dropped and counted).
    - ``dtype``: cast floating point tensors (e.g. ``torch.bfloat16``) while
      copying; names in ``copy_only`` and the run's ``copy_patterns`` keep
      their dtype.
    - ``skip``: globs of names not to push (nor load back).
    - ``copy_only``: globs of floating point names that must be copied, not
      averaged. The server decides that from the run's ``copy_patterns``;
      the pusher checks at its first push that they cover these names.
    - ``compress``: a zstd level (needs ``zstandard``), for slow links.
    - ``codec="bgz"``: the lossless byte-grouped zstd codec (needs
      ``zstandard``; compresses float weights better than plain zstd), at
      zstd level ``codec_level``.
    - ``delta``: send deltas against the server's mirror (the run needs
      ``mirror: true``): ``"xor"`` (lossless) or quantised ``"bf16"``,
      ``"fp8_e4m3"``, ``"int8"`` (``block`` values per scale, 128 or 256),
      with error feedback; a keyframe (full push) every ``keyframe_every``
      pushes (default: the run's ``keyframe_every``). Encoding runs on the
      sender thread.
    - ``retry``: a :class:`RetryPolicy`.
    - ``split_replicated``: plain (non-DTensor, non-ShardedTensor) tensors
      are taken to be the same on every rank (DDP replicas, FSDP buffers)
      and split between the run's ranks along dim 0, so each rank sends its
      share. ``False`` when each rank holds its own whole tensors (pipeline
      stages): they are pushed whole.
    """

    def __init__(
        self,
        run: Run,
        rank: int,
        *,
        max_queue: int = 2,
        policy: Literal["block", "drop_oldest"] = "block",
        dtype: torch.dtype | None = None,
        skip: Sequence[str] = (),
        copy_only: Sequence[str] = (),
        compress: int | None = None,
        retry: RetryPolicy | None = None,
        split_replicated: bool = True,
        pipeline: int = 1,
        codec: str | None = None,
        codec_level: int = 3,
        delta: str | None = None,
        block: int = 128,
        keyframe_every: int | None = None,
    ) -> None:
        if not 0 <= rank < run.world_size:
            raise ValueError(
                f"rank {rank} is outside run `{run.name}`'s world size {run.world_size}"
            )
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if pipeline < 1:
            raise ValueError("pipeline must be >= 1")
        self.pipeline = int(pipeline)
        if policy not in ("block", "drop_oldest"):
            raise ValueError(f"policy must be `block` or `drop_oldest`, not {policy!r}")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, not {dtype}")
        self.run = run
        self.rank = int(rank)
        self.world_size = run.world_size
        self.update_every = run.update_every
        self.max_queue = int(max_queue)
        self.policy = policy
        self.dtype = dtype
        self.skip = tuple(skip)
        self.copy_only = tuple(copy_only)
        self.compress = compress
        if compress is not None and (codec is not None or delta is not None):
            raise ValueError("compress (plain zstd) and codec/delta are exclusive")
        self._encoder: MirrorEncoder | None = None
        if codec is not None or delta is not None:
            self._encoder = MirrorEncoder(
                delta,
                block=block,
                keyframe_every=int(keyframe_every or run.keyframe_every),
                codec=codec,
                level=codec_level,
            )
        self._encode_seconds = 0.0
        self._encoded = 0
        self._logical_bytes = 0
        self._keyframes = 0
        self.retry = retry or RetryPolicy()
        self.split_replicated = bool(split_replicated)
        self._token = run.write_token or run.client.token
        self._path = f"/v1/runs/{quote(run.name, safe='')}/ranks/{self.rank}/steps/"

        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._in_flight: list[_Job] = []
        # Taking a job and encoding it happen in dispatch order, one sender
        # at a time; sending happens side by side.
        self._dispatch = threading.Lock()
        self._last_dispatched: int | None = None
        self._threads: list[threading.Thread] = []
        self._free: list[HostBody] = []
        self._allocated = 0
        self._layout: WireLayout | None = None
        self._aliases: dict[str, str] = {}
        self._keeps_dtype: dict[str, bool] = {}
        self._pending_error: PolyakError | None = None
        self._more_errors = 0
        self._last_transient = ""
        self._last_queued: int | None = None
        self._closed = False
        self._stopping = False
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        # Deferred parameter copies, oldest first, for the copy thread.
        self._copy_queue: deque[_Job] = deque()
        self._copies_pending = 0
        self._copier: threading.Thread | None = None
        self._storages = _ParamStorages()
        self._counts = {
            "pushed": 0,
            "skipped": 0,
            "acknowledged": 0,
            "applied": 0,
            "duplicates": 0,
            "dropped": 0,
            "rejected": 0,
            "retries": 0,
            "bytes_sent": 0,
        }
        self._last_acked: int | None = None
        self._copy_seconds = 0.0
        self._blocked_seconds = 0.0
        self._push_seconds = 0.0
        self._wait_seconds = 0.0
        self._waits = 0
        self._deferred = 0
        self._deferred_copy_seconds = 0.0
        self._last_response: dict[str, Any] | None = None
        _LIVE_PUSHERS.add(self)
        atexit.register(_warn_if_pending, weakref.ref(self))

    def __repr__(self) -> str:
        return f"Pusher(run={self.run.name!r}, rank={self.rank}, policy={self.policy!r}, max_queue={self.max_queue})"

    # -- the training thread ---------------------------------------------

    def should_push(self, step: int) -> bool:
        """``step`` is one the run applies (``step % update_every == 0``)."""
        return int(step) % self.update_every == 0

    def push(
        self,
        model_or_state_dict: nn.Module | Mapping[str, Any],
        step: int,
        *,
        defer: bool = False,
    ) -> bool:
        """Queues this rank's tensors for ``step``; returns ``False`` (and
        sends nothing) when ``step`` is not an update step.

        ``step`` is the number of optimizer steps taken before this one's
        weights: after the first ``optimizer.step()`` push with step 0 (the
        value ema-pytorch's ``EMA.step`` holds when ``update()`` is entered).
        Raises a pending failure of an earlier push first.

        By default every tensor is copied before ``push`` returns. With
        ``defer=True`` (a module on the CPU) only the buffers are; the
        parameters are copied by the pusher's copy thread while the training
        thread goes on, and the caller must call :meth:`wait_copied` before
        anything changes a parameter (before the next ``optimizer.step()``).
        :meth:`attach` does this with an optimizer pre-step hook.
        """
        return self._push(model_or_state_dict, step, defer=defer)

    def _push(
        self,
        model_or_state_dict: nn.Module | Mapping[str, Any],
        step: int,
        *,
        defer: bool,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> bool:
        entered = time.perf_counter()
        self._raise_pending()
        if self._closed:
            raise PolyakError("the pusher is closed", code="closed", rank=self.rank, step=step)
        step = int(step)
        if not self.should_push(step):
            with self._cond:
                self._counts["skipped"] += 1
            return False
        if self._last_queued is not None and step <= self._last_queued:
            raise PolyakError(
                f"steps must increase; step {step} after {self._last_queued}",
                code="step_order",
                rank=self.rank,
                step=step,
            )
        state = self._local_state(model_or_state_dict)
        pieces, aliases = tied_pieces(push_pieces(state.parts, self.skip))
        specs = [
            TensorSpec(p.name, self._wire_dtype(p.name, p.tensor), tuple(p.tensor.shape), p.chunk)
            for p in pieces
        ]
        layout = self._layout_for(specs, pieces, aliases)
        pin = torch.cuda.is_available() and any(p.tensor.is_cuda for p in pieces)
        later: list[int] = []
        if defer and not any(p.tensor.is_cuda for p in pieces):
            # On CUDA the copies are already asynchronous (pinned memory,
            # `non_blocking`, an event); on the CPU the parameters' copy is
            # what a push costs, and it can wait for the copy thread.
            stable = self._storages.of(model_or_state_dict, optimizer)
            later = [i for i, p in enumerate(pieces) if _storage_key(p.tensor) in stable]
        body = self._acquire(layout, step, pin)
        started = time.perf_counter()
        try:
            if later:
                deferred = set(later)
                now = [i for i in range(len(pieces)) if i not in deferred]
                body.fill([pieces[i].tensor for i in now], now)
            else:
                body.fill([p.tensor for p in pieces])
        except BaseException:
            with self._cond:
                self._free.append(body)
                self._cond.notify_all()
            raise
        job = _Job(step, body, time.monotonic())
        if later:
            job.deferred = (later, [pieces[i].tensor for i in later])
            job.copied = False
        with self._cond:
            self._copy_seconds += time.perf_counter() - started
            self._queue.append(job)
            if later:
                self._copy_queue.append(job)
                self._copies_pending += 1
                self._deferred += 1
            self._counts["pushed"] += 1
            self._last_queued = step
            self._cond.notify_all()
        self._ensure_threads(copier=bool(later))
        with self._cond:
            self._push_seconds += time.perf_counter() - entered
        return True

    def wait_copied(self, timeout: float | None = None) -> None:
        """Waits until the deferred copies of earlier pushes are done, so
        the parameters may change. ``attach`` calls it from an optimizer
        pre-step hook; call it yourself before ``optimizer.step()`` (or any
        other change to the parameters) after ``push(..., defer=True)``.
        The time it waits is counted in :attr:`PushStats.wait_seconds`."""
        with self._cond:
            if not self._copies_pending:
                return
            started = time.perf_counter()
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._copies_pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining if remaining is not None else 1.0)
            self._wait_seconds += time.perf_counter() - started
            self._waits += 1
            if self._copies_pending:
                raise PolyakError(
                    f"{self._copies_pending} deferred copies still running after {timeout:g}s",
                    code="copy_timeout",
                    rank=self.rank,
                )

    def _wire_dtype(self, name: str, t: torch.Tensor) -> torch.dtype:
        if self.dtype is None or not t.is_floating_point():
            return t.dtype
        keep = self._keeps_dtype.get(name)
        if keep is None:
            keep = matches(name, self.copy_only) or matches(name, self.run.copy_patterns)
            self._keeps_dtype[name] = keep
        return t.dtype if keep else self.dtype

    def _layout_for(
        self, specs: list[TensorSpec], pieces: Sequence[Any], aliases: Mapping[str, str]
    ) -> WireLayout:
        layout = self._layout
        if layout is not None:
            if aliases != self._aliases:
                raise PolyakError(
                    f"tied names changed since the first push ({self._aliases} -> "
                    f"{dict(aliases)}); a run's layout is fixed",
                    code="layout_changed",
                    rank=self.rank,
                )
            if tuple((s.name, s.dtype, s.shape, s.chunk) for s in specs) != layout.signature:
                raise PolyakError(
                    "the pushed tensors differ from the first push's "
                    f"({layout.describe_difference(specs)}); a run's layout is fixed",
                    code="layout_changed",
                    rank=self.rank,
                )
            return layout
        if self.copy_only:
            uncovered = [
                p.name
                for p in pieces
                if matches(p.name, self.copy_only)
                and p.tensor.is_floating_point()
                and not matches(p.name, self.run.copy_patterns)
            ]
            if uncovered:
                raise PolyakError(
                    f"copy_only names {uncovered[:5]} are floating point and not in run "
                    f"`{self.run.name}`'s copy_patterns {self.run.copy_patterns}; the server "
                    "would average them. Create the run with copy_patterns covering them.",
                    code="copy_only_not_configured",
                    rank=self.rank,
                )
        # Tied names travel once; the server records the aliases and writes
        # every name back in downloads and the live EMA.
        self._aliases = dict(aliases)
        meta = {ALIASES_KEY: json.dumps(self._aliases, sort_keys=True)} if aliases else None
        self._layout = WireLayout(specs, meta)
        return self._layout

    def _acquire(self, layout: WireLayout, step: int, pin: bool) -> HostBody:
        """A body to fill: a free one, a new one, or (``drop_oldest``) the
        oldest queued one. ``block`` waits for room; a failure reported
        meanwhile is raised."""
        waited_from: float | None = None
        body: HostBody | None = None
        allocate = False
        with self._cond:
            while self._pending_error is None:
                if len(self._queue) < self.max_queue:
                    if self._free:
                        body = self._free.pop()
                        break
                    if self._allocated < self.max_queue + self.pipeline:
                        self._allocated += 1
                        allocate = True
                        break
                if self.policy == "drop_oldest" and self._queue:
                    dropped = self._queue.popleft()
                    if not dropped.copied:
                        # Its deferred copy may be writing the body now.
                        if waited_from is None:
                            waited_from = time.perf_counter()
                        while not dropped.copied:
                            self._cond.wait(0.5)
                    self._counts["dropped"] += 1
                    log.warning(
                        "polyak: run %s rank %d dropped the queued push of step %d for step %d "
                        "(policy drop_oldest)",
                        self.run.name,
                        self.rank,
                        dropped.step,
                        step,
                    )
                    body = dropped.body
                    break
                if waited_from is None:
                    waited_from = time.perf_counter()
                self._cond.wait(0.5)
            if waited_from is not None:
                self._blocked_seconds += time.perf_counter() - waited_from
        if allocate:
            # Allocated outside the lock: pinning a large buffer takes a while.
            return HostBody(layout, pin=pin)
        if body is None:
            self._raise_pending()
            raise AssertionError("no body and no error")  # pragma: no cover
        return body

    def attach(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Mapping[str, Any],
        *,
        start_step: int = 0,
        defer: bool = True,
    ) -> Attachment:
        """Pushes ``model`` after every ``optimizer.step()`` that is an update
        step, with the right step (like ema-pytorch's
        ``add_to_optimizer_post_step_hook``). ``start_step``: the number of
        optimizer steps already taken (when resuming).

        With ``defer`` (the default) the optimizer's parameters are copied
        off the training thread, while the next forward and backward run;
        a pre-step hook waits for that copy before the next step changes
        them (see :class:`Attachment`). Code that changes parameters
        between steps otherwise (weight clipping, loading a checkpoint)
        calls :meth:`wait_copied` first, or attaches with ``defer=False``.
        """
        return Attachment(self, optimizer, model, start_step, defer)

    # -- waiting, errors, stats -------------------------------------------

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every queued push is acknowledged; raises the first
        failure, or ``flush_timeout`` naming what is still pending."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._in_flight) and self._pending_error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    steps = [j.step for j in self._in_flight] + [j.step for j in self._queue]
                    raise PolyakError(
                        f"{len(steps)} push(es) not acknowledged after {timeout:g}s "
                        f"(steps {_steps_text(steps)}); last attempt: {self._last_transient or 'in progress'}",
                        code="flush_timeout",
                        rank=self.rank,
                        step=steps[0],
                    )
                self._cond.wait(remaining if remaining is not None else 1.0)
        self._raise_pending()

    def _raise_pending(self) -> None:
        with self._cond:
            err, self._pending_error = self._pending_error, None
            more, self._more_errors = self._more_errors, 0
        if err is not None:
            if more:
                err = PolyakError(
                    f"{err.message} (and {more} later failure(s); see pusher.stats())",
                    status=err.status,
                    code=err.code,
                    step=err.step,
                    rank=err.rank,
                )
            raise err

    def _report(self, err: PolyakError) -> None:
        """Keeps ``err`` for the training thread (called with the lock held)."""
        if self._pending_error is None:
            self._pending_error = err
        else:
            self._more_errors += 1
        self._cond.notify_all()

    def stats(self) -> PushStats:
        with self._cond:
            c = self._counts
            return PushStats(
                pushed=c["pushed"],
                skipped=c["skipped"],
                acknowledged=c["acknowledged"],
                applied=c["applied"],
                duplicates=c["duplicates"],
                dropped=c["dropped"],
                rejected=c["rejected"],
                retries=c["retries"],
                pending=len(self._queue) + len(self._in_flight),
                in_flight_step=self._in_flight[0].step if self._in_flight else None,
                last_step=self._last_acked,
                bytes_sent=c["bytes_sent"],
                copy_seconds=self._copy_seconds,
                blocked_seconds=self._blocked_seconds,
                push_seconds=self._push_seconds,
                wait_seconds=self._wait_seconds,
                waits=self._waits,
                deferred=self._deferred,
                deferred_copy_seconds=self._deferred_copy_seconds,
                encode_seconds=self._encode_seconds,
                encoded=self._encoded,
                logical_bytes=self._logical_bytes,
                keyframes=self._keyframes,
            )

    @property
    def last_response(self) -> dict[str, Any] | None:
        """The server's answer to the newest acknowledged push."""
        with self._cond:
            return self._last_response

    def close(self, timeout: float | None = None) -> None:
        """Flushes, then stops the sender. If the flush fails, what is still
        queued is abandoned and the error raised."""
        if self._closed:
            return
        try:
            self.flush(timeout)
        finally:
            self._closed = True
            with self._cond:
                self._stopping = True
                aborting = bool(self._queue) or bool(self._in_flight)
                if aborting:
                    self._abort.set()
                self._cond.notify_all()
            if self._copier is not None:
                self._copier.join()
            for thread in self._threads:
                # An abandoned request may be stuck in a socket call; the
                # thread is a daemon, so do not wait for it long.
                thread.join(timeout=5.0 if aborting else None)
            with self._cond:
                self._free.clear()  # the host buffers go back to the allocator

    def __enter__(self) -> Pusher:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            with contextlib.suppress(PolyakError):
                self.close(timeout=0)

    # -- EMA back into the trainer ----------------------------------------

    def _local_state(self, model: nn.Module | Mapping[str, Any]) -> LocalState:
        if self.split_replicated:
            return local_state(model, rank=self.rank, world_size=self.world_size)
        return local_state(model, rank=0, world_size=1)

    def _targets(self, model: nn.Module | Mapping[str, Any]) -> tuple[list[LocalPart], Any]:
        state = self._local_state(model)
        parts = [p for p in state.parts if not (self.skip and matches(p.name, self.skip))]
        return parts, state.commit

    def load_ema_into(
        self,
        model: nn.Module | Mapping[str, Any],
        profile: str | None = None,
        *,
        flush: bool = True,
    ) -> None:
        """Copies the run's EMA into this rank's part of ``model`` (its own,
        possibly sharded, parameters and buffers), after waiting for this
        rank's pushes to be acknowledged. Given a state dict, its tensors (or
        local shards) are written in place; load it into the model yourself.

        The rank's own EMA file is fetched first; other ranks' files only if
        it does not cover everything this rank holds (replicated tensors,
        which are pushed split between the ranks). With FSDP1 every rank
        must call this together (the sharded state dict is a collective).
        Hare-and-tortoise training (ema-pytorch's
        ``update_model_with_ema_every``) is ``load_ema_into`` every N steps.
        """
        if flush:
            self.flush()
        _wait_all_copies()  # other pushers may still be copying these parameters
        parts, commit = self._targets(model)
        files: dict[int, tuple[dict[str, torch.Tensor], dict[str, Chunk]]] = {}

        def fetch(rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Chunk]]:
            if rank not in files:
                ema = self.run.rank_ema(rank, profile)
                files[rank] = (ema.tensors, ema.chunks)
            return files[rank]

        missing = copy_into_parts(parts, [fetch(self.rank)])
        if missing and self.world_size > 1:
            for r in range(self.world_size):
                fetch(r)
            need = [p for p in parts if p.name in set(missing)]
            missing = copy_into_parts(need, [files[r] for r in sorted(files)])
        if missing:
            raise PolyakError(
                f"the EMA does not cover {missing[:5]} (not pushed, or skipped by another rank)",
                code="ema_incomplete",
                rank=self.rank,
            )
        if commit is not None:
            commit()

    @contextlib.contextmanager
    def ema_weights(
        self,
        model: nn.Module | Mapping[str, Any],
        profile: str | None = None,
        *,
        bn_loader: Iterable[Any] | None = None,
    ) -> Iterator[nn.Module | Mapping[str, Any]]:
        """``with pusher.ema_weights(model, "ema"): evaluate(model)``: the EMA
        in place of the online weights, which are restored bit for bit on
        exit (from a host copy of this rank's part, buffers included).

        ``bn_loader``: after loading the EMA, BatchNorm statistics are
        recomputed for the averaged weights with torch's own
        ``torch.optim.swa_utils.update_bn(bn_loader, model)`` (the SWA
        recipe: averaged weights need their own statistics); the online
        statistics come back on exit with the rest."""
        self.flush()
        parts, _ = self._targets(model)
        # A host copy: the point of polyak is not to hold extra weights on the device.
        saved = [p.tensor.detach().to("cpu", copy=True) for p in parts]
        self.load_ema_into(model, profile, flush=False)
        if bn_loader is not None:
            if not isinstance(model, nn.Module):
                raise TypeError("bn_loader needs the module, not a state dict")
            from torch.optim.swa_utils import update_bn

            device = next((p.device for p in model.parameters()), None)
            update_bn(bn_loader, model, device=device)
        try:
            yield model
        finally:
            _wait_all_copies()
            parts, commit = self._targets(model)
            with torch.no_grad():
                for part, online in zip(parts, saved, strict=True):
                    part.tensor.copy_(online)
            if commit is not None:
                commit()

    # -- the sender thread ------------------------------------------------

    def _ensure_threads(self, *, copier: bool) -> None:
        if self._thread is None:
            for slot in range(self.pipeline):
                thread = threading.Thread(
                    target=self._send_loop,
                    name=f"polyak-push-{self.run.name}-{self.rank}-{slot}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()
            self._thread = self._threads[0]
        if copier and self._copier is None:
            self._copier = threading.Thread(
                target=self._copy_loop,
                name=f"polyak-copy-{self.run.name}-{self.rank}",
                daemon=True,
            )
            self._copier.start()

    def _copy_loop(self) -> None:
        """Deferred parameter copies, oldest first. A thread of its own, not
        the sender's: a slow or unreachable server must not delay a copy
        the next ``optimizer.step()`` waits for. torch releases the GIL
        while it copies, so the training thread runs meanwhile."""
        while True:
            with self._cond:
                while not self._copy_queue and not self._stopping:
                    self._cond.wait()
                if not self._copy_queue:
                    return
                job = self._copy_queue[0]
            started = time.perf_counter()
            error: PolyakError | None = None
            try:
                self._copy_deferred(job)
            except Exception as e:  # reported from push/flush; never hangs a waiter
                error = PolyakError(
                    f"deferred copy failed: {type(e).__name__}: {e}",
                    code="copy_failed",
                    step=job.step,
                    rank=self.rank,
                )
            with self._cond:
                self._copy_queue.popleft()
                job.deferred = None  # drop the references to the parameters
                job.copy_error = error
                job.copied = True
                self._copies_pending -= 1
                self._deferred_copy_seconds += time.perf_counter() - started
                self._cond.notify_all()

    def _copy_deferred(self, job: _Job) -> None:
        assert job.deferred is not None
        indices, sources = job.deferred
        job.body.fill(sources, indices)

    def _next_job(self) -> tuple[_Job, int | None, Encoded | None] | None:
        """The next job in dispatch order, its predecessor step, and its
        encoded body (``None`` when there is nothing left to send)."""
        with self._dispatch:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue or self._abort.is_set():
                    return None
                job = self._queue.popleft()
                self._in_flight.append(job)
                prev, self._last_dispatched = self._last_dispatched, job.step
                while not job.copied:
                    self._cond.wait()
            encoded = None
            if self._encoder is not None and job.copy_error is None:
                job.body.wait_ready()
                encoded = self._encoder.encode(job.body.layout, job.body.views, job.body.memory)
                # Optimistic: the server applies in dispatch order, so the
                # next delta builds on this one; a refusal resets it.
                self._encoder.commit(encoded)
                with self._cond:
                    self._encode_seconds += encoded.seconds
                    self._encoded += 1
                    self._logical_bytes += job.body.layout.nbytes
                    self._keyframes += encoded.kind == "full"
            return job, prev, encoded

    def _send_loop(self) -> None:
        conn = _Connection(self.run.url, self.retry.request_timeout)
        try:
            while True:
                taken = self._next_job()
                if taken is None:
                    return
                job, prev, encoded = taken
                answer: dict[str, Any] | None = None
                failure: PolyakError | None = None
                try:
                    if job.copy_error is not None:
                        raise job.copy_error
                    answer = self._deliver(conn, job, prev, encoded)
                except PolyakError as e:
                    failure = e.at(step=job.step, rank=self.rank)
                except Exception as e:  # a bug here must not kill the thread silently
                    failure = PolyakError(
                        f"{type(e).__name__}: {e}",
                        code="client_error",
                        step=job.step,
                        rank=self.rank,
                    )
                # One critical section: whoever sees the outcome sees the job done.
                with self._cond:
                    if failure is not None and failure.code != "aborted":
                        self._counts["rejected"] += 1
                        self._report(failure)
                        log.error("polyak: push failed: %s", failure)
                    elif answer is not None:
                        self._counts["acknowledged"] += 1
                        if answer.get("applied"):
                            self._counts["applied"] += 1
                        if answer.get("duplicate"):
                            self._counts["duplicates"] += 1
                        if self._last_acked is None or job.step > self._last_acked:
                            self._last_acked = job.step
                            self._last_response = answer
                    self._free.append(job.body)
                    self._in_flight.remove(job)
                    self._cond.notify_all()
        finally:
            conn.close()

    def _deliver(
        self, conn: _Connection, job: _Job, prev: int | None, encoded: Encoded | None
    ) -> dict[str, Any]:
        job.body.wait_ready()
        payload: memoryview | bytes = job.body.memory
        from . import __version__

        headers = {
            "Content-Type": "application/octet-stream",
            "User-Agent": f"polyak-python/{__version__}",
        }
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        if prev is not None:
            headers["Polyak-Prev-Step"] = str(prev)
        if encoded is not None:
            payload = encoded.payload
            headers.update(encoded.headers)
        elif self.compress is not None:
            import zstandard

            payload = zstandard.ZstdCompressor(level=self.compress).compress(payload)
            headers["Content-Encoding"] = "zstd"
        headers["Content-Length"] = str(len(payload))
        path = f"{self._path}{job.step}"
        attempt = 0
        failing_since: float | None = None
        while True:
            if self._abort.is_set():
                raise PolyakError(
                    "the pusher was closed before this push was delivered", code="aborted"
                )
            retry_after: float | None = None
            try:
                status, data, retry_header = conn.put(path, payload, headers)
            except (OSError, http.client.HTTPException) as e:
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                if status == 200:
                    answer = dict(json.loads(data))
                    with self._cond:
                        self._counts["bytes_sent"] += len(payload)
                        self._last_transient = ""
                    return answer
                retry_after = parse_retry_after(retry_header)
                err = error_from_response(status, data, retry_after)
                if status not in RETRY_STATUSES:
                    if self._encoder is not None:
                        # The server's mirror is not what this push assumed
                        # next: the next push is a keyframe.
                        self._encoder.reset()
                    raise err
                problem = f"{status} {err.code}: {err.message}"
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
            with self._cond:
                self._counts["retries"] += 1
                self._last_transient = problem
                if now - failing_since >= self.retry.report_after:
                    pending = len(self._queue) + 1
                    self._report(
                        PolyakError(
                            f"could not deliver to {self.run.url} for {now - failing_since:.1f}s "
                            f"({attempt + 1} attempts; last: {problem}); {pending} push(es) kept "
                            f"and still retried, {self._counts['dropped']} dropped so far",
                            code="unavailable",
                            step=job.step,
                            rank=self.rank,
                        )
                    )
                    failing_since = now
            log.debug("polyak: step %d attempt %d failed: %s", job.step, attempt + 1, problem)
            self._abort.wait(self.retry.delay(attempt, retry_after))
            attempt += 1


class Attachment:
    """Optimizer hooks that push (see :meth:`Pusher.attach`).

    The post-step hook pushes, copying at once only what may change before
    the next ``optimizer.step()`` (buffers, tensors that are not parameters
    of this optimizer); the parameters are copied by the pusher's copy
    thread while forward and backward run, which only read them. The
    pre-step hook waits until those copies are done, so a step never
    changes a parameter that is being copied.

    ``step`` is the step the next ``optimizer.step()`` will push as.
    """

    def __init__(
        self,
        pusher: Pusher,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Mapping[str, Any],
        start_step: int = 0,
        defer: bool = True,
    ) -> None:
        self.pusher = pusher
        self.model = model
        self.step = int(start_step)
        self.defer = bool(defer)
        self._pre = optimizer.register_step_pre_hook(self._pre_hook)
        self._post = optimizer.register_step_post_hook(self._hook)

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.pusher.wait_copied()

    def _hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step = self.step
        self.step += 1
        if self.pusher.should_push(step):
            self.pusher._push(self.model, step, defer=self.defer, optimizer=optimizer)

    def remove(self) -> None:
        """Removes both hooks, after the pending copies are done."""
        self.pusher.wait_copied()
        self._pre.remove()
        self._post.remove()


class _ParamStorages:
    """The storages of the tensors a deferred push may copy later: those
    that change only in ``optimizer.step()``.

    With an optimizer (``attach``): its parameters (what its steps write,
    and what its pre-step hook protects), plus the module's frozen
    parameters (no optimizer changes them). Without one (``push(...,
    defer=True)``): the module's parameters, the caller having promised to
    call ``wait_copied`` before changing them. Buffers are never in it
    (BatchNorm statistics change in the forward pass), nor is anything else
    of a state dict. Cached while the parameter objects stay the same.
    """

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self._keys: frozenset[tuple[int, int]] = frozenset()

    def of(
        self, model: nn.Module | Mapping[str, Any], optimizer: torch.optim.Optimizer | None
    ) -> frozenset[tuple[int, int]]:
        params: list[torch.Tensor] = []
        if optimizer is not None:
            for group in optimizer.param_groups:
                params.extend(group["params"])
            if isinstance(model, nn.Module):
                params.extend(p for p in model.parameters() if not p.requires_grad)
        elif isinstance(model, nn.Module):
            params.extend(model.parameters())
        key = tuple(id(p) for p in params)
        if key != self._key:
            with torch.no_grad():
                locals_ = [_local_tensor(p) for p in params]
            self._keys = frozenset(_storage_key(t) for t in locals_ if t.numel() > 0)
            self._key = key
        return self._keys


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor (FSDP2)
    return to_local() if callable(to_local) else t


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """Which storage a tensor lives in (empty tensors match nothing)."""
    if t.numel() == 0 or t.device.type != "cpu":
        return (-1, id(t))
    return (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())


#: Every pusher of this process, so that writing the EMA into a model waits
#: for the deferred copies of all of them (two runs may push one model).
_LIVE_PUSHERS: weakref.WeakSet[Pusher] = weakref.WeakSet()


def _wait_all_copies() -> None:
    for pusher in list(_LIVE_PUSHERS):
        pusher.wait_copied()


def _steps_text(steps: Sequence[int]) -> str:
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{steps[0]}, {steps[1]}, ... {steps[-1]}"


def _warn_if_pending(ref: weakref.ref[Pusher]) -> None:
    pusher = ref()
    if pusher is None or pusher._closed:
        return
    pending = pusher.stats().pending
    if pending:
        log.warning(
            "polyak: %d push(es) of run %s rank %d were never delivered; call pusher.flush() before exit",
            pending,
            pusher.run.name,
            pusher.rank,
        )
