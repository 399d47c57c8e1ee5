"""Snapshot downloads with a progress bar (``GET .../snapshots/{id}/download``).

``layout=full`` is one safetensors stream of whole tensors; ``layout=sharded``
is a tar of one safetensors file per rank (``hf``: HF-style shards and their
index). All are streamed: to memory for :meth:`Run.download`, to a temporary
file renamed into place (or unpacked) for :meth:`Run.download_to`.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import io
import mmap
import os
import select
import shutil
import socket
import stat
import tarfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlencode, urlsplit

from .errors import PolyakError, error_from_response, parse_retry_after

if TYPE_CHECKING:
    from .client import Run

__all__ = ["download_to", "fetch_bytes", "snapshot_done", "snapshot_id"]

#: Bytes read (and written) at a time.
_CHUNK = 8 << 20
#: Pipe size asked for when splicing (Linux caps it at
#: /proc/sys/fs/pipe-max-size, 1 MiB by default).
_PIPE_SIZE = 1 << 20
_DONE = {"complete", "completed", "ready", "done"}
_FAILED = {"failed", "error", "aborted"}


def snapshot_id(snapshot: str | int | Mapping[str, Any]) -> str:
    """A snapshot given by id, or as returned by ``run.snapshot()``."""
    if isinstance(snapshot, Mapping):
        return str(snapshot["id"])
    return str(snapshot)


def snapshot_done(snap: Mapping[str, Any]) -> bool:
    """``True`` when complete, ``False`` while pending; a failed snapshot
    raises ``snapshot_failed`` with the server's reason."""
    status = str(snap.get("status", "")).lower()
    if status in _FAILED:
        reason = snap.get("reason") or snap.get("error") or ""
        raise PolyakError(
            f"snapshot {snap.get('id')} {status}: {reason}".strip().rstrip(":"),
            code="snapshot_failed",
        )
    return status in _DONE


def _open(run: Run, path: str, params: Mapping[str, Any]) -> http.client.HTTPResponse:
    """A streamed GET on a connection of its own.

    ``http.client`` rather than the client's httpx session: its response
    reads straight into a caller's buffer (``readinto``, the GIL released
    for the whole read), where httpx hands out 64 KiB ``bytes`` pieces,
    which measured about four times slower than the server streams.
    """
    parts = urlsplit(run.client.url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"server URL must be http(s)://, not {run.client.url!r}")
    https = parts.scheme == "https"
    cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
    conn = cls(
        parts.hostname or "127.0.0.1",
        parts.port or (443 if https else 80),
        timeout=run.client.timeout,
    )
    query = urlencode({k: v for k, v in params.items() if v is not None})
    target = parts.path.rstrip("/") + path + (f"?{query}" if query else "")
    from . import __version__

    headers = {
        "User-Agent": f"polyak-python/{__version__}",
        **run.client._headers(run.read_token),
    }
    try:
        conn.request("GET", target, headers=headers)
        r = conn.getresponse()
    except (OSError, http.client.HTTPException) as e:
        conn.close()
        raise PolyakError(
            f"GET {run.client.url}{path}: {type(e).__name__}: {e}", code="unavailable"
        ) from e
    if r.status >= 300:
        body = r.read()
        conn.close()
        raise error_from_response(r.status, body, parse_retry_after(r.getheader("retry-after")))
    return r


