"""Progress of downloads and derived snapshots: a tqdm bar on a terminal
(or in a notebook), a line per tenth of the way anywhere else.

A bar redraws itself with carriage returns many times a second; written to
a log file or a CI job's output, every redraw becomes text. So the bar is
only drawn where something shows it in place, and a pipe or a file gets a
plain line at 10 %, 20 %, ... 100 % instead.
"""

from __future__ import annotations

import sys
from typing import IO, Any

__all__ = ["LineProgress", "progress_bar"]


def progress_bar(
    progress: bool | IO[str],
    *,
    desc: str,
    total: int | None,
    initial: int = 0,
) -> Any:
    """A progress display of ``total`` bytes (``None``: unknown) on
    ``progress`` (``True``: stderr, ``False``: none, or a text stream):
    tqdm's bar where the stream is a terminal, else :class:`LineProgress`.
    Both offer ``update(n)``, settable ``n`` and ``total``, ``refresh()``
    and ``close()``, and are context managers."""
    stream = sys.stderr if progress is True else progress
    if progress is False or stream is None:
        return LineProgress(None, desc=desc, total=total, initial=initial)
    if _interactive(stream):
        from tqdm.auto import tqdm

        return tqdm(
            total=total,
            initial=initial,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=desc,
            file=None if progress is True else stream,
        )
    return LineProgress(stream, desc=desc, total=total, initial=initial)


def _interactive(stream: IO[str]) -> bool:
    """The stream shows a bar in place: a terminal, or a notebook's stderr
    (whose stream is no terminal, but where tqdm draws a widget)."""
    isatty = getattr(stream, "isatty", None)
    try:
        if callable(isatty) and isatty():
            return True
    except ValueError:  # a closed stream
        return False
    return stream is sys.stderr and "ipykernel" in sys.modules


class LineProgress:
    """One line each time another tenth of ``total`` is done (only the
    newest tenth when several pass at once), and one at the end when the
    total was unknown. ``stream=None``: silent."""

    def __init__(
        self, stream: IO[str] | None, *, desc: str, total: int | None, initial: int = 0
    ) -> None:
        self.stream = stream
        self.desc = desc
        self.total = total
        self.n = initial
        self._tenths = -1 if initial == 0 else self._tenth()
        self._closed = False

    def _tenth(self) -> int:
        if not self.total:
            return -1
        return min(10, self.n * 10 // self.total)

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()

    def refresh(self) -> None:
        tenth = self._tenth()
        if tenth > self._tenths:
            self._tenths = tenth
            self._say(f"{tenth * 10}% ({_size(self.n)} of {_size(self.total or 0)})")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.total and self.n:
            self._say(f"{_size(self.n)} done")

    def _say(self, text: str) -> None:
        if self.stream is None:
            return
        self.stream.write(f"{self.desc}: {text}\n")
        self.stream.flush()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _size(n: int) -> str:
    """Bytes in binary units, three significant digits (as tqdm shows them)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
