"""The bounded queue between the training thread and the sender.

``max_queue`` bodies may wait while ``in_flight`` are being sent, so there
are at most ``max_queue + in_flight`` bodies, allocated on first use and
reused; the training thread never writes a body the sender is reading.
When the queue is full, policy ``block`` waits for room and ``drop_oldest``
takes the buffer of the oldest waiting push (never one in flight) and
counts it: at once while the server is away (an *outage*: the sender's
last attempt failed for the server's sake, or nothing was acknowledged
for ``max_wait`` seconds), else once ``max_wait`` seconds passed without
room. The first drop of an outage is logged as a warning, and its end
(the next acknowledged push) with the count of pushes dropped meanwhile.

One condition variable guards the queue, the copy thread's work and every
counter: whoever sees an outcome sees the job done. A failure of the copy
thread or the sender is kept here for the training thread, which raises it
from its next ``push`` or ``flush``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import PolyakError
from ..wire import HostBody, WireLayout
from .stats import Counters

__all__ = ["Job", "Policy", "PushQueue"]

log = logging.getLogger("polyak")

Policy = Literal["block", "drop_oldest"]


@dataclass
class Job:
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


class PushQueue:
    """Queued jobs, the ones in flight, the pool of bodies and the failure
    kept for the training thread, under one lock (:attr:`cond`)."""

    def __init__(
        self,
        *,
        max_queue: int,
        policy: Policy,
        in_flight: int,
        counters: Counters,
        who: str,
        max_wait: float = 10.0,
    ) -> None:
        self.cond = threading.Condition()
        self.max_queue = max_queue
        self.policy = policy
        #: Seconds ``drop_oldest`` waits for room before it drops (none
        #: during an outage).
        self.max_wait = float(max_wait)
        #: When the current outage began (``time.monotonic()``), ``None``
        #: while pushes are delivered.
        self.outage_since: float | None = None
        #: ``counters.dropped`` when the outage began.
        self._dropped_before = 0
        #: The first drop of this outage was warned about.
        self._drop_warned = False
        #: Delivery has failed for ``report_after`` seconds: what a strict
        #: flush raises (cleared by the next acknowledged push).
        self.overdue: PolyakError | None = None
        #: Bodies that may be sent at once (the sender's connection slots).
        self.max_in_flight = in_flight
        self.counters = counters
        #: ``run X rank N``, for log lines.
        self.who = who
        self.jobs: deque[Job] = deque()
        self.in_flight: list[Job] = []
        self.free: list[HostBody] = []
        self.allocated = 0
        #: Set by ``close``: the threads finish what is queued and return.
        self.stopping = False
        self._error: PolyakError | None = None
        self._more_errors = 0

    # -- the training thread ----------------------------------------------

    def acquire(self, layout: WireLayout, step: int, pin: bool) -> HostBody:
        """A body to fill: a free one, a new one, or (``drop_oldest``) the
        oldest queued one. ``block`` waits for room; a failure reported
        meanwhile is raised."""
        waited_from: float | None = None
        body: HostBody | None = None
        allocate = False
        with self.cond:
            while self._error is None:
                if len(self.jobs) < self.max_queue:
                    if self.free:
                        body = self.free.pop()
                        break
                    if self.allocated < self.max_queue + self.max_in_flight:
                        self.allocated += 1
                        allocate = True
                        break
                now = time.perf_counter()
                if self.policy == "drop_oldest" and self.jobs:
                    waited = 0.0 if waited_from is None else now - waited_from
                    if self.outage_since is None and waited >= self.max_wait > 0:
                        # Nothing acknowledged for max_wait: the server
                        # stalls (paused, or a request hangs).
                        self.begin_outage(f"no push acknowledged for {self.max_wait:g}s")
                    if self.outage_since is not None or self.max_wait <= 0:
                        if waited_from is None and not self.jobs[0].copied:
                            waited_from = now
                        body = self._drop_oldest(step)
                        break
                if waited_from is None:
                    waited_from = now
                left = self.max_wait - (now - waited_from)
                self.cond.wait(0.5 if self.policy == "block" else min(0.5, max(left, 0.01)))
            if waited_from is not None:
                self.counters.blocked_seconds += time.perf_counter() - waited_from
        if allocate:
            # Allocated outside the lock: pinning a large buffer takes a while.
            return HostBody(layout, pin=pin)
        if body is None:
            self.raise_failure()
            raise AssertionError("no body and no error")  # pragma: no cover
        return body

    def _drop_oldest(self, step: int) -> HostBody:
        """The oldest queued job's body, once its deferred copy (which may be
        writing it now) is done; counted and logged. Lock held."""
        dropped = self.jobs.popleft()
        while not dropped.copied:
            self.cond.wait(0.5)
        self.counters.dropped += 1
        if not self._drop_warned:
            self._drop_warned = True
            log.warning(
                "polyak: %s: the server is not taking pushes as fast as they come%s; "
                "dropping the oldest queued push (step %d, for step %d) and the next "
                "ones as needed so training goes on (policy drop_oldest; counted in "
                "pusher.stats().dropped)",
                self.who,
                f" ({self.outage_reason})" if self.outage_reason else "",
                dropped.step,
                step,
            )
        else:
            log.debug("polyak: %s dropped the queued push of step %d", self.who, dropped.step)
        return dropped.body

    # -- outages: the server away or stalled --------------------------------

    #: What began the current outage (for the drop warning).
    outage_reason = ""

    def begin_outage(self, reason: str) -> bool:
        """Marks the server away (lock held); true when this begins an outage."""
        if self.outage_since is not None:
            return False
        self.outage_since = time.monotonic()
        self.outage_reason = reason
        self._dropped_before = self.counters.dropped
        self.cond.notify_all()
        return True

    def end_outage(self) -> tuple[float, int] | None:
        """A push was acknowledged (lock held): the outage that ends, as
        (seconds, pushes dropped meanwhile), or ``None`` when there was none."""
        self.overdue = None
        if self.outage_since is None:
            return None
        lasted = time.monotonic() - self.outage_since
        dropped = self.counters.dropped - self._dropped_before
        self.outage_since = None
        self.outage_reason = ""
        self._drop_warned = False
        return lasted, dropped

    def put(self, job: Job) -> None:
        """Queues a filled (or deferred) job behind the others (lock held)."""
        self.jobs.append(job)
        self.cond.notify_all()

    def release(self, body: HostBody) -> None:
        """A body back to the pool (its push was abandoned before queueing)."""
        with self.cond:
            self.free.append(body)
            self.cond.notify_all()

    def pending_steps(self) -> list[int]:
        """Steps in flight, then queued (lock held)."""
        return [j.step for j in self.in_flight] + [j.step for j in self.jobs]

    def busy(self) -> bool:
        """Something is queued or in flight (lock held)."""
        return bool(self.jobs or self.in_flight)

    # -- the sender -------------------------------------------------------

    def take(self, abort: threading.Event) -> Job | None:
        """The next job in step order, marked in flight, once its body is
        full; ``None`` when stopping with nothing queued, or aborting."""
        with self.cond:
            while not self.jobs and not self.stopping:
                self.cond.wait()
            if not self.jobs or abort.is_set():
                return None
            job = self.jobs.popleft()
            self.in_flight.append(job)
            while not job.copied:
                self.cond.wait()
            return job

    def finished(self, job: Job) -> None:
        """``job`` is done (acknowledged or failed): its body back to the
        pool, waiters woken. Lock held."""
        self.free.append(job.body)
        self.in_flight.remove(job)
        self.cond.notify_all()

    # -- failures kept for the training thread -----------------------------

    def report(self, err: PolyakError) -> None:
        """Keeps ``err`` for the training thread (lock held)."""
        if self._error is None:
            self._error = err
        else:
            self._more_errors += 1
        self.cond.notify_all()

    def has_failure(self) -> bool:
        return self._error is not None

    def raise_failure(self) -> None:
        """Raises the kept failure (once), naming how many came after it."""
        with self.cond:
            err, self._error = self._error, None
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
