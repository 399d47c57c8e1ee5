"""The bounded queue between the training thread and the sender.

``max_queue`` bodies may wait while ``in_flight`` are being sent, so there
are at most ``max_queue + in_flight`` bodies, allocated on first use and
reused; the training thread never writes a body the sender is reading.
When the queue is full, policy ``block`` waits for room and ``drop_oldest``
takes the buffer of the oldest waiting push (never one in flight) and
counts it.

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
        self, *, max_queue: int, policy: Policy, in_flight: int, counters: Counters, who: str
    ) -> None:
        self.cond = threading.Condition()
        self.max_queue = max_queue
        self.policy = policy
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
                if self.policy == "drop_oldest" and self.jobs:
                    if waited_from is None and not self.jobs[0].copied:
                        waited_from = time.perf_counter()
                    body = self._drop_oldest(step)
                    break
                if waited_from is None:
                    waited_from = time.perf_counter()
                self.cond.wait(0.5)
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
        log.warning(
            "polyak: %s dropped the queued push of step %d for step %d (policy drop_oldest)",
            self.who,
            dropped.step,
            step,
        )
        return dropped.body

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
