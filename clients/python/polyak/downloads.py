"""Snapshot downloads with a progress bar (``GET .../snapshots/{id}/download``).

``layout=full`` is one safetensors stream of whole tensors; ``layout=sharded``
is a tar of one safetensors file per rank (``hf``: HF-style shards and their
index). All are streamed: to memory for :meth:`Run.download`, to a temporary
file renamed into place (or unpacked) for :meth:`Run.download_to`. The bytes
move through the client's transport (:class:`polyak._transport.BodySink`:
spliced socket to file where the platform allows); this module names the
files, shows the progress and makes the result durable.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tarfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol

from ._progress import progress_bar
from ._transport import BodySink, Transport
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


def _stream_into(
    run: SnapshotSource,
    snapshot: str | int | Mapping[str, Any],
    profile: str | None,
    layout: str,
    dtype: str | None,
    out: BinaryIO,
    progress: bool | IO[str],
    on_progress: Callable[[int, int | None], None] | None = None,
) -> None:
    """The snapshot's download (``layout``, ``profile``, ``dtype``) into
    ``out``, with a tqdm bar (``progress``) and ``on_progress(done, total)``."""
    sid = snapshot_id(snapshot)
    transport = run.transport
    r = transport.open_download(
        f"{run.path}/snapshots/{sid}/download",
        {"profile": profile, "layout": layout, "dtype": dtype},
        run.read_token if run.read_token is not None else transport.token,
    )
    with BodySink(r, out, transport.timeout) as sink:
        with progress_bar(
            progress,
            total=sink.total,
            initial=sink.done,
            desc=f"{run.name}/{sid}" + (f" {profile}" if profile else ""),
        ) as bar:
            reported = 0

            def moved(n: int, done: int) -> None:
                nonlocal reported
                bar.update(n)
                if on_progress is not None:
                    on_progress(done, sink.total)
                    reported = done

            done = sink.move_all(f"download of snapshot {sid}", moved)
        if on_progress is not None and reported != done:
            on_progress(done, sink.total)  # it all came with the headers


def fetch_bytes(
    run: SnapshotSource,
    snapshot: str | int | Mapping[str, Any],
    profile: str | None,
    *,
    layout: str,
    dtype: str | None,
    progress: bool | IO[str],
    on_progress: Callable[[int, int | None], None] | None = None,
) -> bytes:
    """The whole download in memory (``Run.download``)."""
    buf = io.BytesIO()
    _stream_into(run, snapshot, profile, layout, dtype, buf, progress, on_progress)
    return buf.getvalue()


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

    def stream(out: BinaryIO) -> None:
        _stream_into(run, snapshot, profile, layout, dtype, out, progress, on_progress)

    if layout == DownloadLayout.FULL:
        return _write_file(directory / (final_name or f"{stem}.safetensors"), stream, fsync)
    target = directory / (stem if layout == DownloadLayout.SHARDED else f"{stem}-hf")
    return _unpack_tree(target, stream, fsync)


def _write_file(final: Path, stream: Callable[[BinaryIO], None], fsync: bool) -> Path:
    """``stream`` into a temporary file beside ``final``, renamed into place
    (made durable first with ``fsync``)."""
    tmp = final.with_suffix(".safetensors.part")
    try:
        with open(tmp, "w+b") as f:  # readable too, to be mapped
            stream(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if fsync:
            _fsync_dir(final.parent)  # the rename itself
    finally:
        tmp.unlink(missing_ok=True)
    return final


def _unpack_tree(target: Path, stream: Callable[[BinaryIO], None], fsync: bool) -> Path:
    """``stream`` (a tar) into a temporary file, unpacked beside ``target``
    and renamed into place: a crash leaves the old directory or the whole
    new one, never a half-unpacked one."""
    directory = target.parent
    tmp_tar = directory / f"{target.name}.tar.part"
    staging = directory / f".{target.name}.part"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with open(tmp_tar, "w+b") as f:
            stream(f)
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
