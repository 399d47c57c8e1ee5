"""Downloads fetched by byte ranges over several connections, resumed and
checked end to end.

A download is cut into *pieces* (runs of the server's 8 MiB digest
blocks). ``connections`` threads each keep one connection and fetch
pieces with ``Range`` and ``If-Range`` (the ETag of the first answer), each
straight into its place in the target (a mapping of the file, or a buffer
in memory). Every piece's blocks are hashed (CRC-32) as soon as they are
in; at the end the client asks the server for the digests of the file it
serves (``GET .../download/digests``, the same query) and compares them
block by block: a block that differs is fetched once more, and if it
still differs the download raises ``download_corrupt``. Nothing is handed
back or renamed into place before every block matches.

A download into a file records the pieces it holds beside its temporary
file (``<file>.part.json``: the ETag, the length, the piece size, the
pieces done), so a later download of the same file fetches only what is
missing, provided the server still serves the same bytes (``If-Range``: a
changed file is answered whole and the download starts over). What a
resumed block holds is checked with the rest.

A piece whose answer breaks or ends short is asked again from where it
stopped (a few times, on a new connection); a stored block that does not
match its checksum is refused by the server (``snapshot_corrupt``, naming
the part), and that raises at once.
"""

from __future__ import annotations

import errno
import http.client
import json
import logging
import mmap
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from ._transport import CHUNK, Connection, Transport, _without_none, splice_at
from ._version import USER_AGENT
from .errors import PolyakError, error_from_response, parse_retry_after

__all__ = ["DEFAULT_CONNECTIONS", "DIGEST_BLOCK", "Target", "fetch", "piece_blocks"]

log = logging.getLogger("polyak")

#: Bytes per digest the server states (``block_bytes`` of its answer).
DIGEST_BLOCK = 8 << 20
#: Connections a download opens unless told otherwise (benches/README.md:
#: the rate they reach against one, and against ``curl``).
DEFAULT_CONNECTIONS = 4
#: Largest and smallest piece: large enough that a request's cost (the
#: server assembling the file's recipe, a partly read stored block at each
#: end) stays small, small enough that every connection has work.
MAX_PIECE = 64 << 20
MIN_PIECE = DIGEST_BLOCK
#: Times the digests are asked for before their failure is raised.
DIGEST_ATTEMPTS = 5
#: Seconds between saves of the blocks held (and at every failure).
SAVE_EVERY = 1.0
#: Attempts at one piece whose answer broke before the end.
PIECE_ATTEMPTS = 4


