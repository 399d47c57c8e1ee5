"""``Pusher``: one rank's stream of pushes, off the training thread.

On the training thread, :meth:`Pusher.push` only finds this rank's tensors
(:mod:`polyak.shards`) and copies them into a reusable host body
(:class:`~polyak.wire.HostBody`: the safetensors header is already there; on
CUDA the memory is pinned and the copies are ``non_blocking`` with an event).
The rest happens in the parts of :mod:`polyak._push`, which this class
wires together:

- the bounded queue of bodies and their pool (:class:`~polyak._push.queue.PushQueue`:
  ``max_queue`` bodies may wait while ``pipeline`` are in flight; when it is full,
  policy ``drop_oldest`` (the default) takes the buffer of the oldest
  waiting push and counts it in :attr:`PushStats.dropped`, at once while
  the server is away and after ``max_wait`` seconds otherwise, and policy
  ``block`` waits for room);
- the copy thread (:class:`~polyak._push.copier.CopyThread`) for deferred
  parameter copies;
- the sender (:class:`~polyak._push.sender.Sender`), which encodes each
  body (:mod:`polyak._push.encoding`: as is, zstd, or the ``polyak-bgz``
  codec and deltas against the server's mirror) in step order and PUTs it
  over one of ``pipeline`` keep-alive connections of the client's transport
  (:mod:`polyak._transport`), each push naming the step sent before it
  (``Polyak-Prev-Step``), so the server receives the next body while it
  applies the previous one; connection errors, timeouts, 429 and 5xx are
  retried with exponential backoff and jitter, at least as long as
  ``Retry-After`` says.

Deferred copies: parameters change only in ``optimizer.step()`` (forward
and backward read them), so a push from :meth:`Pusher.attach` copies at
once only the buffers and whatever else is not a parameter of the
optimizer, and leaves the parameters' copy to the copy thread, which runs
while the next forward and backward do (torch releases the GIL while it
copies). An optimizer pre-step hook waits until those copies are done, so
no step changes a parameter being copied; the wait is counted in
:attr:`PushStats.wait_seconds`. A plain ``push`` copies everything before
it returns unless asked ``defer=True`` (the caller then calls
:meth:`Pusher.wait_copied` before changing the parameters). The copy thread
is not the sender: a slow server delays sending, never the copy the next
step waits for.

The server's failures never reach the training thread: whatever says
the server failed or lost what it was sent (no answer, a 5xx, a lost
predecessor, a lost mirror) is retried and recovered by the sender, and
logged as a warning when an outage begins, while it lasts and when it ends.
What the trainer got wrong (a push the server refuses with a 4xx: a layout
that does not match, NaN in a run that refuses it) is raised from the
next :meth:`Pusher.push` or :meth:`Pusher.flush`. ``flush()`` and
``close()`` wait at most ``flush_timeout`` seconds and then warn about what
is still not acknowledged; ``flush(timeout)`` raises instead (a read of the
EMA, which must not go on without it).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol
from urllib.parse import quote

import torch
from torch import nn

from ._push.copier import CopyThread
from ._push.encoding import Mirrored, encoding_for
from ._push.layout import LayoutKeeper
from ._push.mirror import DEFAULT_CODEC_LEVEL, MirrorEncoder
from ._push.queue import Job, PushQueue
from ._push.sender import Route, Sender
from ._push.stats import Counters, PushStats
from ._transport import RETRY_STATUSES, RetryPolicy, Transport
from .errors import PolyakError
from .shards import (
    LocalPart,
    LocalState,
    Piece,
    copy_into_parts,
    local_state,
    matches,
    push_pieces,
    tied_pieces,
)
from .wire import Chunk, HostBody, RankEma, WireLayout

__all__ = ["RETRY_STATUSES", "Attachment", "PushStats", "PushTarget", "Pusher", "RetryPolicy"]

log = logging.getLogger("polyak")


class PushTarget(Protocol):
    """What a pusher needs of its run (:class:`polyak.Run` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def update_every(self) -> int: ...
    @property
    def copy_patterns(self) -> list[str]: ...
    @property
    def keyframe_every(self) -> int: ...
    @property
    def write_token(self) -> str | None: ...
    @property
    def transport(self) -> Transport: ...
    def rank_ema(self, rank: int, profile: str | None = None) -> RankEma: ...


def _send_model_config(run: PushTarget, rank: int, model: Any) -> None:
    """Rank 0's first push of a model with a transformers-style ``config``
    (``to_dict()``) stores it in the run's metadata, so ``hf`` downloads
    carry its ``config.json``. Best effort: a failure only warns."""
    # DDP and FSDP wrappers keep the model as `.module`.
    config = getattr(model, "config", None) or getattr(
        getattr(model, "module", None), "config", None
    )
    annotate = getattr(run, "annotate", None)
    if rank != 0 or annotate is None or not callable(getattr(config, "to_dict", None)):
        return
    try:
        # A JSON round trip: dtypes and other objects become their names.
        as_json = json.loads(json.dumps(config.to_dict(), default=str))
        annotate(model_config=as_json)
    except Exception as e:  # the push itself must go on
        warnings.warn(
            f"polyak: the model's config was not stored with run {run.name!r} ({e}); "
            "hf downloads will have no config.json",
            stacklevel=3,
        )


class Pusher:
    """Pushes one rank's tensors to a run without stalling the training step.

    Options:

    - ``max_queue``: pushes that may wait while others are in flight (host
      memory: ``max_queue + pipeline`` copies of this rank's shard).
    - ``pipeline``: pushes in flight at once, each on its own connection
      (default 2: the server receives the next body while it applies the
      previous one; 1 sends one at a time). The server applies them in step
      order and answers each after its own apply; while a push waits for a
      retry, later ones are held back and sent after it.
    - ``policy``: what ``push`` does when the queue is full.
      ``"drop_oldest"`` (default): the oldest queued push is dropped and
      counted (:attr:`PushStats.dropped`; the first drop of an outage and
      its end are logged as warnings), at once while the server is away
      (delivery failing, or nothing acknowledged for ``max_wait``) and
      after waiting up to ``max_wait`` seconds for room otherwise, so a
      server slower than the trainer for a moment costs no push and an
      outage never holds the training step. ``"block"``: ``push`` waits
      for room as long as it takes; nothing is ever dropped.
    - ``max_wait``: seconds ``drop_oldest`` waits for room before it drops
      (default 10; 0: never wait).
    - ``flush_timeout``: seconds ``flush()`` and ``close()`` wait for the
      pushes to be acknowledged before they warn and return (default 60).
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
      zstd level ``codec_level`` (default 1: on trained weights it compresses
      the grouped bytes better than level 3, and faster).
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

    #: The sender class (a bench swaps in one that does not send).
    _sender_class: type[Sender] = Sender

    def __init__(
        self,
        run: PushTarget,
        rank: int,
        *,
        max_queue: int = 2,
        policy: Literal["block", "drop_oldest"] = "drop_oldest",
        max_wait: float = 10.0,
        flush_timeout: float = 60.0,
        dtype: torch.dtype | None = None,
        skip: Sequence[str] = (),
        copy_only: Sequence[str] = (),
        compress: int | None = None,
        retry: RetryPolicy | None = None,
        split_replicated: bool = True,
        pipeline: int = 2,
        codec: str | None = None,
        codec_level: int = DEFAULT_CODEC_LEVEL,
        delta: str | None = None,
        block: int = 128,
        keyframe_every: int | None = None,
    ) -> None:
        _check_options(run, rank, max_queue, policy, dtype)
        if max_wait < 0 or flush_timeout < 0:
            raise ValueError("max_wait and flush_timeout must be >= 0")
        if pipeline < 1:
            raise ValueError("pipeline must be >= 1")
        encoding = encoding_for(
            compress,
            codec=codec,
            delta=delta,
            codec_level=codec_level,
            block=block,
            keyframe_every=int(keyframe_every or run.keyframe_every),
        )
        self.pipeline = int(pipeline)
        self.run = run
        self.rank = int(rank)
        self.world_size = run.world_size
        self.update_every = run.update_every
        self.max_queue = int(max_queue)
        self.policy = policy
        self.max_wait = float(max_wait)
        self.flush_timeout = float(flush_timeout)
        self.dtype = dtype
        self.skip = tuple(skip)
        self.copy_only = tuple(copy_only)
        self.compress = compress
        self.retry = retry or RetryPolicy()
        self.split_replicated = bool(split_replicated)
        transport = run.transport
        self._counters = Counters()
        self._queue = PushQueue(
            max_queue=self.max_queue,
            policy=policy,
            in_flight=self.pipeline,
            counters=self._counters,
            who=f"run {run.name} rank {self.rank}",
            max_wait=self.max_wait,
        )
        self._copier = CopyThread(
            self._queue, name=f"polyak-copy-{run.name}-{self.rank}", rank=self.rank
        )
        self._sender = self._sender_class(
            self._queue,
            transport,
            path=f"/v1/runs/{quote(run.name, safe='')}/ranks/{self.rank}/steps/",
            token=run.write_token or transport.token,
            encoding=encoding,
            retry=self.retry,
            rank=self.rank,
            name=f"polyak-push-{run.name}-{self.rank}",
            slots=self.pipeline,
            route=_route_of(run, self.rank, transport),
        )
        self._layouts = LayoutKeeper(
            dtype=dtype,
            copy_only=self.copy_only,
            copy_patterns=run.copy_patterns,
            run_name=run.name,
            rank=self.rank,
        )
        self._storages = _ParamStorages()
        self._last_queued: int | None = None
        self._closed = False
        _LIVE_PUSHERS.add(self)
        atexit.register(_warn_if_pending, weakref.ref(self))

    def __repr__(self) -> str:
        return f"Pusher(run={self.run.name!r}, rank={self.rank}, policy={self.policy!r}, max_queue={self.max_queue})"

    @property
    def _encoder(self) -> MirrorEncoder | None:
        """The copy of the server's mirror and the delta encoder (``codec``
        or ``delta`` set), which the sender thread owns."""
        encoding = self._sender.encoding
        return encoding.encoder if isinstance(encoding, Mirrored) else None

    @property
    def _layout(self) -> WireLayout | None:
        """The wire layout of this rank's first push (``None`` before it)."""
        return self._layouts.layout

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
        self._queue.raise_failure()
        if self._closed:
            raise PolyakError("the pusher is closed", code="closed", rank=self.rank, step=step)
        step = int(step)
        if not self.should_push(step):
            with self._queue.cond:
                self._counters.skipped += 1
            return False
        if self._last_queued is None:
            _send_model_config(self.run, self.rank, model_or_state_dict)
        if self._last_queued is not None and step <= self._last_queued:
            raise PolyakError(
                f"steps must increase; step {step} after {self._last_queued}",
                code="step_order",
                rank=self.rank,
                step=step,
            )
        pieces, aliases = tied_pieces(
            push_pieces(self._local_state(model_or_state_dict).parts, self.skip)
        )
        layout = self._layouts.of(pieces, aliases)
        later = self._deferrable(pieces, model_or_state_dict, optimizer) if defer else []
        pin = torch.cuda.is_available() and any(p.tensor.is_cuda for p in pieces)
        body = self._queue.acquire(layout, step, pin)
        started = time.perf_counter()
        job = self._fill(body, step, pieces, later)
        with self._queue.cond:
            self._counters.copy_seconds += time.perf_counter() - started
            if later:
                self._copier.submit(job)
            self._counters.pushed += 1
            self._last_queued = step
            self._queue.put(job)
        self._sender.start()
        if later:
            self._copier.start()
        with self._queue.cond:
            self._counters.push_seconds += time.perf_counter() - entered
        return True

    def _deferrable(
        self,
        pieces: Sequence[Piece],
        model_or_state_dict: nn.Module | Mapping[str, Any],
        optimizer: torch.optim.Optimizer | None,
    ) -> list[int]:
        """Indices of the pieces the copy thread may copy later: parameters
        only ``optimizer.step()`` changes. None on CUDA, where the copies
        are already asynchronous (pinned memory, ``non_blocking``, an
        event); on the CPU the parameters' copy is what a push costs."""
        if any(p.tensor.is_cuda for p in pieces):
            return []
        stable = self._storages.of(model_or_state_dict, optimizer)
        return [i for i, p in enumerate(pieces) if _storage_key(p.tensor) in stable]

    def _fill(self, body: HostBody, step: int, pieces: Sequence[Piece], later: list[int]) -> Job:
        """Copies what must be copied now into ``body``; the job to queue,
        holding the deferred rest. The body goes back to the pool on failure."""
        try:
            if later:
                deferred = set(later)
                now = [i for i in range(len(pieces)) if i not in deferred]
                body.fill([pieces[i].tensor for i in now], now)
            else:
                body.fill([p.tensor for p in pieces])
        except BaseException:
            self._queue.release(body)
            raise
        job = Job(step, body, time.monotonic())
        if later:
            job.deferred = (later, [pieces[i].tensor for i in later])
            job.copied = False
        return job

    def wait_copied(self, timeout: float | None = None) -> None:
        """Waits until the deferred copies of earlier pushes are done, so
        the parameters may change. ``attach`` calls it from an optimizer
        pre-step hook; call it yourself before ``optimizer.step()`` (or any
        other change to the parameters) after ``push(..., defer=True)``.
        The time it waits is counted in :attr:`PushStats.wait_seconds`."""
        self._copier.wait(timeout)

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

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued push is acknowledged; true when they
        are. Raises the first push the server refused for the trainer's
        sake (a 4xx).

        Without ``timeout`` it waits at most ``flush_timeout`` seconds and
        then logs a warning naming what is still not acknowledged (the
        server away) and returns false: the end of training never fails
        because the server did. With ``timeout`` it raises instead:
        ``flush_timeout`` naming what is still pending, or ``unavailable``
        once delivery has failed for ``RetryPolicy.report_after`` seconds
        (for a read of the EMA, which must not go on without them)."""
        strict = timeout is not None
        wait = timeout if timeout is not None else self.flush_timeout
        deadline = time.monotonic() + wait
        queue = self._queue
        with queue.cond:
            while queue.busy() and not queue.has_failure():
                if strict and queue.overdue is not None:
                    overdue, queue.overdue = queue.overdue, None
                    raise overdue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    steps = queue.pending_steps()
                    message = (
                        f"{len(steps)} push(es) not acknowledged after {wait:g}s "
                        f"(steps {_steps_text(steps)}); last attempt: "
                        f"{self._sender.last_transient or 'in progress'}"
                    )
                    if strict:
                        raise PolyakError(
                            message, code="flush_timeout", rank=self.rank, step=steps[0]
                        )
                    log.warning(
                        "polyak: %s: %s; they are still retried while the pusher is open",
                        queue.who,
                        message,
                    )
                    break
                queue.cond.wait(min(remaining, 1.0))
            done = not queue.busy()
        queue.raise_failure()
        return done

    def stats(self) -> PushStats:
        with self._queue.cond:
            in_flight = self._queue.in_flight
            return self._counters.snapshot(
                pending=len(self._queue.jobs) + len(in_flight),
                in_flight_step=in_flight[0].step if in_flight else None,
            )

    @property
    def last_response(self) -> dict[str, Any] | None:
        """The server's answer to the newest acknowledged push."""
        with self._queue.cond:
            return self._counters.last_response

    def close(self, timeout: float | None = None) -> None:
        """Flushes (``flush(timeout)``: without one, waits at most
        ``flush_timeout`` and warns), then stops the sender; what is still
        queued then is abandoned. A push the server refused, or with a
        ``timeout`` a flush that ran out of it, is raised after stopping."""
        if self._closed:
            return
        try:
            self.flush(timeout)
        finally:
            self._closed = True
            queue = self._queue
            with queue.cond:
                queue.stopping = True
                aborting = queue.busy()
                if aborting:
                    self._sender.abort.set()
                queue.cond.notify_all()
            self._copier.join()
            # An abandoned request may be stuck in a socket call; the
            # thread is a daemon, so do not wait for it long.
            self._sender.join(timeout=5.0 if aborting else None)
            with queue.cond:
                queue.free.clear()  # the host buffers go back to the allocator

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
            self.flush(self.flush_timeout)  # raises rather than load a stale EMA
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
        self.flush(self.flush_timeout)
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

    def post_ema_eval(
        self,
        metrics: Mapping[str, float],
        profile: str | None = None,
        *,
        evaluator: str | None = None,
        timeout: float = 600.0,
    ) -> dict[str, Any] | None:
        """Posts ``metrics`` computed under :meth:`ema_weights` as an
        evaluation of the live EMA of ``profile`` (default the run's
        first): of the snapshot at the last step pushed (the EMA
        ``ema_weights`` loaded), a periodic one of that step or else one
        taken for it, which this waits for::

            with pusher.ema_weights(model, "ema"):
                val_loss = evaluate(model)
            pusher.post_ema_eval({"val_loss": val_loss}, "ema")

        Posted from rank 0 only (one evaluation, one snapshot): other ranks
        return ``None``, so every rank may call it. Answers the stored
        evaluation (its ``snapshot`` and ``step`` included)."""
        if self.rank != 0:
            return None
        self.flush(self.flush_timeout)
        if self._last_queued is None:
            raise PolyakError(
                "nothing was pushed yet: no live EMA to evaluate",
                code="nothing_pushed",
                rank=self.rank,
            )
        post = getattr(self.run, "post_live_eval", None)
        if post is None:
            raise TypeError("post_ema_eval needs a polyak.Run (with post_live_eval)")
        stored: dict[str, Any] = post(
            metrics, profile, step=self._last_queued, evaluator=evaluator, timeout=timeout
        )
        return stored


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


