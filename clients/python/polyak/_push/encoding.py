"""What a filled host body becomes on the wire.

An encoding runs on the sender's thread, between the copy and the PUT, so
the training thread never pays for it. The sender encodes a rank's bodies
one at a time in step order (dispatch order), before a body is handed to a
connection slot, so an encoding that keeps state between pushes (the
client-side copy of the server's mirror, for deltas) sees every push in the
order the server applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..wire import HostBody
from .mirror import DEFAULT_CODEC_LEVEL, MirrorEncoder

__all__ = ["Encoding", "Identity", "Mirrored", "Wire", "Zstd", "encoding_for"]


@dataclass
class Wire:
    """One body as it goes out: its bytes and their extra headers."""

    payload: memoryview | bytes
    headers: dict[str, str]
    #: ``full``, ``delta`` or ``xor`` when the encoding knows (mirrored).
    kind: str | None = None
    #: Sender-thread CPU seconds spent encoding.
    seconds: float = 0.0


class Encoding(Protocol):
    """Turns one body into the bytes to send and their extra headers."""

    #: The encoding keeps state between pushes (reported in ``PushStats``).
    stateful: bool

    def encode(self, body: HostBody) -> Wire:
        """The next push's bytes; for a stateful encoding, they assume every
        earlier push was applied."""
        ...

    def refused(self) -> None:
        """The server refused a push: the state it assumed is not the
        server's, so start again (the next push is a keyframe)."""
        ...


class Identity:
    """The body as it is: the host buffer itself goes to the socket."""

    stateful = False

    def encode(self, body: HostBody) -> Wire:
        return Wire(body.memory, {})

    def refused(self) -> None:
        pass


class Zstd:
    """``Content-Encoding: zstd`` at ``level`` (needs ``zstandard``)."""

    stateful = False

    def __init__(self, level: int) -> None:
        self.level = level

    def encode(self, body: HostBody) -> Wire:
        # Imported here, on the sender's thread: a missing module is
        # reported like any other failed push.
        import zstandard

        data = zstandard.ZstdCompressor(level=self.level).compress(body.memory)
        return Wire(data, {"Content-Encoding": "zstd"})

    def refused(self) -> None:
        pass


class Mirrored:
    """The ``polyak-bgz`` codec and/or deltas against the server's mirror
    (:class:`~polyak._push.mirror.MirrorEncoder`): keyframes, XOR or
    quantised deltas with error feedback."""

    stateful = True

    def __init__(self, encoder: MirrorEncoder) -> None:
        self.encoder = encoder

    def encode(self, body: HostBody) -> Wire:
        encoded = self.encoder.encode(body.layout, body.views, body.memory)
        # Optimistic: the server applies in dispatch order, so the next
        # delta builds on this one; a refusal resets it.
        self.encoder.commit(encoded)
        return Wire(encoded.payload, encoded.headers, encoded.kind, encoded.seconds)

    def refused(self) -> None:
        self.encoder.reset()


def encoding_for(
    compress: int | None,
    *,
    codec: str | None = None,
    delta: str | None = None,
    codec_level: int = DEFAULT_CODEC_LEVEL,
    block: int = 128,
    keyframe_every: int = 100,
) -> Encoding:
    """The encoding of a pusher's ``compress``, ``codec`` and ``delta``
    options."""
    if codec is not None or delta is not None:
        if compress is not None:
            raise ValueError("compress (plain zstd) and codec/delta are exclusive")
        return Mirrored(
            MirrorEncoder(
                delta, block=block, keyframe_every=keyframe_every, codec=codec, level=codec_level
            )
        )
    return Identity() if compress is None else Zstd(compress)