def piece_blocks(total: int, connections: int) -> int:
    """Digest blocks per piece of a ``total``-byte file fetched over
    ``connections``: about two pieces per connection, between
    :data:`MIN_PIECE` and :data:`MAX_PIECE` bytes. Each piece after the
    first reads up to one stored block per part again (its first bytes
    share a stored block with the end of the piece before), so fewer,
    larger pieces cost the store less (``benches/client_download.py``)."""
    want = total // max(1, connections * 2)
    return max(1, min(MAX_PIECE, max(MIN_PIECE, want)) // DIGEST_BLOCK)


def blocks_in(total: int) -> int:
    """Digest blocks of a ``total``-byte file."""
    return -(-total // DIGEST_BLOCK)


def block_span(b: int, total: int) -> tuple[int, int]:
    """The bytes ``[start, end)`` of digest block ``b``."""
    return b * DIGEST_BLOCK, min(total, (b + 1) * DIGEST_BLOCK)


def pieces_of(missing: list[int], per: int) -> list[list[int]]:
    """Runs of consecutive missing blocks, cut at ``per`` blocks."""
    out: list[list[int]] = []
    for b in missing:
        if out and out[-1][-1] == b - 1 and len(out[-1]) < per:
            out[-1].append(b)
        else:
            out.append([b])
    return out


@dataclass
class Resume:
    """What an earlier attempt left of a download into ``part``: the
    digest blocks it holds of the file ``etag`` (``total`` bytes)."""

    etag: str
    total: int
    done: set[int] = field(default_factory=set)

    @staticmethod
    def sidecar(part: Path) -> Path:
        return part.with_name(part.name + ".json")

    @classmethod
    def load(cls, part: Path) -> Resume | None:
        try:
            d = json.loads(cls.sidecar(part).read_text())
            if not part.exists() or part.stat().st_size != int(d["total"]):
                return None
            if int(d["block_bytes"]) != DIGEST_BLOCK:
                return None
            return cls(str(d["etag"]), int(d["total"]), {int(b) for b in d["done"]})
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, part: Path) -> None:
        path = self.sidecar(part)
        tmp = path.with_name(path.name + ".tmp")
        body = {"etag": self.etag, "total": self.total, "block_bytes": DIGEST_BLOCK}
        tmp.write_text(json.dumps({**body, "done": sorted(self.done)}))
        os.replace(tmp, path)

    @classmethod
    def forget(cls, part: Path) -> None:
        cls.sidecar(part).unlink(missing_ok=True)


class _Changed(Exception):
    """The server answered a range with the whole file: it changed."""


class Ranged:
    """One download (``path`` + ``params``) fetched in pieces."""

    def __init__(
        self,
        transport: Transport,
        path: str,
        params: Mapping[str, Any],
        token: str | None,
        *,
        connections: int,
        what: str,
        on_bytes: Callable[[int], None],
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be at least 1, not {connections}")
        self.transport = transport
        self.path = path
        self.query = urlencode(_without_none(params))
        self.params = params
        self.token = token
        self.connections = connections
        self.what = what
        self.on_bytes = on_bytes
        #: The target file's descriptor, when bodies may be spliced into it.
        self.fd: int | None = None
        #: The file's length, and what hears of each block that is in.
        self.total = 0
        self.on_block: Callable[[int], None] = lambda b: None
        self._lock = threading.Lock()

    def _open(
        self, conn: Connection, start: int, end: int, etag: str | None
    ) -> http.client.HTTPResponse:
        """``bytes=start-(end-1)``, under ``If-Range: etag`` when given. A
        refusal raises its error (``snapshot_corrupt`` naming the part)."""
        headers = {
            "User-Agent": USER_AGENT,
            **self.transport.auth(self.token),
            "Range": f"bytes={start}-{end - 1}",
        }
        if etag is not None:
            headers["If-Range"] = etag
        target = self.path + (f"?{self.query}" if self.query else "")
        r = conn.send("GET", target, None, headers)
        if r.status >= 300:
            body = r.read()
            conn.close()
            raise error_from_response(r.status, body, parse_retry_after(r.getheader("retry-after")))
        return r

    def _read_into(
        self,
        r: http.client.HTTPResponse,
        view: memoryview,
        abort: threading.Event,
        at: tuple[int, int] | None = None,
        landed: Callable[[int], None] | None = None,
    ) -> int:
        """Reads the answer's body into ``view``; the bytes read (fewer when
        it broke or ended early, or the download was aborted). With ``at``
        (a file's descriptor and the offset ``view`` starts at) the body is
        spliced from the socket into the file where the platform allows:
        the kernel copies each page once, into the page cache, where
        reading into the mapping costs a zero-fill and a copy."""
        count = self._count if landed is None else landed
        done = 0
        spliced = None
        try:
            if at is not None:
                spliced = splice_at(r, at[0], at[1], len(view), self.transport.timeout)
            if spliced is not None:
                done, sp = spliced
                try:
                    if done:
                        count(done)
                    while sp.remaining and not abort.is_set():
                        n = sp.step()
                        if not n:
                            break
                        done += n
                        count(n)
                finally:
                    sp.close()
                return done
            while done < len(view) and not abort.is_set():
                n = r.readinto(view[done : min(len(view), done + CHUNK)])
                if not n:
                    break
                done += n
                count(n)
        except (OSError, http.client.HTTPException) as e:
            log.debug("polyak: %s: an answer broke after %d bytes: %s", self.what, done, e)
        return done

    def _count(self, n: int) -> None:
        self.on_bytes(n)

    def tracker(self, start: int) -> Callable[[int], None]:
        """What counts the bytes of answers that land from ``start`` on (in
        order): each digest block whose last byte landed is handed to
        ``on_block`` first, then the bytes are counted."""
        pos = start

        def landed(n: int) -> None:
            nonlocal pos
            before, pos = pos, pos + n
            b = before // DIGEST_BLOCK
            while b * DIGEST_BLOCK < self.total:
                block_end = min(self.total, (b + 1) * DIGEST_BLOCK)
                if block_end > pos:
                    break
                if block_end > before:
                    self.on_block(b)
                b += 1
            self._count(n)

        return landed

    def fetch_span(
        self,
        conn: Connection,
        buf: memoryview,
        start: int,
        end: int,
        etag: str,
        abort: threading.Event,
    ) -> Connection:
        """Fetches ``[start, end)`` into ``buf`` (the whole target), asking
        again from where a broken answer stopped (a new connection, a short
        pause, at most :data:`PIECE_ATTEMPTS` answers in a row that bring
        nothing); returns the connection to go on with. Each digest block
        is handed to ``on_block`` as soon as its last byte is in (before
        the bytes are counted: a download stopped by its progress callback
        keeps the block)."""
        at = start
        empty = 0
        landed = self.tracker(start)
        while at < end and not abort.is_set():
            got = 0
            try:
                r = self._open(conn, at, end, etag)
                if r.status != 206:
                    r.close()
                    conn.close()
                    raise _Changed()
                into = None if self.fd is None else (self.fd, at)
                got = self._read_into(r, buf[at:end], abort, into, landed)
                if got < end - at or r.will_close or into is not None:
                    conn.close()  # the rest of the answer is not read
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                log.debug("polyak: %s: asking for bytes %d- failed: %s", self.what, at, e)
            at += got
            if at >= end or abort.is_set():
                break
            empty = empty + 1 if got == 0 else 0
            if empty >= PIECE_ATTEMPTS:
                self.why_cut()
                raise PolyakError(
                    f"{self.what}: bytes {at}-{end - 1} could not be fetched "
                    f"({PIECE_ATTEMPTS} attempts brought nothing)",
                    code="incomplete_download",
                )
            time.sleep(0.05 * (empty + 1))
        return conn

    def fetch_pieces(
        self,
        conn: Connection,
        buf: memoryview,
        pieces: list[list[int]],
        total: int,
        etag: str,
    ) -> None:
        """Fetches ``pieces`` (runs of blocks) over up to ``connections``
        connections (``conn``: the first one's). The first failure stops
        the others and is raised here."""
        jobs: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        for p in pieces:
            jobs.put(p)
        abort = threading.Event()
        failures: list[BaseException] = []

        def work(conn: Connection) -> None:
            try:
                while not abort.is_set():
                    try:
                        blocks = jobs.get_nowait()
                    except queue.Empty:
                        return
                    start, end = block_span(blocks[0], total)[0], block_span(blocks[-1], total)[1]
                    conn = self.fetch_span(conn, buf, start, end, etag, abort)
            except BaseException as e:  # raised in the caller's thread
                with self._lock:
                    failures.append(e)
                abort.set()
            finally:
                conn.close()

        n = max(1, min(self.connections, len(pieces)))
        threads = [
            threading.Thread(
                target=work,
                args=(conn if k == 0 else self.transport.connection(),),
                daemon=True,
                name=f"polyak-download-{k}",
            )
            for k in range(n)
        ]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        except BaseException:
            abort.set()  # e.g. KeyboardInterrupt: the blocks done stay done
            for t in threads:
                t.join(5)
            raise
        if failures:
            raise failures[0]

    def why_cut(self) -> None:
        """Raises ``snapshot_corrupt`` when answers keep breaking before
        their first byte because a stored block fails its check: the
        server checks an answer's first blocks before it answers, and can
        only break one whose later block fails (an answer may break before
        any byte left it). Its digests read every block no answer carried
        through the same checks and refuse, naming the part; anything else
        they answer leaves the caller's own error."""
        try:
            self.digests()
        except PolyakError as e:
            if e.code == "snapshot_corrupt":
                raise

    def digests(self) -> dict[str, Any]:
        """What the server states of the file it serves (``crc32`` per
        ``block_bytes``, ``etag``, ``bytes``)."""
        for attempt in range(DIGEST_ATTEMPTS):
            try:
                r = self.transport.request(
                    "GET",
                    f"{self.path}/digests",
                    params=self.params,
                    token=self.token,
                    what=f"digests of {self.what}",
                )
                return dict(r.json())
            except PolyakError as e:
                # A timeout (blocks no response of that node carried are
                # hashed on the server, which goes on after the answer is
                # given up and keeps them), or 429/503: asked again.
                again = e.status is None or e.status in (429, 503)
                if not again or attempt == DIGEST_ATTEMPTS - 1:
                    raise
                time.sleep(min(5.0, e.retry_after or 1.0))
        raise AssertionError("unreachable")

    def mismatches(self, crcs: dict[int, int], total: int, etag: str) -> list[int]:
        """The blocks whose CRC-32 differs from what the server states."""
        stated = self.digests()
        if stated.get("etag") != etag or int(stated.get("bytes", -1)) != total:
            raise _Changed()
        if int(stated.get("block_bytes", 0)) != DIGEST_BLOCK or stated.get("algorithm") != "crc32":
            raise PolyakError(
                f"{self.what}: the server states {stated.get('algorithm')} per "
                f"{stated.get('block_bytes')} bytes, which this client does not check",
                code="invalid_download",
            )
        return [b for b, crc in enumerate(stated["crc32"]) if crcs.get(b) != crc]


def crc_blocks(buf: memoryview, blocks: list[int] | range, total: int) -> dict[int, int]:
    """The CRC-32 of each digest block ``blocks`` of ``buf``."""
    out = {}
    for b in blocks:
        start, end = block_span(b, total)
        out[b] = zlib.crc32(buf[start:end])
    return out


class Target:
    """Where a download's bytes go: a buffer in memory (``file=None``), or
    a shared mapping of ``file``, sized to the download's length."""

    def __init__(self, file: Path | None) -> None:
        self.file = file
        self.buf: bytearray | None = None
        self.mm: mmap.mmap | None = None
        self.fd: int | None = None
        self.view: memoryview | None = None

    def open(self, total: int, keep: bool) -> memoryview:
        """A view of ``total`` bytes (``keep``: the file's bytes are an
        earlier attempt's and stay)."""
        self.close()
        if self.file is None:
            self.buf = bytearray(total)
            self.view = memoryview(self.buf)
            return self.view
        self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT | (0 if keep else os.O_TRUNC), 0o644)
        if not keep:
            _reserve(self.fd, total)
        os.ftruncate(self.fd, total)
        if total == 0:
            self.view = memoryview(b"")
            return self.view
        self.mm = mmap.mmap(self.fd, total, flags=mmap.MAP_SHARED)
        self.view = memoryview(self.mm)
        return self.view

    def bytes(self) -> bytes | bytearray:
        """What an in-memory target holds."""
        assert self.buf is not None
        return self.buf

    def fsync(self) -> None:
        if self.mm is not None:
            self.mm.flush()
        if self.fd is not None:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                # Views of it live on in an exception's frames: it is
                # unmapped when they are collected (it holds a descriptor
                # of its own).
                pass
            self.mm = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _reserve(fd: int, total: int) -> None:
    """The file's blocks reserved: a full disk fails here, at once."""
    if not hasattr(os, "posix_fallocate") or total == 0:
        return
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise PolyakError(
                f"not enough disk space for a {total}-byte download", code="no_space"
            ) from e


def fetch(
    transport: Transport,
    path: str,
    params: Mapping[str, Any],
    token: str | None,
    target: Target,
    *,
    connections: int,
    what: str,
    on_bytes: Callable[[int], None],
    on_total: Callable[[int, int], None],
) -> None:
    """The download into ``target``, every block checked against the
    server's digests; ``on_total(total, held)`` once the length is known
    (``held``: bytes an earlier attempt left, not fetched again)."""
    ranged = Ranged(
        transport, path, params, token, connections=connections, what=what, on_bytes=on_bytes
    )
    part = target.file
    resume = Resume.load(part) if part is not None else None
    for _ in range(2):  # again only when the file changed under a resume
        try:
            _fetch_once(ranged, target, resume, on_total)
            if part is not None:
                Resume.forget(part)
            return
        except _Changed:
            log.warning("polyak: %s changed on the server since it was begun; starting over", what)
            if part is not None:
                Resume.forget(part)
            resume = None
    raise PolyakError(
        f"{what}: the file kept changing while it was fetched", code="download_changed"
    )


def _fetch_once(
    ranged: Ranged,
    target: Target,
    resume: Resume | None,
    on_total: Callable[[int, int], None],
) -> None:
    part = target.file
    conn = ranged.transport.connection()
    try:
        if resume is not None and len(resume.done) >= blocks_in(resume.total):
            resume.done.discard(blocks_in(resume.total) - 1)  # probed again below
        if resume is not None:
            # The first missing block, under If-Range: a 206 says the file
            # is the one the held blocks are of.
            total, etag = resume.total, resume.etag
            first = min(set(range(blocks_in(total))) - resume.done)
            start, end = block_span(first, total)
            r = ranged._open(conn, start, end, etag)
            if r.status != 206:
                r.close()
                raise _Changed()
            buf = target.open(total, keep=True)
            ranged.fd = target.fd
        else:
            # The first block: its answer states the file's length and ETag.
            first, start = 0, 0
            r = ranged._open(conn, 0, DIGEST_BLOCK, None)
            etag = r.getheader("etag") or ""
            if r.status == 206:
                total = _length_of(r)
            else:  # ranges not served here: the whole body, on this connection
                total = int(r.getheader("content-length") or 0)
            buf = target.open(total, keep=False)
            ranged.fd = target.fd
            resume = Resume(etag, total)
            if r.status != 206:
                on_total(total, 0)
                into = None if target.fd is None else (target.fd, 0)
                got = ranged._read_into(r, buf, threading.Event(), into)
                if got != total:
                    raise PolyakError(
                        f"{ranged.what} ended after {got} of {total} bytes",
                        code="incomplete_download",
                    )
                crcs = crc_blocks(buf, range(blocks_in(total)), total)
                bad = ranged.mismatches(crcs, total, etag) if etag else []
                if bad:
                    raise PolyakError(
                        f"{ranged.what}: {len(bad)} block(s) differ from the server's digests "
                        f"(first at byte {bad[0] * DIGEST_BLOCK})",
                        code="download_corrupt",
                    )
                return
            end = min(total, DIGEST_BLOCK)
        held = sum(block_span(b, total)[1] - block_span(b, total)[0] for b in resume.done)
        on_total(total, held)
        ranged.total = total
        crcs: dict[int, int] = {}
        lock = threading.Lock()
        saved = time.monotonic()

        def save(now: bool = False) -> None:
            nonlocal saved
            if part is not None and (now or time.monotonic() - saved >= SAVE_EVERY):
                resume.save(part)
                saved = time.monotonic()

        def block_in(b: int) -> None:
            crc = crc_blocks(buf, [b], total)  # hashed while its pages are warm
            with lock:
                crcs.update(crc)
                resume.done.add(b)
                save()

        ranged.on_block = block_in
        try:
            into = None if target.fd is None else (target.fd, start)
            got = ranged._read_into(
                r, buf[start:end], threading.Event(), into, ranged.tracker(start)
            )
            if got < end - start or r.will_close or into is not None:
                conn.close()
            per = piece_blocks(total, ranged.connections)
            missing = [b for b in range(blocks_in(total)) if b not in resume.done]
            ranged.fetch_pieces(conn, buf, pieces_of(missing, per), total, etag)
            conn = ranged.transport.connection()  # fetch_pieces closed the one it was given
            # Blocks an earlier attempt fetched are hashed now.
            rest = [b for b in range(blocks_in(total)) if b not in crcs]
            crcs.update(crc_blocks(buf, rest, total))
            bad = ranged.mismatches(crcs, total, etag)
            if bad:
                log.warning(
                    "polyak: %s: %d block(s) differ from the server's digests (first: bytes "
                    "%d-%d); fetched again",
                    ranged.what,
                    len(bad),
                    *block_span(bad[0], total),
                )
                with lock:
                    resume.done.difference_update(bad)
                ranged.fetch_pieces(conn, buf, pieces_of(bad, per), total, etag)
                conn = ranged.transport.connection()
                bad = ranged.mismatches(crcs, total, etag)
            if bad:
                with lock:
                    resume.done.difference_update(bad)
                raise PolyakError(
                    f"{ranged.what}: {len(bad)} block(s) still differ from the server's "
                    f"digests after being fetched again (first at byte "
                    f"{bad[0] * DIGEST_BLOCK}); the file was not kept as complete",
                    code="download_corrupt",
                )
        except BaseException:
            with lock:
                save(now=True)  # what is in stays, for the next attempt
            raise
    finally:
        conn.close()


def _length_of(r: http.client.HTTPResponse) -> int:
    """The whole file's length a 206 states (``bytes a-b/LEN``)."""
    _, _, total = (r.getheader("content-range") or "").rpartition("/")
    if not total.isdigit():
        raise PolyakError("a ranged answer without the file's length", code="invalid_download")
    return int(total)
