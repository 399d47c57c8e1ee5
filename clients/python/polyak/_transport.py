"""The client's one way to the server: connection reuse, auth headers,
retries with backoff, and streamed bodies in both directions.

Two kinds of connection, each where it measured fastest:

- **Control plane** (JSON calls, small GETs): one keep-alive
  ``httpx.Client`` per :class:`Transport` (:meth:`Transport.request`,
  :meth:`Transport.stream`).
- **Data plane** (push bodies, snapshot downloads): :class:`Connection`,
  a keep-alive ``http.client`` connection owned by one thread. A push body
  is the host buffer itself, handed to one ``socket.sendall`` (which
  releases the GIL for the whole transfer), where httpx's h11 path would
  copy it in 64 KiB ``bytes`` pieces on the calling thread. A download's
  ranged answers (:mod:`polyak._ranged`) are moved from the socket to their
  place in the file with :func:`splice_at` (``splice(2)``: no copy through
  user space) where the platform has it, else ``readinto`` a mapping of the
  file or a buffer; httpx hands out 64 KiB ``bytes`` pieces, which
  measured about four times slower than the server streams.

Retries (:func:`send_with_retries`): connection errors (refused, reset,
cut mid-body), timeouts, 408, 429 and every 5xx are retried with
exponential backoff and "equal jitter", never sooner than ``Retry-After``,
as is any other answer its caller says it recovers from (the sender: a
pipelined push whose predecessor the server lost); anything else is raised
at once. Only idempotent requests go through it (a push PUT: a retried
push the server already applied is answered ``duplicate: true``).

A sender that keeps several pushes of one rank in flight opens one
:class:`Connection` per slot from :meth:`Transport.connection`; nothing
here is shared between threads but the ``Transport``'s immutable settings.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from ._version import USER_AGENT
from .errors import PolyakError, error_from_response, parse_retry_after

__all__ = [
    "RETRY_STATUSES",
    "Connection",
    "RetryPolicy",
    "Transport",
    "retryable_status",
    "send_with_retries",
    "splice_at",
]

#: Answers worth another attempt (with every other 5xx: a server fault).
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def retryable_status(status: int) -> bool:
    """An answer that says "not now" or "the server failed", never "the
    request is wrong": 408, 429 and every 5xx."""
    return status in RETRY_STATUSES or 500 <= status <= 599


#: Bytes read (and written) at a time by a download.
CHUNK = 8 << 20
#: Pipe size asked for when splicing (Linux caps it at
#: /proc/sys/fs/pipe-max-size, 1 MiB by default).
_PIPE_SIZE = 1 << 20


def _without_none(params: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (params or {}).items() if v is not None}


