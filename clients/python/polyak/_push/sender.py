"""The sender: takes full bodies from the queue in step order, encodes
them and PUTs them to the server, retrying what can be retried.

Each connection slot is a thread with a keep-alive
:class:`~polyak._transport.Connection` of its own (``slots`` of them; the
queue counts bodies per slot, ``max_queue + slots``). Taking a job and
encoding it happen in dispatch order, one slot at a time; sending happens
side by side. Each push names the step dispatched before it
(``Polyak-Prev-Step``), so the server receives the next body while it
applies the previous one and still applies them in step order, answering
each after its own apply.

A push the server answers with a retry (429, 408, 5xx) holds back the
later ones: while step N waits for its retry, no slot sends a step after
it, first attempt or retry, until N is delivered (or given up). The server
refuses pushes waiting for a predecessor that was answered with a retry
(``429 predecessor_retry``) so that they give back the in-flight budget the
retry needs; the client then sends them again after the predecessor, in
step order, instead of racing it.

A PUT is idempotent: if a first attempt was applied and only its answer
was lost, the retry carries the same bytes and the server answers
``duplicate: true``.

The server's failures never reach the training thread. Everything that
says the server failed or lost what it was sent is recovered here: no
answer (refused, reset, cut mid-body, timed out) and every 5xx
(``lease_lost``, ``placement_moved``, ...) are retried with backoff,
looking the rank's owner up again; ``Polyak-Prev-Step`` names the
predecessor only while that push is still in flight from here (one the
server acknowledged and then lost with a crash is not waited for), and a
``predecessor_timeout`` or ``pipeline_reset`` is sent again without it;
``needs_keyframe`` is sent again in full; a ``step_conflict`` for a push
whose earlier attempt failed means the server already holds that step or a
later one (its answer was lost), and the push is counted ``superseded``.
The first failure of an outage, every ``RetryPolicy.report_after`` seconds
of it, and its end are logged as warnings. Only what the trainer got wrong
(a 4xx: a layout that does not match, NaN in a run that refuses it, a step
already pushed) is reported, and raised from the next ``push`` or
``flush``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from .._transport import Connection, FailedAttempt, RetryPolicy, Transport, send_with_retries
from .._version import USER_AGENT
from ..errors import PolyakError
from .encoding import Encoding, Identity, Wire
from .queue import Job, PushQueue

__all__ = ["Sender"]

log = logging.getLogger("polyak")


#: Redirects followed for one attempt before it counts as failed.
MAX_REDIRECTS = 3
#: Failed attempts in a row after which the rank's owner is looked up again.
REFRESH_AFTER = 2


class Route:
    """Where one rank's pushes go: the node holding it, as the run's
    placement says. A ``307`` from the server moves it to the redirect's
    node; failed attempts in a row look the owner up again (``lookup``:
    the placement read anew, through any node that answers), so a rank
    whose node died follows it to the node that took it over."""

    def __init__(self, url: str, lookup: Callable[[], str | None] | None = None) -> None:
        self._lock = threading.Lock()
        self.url = url.rstrip("/")
        #: Raised at every move: a slot whose connection is older reconnects.
        self.version = 0
        self._lookup = lookup
        self._failures = 0

    def _move(self, url: str) -> None:
        url = url.rstrip("/")
        with self._lock:
            if url != self.url:
                log.info("polyak: pushes of this rank now go to %s (was %s)", url, self.url)
                self.url = url
                self.version += 1
            self._failures = 0

    def redirected(self, location: str, path: str) -> None:
        """A ``307`` to ``location`` (the pushed path on the owner)."""
        cut = location.find("/v1/runs/")
        self._move(location[:cut] if cut > 0 else location.removesuffix(path))

    def delivered(self) -> None:
        with self._lock:
            self._failures = 0

    def failed(self) -> None:
        """An attempt failed to connect or was refused for a while: after a
        few in a row, the owner is looked up again."""
        with self._lock:
            self._failures += 1
            due = self._failures >= REFRESH_AFTER and self._lookup is not None
            if due:
                self._failures = 0
        if due and self._lookup is not None:
            try:
                url = self._lookup()
            except Exception as e:  # no node answered: retried later
                log.debug("polyak: looking up the rank's node failed: %s", e)
                return
            if url:
                self._move(url)


class _Slot:
    """One sending thread's connection, renewed when the route moves."""

    def __init__(self, route: Route, timeout: float) -> None:
        self.route = route
        self.timeout = timeout
        self.version = route.version
        self.conn = Connection(route.url, timeout)

    def current(self) -> Connection:
        if self.version != self.route.version:
            self.conn.close()
            self.version = self.route.version
            self.conn = Connection(self.route.url, self.timeout)
        return self.conn

    def close(self) -> None:
        self.conn.close()


