"""Snapshot downloads with a progress bar (``GET .../snapshots/{id}/download``).

``layout=full`` is one safetensors stream of whole tensors; ``layout=sharded``
is a tar of one safetensors file per rank (``hf``: HF-style shards and their
index). All are fetched by byte ranges over several connections and
checked block by block against the digests the server states
(:mod:`polyak._ranged`): into memory for :meth:`Run.download`, into a
temporary file renamed into place (or unpacked) for :meth:`Run.download_to`.
A download into a file that failed leaves its temporary file and what it
holds (``NAME.part`` and ``NAME.part.json``), and the next download of the
same file fetches only what is missing. This module names the files, shows
the progress and makes the result durable.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Protocol

from ._progress import progress_bar
from ._ranged import DEFAULT_CONNECTIONS, Resume, Target, fetch
from ._transport import Transport
from .contract import WRITTEN_LAYOUTS, DownloadLayout, snapshot_done, snapshot_id
from .errors import PolyakError

__all__ = ["SnapshotSource", "download_to", "fetch_bytes", "snapshot_done", "snapshot_id"]


class SnapshotSource(Protocol):
    """What a download needs of a run (:class:`polyak.Run` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def read_token(self) -> str | None: ...
    @property
    def transport(self) -> Transport: ...


def _fetch_into(
    run: SnapshotSource,
    snapshot: str | int | Mapping[str, Any],
    profile: str | None,
    layout: str,
    dtype: str | None,
    target: Target,
    progress: bool | IO[str],
    on_progress: Callable[[int, int | None], None] | None,
    connections: int | None,
) -> None:
    """The snapshot's download (``layout``, ``profile``, ``dtype``) into
    ``target``, fetched by ranges over ``connections`` and checked against
    the server's digests (:mod:`polyak._ranged`), with a tqdm bar
    (``progress``) and ``on_progress(done, total)`` (a resumed download
    starts at the bytes it held)."""
    sid = snapshot_id(snapshot)
    desc = f"{run.name}/{sid}" + (f" {profile}" if profile else "")
    lock = threading.Lock()
    bar: Any = None
    done, total_of = 0, 0

    def on_total(total: int, held: int) -> None:
        nonlocal bar, done, total_of
        bar = progress_bar(progress, total=total, initial=held, desc=desc)
        done, total_of = held, total
        if on_progress is not None:
            on_progress(done, total)

    def on_bytes(n: int) -> None:
        nonlocal done
        with lock:
            n = min(n, total_of - done)  # a block fetched again is not counted twice
            done += n
            if bar is not None and n:
                bar.update(n)
            if on_progress is not None and n:
                on_progress(done, total_of)

    try:
        fetch(
            run.transport,
            f"{run.path}/snapshots/{sid}/download",
            {"profile": profile, "layout": layout, "dtype": dtype},
            run.read_token if run.read_token is not None else run.transport.token,
            target,
            connections=DEFAULT_CONNECTIONS if connections is None else connections,
            what=f"download of snapshot {sid}",
            on_bytes=on_bytes,
            on_total=on_total,
        )
    finally:
        if bar is not None:
            bar.close()


def fetch_bytes(
    run: SnapshotSource,
    snapshot: str | int | Mapping[str, Any],
    profile: str | None,
    *,
    layout: str,
    dtype: str | None,
    progress: bool | IO[str],
    on_progress: Callable[[int, int | None], None] | None = None,
    connections: int | None = None,
) -> bytearray:
    """The whole download in memory (``Run.download``), checked."""
    target = Target(None)
    try:
        _fetch_into(
            run, snapshot, profile, layout, dtype, target, progress, on_progress, connections
        )
        return target.bytes()
    finally:
        target.close()


def download_to(
    run: SnapshotSource,
    snapshot: str | int | Mapping[str, Any],
    directory: Path,
    profile: str | None,
    *,
    layout: str,
    dtype: str | None,
    progress: bool | IO[str],
    on_progress: Callable[[int, int | None], None] | None = None,
    fsync: bool = True,
    connections: int | None = None,
) -> Path:
    if layout not in {x.value for x in WRITTEN_LAYOUTS}:
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

    def fetch_to(path: Path) -> None:
        target = Target(path)
        try:
            _fetch_into(
                run, snapshot, profile, layout, dtype, target, progress, on_progress, connections
            )
            if fsync:
                target.fsync()
        except BaseException:
            target.close()
            if not Resume.sidecar(path).exists():
                path.unlink(missing_ok=True)  # nothing in it a later attempt could use
            raise
        finally:
            target.close()

    if layout == DownloadLayout.FULL:
        return _write_file(directory / (final_name or f"{stem}.safetensors"), fetch_to, fsync)
    target = directory / (stem if layout == DownloadLayout.SHARDED else f"{stem}-hf")
    return _unpack_tree(target, fetch_to, fsync)


def _write_file(final: Path, fetch_to: Callable[[Path], None], fsync: bool) -> Path:
    """Fetched into a temporary file beside ``final`` (``NAME.part``, kept
    with what it holds when the fetch fails, for the next attempt to
    resume), renamed into place once every block checked (made durable
    first with ``fsync``)."""
    tmp = final.with_suffix(".safetensors.part")
    fetch_to(tmp)
    os.replace(tmp, final)
    if fsync:
        _fsync_dir(final.parent)  # the rename itself
    return final


def _unpack_tree(target: Path, fetch_to: Callable[[Path], None], fsync: bool) -> Path:
    """The tar fetched into a temporary file (kept when the fetch fails,
    for the next attempt to resume), unpacked beside ``target`` and renamed
    into place: a crash leaves the old directory or the whole new one,
    never a half-unpacked one."""
    directory = target.parent
    tmp_tar = directory / f"{target.name}.tar.part"
    staging = directory / f".{target.name}.part"
    shutil.rmtree(staging, ignore_errors=True)
    fetch_to(tmp_tar)
    try:
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
