"""Safetensors bodies: push bodies written in place, EMA files read back.

A push body is one safetensors file (8-byte little-endian header length,
JSON header, data). Its header depends only on the pushed layout (names,
dtypes, shapes, chunk metadata), never on the values, so a pusher builds it
once (:class:`WireLayout`) and writes it into each of its reused host
buffers (:class:`HostBody`) when the buffer is allocated. A push then only
copies the tensors into typed views of the buffer's data section: one copy
on the training thread, none while sending (the sender hands the buffer's
memory to the socket as it is). ``safetensors.torch.save`` would build a
new ``bytes`` object per push and copy every tensor more than once.

Tensors are laid out grouped by dtype, in decreasing element size, each
group in the caller's (state-dict) order, with the data starting at a
multiple of 8 bytes: every tensor is aligned for its dtype, and the server
finds each dtype group contiguous and in the same order on every push, so it
updates a group with one kernel call.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import safetensors.torch
import torch

from .errors import PolyakError

__all__ = [
    "ALIASES_KEY",
    "SHARDS_KEY",
    "Chunk",
    "HostBody",
    "RankEma",
    "TensorSpec",
    "WireLayout",
    "expand_aliases",
    "parse_chunks",
    "read_safetensors",
    "st_dtype",
    "wire_dtype",
]

#: ``__metadata__`` key holding chunk placement of sharded tensors.
SHARDS_KEY = "polyak.shards"
#: ``__metadata__`` key selecting ``full`` or ``delta`` pushes.
KIND_KEY = "polyak.kind"
#: ``__metadata__`` key: JSON ``{alias: name}`` of tied names (one storage,
#: several state-dict names), pushed and stored once under ``name``.
ALIASES_KEY = "polyak.aliases"

# The dtypes the server keeps: averaged floats, copied integers and bools.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# Inside one element size, a fixed dtype order (floats first).
_DTYPE_RANK = {dtype: i for i, dtype in enumerate(_DTYPE_NAMES)}
# What a push body may carry besides: fp8 quantised deltas.
_PAYLOAD_NAMES = {**_DTYPE_NAMES, torch.float8_e4m3fn: "F8_E4M3"}


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a tensor in a push body (the kept
    dtypes, and ``F8_E4M3`` for fp8 quantised deltas)."""
    return _PAYLOAD_NAMES[dtype]


def wire_dtype(dtype: torch.dtype, name: str = "") -> str:
    """The safetensors dtype string, or a clear error for a dtype polyak does
    not keep (fp8, complex, unsigned wider than 8 bits)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise PolyakError(
            f"tensor `{name}` has dtype {dtype}, which polyak does not keep "
            "(float: float64 float32 float16 bfloat16; copied: int64 int32 int16 int8 "
            "uint8 bool); skip it with `skip=[...]`",
            code="unsupported_dtype",
        ) from None


@dataclass(frozen=True)
class Chunk:
    """Where a tensor chunk sits in its whole (unsharded) tensor."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def to_json(self) -> dict[str, list[int]]:
        return {"global_shape": list(self.global_shape), "offsets": list(self.offsets)}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a push as the wire sees it (dtype after any cast)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunk: Chunk | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class _Placed:
    spec_index: int
    start: int  # absolute byte offset in the body
    nbytes: int