class Sender:
    """Delivers a rank's queued pushes over ``slots`` connections."""

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
        slots: int = 1,
        route: Route | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        #: Connection slots: pushes of this rank in flight at once.
        self.slots = int(slots)
        self.queue = queue
        self.transport = transport
        #: The node this rank's pushes go to.
        self.route = route or Route(transport.url)
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
        # Held while a slot takes its job and encodes it: dispatch order is
        # step order, and a stateful encoding sees every push in it.
        self._dispatch = threading.Lock()
        #: Steps dispatched to be sent and not yet done (under
        #: ``queue.cond``): a push names the newest earlier one as its
        #: predecessor.
        self._sending: set[int] = set()
        #: Steps whose delivery failed and waits for a retry (under
        #: ``queue.cond``): later steps are not sent meanwhile.
        self._retrying: set[int] = set()

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
        conn = _Slot(self.route, self.retry.request_timeout)
        try:
            while (taken := self._next()) is not None:
                job, wire = taken
                answer: dict[str, Any] | None = None
                failure: PolyakError | None = None
                try:
                    if job.copy_error is not None:
                        raise job.copy_error
                    if isinstance(wire, Exception):
                        raise wire
                    assert wire is not None
                    answer = self.deliver(conn, job, wire)
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

    def _next(self) -> tuple[Job, Wire | Exception | None] | None:
        """The next job in dispatch order and its encoded body (or why
        encoding failed; ``None`` when the copy failed); ``None`` when
        there is nothing left to send."""
        with self._dispatch:
            job = self.queue.take(self.abort)
            if job is None:
                return None
            # A job that is not sent (its copy or its encoding failed) is
            # nobody's predecessor: it never joins `_sending`.
            if job.copy_error is not None:
                return job, None
            try:
                job.body.wait_ready()
                wire = self.encoding.encode(job.body)
            except Exception as e:  # reported as this push's failure
                return job, e
            with self.queue.cond:
                self._sending.add(job.step)
                if self.encoding.stateful:
                    counters = self.queue.counters
                    counters.encode_seconds += wire.seconds
                    counters.encoded += 1
                    counters.logical_bytes += job.body.layout.nbytes
                    counters.keyframes += wire.kind == "full"
            return job, wire

    def _predecessor(self, step: int) -> int | None:
        """The step this push waits for on the server: the newest earlier
        one still being sent from here. One that is done (acknowledged,
        refused or dropped) is not named: acknowledged, the server applied
        it, unless a crash lost it since, and then nothing would come."""
        with self.queue.cond:
            return max((s for s in self._sending if s < step), default=None)

    def _record(self, job: Job, answer: dict[str, Any] | None, failure: PolyakError | None) -> None:
        # One critical section: whoever sees the outcome sees the job done.
        queue = self.queue
        with queue.cond:
            self._sending.discard(job.step)
            if failure is not None and failure.code != "aborted":
                queue.counters.rejected += 1
                queue.report(failure)
                log.error("polyak: push failed: %s", failure)
            elif answer is not None and answer.get("superseded"):
                queue.counters.superseded += 1
            elif answer is not None:
                queue.counters.acknowledged_push(job.step, answer)
                ended = queue.end_outage()
                if ended is not None:
                    lasted, dropped = ended
                    log.warning(
                        "polyak: %s: pushes are delivered again to %s (step %d) after %.1fs; "
                        "%d push(es) dropped meanwhile (%d in all)",
                        queue.who,
                        self.route.url,
                        job.step,
                        lasted,
                        dropped,
                        queue.counters.dropped,
                    )
            queue.finished(job)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/octet-stream", "User-Agent": USER_AGENT}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def deliver(self, slot: _Slot, job: Job, wire: Wire) -> dict[str, Any]:
        """PUTs ``job``'s encoded body (``wire``) until the server answers
        200; its answer (``{"superseded": true}`` when the server holds a
        later state than this push, whose earlier attempt it applied)."""
        payload = wire.payload
        base = {**self.headers(), **wire.headers, "Content-Length": str(len(payload))}
        path = f"{self.path}{job.step}"
        failed_before = False

        def retrying(failed: FailedAttempt) -> None:
            nonlocal failed_before
            failed_before = True
            self._failed_attempt(job, failed)
            self.route.failed()

        def attempt() -> tuple[int, bytes, str | None]:
            self._wait_turn(job.step)
            # Named anew at each attempt: a predecessor acknowledged since
            # the last one may have been lost by a server that restarted.
            prev = self._predecessor(job.step)
            headers = base if prev is None else {**base, "Polyak-Prev-Step": str(prev)}
            for _ in range(MAX_REDIRECTS):
                conn = slot.current()
                answer = conn.put(path, payload, headers)
                if answer[0] != 307 or not conn.location:
                    break
                # Another node holds the rank: send it there.
                self.route.redirected(conn.location, path)
            return answer

        try:
            data = send_with_retries(
                attempt,
                policy=self.retry,
                abort=self.abort,
                on_retry=retrying,
                recover=_predecessor_lost,
            )
        except PolyakError as e:
            if e.status is None:
                raise
            # Refused: the server's mirror is not what the encoding
            # assumed next, so the next push is a keyframe.
            self.encoding.refused()
            if e.code == "step_conflict" and failed_before:
                # An earlier attempt was applied and its answer lost, and
                # the server has moved past it (or forgot it in a
                # restart): nothing of the trainer's is wrong.
                log.warning(
                    "polyak: rank %s step %s: the server already holds this step or a later "
                    "one (an earlier attempt's answer was lost): %s",
                    self.rank,
                    job.step,
                    e.message,
                )
                return {"superseded": True, "applied": False, "step": job.step}
            if e.code != "needs_keyframe" or wire.kind in (None, "full"):
                raise
            resent = True
        else:
            resent = False
        finally:
            with self.queue.cond:
                if job.step in self._retrying:
                    self._retrying.discard(job.step)
                    self.queue.cond.notify_all()
        if resent:
            # The rank's owner has no mirror this delta adds to (it took
            # the rank over from a node that is gone): this step goes
            # again in full, which makes its mirror this body.
            with self.queue.cond:
                self.queue.counters.keyframes += 1
            log.warning(
                "polyak: rank %s step %s: the server needs a keyframe; sent in full",
                self.rank,
                job.step,
            )
            return self.deliver(slot, job, Identity().encode(job.body))
        self.route.delivered()
        with self.queue.cond:
            self.queue.counters.bytes_sent += len(payload)
            self.last_transient = ""
        return dict(json.loads(data))

    def _wait_turn(self, step: int) -> None:
        """Waits while an earlier step waits for its retry (or until
        ``close`` abandons the pushes)."""
        cond = self.queue.cond
        with cond:
            while not self.abort.is_set() and any(s < step for s in self._retrying):
                cond.wait(0.5)

    def _failed_attempt(self, job: Job, failed: FailedAttempt) -> None:
        """Counts a failed attempt and holds later steps back until this
        one is delivered. The first failure of an outage is logged as a
        warning, and again each time delivery has failed for
        ``report_after`` seconds (the push is kept and retried; a strict
        ``flush`` raises it)."""
        queue = self.queue
        with queue.cond:
            queue.counters.retries += 1
            self._retrying.add(job.step)
            self.last_transient = failed.problem
            if failed.server_lost and queue.begin_outage(failed.problem):
                log.warning(
                    "polyak: %s: step %d not delivered to %s (%s); retrying in the "
                    "background with backoff, training goes on",
                    queue.who,
                    job.step,
                    self.route.url,
                    failed.problem,
                )
            if failed.overdue:
                pending = len(queue.jobs) + len(queue.in_flight)
                queue.overdue = PolyakError(
                    f"could not deliver to {self.route.url} for {failed.failing_for:.1f}s "
                    f"({failed.attempt + 1} attempts; last: {failed.problem}); {pending} "
                    f"push(es) kept and still retried, {queue.counters.dropped} dropped so far",
                    code="unavailable",
                    step=job.step,
                    rank=self.rank,
                )
                queue.cond.notify_all()
                log.warning("polyak: %s: %s", queue.who, queue.overdue.message)
        log.debug(
            "polyak: step %d attempt %d failed: %s", job.step, failed.attempt + 1, failed.problem
        )


#: Answers that say the server lost a push's predecessor (a crash, a
#: restart, a run resumed): sent again, naming only a predecessor still
#: in flight from here.
RESEND_CODES = frozenset({"predecessor_timeout", "pipeline_reset"})


def _predecessor_lost(err: PolyakError) -> bool:
    return err.status == 409 and err.code in RESEND_CODES
