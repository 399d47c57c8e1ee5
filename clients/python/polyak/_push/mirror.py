"""Fewer bytes on the wire: the lossless byte-grouped zstd codec, XOR and
quantised deltas against the server's mirror, keyframes with a mirror
checksum.

Everything here runs on a pusher's sender thread, never on the training
thread.

- :func:`encode_bgz` writes a safetensors body in the ``polyak-bgz``
  encoding (``Content-Encoding: polyak-bgz``): the header unchanged, the
  data cut into frames (runs of tensors of one element size, at most
  :data:`CHUNK_BYTES` each), each frame byte-grouped (every element's byte
  0, then byte 1, ...) and compressed as one zstd frame with its checksum.
  The server decodes it back to the identical safetensors body.
- :class:`MirrorEncoder` keeps a copy of exactly what the server's mirror
  holds and turns each push into a keyframe (the full body, with
  ``polyak.mirror_crc32`` of that copy) or a delta: ``xor`` (lossless bits),
  ``bf16``, ``fp8_e4m3`` or ``int8`` (one float32 scale per block of 128 or
  256 values). Both sides add ``dequant(q)`` to their mirror with the same
  float32 arithmetic, so the quantisation error of one push is carried by
  the next delta (error feedback) and never accumulates.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PolyakError
from ..wire import KIND_KEY, WireLayout, st_dtype

__all__ = [
    "CHUNK_BYTES",
    "DELTA_FORMATS",
    "ENCODING",
    "MirrorEncoder",
    "decode_bgz",
    "dequantise",
    "encode_bgz",
    "quantise",
]

#: The ``Content-Encoding`` token of the byte-grouped codec.
ENCODING = "polyak-bgz"
#: Logical bytes per frame (whole elements).
CHUNK_BYTES = 1 << 20
MAGIC = b"PBG1"
#: ``__metadata__`` keys of delta bodies and keyframes.
QUANT_KEY = "polyak.quant"
MIRROR_CRC_KEY = "polyak.mirror_crc32"
SCALE_SUFFIX = ":scale"
#: Delta kinds a pusher may send.
DELTA_FORMATS = ("xor", "bf16", "fp8_e4m3", "int8")

_SIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}
_SIZES.update({"I16": 2, "U16": 2})
#: zstd level of the byte-grouped codec. On trained weights level 1 both
#: compresses byte-grouped streams better than level 3 (bf16: 1.45x against
#: 1.41x of the raw bytes) and runs faster: ``benches/wire.py`` measures it.
DEFAULT_CODEC_LEVEL = 1
_FP8_MAX = 448.0
_INT8_MAX = 127.0


def _frames(header: bytes) -> tuple[list[tuple[int, int, int]], int]:
    """``(start, end, stride)`` of each frame of the data section, and its
    length: the server derives the same list from the same header."""
    entries = json.loads(header)
    spans = sorted(
        (int(v["data_offsets"][0]), int(v["data_offsets"][1]), _SIZES.get(v["dtype"], 1))
        for k, v in entries.items()
        if k != "__metadata__"
    )
    runs: list[list[int]] = []
    end = 0
    for start, stop, size in spans:
        if start != end:
            raise PolyakError("tensor data leaves a gap", code="invalid_safetensors")
        end = stop
        if start == stop:
            continue
        if runs and runs[-1][2] == size and runs[-1][1] == start:
            runs[-1][1] = stop
        else:
            runs.append([start, stop, size])
    frames = []
    for start, stop, size in runs:
        step = (CHUNK_BYTES // size) * size
        for at in range(start, stop, step):
            frames.append((at, min(at + step, stop), size))
    return frames, end


def _group(data: memoryview, stride: int) -> bytes:
    if stride == 1:
        return bytes(data)
    arr = np.frombuffer(data, dtype=np.uint8).reshape(-1, stride)
    return arr.T.tobytes()


def _ungroup(grouped: bytes, stride: int) -> bytes:
    if stride == 1:
        return grouped
    arr = np.frombuffer(grouped, dtype=np.uint8).reshape(stride, -1)
    return arr.T.tobytes()


def encode_bgz(body: bytes | bytearray | memoryview, level: int = DEFAULT_CODEC_LEVEL) -> bytes:
    """``body`` (one safetensors file) in the ``polyak-bgz`` encoding."""
    import zstandard

    view = memoryview(body).cast("B")
    (n,) = struct.unpack("<Q", view[:8])
    header = bytes(view[8 : 8 + n])
    frames, data_len = _frames(header)
    data = view[8 + n :]
    if len(data) != data_len:
        raise PolyakError("data does not match the header", code="invalid_safetensors")
    cx = zstandard.ZstdCompressor(level=level, write_checksum=True)
    compressed = [cx.compress(_group(data[a:b], s)) for a, b, s in frames]
    table = struct.pack(f"<{len(compressed)}I", *(len(c) for c in compressed))
    return b"".join(
        [
            MAGIC,
            struct.pack("<Q", n),
            header,
            struct.pack("<I", len(compressed)),
            table,
            *compressed,
        ]
    )


def decode_bgz(raw: bytes) -> bytes:
    """The inverse of :func:`encode_bgz` (for tests and tools)."""
    import zstandard

    if raw[:4] != MAGIC:
        raise PolyakError("not a polyak-bgz body", code="invalid_encoding")
    (n,) = struct.unpack("<Q", raw[4:12])
    header = raw[12 : 12 + n]
    frames, _ = _frames(header)
    at = 12 + n
    (count,) = struct.unpack("<I", raw[at : at + 4])
    at += 4
    lengths = struct.unpack(f"<{count}I", raw[at : at + 4 * count])
    at += 4 * count
    dx = zstandard.ZstdDecompressor()
    out = [struct.pack("<Q", n), header]
    for (a, b, s), length in zip(frames, lengths, strict=True):
        out.append(_ungroup(dx.decompress(raw[at : at + length], max_output_size=b - a), s))
        at += length
    return b"".join(out)


# -- quantised deltas -------------------------------------------------------


def quantise(
    delta: torch.Tensor, fmt: str, block: int = 128
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``delta`` (float32, flat) as ``(q, scales)``: fp8 e4m3 or int8 values
    with one float32 scale per block (``amax / 448`` or ``amax / 127``; 1
    for an all-zero block), or bf16 values and no scales."""
    d = delta.reshape(-1).float()
    if fmt == "bf16":
        return d.to(torch.bfloat16), None
    n = d.numel()
    blocks = -(-n // block)
    padded = torch.nn.functional.pad(d, (0, blocks * block - n)).view(blocks, block)
    amax = padded.abs().amax(dim=1)
    top = _FP8_MAX if fmt == "fp8_e4m3" else _INT8_MAX
    scales = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    x = (padded / scales[:, None]).clamp(-top, top).reshape(-1)[:n]
    if fmt == "fp8_e4m3":
        return x.to(torch.float8_e4m3fn), scales
    if fmt == "int8":
        return x.round().to(torch.int8), scales
    raise ValueError(f"unknown delta format {fmt!r}")


def dequantise(q: torch.Tensor, scales: torch.Tensor | None, block: int = 128) -> torch.Tensor:
    """``float32(q) * scale`` per block, as the server computes it."""
    w = q.reshape(-1).float()
    if scales is None:
        return w
    n = w.numel()
    blocks = scales.numel()
    padded = torch.nn.functional.pad(w, (0, blocks * block - n)).view(blocks, block)
    return (padded * scales[:, None]).reshape(-1)[:n]


def _add_to_mirror(mirror: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    """``mirror + deq`` in float32, rounded to the mirror's dtype (the
    server's rounding)."""
    flat = mirror.reshape(-1)
    if flat.dtype == torch.float32:
        out = flat + deq
    else:
        out = (flat.float() + deq).to(flat.dtype)
    return out.view(mirror.shape)


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    size = torch.empty((), dtype=dtype).element_size()
    return {8: torch.int64, 4: torch.int32, 2: torch.int16}.get(size, torch.uint8)


def build_body(entries: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """One safetensors body of ``entries`` (in order, the data aligned to 8
    bytes and grouped by decreasing element size, as the pusher lays out
    its full bodies)."""
    order = sorted(range(len(entries)), key=lambda i: -entries[i][1].element_size())
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    parts: list[bytes] = []
    for i in order:
        name, t = entries[i]
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": st_dtype(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        parts.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *parts])


@dataclass
class Encoded:
    """A body ready to send, and what committing it does to the mirror."""

    payload: bytes | memoryview
    headers: dict[str, str]
    kind: str
    #: The client's mirror once the server applied this push.
    mirror_after: list[torch.Tensor] | None
    seconds: float = 0.0


class MirrorEncoder:
    """A rank's copy of the server's mirror, and the delta encoder.

    ``delta``: ``None`` (every push full), ``"xor"`` or a quantised format.
    ``keyframe_every``: a full push every that many pushes (the first push
    is always one). ``codec``: ``"bgz"`` to byte-group and compress every
    body, at zstd ``level``.

    :meth:`encode` returns the body of the next push; :meth:`commit` makes
    its mirror the current one once the server applied it; :meth:`reset`
    (after a refused push) makes the next push a keyframe.
    """

    def __init__(
        self,
        delta: str | None = None,
        *,
        block: int = 128,
        keyframe_every: int = 100,
        codec: str | None = None,
        level: int = DEFAULT_CODEC_LEVEL,
    ) -> None:
        if delta is not None and delta not in DELTA_FORMATS:
            raise ValueError(f"delta must be one of {DELTA_FORMATS} or None, not {delta!r}")
        if block not in (128, 256):
            raise ValueError("block must be 128 or 256")
        if keyframe_every < 1:
            raise ValueError("keyframe_every must be >= 1")
        if codec not in (None, "bgz"):
            raise ValueError(f"codec must be None or 'bgz', not {codec!r}")
        self.delta = delta
        self.block = block
        self.keyframe_every = keyframe_every
        self.codec = codec
        self.level = level
        self._mirror: list[torch.Tensor] | None = None
        self._since_keyframe = 0

    @property
    def mirror(self) -> list[torch.Tensor] | None:
        """What the server's mirror holds, per tensor of the layout (spec order)."""
        return self._mirror

    def reset(self) -> None:
        self._mirror = None

    def commit(self, encoded: Encoded) -> None:
        if encoded.mirror_after is not None:
            self._mirror = encoded.mirror_after
            self._since_keyframe = 0 if encoded.kind == "full" else self._since_keyframe + 1

    def encode(
        self, layout: WireLayout, views: Sequence[torch.Tensor], full: memoryview
    ) -> Encoded:
        """The next push of ``views`` (the body's tensors, spec order;
        ``full`` the whole body as filled)."""
        import time

        started = time.thread_time()
        keyframe = (
            self.delta is None
            or self._mirror is None
            or self._since_keyframe + 1 >= self.keyframe_every
        )
        headers: dict[str, str] = {}
        if keyframe:
            payload: bytes | memoryview = full
            kind = "full"
            mirror_after = [v.detach().clone() for v in views] if self.delta is not None else None
            if self.delta is not None and self._mirror is not None:
                payload = self._with_crc(layout, full)
        else:
            assert self._mirror is not None
            payload, mirror_after = self._delta(layout, views)
            kind = "xor" if self.delta == "xor" else "delta"
        if self.codec == "bgz":
            payload = encode_bgz(payload, self.level)
            headers["Content-Encoding"] = ENCODING
        seconds = time.thread_time() - started
        headers["Polyak-Encode-Seconds"] = f"{seconds:.6f}"
        return Encoded(payload, headers, kind, mirror_after, seconds)

    def mirror_crc32(self, layout: WireLayout) -> int:
        """CRC-32 of the mirror copy's bytes, in the body's data order."""
        assert self._mirror is not None
        crc = 0
        for placed in sorted(layout.placed, key=lambda p: p.start):
            t = self._mirror[placed.spec_index]
            crc = zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
        return crc

    def _with_crc(self, layout: WireLayout, full: memoryview) -> bytes:
        """The full body with ``polyak.mirror_crc32`` added to its metadata."""
        (n,) = struct.unpack("<Q", full[:8])
        header = json.loads(bytes(full[8 : 8 + n]))
        meta = dict(header.get("__metadata__") or {})
        meta[MIRROR_CRC_KEY] = f"{self.mirror_crc32(layout):08x}"
        header["__metadata__"] = meta
        # Same data offsets: only the header changes.
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * ((-(8 + len(text))) % 8)
        return b"".join([struct.pack("<Q", len(text)), text, full[8 + n :]])

    def _delta(
        self, layout: WireLayout, views: Sequence[torch.Tensor]
    ) -> tuple[bytes, list[torch.Tensor]]:
        assert self._mirror is not None
        entries: list[tuple[str, torch.Tensor]] = []
        after: list[torch.Tensor] = []
        # The layout's own metadata (chunk placement of sharded tensors,
        # tied names) goes with every push of it, deltas included.
        (n,) = struct.unpack("<Q", layout.header[:8])
        meta = dict(json.loads(layout.header[8 : 8 + n]).get("__metadata__") or {})
        meta[KIND_KEY] = "xor" if self.delta == "xor" else "delta"
        if self.delta not in (None, "xor"):
            meta[QUANT_KEY] = json.dumps({"format": self.delta, "block": self.block})
        for spec, view, mirror in zip(layout.specs, views, self._mirror, strict=True):
            if not view.is_floating_point():
                entries.append((spec.name, view))
                after.append(view.detach().clone())
            elif self.delta == "xor":
                bits = _bits_dtype(view.dtype)
                # The XORed bits travel under the tensor's own dtype (the
                # server undoes them against its mirror in that layout).
                entries.append((spec.name, (view.view(bits) ^ mirror.view(bits)).view(view.dtype)))
                after.append(view.detach().clone())
            else:
                d = view.reshape(-1).float() - mirror.reshape(-1).float()
                assert self.delta is not None
                q, scales = quantise(d, self.delta, self.block)
                entries.append((spec.name, q.view(view.shape)))
                if scales is not None:
                    entries.append((spec.name + SCALE_SUFFIX, scales))
                after.append(_add_to_mirror(mirror, dequantise(q, scales, self.block)))
        return build_body(entries, meta), after
