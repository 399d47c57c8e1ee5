"""The one error type of the client.

Every failure the server reports arrives as ``{"error": {"code", "message"}}``
with an HTTP status; the client turns it into a :class:`PolyakError` with the
same ``status``, ``code`` and ``message``. Failures that never reached the
server (connection refused, timeouts, a flush that ran out of time) use the
same class with ``status=None`` and a client-side code such as
``unavailable`` or ``flush_timeout``, so callers catch one thing.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["PolyakError", "error_from_response"]


class PolyakError(Exception):
    """A request the server refused, or one that could not be delivered.

    ``step`` and ``rank`` are set for pushes, so a trainer that sees the
    error from a later ``push`` or ``flush`` knows which step it is about.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str = "error",
        step: int | None = None,
        rank: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.step = step
        self.rank = rank
        self.retry_after = retry_after
        super().__init__(self._describe())

    def _describe(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.step is not None:
            where.append(f"step {self.step}")
        prefix = f"{', '.join(where)}: " if where else ""
        status = f"{self.status} " if self.status is not None else ""
        return f"{prefix}{status}{self.code}: {self.message}"

    def at(self, *, step: int | None = None, rank: int | None = None) -> PolyakError:
        """The same error, naming the push it is about."""
        return PolyakError(
            self.message,
            status=self.status,
            code=self.code,
            step=step if step is not None else self.step,
            rank=rank if rank is not None else self.rank,
            retry_after=self.retry_after,
        )


def error_from_response(
    status: int, body: bytes, retry_after: float | None = None, *, what: str = ""
) -> PolyakError:
    """Reads the server's ``{"error": {"code", "message"}}``; anything else
    (a proxy's HTML page, an empty body) keeps its status and a short excerpt."""
    code, message = f"http_{status}", ""
    try:
        payload: Any = json.loads(body)
        detail = payload["error"]
        code = str(detail["code"])
        message = str(detail["message"])
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode("utf-8", "replace").strip() or "no error body"
    if what:
        message = f"{what}: {message}"
    return PolyakError(message, status=status, code=code, retry_after=retry_after)


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    import datetime as _dt

    now = _dt.datetime.now(when.tzinfo or _dt.timezone.utc)
    return max(0.0, (when - now).total_seconds())
