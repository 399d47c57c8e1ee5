"""Deferred parameter copies, off the training thread.

Parameters change only in ``optimizer.step()`` (forward and backward read
them), so a push may leave their copy into the host body to this thread,
which runs while the next forward and backward do (torch releases the GIL
while it copies). The training thread calls :meth:`CopyThread.wait` before
anything changes a parameter. A thread of its own, not the sender's: a
slow or unreachable server must not delay a copy the next step waits for.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from ..errors import PolyakError
from .queue import Job, PushQueue

__all__ = ["CopyThread"]


class CopyThread:
    """Copies the deferred part of each queued body, oldest first."""

    def __init__(self, queue: PushQueue, *, name: str, rank: int) -> None:
        self.queue = queue
        self.name = name
        self.rank = rank
        self._jobs: deque[Job] = deque()
        #: Deferred copies not done yet (the training thread waits for 0).
        self.pending = 0
        self._thread: threading.Thread | None = None

    def submit(self, job: Job) -> None:
        """Queues ``job``'s deferred copy (lock held); the thread is started
        by :meth:`start`."""
        self._jobs.append(job)
        self.pending += 1
        self.queue.counters.deferred += 1

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def wait(self, timeout: float | None = None) -> None:
        """Waits until every submitted copy is done; ``copy_timeout`` after
        ``timeout`` seconds. The time waited is counted."""
        cond = self.queue.cond
        counters = self.queue.counters
        with cond:
            if not self.pending:
                return
            started = time.perf_counter()
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                cond.wait(remaining if remaining is not None else 1.0)
            counters.wait_seconds += time.perf_counter() - started
            counters.waits += 1
            if self.pending:
                raise PolyakError(
                    f"{self.pending} deferred copies still running after {timeout:g}s",
                    code="copy_timeout",
                    rank=self.rank,
                )

    def _loop(self) -> None:
        cond = self.queue.cond
        while True:
            with cond:
                while not self._jobs and not self.queue.stopping:
                    cond.wait()
                if not self._jobs:
                    return
                job = self._jobs[0]
            started = time.perf_counter()
            error = self._copy(job)
            with cond:
                self._jobs.popleft()
                job.deferred = None  # drop the references to the parameters
                job.copy_error = error
                job.copied = True
                self.pending -= 1
                self.queue.counters.deferred_copy_seconds += time.perf_counter() - started
                cond.notify_all()

    def _copy(self, job: Job) -> PolyakError | None:
        """Fills the rest of ``job``'s body; a failure is returned, to be
        reported by the sender, so that no waiter hangs."""
        assert job.deferred is not None
        indices, sources = job.deferred
        try:
            job.body.fill(sources, indices)
        except Exception as e:
            return PolyakError(
                f"deferred copy failed: {type(e).__name__}: {e}",
                code="copy_failed",
                step=job.step,
                rank=self.rank,
            )
        return None