class Transport:
    """One server: its URL, the default token and timeout, the control
    plane's keep-alive session, and data-plane connections on demand."""

    def __init__(self, url: str, token: str | None, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._http = httpx.Client(
            base_url=self.url, timeout=timeout, headers={"User-Agent": USER_AGENT}
        )

    def auth(self, token: str | None = None) -> dict[str, str]:
        """The ``Authorization`` header of ``token`` (default: the
        transport's own); empty without one."""
        token = token if token is not None else self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    # -- control plane ----------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        token: str | None = None,
        what: str = "",
    ) -> httpx.Response:
        """One call; a non-2xx answer raises :class:`PolyakError`."""
        try:
            r = self._http.request(
                method, path, json=json, params=_without_none(params), headers=self.auth(token)
            )
        except httpx.HTTPError as e:
            raise PolyakError(
                f"{method} {self.url}{path}: {type(e).__name__}: {e}", code="unavailable"
            ) from e
        if r.status_code >= 300:
            raise error_from_response(
                r.status_code, r.content, parse_retry_after(r.headers.get("retry-after")), what=what
            )
        return r

    def stream(
        self,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        token: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """A streamed GET (the caller closes it); errors raise as ``request``."""
        req = self._http.build_request(
            "GET",
            path,
            params=_without_none(params),
            headers={**(headers or {}), **self.auth(token)},
        )
        try:
            r = self._http.send(req, stream=True)
        except httpx.HTTPError as e:
            raise PolyakError(f"GET {self.url}{path}: {e}", code="unavailable") from e
        if r.status_code >= 300:
            body = r.read()
            r.close()
            raise error_from_response(r.status_code, body)
        return r

    def ready(self) -> bool:
        """``GET /readyz`` answered 200."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._http.close()

    # -- data plane -------------------------------------------------------

    def connection(self, timeout: float | None = None) -> Connection:
        """A keep-alive connection of its own (one per sending thread or slot)."""
        return Connection(self.url, self.timeout if timeout is None else timeout)


class Connection:
    """One keep-alive HTTP/1.1 connection (``http.client``), opened on first
    use and again after the server closed it; one thread uses it at a time."""

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
        #: ``Location`` of the last answer (a redirect's target), if any.
        self.location: str | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self.conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self.conn = cls(self.host, self.port, timeout=self.timeout)
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def send(
        self,
        method: str,
        target: str,
        body: memoryview | bytes | None,
        headers: Mapping[str, str],
    ) -> http.client.HTTPResponse:
        """Sends one request and answers its response, unread. A server that
        answers early (a body over its limit) and closes still has its
        answer read."""
        conn = self._connect()
        try:
            try:
                conn.request(method, self.prefix + target, body=body, headers=dict(headers))
            except (BrokenPipeError, ConnectionResetError):
                return conn.getresponse()
            return conn.getresponse()
        except BaseException:
            self.close()
            raise

    def put(
        self, path: str, body: memoryview | bytes, headers: Mapping[str, str]
    ) -> tuple[int, bytes, str | None]:
        """Status, body and ``Retry-After`` of one PUT; connection problems
        raise ``OSError`` / ``http.client.HTTPException``."""
        resp = self.send("PUT", path, body, headers)
        try:
            data = resp.read()
        except BaseException:
            self.close()
            raise
        if resp.will_close:
            self.close()
        self.location = resp.getheader("Location")
        return resp.status, data, resp.getheader("Retry-After")


# -- retries ---------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How the sender retries a push it could not deliver."""

    #: First backoff delay; doubles per attempt up to ``max_delay``.
    base_delay: float = 0.05
    #: Kept short: a server back from a restart is found within it, and
    #: what is pushed meanwhile is dropped (one small request per rank).
    max_delay: float = 2.0
    #: Seconds of failed delivery after which it is reported again as a
    #: warning (the push stays queued and is still retried), and after
    #: which a ``flush`` given a ``timeout`` raises ``unavailable``.
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
class FailedAttempt:
    """One attempt that will be retried, as :func:`send_with_retries`
    tells its caller."""

    #: What went wrong (``"503 busy: ..."``, ``"ConnectionRefusedError: ..."``).
    problem: str
    #: 0 for the first attempt.
    attempt: int
    #: Seconds since the first failure, or since the last overdue report.
    failing_for: float
    #: ``failing_for`` reached ``RetryPolicy.report_after``: report it (the
    #: clock then starts again).
    overdue: bool
    #: The answer's status (``None``: no answer, the connection failed).
    status: int | None = None
    #: The answer's error code (``None`` without an answer).
    code: str | None = None
    #: The connection was closed or reset under the request: also what a
    #: keep-alive connection the server closed while idle does once.
    broken: bool = False

    @property
    def server_lost(self) -> bool:
        """The server failed or is away (no connection, a 5xx, or an answer
        the caller recovers from), rather than asking to slow down (429),
        or a first attempt on a keep-alive connection the server had
        closed (the retry opens a new one)."""
        if self.status is None:
            return not (self.broken and self.attempt == 0)
        return self.status not in (408, 429)


def send_with_retries(
    send: Callable[[], tuple[int, bytes, str | None]],
    *,
    policy: RetryPolicy,
    abort: threading.Event,
    on_retry: Callable[[FailedAttempt], None],
    recover: Callable[[PolyakError], bool] | None = None,
) -> bytes:
    """Calls ``send`` (status, body, ``Retry-After``) until it answers 200,
    and returns that body. Retryable failures, and answers ``recover``
    says are worth another attempt, are passed to ``on_retry``, then
    waited out (``abort`` cuts the wait short and ends the loop with
    ``aborted``); any other answer raises its :class:`PolyakError`."""
    attempt = 0
    failing_since: float | None = None
    while True:
        if abort.is_set():
            raise PolyakError("closed before this request was delivered", code="aborted")
        retry_after: float | None = None
        status: int | None = None
        code: str | None = None
        broken = False
        try:
            status, data, retry_header = send()
        except (OSError, http.client.HTTPException) as e:
            problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            status = None
            broken = isinstance(e, (ConnectionResetError, BrokenPipeError))
        else:
            if status == 200:
                return data
            retry_after = parse_retry_after(retry_header)
            err = error_from_response(status, data, retry_after)
            if not retryable_status(status) and not (recover is not None and recover(err)):
                raise err
            problem = f"{status} {err.code}: {err.message}"
            code = err.code
        now = time.monotonic()
        if failing_since is None:
            failing_since = now
        overdue = now - failing_since >= policy.report_after
        on_retry(
            FailedAttempt(problem, attempt, now - failing_since, overdue, status, code, broken)
        )
        if overdue:
            failing_since = now
        abort.wait(policy.delay(attempt, retry_after))
        attempt += 1


# -- streamed downloads ----------------------------------------------------


class _Splice:
    """Moves the rest of a response from its socket to a file through a
    pipe (``splice(2)``): the socket's pages are handed to the pipe without
    a copy, and the kernel copies them once, into the file's page cache.
    Read into a buffer and written out, the same bytes cost two copies."""

    def __init__(
        self,
        sock_fd: int,
        file_fd: int,
        remaining: int,
        timeout: float | None,
        offset: int | None = None,
    ):
        self.sock_fd, self.file_fd, self.remaining = sock_fd, file_fd, remaining
        self.timeout = timeout
        #: Where in the file the next byte goes (``None``: its position).
        self.offset = offset
        import fcntl  # Linux only, as splice is

        self.pipe_r, self.pipe_w = os.pipe()
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(self.pipe_w, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)  # type: ignore[attr-defined]
        self.poll = select.poll()
        self.poll.register(sock_fd, select.POLLIN)

    def step(self) -> int:
        """Moves up to one pipe's worth; returns the bytes written to the file."""
        while True:
            try:
                n = os.splice(self.sock_fd, self.pipe_w, min(self.remaining, _PIPE_SIZE))
                break
            except BlockingIOError:  # the socket has a timeout, so it is non-blocking
                wait = None if self.timeout is None else int(self.timeout * 1000)
                if not self.poll.poll(wait):
                    raise TimeoutError(f"no data for {self.timeout} s") from None
        if n == 0:
            return 0
        moved = 0
        while moved < n:
            if self.offset is None:
                moved += os.splice(self.pipe_r, self.file_fd, n - moved)
            else:
                k = os.splice(self.pipe_r, self.file_fd, n - moved, offset_dst=self.offset)
                self.offset += k
                moved += k
        self.remaining -= n
        return n

    def close(self) -> None:
        os.close(self.pipe_r)
        os.close(self.pipe_w)


def splice_at(
    r: http.client.HTTPResponse, fd: int, offset: int, length: int, timeout: float | None
) -> tuple[int, _Splice] | None:
    """Where the platform has ``splice`` and the response comes over a plain
    socket: what ``http.client`` already buffered of the body written at
    ``offset`` of ``fd``, and a :class:`_Splice` for the rest of ``length``
    bytes, written after it. ``None`` otherwise (the caller reads the
    body). The response is left unread as far as ``http.client`` knows:
    its connection is not used again."""
    sock = getattr(r.fp, "raw", None)
    sock = getattr(sock, "_sock", None)
    if not length or not hasattr(os, "splice") or type(sock) is not socket.socket:
        return None
    head = r.fp.peek(1)[: min(length, CHUNK)]
    r.fp.read(len(head))
    os.pwrite(fd, head, offset)
    return len(head), _Splice(sock.fileno(), fd, length - len(head), timeout, offset + len(head))
