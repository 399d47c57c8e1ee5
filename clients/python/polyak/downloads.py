"""Snapshot downloads with a progress bar (``GET .../snapshots/{id}/download``).

``layout=full`` is one safetensors stream of whole tensors; ``layout=sharded``
is a tar of one safetensors file per rank (``hf``: HF-style shards and their
index). All are streamed: to memory for :meth:`Run.download`, to a temporary
file renamed into place (or unpacked) for :meth:`Run.download_to`.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO

from .errors import PolyakError

if TYPE_CHECKING:
    from .client import Run

__all__ = ["download_to", "fetch_bytes", "snapshot_done", "snapshot_id"]

_CHUNK = 1 << 20
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
    r = run.client.stream(path, params=params, token=run.read_token)
    try:
        total = int(r.headers.get("content-length", 0)) or None
        done = 0
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"{run.name}/{sid}" + (f" {profile}" if profile else ""),
            disable=progress is False,
            file=None if isinstance(progress, bool) else progress,
        ) as bar:
            for chunk in r.iter_bytes(_CHUNK):
                out.write(chunk)
                done += len(chunk)
                bar.update(len(chunk))
                if on_progress is not None:
                    on_progress(done, total)
        if total is not None and done != total:
            raise PolyakError(
                f"download of snapshot {sid} ended after {done} of {total} bytes",
                code="incomplete_download",
            )
    finally:
        r.close()


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
) -> Path:
    if layout not in ("full", "sharded", "hf"):
        raise ValueError(f"layout must be `full`, `sharded` or `hf`, not {layout!r}")
    directory.mkdir(parents=True, exist_ok=True)
    sid = snapshot_id(snapshot)
    stem = f"{run.name}-{sid}" + (f"-{profile}" if profile else "")
    if layout == "full":
        final = directory / f"{stem}.safetensors"
        tmp = final.with_suffix(".safetensors.part")
        try:
            with open(tmp, "wb") as f:
                _stream_into(run, snapshot, profile, layout, dtype, f, progress, on_progress)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return final
    target = directory / (stem if layout == "sharded" else f"{stem}-hf")
    tmp_tar = directory / f"{target.name}.tar.part"
    try:
        with open(tmp_tar, "wb") as f:
            _stream_into(run, snapshot, profile, layout, dtype, f, progress, on_progress)
        with tarfile.open(tmp_tar) as tar:
            target.mkdir(parents=True, exist_ok=True)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(target, filter="data")
            else:  # Python without extraction filters: refuse paths that escape
                for member in tar.getmembers():
                    dest = (target / member.name).resolve()
                    if not dest.is_relative_to(target.resolve()) or not (
                        member.isfile() or member.isdir()
                    ):
                        raise PolyakError(
                            f"unsafe tar entry {member.name!r}", code="invalid_download"
                        )
                tar.extractall(target)
    finally:
        tmp_tar.unlink(missing_ok=True)
    return target