def _stream_into(
    run: Run,
    snapshot: str | int | Mapping[str, Any],
    profile: str | None,
    layout: str,
    dtype: str | None,
    out: BinaryIO,
    progress: bool | IO[str],
    on_progress: Callable[[int, int | None], None] | None = None,
) -> None:
    from tqdm.auto import tqdm

    sid = snapshot_id(snapshot)
    path = f"{run.path}/snapshots/{sid}/download"
    params = {"profile": profile, "layout": layout, "dtype": dtype}
    r = _open(run, path, params)
    mapped: memoryview | None = None
    spliced: _Splice | None = None
    try:
        total = int(r.getheader("content-length") or 0) or None
        spliced = _splice_into(r, out, total, run.client.timeout)
        mapped = None if spliced is not None else _map_file(out, total)
        done = 0 if spliced is None else (total or 0) - spliced.remaining
        buf = bytearray(0 if mapped is not None or spliced is not None else _CHUNK)
        view = memoryview(buf)
        reported = 0

        def read_some() -> int:
            if spliced is not None:
                return spliced.step() if spliced.remaining else 0
            if mapped is not None:
                # Straight from the socket into the file's pages.
                return r.readinto(mapped[done : min(done + _CHUNK, len(mapped))])
            n = r.readinto(buf)
            out.write(view[:n])
            return n

        with tqdm(
            total=total,
            initial=done,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"{run.name}/{sid}" + (f" {profile}" if profile else ""),
            disable=progress is False,
            file=None if isinstance(progress, bool) else progress,
        ) as bar:
            while True:
                try:
                    n = read_some()
                except (OSError, http.client.HTTPException) as e:
                    raise PolyakError(
                        f"download of snapshot {sid} failed after {done} bytes: "
                        f"{type(e).__name__}: {e}",
                        code="incomplete_download",
                    ) from e
                if not n:
                    break
                done += n
                bar.update(n)
                if on_progress is not None:
                    on_progress(done, total)
                    reported = done
        if on_progress is not None and reported != done:
            on_progress(done, total)  # it all came with the headers
        if total is not None and done != total:
            raise PolyakError(
                f"download of snapshot {sid} ended after {done} of {total} bytes",
                code="incomplete_download",
            )
    finally:
        if spliced is not None:
            spliced.close()
        if mapped is not None:
            mm = mapped.obj
            mapped.release()
            mm.close()  # type: ignore[union-attr]
        r.close()


class _Splice:
    """Moves the rest of a response from its socket to a file through a
    pipe (``splice(2)``): the socket's pages are handed to the pipe without
    a copy, and the kernel copies them once, into the file's page cache.
    Read into a buffer and written out, the same bytes cost two copies."""

    def __init__(self, sock_fd: int, file_fd: int, remaining: int, timeout: float | None):
        self.sock_fd, self.file_fd, self.remaining = sock_fd, file_fd, remaining
        self.timeout = timeout
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
            moved += os.splice(self.pipe_r, self.file_fd, n - moved)
        self.remaining -= n
        return n

    def close(self) -> None:
        os.close(self.pipe_r)
        os.close(self.pipe_w)


def _splice_into(
    r: http.client.HTTPResponse, out: BinaryIO, total: int | None, timeout: float | None
) -> _Splice | None:
    """Where the platform has ``splice`` (Linux), ``out`` is an empty regular
    file and the length is known: the file's blocks reserved (a full disk
    fails here, at once, not half way), what ``http.client`` has already
    buffered written out, and a :class:`_Splice` for the rest. ``None``
    otherwise (TLS, a pipe, another platform): the caller reads the body."""
    sock = getattr(r.fp, "raw", None)
    sock = getattr(sock, "_sock", None)
    # A plain socket only: an ssl.SSLSocket (a subclass) carries ciphertext.
    if not total or not hasattr(os, "splice") or type(sock) is not socket.socket:
        return None
    fd = _empty_file(out)
    if fd is None:
        return None
    _reserve(fd, total)
    # The bytes read past the headers wait in the response's buffer: peek
    # hands them out without another read of the socket (it reads only when
    # the buffer is empty, and then the bytes are the body's too).
    head = r.fp.peek(1)[: min(total, _CHUNK)]
    r.fp.read(len(head))
    out.write(head)
    out.flush()
    return _Splice(sock.fileno(), fd, total - len(head), timeout)


def _empty_file(out: BinaryIO) -> int | None:
    """The descriptor of ``out`` when it is an empty regular file."""
    try:
        fd = out.fileno()
        if out.tell() != 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None
    return fd


def _reserve(fd: int, total: int) -> bool:
    """``posix_fallocate``: a full disk fails here, at once, not half way.
    ``False`` where the filesystem cannot reserve blocks."""
    if not hasattr(os, "posix_fallocate"):
        return False
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise PolyakError(
                f"not enough disk space for a {total}-byte download", code="no_space"
            ) from e
        return False
    return True