class WireLayout:
    """The fixed part of a pusher's bodies: header bytes and where each
    tensor's data goes.

    ``specs`` are given in the caller's order (the state-dict order); the
    data is laid out in wire order (see the module doc). ``placed[i]`` is
    where ``specs[i]`` goes.
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        metadata: Mapping[str, str] | None = None,
        *,
        align: int = 8,
    ) -> None:
        if not specs:
            raise PolyakError("nothing to push: no tensors left after `skip`", code="empty")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise PolyakError(f"tensor names pushed twice: {dup}", code="duplicate_names")
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        for spec in specs:
            wire_dtype(spec.dtype, spec.name)
        order = sorted(
            range(len(specs)),
            key=lambda i: (-_itemsize(specs[i].dtype), _DTYPE_RANK[specs[i].dtype]),
        )
        header: dict[str, object] = {}
        meta = dict(metadata or {})
        shards = {s.name: s.chunk.to_json() for s in specs if s.chunk is not None}
        if shards:
            meta[SHARDS_KEY] = json.dumps(shards, separators=(",", ":"))
        if meta:
            header["__metadata__"] = meta
        offset = 0
        relative: dict[int, tuple[int, int]] = {}
        for i in order:
            spec = specs[i]
            header[spec.name] = {
                "dtype": _DTYPE_NAMES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            relative[i] = (offset, spec.nbytes)
            offset += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        # Pad with spaces (allowed by the format) so the data starts aligned.
        text += b" " * ((-(8 + len(text))) % align)
        self.header: bytes = struct.pack("<Q", len(text)) + text
        self.data_start = len(self.header)
        self.nbytes = self.data_start + offset
        self.placed: tuple[_Placed, ...] = tuple(
            _Placed(i, self.data_start + relative[i][0], relative[i][1]) for i in range(len(specs))
        )
        self.signature = tuple((s.name, s.dtype, s.shape, s.chunk) for s in specs)

    def describe_difference(self, specs: Sequence[TensorSpec]) -> str:
        """Why ``specs`` do not fit this layout (for the error message)."""
        mine = {s.name: s for s in self.specs}
        theirs = {s.name: s for s in specs}
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        if missing or extra:
            return f"missing {missing[:5]}, new {extra[:5]}"
        for name, s in theirs.items():
            m = mine[name]
            if (m.dtype, m.shape, m.chunk) != (s.dtype, s.shape, s.chunk):
                return (
                    f"`{name}` was {m.dtype} {list(m.shape)} {m.chunk}, "
                    f"now {s.dtype} {list(s.shape)} {s.chunk}"
                )
        return "tensor order changed"


class HostBody:
    """One reusable push body in host memory: the header written once, a
    typed view per tensor into the data section.

    With ``pin=True`` (CUDA sources) the memory is page-locked, so device to
    host copies run asynchronously; ``ready`` then holds the CUDA events
    recorded after the copies, which the sender waits on before reading the
    buffer.
    """

    def __init__(self, layout: WireLayout, *, pin: bool = False) -> None:
        self.layout = layout
        self.storage = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.pinned = pin
        self.storage[: layout.data_start].copy_(
            torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
        )
        self.views: list[torch.Tensor] = []
        for spec, placed in zip(layout.specs, layout.placed, strict=True):
            raw = self.storage.narrow(0, placed.start, placed.nbytes)
            self.views.append(raw.view(spec.dtype).view(spec.shape))
        self.ready: list[torch.cuda.Event] = []
        # The bytes the socket sends: the same memory, no copy.
        self.memory: memoryview = self.storage.numpy().data.cast("B")

    def fill(self, sources: Sequence[torch.Tensor], indices: Sequence[int] | None = None) -> None:
        """Copies ``sources`` into the views: one per spec in spec order, or
        one per entry of ``indices`` (the specs they fill; a push copies its
        buffers at once and its parameters later, on another thread).

        CPU sources: one memcpy each, done when this returns. CUDA sources:
        ``non_blocking`` copies into pinned memory on the current stream and
        an event the sender waits on; the training stream never waits for
        the host.
        """
        views = self.views if indices is None else [self.views[i] for i in indices]
        if len(views) != len(sources):
            raise ValueError(f"{len(sources)} sources for {len(views)} tensors")
        on_cuda = any(s.is_cuda for s in sources)
        non_blocking = on_cuda and self.pinned
        with torch.no_grad():
            if not views:
                pass
            elif not on_cuda and hasattr(torch, "_foreach_copy_"):
                # One call for the whole list (what torch's optimizers use).
                torch._foreach_copy_(views, list(sources))
            else:
                # Device to host: one asynchronous copy per tensor, each on
                # its device's current stream.
                for view, src in zip(views, sources, strict=True):
                    view.copy_(src, non_blocking=non_blocking)
        # One event per CUDA device, on the stream the copies went to.
        self.ready = []
        devices = {s.device for s in sources if s.is_cuda}
        for device in sorted(devices, key=str):
            with torch.cuda.device(device):
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(device))
            self.ready.append(event)

    def wait_ready(self) -> None:
        """Blocks (the sender) until the copies into this buffer are done."""
        for event in self.ready:
            event.synchronize()


def read_safetensors(
    data: bytes | bytearray | memoryview,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and ``__metadata__`` of one safetensors file held in memory."""
    raw = bytes(data)
    if len(raw) < 8:
        raise PolyakError(f"safetensors file of {len(raw)} bytes", code="invalid_safetensors")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise PolyakError("safetensors header runs past the file", code="invalid_safetensors")
    header = json.loads(raw[8 : 8 + n])
    metadata = header.get("__metadata__") or {}
    tensors = safetensors.torch.load(raw)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def expand_aliases(
    tensors: dict[str, torch.Tensor], chunks: dict[str, Chunk], metadata: Mapping[str, str]
) -> None:
    """Adds the tied names a file's ``polyak.aliases`` lists, each the same
    tensor (and chunk) as the name it aliases, in place."""
    text = metadata.get(ALIASES_KEY)
    if not text:
        return
    for alias, target in json.loads(text).items():
        if target in tensors and alias not in tensors:
            tensors[alias] = tensors[target]
            if target in chunks:
                chunks[alias] = chunks[target]


def parse_chunks(metadata: Mapping[str, str]) -> dict[str, Chunk]:
    """The ``polyak.shards`` entry of a file's metadata."""
    text = metadata.get(SHARDS_KEY)
    if not text:
        return {}
    out: dict[str, Chunk] = {}
    for name, c in json.loads(text).items():
        out[name] = Chunk(
            tuple(int(d) for d in c["global_shape"]), tuple(int(o) for o in c["offsets"])
        )
    return out


@dataclass
class RankEma:
    """One rank's live EMA for one profile, as the server holds it."""

    rank: int
    profile: str
    step: int | None
    tensors: dict[str, torch.Tensor]
    chunks: dict[str, Chunk]
    metadata: dict[str, str]

    @classmethod
    def read(cls, data: bytes | bytearray | memoryview, rank: int, profile: str | None) -> RankEma:
        """A ``GET .../ranks/{rank}/ema`` answer: tensors, chunk placement,
        and the tied names the rank pushed once, each under every name."""
        tensors, metadata = read_safetensors(data)
        chunks = parse_chunks(metadata)
        expand_aliases(tensors, chunks, metadata)
        step = metadata.get("polyak.step")
        return cls(
            rank=int(rank),
            profile=metadata.get("polyak.profile", profile or ""),
            step=int(step) if step is not None else None,
            tensors=tensors,
            chunks=chunks,
            metadata=metadata,
        )
