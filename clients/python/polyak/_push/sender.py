"""The sender: takes full bodies from the queue in step order, encodes
them and PUTs them to the server, retrying what can be retried.

Each connection slot is a thread with a keep-alive
:class:`~polyak._transport.Connection` of its own. v1 answers a push after
applying it and a rank's pushes must arrive in step order, so there is one
slot; the queue already counts bodies per slot (``max_queue + slots``) and
tracks every job in flight, so more slots need only a server that keeps
several pushes of a rank in flight.

A PUT is idempotent: if a first attempt was applied and only its answer
was lost, the retry carries the same bytes and the server answers
``duplicate: true``. A push the server refuses (4xx) is reported, and a
push that could not be delivered for ``RetryPolicy.report_after`` seconds
is reported (and kept, and retried); the training thread raises either
from its next ``push`` or ``flush``.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from .._transport import Connection, FailedAttempt, RetryPolicy, Transport, send_with_retries
from .._version import USER_AGENT
from ..errors import PolyakError
from .encoding import Encoding
from .queue import Job, PushQueue

__all__ = ["Sender"]

log = logging.getLogger("polyak")


class Sender:
    """Delivers a rank's queued pushes over ``slots`` connections."""

    #: Connection slots: pushes of this rank in flight at once.
    slots = 1

    def __init__(
        self,
        queue: PushQueue,
        transport: Transport,
        *,
        path: str,
        token: str | None,
        encoding: Encoding,
        retry: RetryPolicy,
        rank: int,
        name: str,
    ) -> None:
        self.queue = queue
        self.transport = transport
        #: ``/v1/runs/{run}/ranks/{rank}/steps/`` (the step is appended).
        self.path = path
        self.token = token
        self.encoding = encoding
        self.retry = retry
        self.rank = rank
        self.name = name
        #: Set by ``close`` when pushes are abandoned: waits and retries stop.
        self.abort = threading.Event()
        #: The newest failed attempt's problem ("" once one is delivered).
        self.last_transient = ""
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        if not self._threads:
            for slot in range(self.slots):
                t = threading.Thread(
                    target=self._loop,
                    name=self.name if self.slots == 1 else f"{self.name}-{slot}",
                    daemon=True,
                )
                self._threads.append(t)
                t.start()

    def join(self, timeout: float | None = None) -> None:
        for t in self._threads:
            t.join(timeout=timeout)

    def _loop(self) -> None:
        conn = self.transport.connection(self.retry.request_timeout)
        try:
            while (job := self.queue.take(self.abort)) is not None:
                answer: dict[str, Any] | None = None
                failure: PolyakError | None = None
                try:
                    if job.copy_error is not None:
                        raise job.copy_error
                    answer = self.deliver(conn, job)
                except PolyakError as e:
                    failure = e.at(step=job.step, rank=self.rank)
                except Exception as e:  # a bug here must not kill the thread silently
                    failure = PolyakError(
                        f"{type(e).__name__}: {e}",
                        code="client_error",
                        step=job.step,
                        rank=self.rank,
                    )
                self._record(job, answer, failure)
        finally:
            conn.close()

    def _record(self, job: Job, answer: dict[str, Any] | None, failure: PolyakError | None) -> None:
        # One critical section: whoever sees the outcome sees the job done.
        with self.queue.cond:
            if failure is not None and failure.code != "aborted":
                self.queue.counters.rejected += 1
                self.queue.report(failure)
                log.error("polyak: push failed: %s", failure)
            elif answer is not None:
                self.queue.counters.acknowledged_push(job.step, answer)
            self.queue.finished(job)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/octet-stream", "User-Agent": USER_AGENT}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def deliver(self, conn: Connection, job: Job) -> dict[str, Any]:
        """PUTs ``job``'s body until the server answers 200; its answer."""
        job.body.wait_ready()
        payload, extra = self.encoding.encode(job.body.memory)
        headers = {**self.headers(), **extra, "Content-Length": str(len(payload))}
        path = f"{self.path}{job.step}"

        def retrying(failed: FailedAttempt) -> None:
            self._retrying(job, failed)

        data = send_with_retries(
            lambda: conn.put(path, payload, headers),
            policy=self.retry,
            abort=self.abort,
            on_retry=retrying,
        )
        with self.queue.cond:
            self.queue.counters.bytes_sent += len(payload)
            self.last_transient = ""
        return dict(json.loads(data))

    def _retrying(self, job: Job, failed: FailedAttempt) -> None:
        """Counts a failed attempt; reports it when delivery has failed
        for ``report_after`` seconds (the push is kept and retried)."""
        queue = self.queue
        with queue.cond:
            queue.counters.retries += 1
            self.last_transient = failed.problem
            if failed.overdue:
                pending = len(queue.jobs) + len(queue.in_flight)
                queue.report(
                    PolyakError(
                        f"could not deliver to {self.transport.url} for {failed.failing_for:.1f}s "
                        f"({failed.attempt + 1} attempts; last: {failed.problem}); {pending} "
                        f"push(es) kept and still retried, {queue.counters.dropped} dropped so far",
                        code="unavailable",
                        step=job.step,
                        rank=self.rank,
                    )
                )
        log.debug(
            "polyak: step %d attempt %d failed: %s", job.step, failed.attempt + 1, failed.problem
        )