def _map_file(out: BinaryIO, total: int | None) -> memoryview | None:
    """When ``out`` is an empty regular file and the size is known: the
    file's blocks reserved (``posix_fallocate``: a full disk fails here, at
    once, not half way) and mapped, so the response is read straight into
    the page cache, with no copy through a buffer and no ``write``.
    ``None`` (write in pieces) where that is not possible."""
    if not total:
        return None
    fd = _empty_file(out)
    if fd is None or not _reserve(fd, total):
        return None  # not a file, or a filesystem without fallocate: plain writes
    out.flush()
    try:
        return memoryview(mmap.mmap(fd, total, flags=mmap.MAP_SHARED))
    except (OSError, ValueError):
        return None  # e.g. opened write-only: plain writes


def fetch_bytes(
    run: Run,
    snapshot: str | int | Mapping[str, Any],
    profile: str | None,
    *,
    layout: str,
    dtype: str | None,
    progress: bool | IO[str],
    on_progress: Callable[[int, int | None], None] | None = None,
) -> bytes:
    import io

    buf = io.BytesIO()
    _stream_into(run, snapshot, profile, layout, dtype, buf, progress, on_progress)
    return buf.getvalue()


def download_to(
    run: Run,
    snapshot: str | int | Mapping[str, Any],
    directory: Path,
    profile: str | None,
    *,
    layout: str,
    dtype: str | None,
    progress: bool | IO[str],
    on_progress: Callable[[int, int | None], None] | None = None,
    fsync: bool = True,
) -> Path:
    if layout not in ("full", "sharded", "hf"):
        raise ValueError(f"layout must be `full`, `sharded` or `hf`, not {layout!r}")
    sid = snapshot_id(snapshot)
    # A path that names a .safetensors file is that file, not a directory.
    named = layout == "full" and directory.suffix == ".safetensors" and not directory.is_dir()
    final_name = directory.name if named else None
    if named:
        directory = directory.parent
    directory.mkdir(parents=True, exist_ok=True)
    # Each dtype gets a name of its own: a bf16 copy never replaces the fp32 one.
    stem = f"{run.name}-{sid}" + (f"-{profile}" if profile else "") + (f"-{dtype}" if dtype else "")
    if layout == "full":
        final = directory / (final_name or f"{stem}.safetensors")
        tmp = final.with_suffix(".safetensors.part")
        try:
            with open(tmp, "w+b") as f:  # readable too, to be mapped
                _stream_into(run, snapshot, profile, layout, dtype, f, progress, on_progress)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if fsync:
                _fsync_dir(directory)  # the rename itself
        finally:
            tmp.unlink(missing_ok=True)
        return final
    target = directory / (stem if layout == "sharded" else f"{stem}-hf")
    tmp_tar = directory / f"{target.name}.tar.part"
    # Unpacked beside the target and renamed into place: a crash leaves the
    # old directory or the whole new one, never a half-unpacked one.
    staging = directory / f".{target.name}.part"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with open(tmp_tar, "w+b") as f:
            _stream_into(run, snapshot, profile, layout, dtype, f, progress, on_progress)
        with tarfile.open(tmp_tar) as tar:
            staging.mkdir()
            _extract(tar, staging)
        if fsync:
            _fsync_tree(staging)
        if target.exists():
            old = directory / f".{target.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)
        if fsync:
            _fsync_dir(directory)
    finally:
        tmp_tar.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _extract(tar: tarfile.TarFile, dest: Path) -> None:
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
        return
    # Python without extraction filters: refuse paths that escape.
    for member in tar.getmembers():
        path = (dest / member.name).resolve()
        if not path.is_relative_to(dest.resolve()) or not (member.isfile() or member.isdir()):
            raise PolyakError(f"unsafe tar entry {member.name!r}", code="invalid_download")
    tar.extractall(dest)


def _fsync_tree(root: Path) -> None:
    """Every file under ``root``, then every directory, made durable."""
    for here, _dirs, files in os.walk(root):
        for name in files:
            _fsync(os.path.join(here, name))
        _fsync_dir(Path(here))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform opens directories
        _fsync(path)


def _fsync(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
