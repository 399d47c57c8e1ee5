"""A pusher's counters and the public snapshot of them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Counters", "PushStats"]


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
    #: Queued pushes replaced by newer ones (policy ``drop_oldest``: the
    #: server away, or slower than the pushes come for ``max_wait``).
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
    #: Time ``push`` spent waiting for room in the queue (policy ``block``,
    #: or ``drop_oldest`` for at most ``max_wait`` before it drops).
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
    #: Pushes whose earlier attempt the server applied without its answer
    #: arriving, and which it had moved past when sent again (``409
    #: step_conflict`` after a failed attempt): not raised, not acknowledged.
    superseded: int = 0

    @property
    def training_thread_seconds(self) -> float:
        """What the pushes cost the training thread: time in ``push`` plus
        time waiting for deferred copies before ``optimizer.step()``."""
        return self.push_seconds + self.wait_seconds


@dataclass
class Counters:
    """What every part of a pusher counts; changed only under the
    :class:`~polyak._push.queue.PushQueue`'s lock."""

    pushed: int = 0
    skipped: int = 0
    acknowledged: int = 0
    applied: int = 0
    duplicates: int = 0
    dropped: int = 0
    rejected: int = 0
    retries: int = 0
    bytes_sent: int = 0
    copy_seconds: float = 0.0
    blocked_seconds: float = 0.0
    push_seconds: float = 0.0
    wait_seconds: float = 0.0
    waits: int = 0
    deferred: int = 0
    deferred_copy_seconds: float = 0.0
    encode_seconds: float = 0.0
    encoded: int = 0
    logical_bytes: int = 0
    keyframes: int = 0
    superseded: int = 0
    #: Newest step the server acknowledged.
    last_acked: int | None = None
    #: The server's answer to that push.
    last_response: dict[str, Any] | None = field(default=None)

    def acknowledged_push(self, step: int, answer: dict[str, Any]) -> None:
        self.acknowledged += 1
        if answer.get("applied"):
            self.applied += 1
        if answer.get("duplicate"):
            self.duplicates += 1
        # Pipelined pushes may be answered out of step order.
        if self.last_acked is None or step > self.last_acked:
            self.last_acked = step
            self.last_response = answer

    def snapshot(self, pending: int, in_flight_step: int | None) -> PushStats:
        """The public copy: every counter :class:`PushStats` has, by name."""
        counted = {f.name: getattr(self, f.name) for f in fields(self) if f.name in _PUBLIC}
        return PushStats(
            **counted, pending=pending, in_flight_step=in_flight_step, last_step=self.last_acked
        )


#: The counters :class:`PushStats` shows under their own names.
_PUBLIC = frozenset(f.name for f in fields(PushStats)) - {"pending", "in_flight_step", "last_step"}
