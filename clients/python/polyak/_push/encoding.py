"""What a filled host body becomes on the wire.

An encoding runs on the sender's thread, between the copy and the PUT, so
the training thread never pays for it. With one connection slot it sees a
rank's bodies in step order; an encoding that keeps state between pushes
(a client-side copy of the server's mirror, for deltas) relies on that, and
with several slots it would encode in step order before a body is handed
to a slot.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Encoding", "Identity", "Zstd", "encoding_for"]


class Encoding(Protocol):
    """Turns one body into the bytes to send and their extra headers."""

    def encode(self, body: memoryview) -> tuple[memoryview | bytes, dict[str, str]]: ...


class Identity:
    """The body as it is: the host buffer itself goes to the socket."""

    def encode(self, body: memoryview) -> tuple[memoryview | bytes, dict[str, str]]:
        return body, {}


class Zstd:
    """``Content-Encoding: zstd`` at ``level`` (needs ``zstandard``)."""

    def __init__(self, level: int) -> None:
        self.level = level

    def encode(self, body: memoryview) -> tuple[memoryview | bytes, dict[str, str]]:
        # Imported here, on the sender's thread: a missing module is
        # reported like any other failed push.
        import zstandard

        data = zstandard.ZstdCompressor(level=self.level).compress(body)
        return data, {"Content-Encoding": "zstd"}


def encoding_for(compress: int | None) -> Encoding:
    """The encoding of a pusher's ``compress`` option."""
    return Identity() if compress is None else Zstd(compress)