def _route_of(run: PushTarget, rank: int, transport: Transport) -> Route:
    """Where ``rank``'s pushes go: the node holding it, when the target
    knows its placement (a :class:`~polyak.client.Run` does)."""
    owner_url = getattr(run, "owner_url", None)
    if owner_url is None:
        return Route(transport.url)
    try:
        url = owner_url(rank)
    except PolyakError as e:  # a server without placement: push to it
        log.debug("polyak: no placement for rank %d (%s); pushing to %s", rank, e, transport.url)
        url = transport.url
    return Route(url, lookup=lambda: owner_url(rank, refresh=True))


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


#: How long the process waits at exit for pushes still queued or in flight
#: (a trainer that ends without ``flush``), all pushers together: the
#: sender is a daemon thread, so what is not acknowledged by then is lost
#: with the process.
EXIT_WAIT_SECONDS = 10.0
_exit_deadline: float | None = None


def _warn_if_pending(ref: weakref.ref[Pusher]) -> None:
    """At exit: waits briefly for what is still queued or in flight, then
    names what the server has not acknowledged. Pushes in flight may still
    be applied by the server after the process is gone, so they are "not
    yet acknowledged", not "never delivered"."""
    pusher = ref()
    if pusher is None or pusher._closed:
        return
    global _exit_deadline
    if _exit_deadline is None:
        _exit_deadline = time.monotonic() + EXIT_WAIT_SECONDS
    deadline = _exit_deadline
    queue = pusher._queue
    with queue.cond:
        while queue.busy() and not queue.has_failure():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            queue.cond.wait(min(left, 0.5))
        steps = queue.pending_steps()
        in_flight = len(queue.in_flight)
    if steps:
        log.warning(
            "polyak: %d push(es) of run %s rank %d not yet acknowledged at exit "
            "(steps %s; %d in flight, which the server may still apply); "
            "call pusher.flush() before exit",
            len(steps),
            pusher.run.name,
            pusher.rank,
            _steps_text(steps),
            in_flight,
        )


def _check_options(
    run: PushTarget, rank: int, max_queue: int, policy: str, dtype: torch.dtype | None
) -> None:
    if not 0 <= rank < run.world_size:
        raise ValueError(f"rank {rank} is outside run `{run.name}`'s world size {run.world_size}")
    if max_queue < 1:
        raise ValueError("max_queue must be >= 1")
    if policy not in ("block", "drop_oldest"):
        raise ValueError(f"policy must be `block` or `drop_oldest`, not {policy!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, not {dtype}")
