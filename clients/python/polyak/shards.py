"""What this process holds of a model, found with torch's own APIs.

:func:`local_state` turns a module or a state dict into :class:`LocalPart`
records: the fully-qualified name as in the *unsharded* ``state_dict()``, the
local tensor (a view of the live parameter or buffer wherever torch gives
one), and where it sits in the whole tensor:

- FSDP2 / DTensor: ``to_local()``, with the local shape and global offsets
  from ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``
  (what ``torch.distributed.checkpoint`` uses), so uneven ``Shard(0)``
  splits, ranks holding zero rows and 2-D meshes come out as torch sees them;
- FSDP1: the ``SHARDED_STATE_DICT`` (``ShardedTensor.local_shards()`` and
  their ``shard_offsets``); a state dict from ``get_model_state_dict`` holds
  the same ``ShardedTensor`` or ``DTensor`` values and is read the same way;
- DDP, ``torch.compile`` and wrapper prefixes: the module is unwrapped by
  type, and the key segments ``_orig_mod``, ``_fsdp_wrapped_module`` and
  ``_checkpoint_wrapped_module`` are dropped;
- a plain module or state dict: whole tensors.

Data held identically by several pushers (DDP replicas, FSDP buffers, a
DTensor's ``Replicate`` mesh dimensions) is split between them along dim 0,
so that the chunks of every name tile the whole tensor exactly once (the
server checks this when it assembles a snapshot) and each rank sends only
its share of the bytes. :func:`push_pieces` does that split;
:func:`copy_into_parts` is the way back, copying EMA chunks into whatever
region each local tensor covers.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from .errors import PolyakError
from .wire import Chunk

__all__ = [
    "LocalPart",
    "LocalState",
    "Piece",
    "assemble",
    "canonical_name",
    "copy_into_parts",
    "local_state",
    "push_pieces",
    "split_range",
    "tied_pieces",
]

# Key segments that wrappers insert and the unsharded ``state_dict()`` lacks.
_WRAPPER_SEGMENTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


@dataclass
class LocalPart:
    """What this process holds of one state-dict entry."""

    name: str
    #: The local data; a view of the live tensor for plain modules, DDP,
    #: ``torch.compile`` and FSDP2; a fresh tensor for FSDP1 (written back
    #: by :attr:`LocalState.commit`).
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    #: Offset of ``tensor``'s first element in the whole tensor, per dim.
    offsets: tuple[int, ...]
    #: ``(index, count)`` of this process among those holding the same data.
    replica: tuple[int, int] = (0, 1)
    #: A chunk of a tensor sharded between processes (DTensor ``Shard``,
    #: ShardedTensor), even where this process happens to hold all of it.
    sharded: bool = False


@dataclass
class LocalState:
    parts: list[LocalPart]
    #: Writes changed ``parts`` back into the model, where the parts are not
    #: views of it (FSDP1 sharded state dicts); ``None`` when they are.
    commit: Callable[[], None] | None = None


@dataclass(frozen=True)
class Piece:
    """The slice of a :class:`LocalPart` that this process pushes."""

    name: str
    tensor: torch.Tensor
    chunk: Chunk | None


@functools.lru_cache(maxsize=65536)
def canonical_name(key: str) -> str:
    """Drops wrapper segments (``torch.compile``'s ``_orig_mod``, FSDP1's
    ``_fsdp_wrapped_module``, activation checkpointing's wrapper)."""
    parts = [p for p in key.split(".") if p not in _WRAPPER_SEGMENTS]
    return ".".join(parts)


def _module_type(module_name: str, attr: str) -> type | None:
    """A class from a torch module, only if that module is already imported
    (if it is not, no object of that class can exist)."""
    mod = sys.modules.get(module_name)
    return getattr(mod, attr, None) if mod is not None else None


def _dtensor_type() -> type | None:
    return _module_type("torch.distributed.tensor", "DTensor")


def _sharded_tensor_type() -> type | None:
    return _module_type("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")


def unwrap(module: nn.Module) -> nn.Module:
    """Strips DDP and ``torch.compile`` wrappers (in any nesting)."""
    ddp = _module_type("torch.nn.parallel.distributed", "DistributedDataParallel")
    compiled = _module_type("torch._dynamo.eval_frame", "OptimizedModule")
    for _ in range(16):
        if ddp is not None and isinstance(module, ddp):
            module = cast(nn.Module, module.module)
        elif compiled is not None and isinstance(module, compiled):
            module = cast(nn.Module, module._orig_mod)
        else:
            return module
    return module


_FSDP1_SEEN: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _is_fsdp1(module: nn.Module) -> bool:
    """Holds an FSDP1 wrapper anywhere (remembered per module: a push must
    not walk a large module tree every step)."""
    fsdp1 = _module_type(
        "torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"
    )
    if fsdp1 is None:
        return False
    found = _FSDP1_SEEN.get(module)
    if found is None:
        found = any(isinstance(m, fsdp1) for m in module.modules())
        _FSDP1_SEEN[module] = found
    return found


@contextlib.contextmanager
def _fsdp1_sharded(module: nn.Module) -> Iterator[None]:
    """``SHARDED_STATE_DICT`` for the duration, the previous type after."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(module, StateDictType.SHARDED_STATE_DICT):
        yield


def local_state(obj: nn.Module | Mapping[str, Any], *, rank: int, world_size: int) -> LocalState:
    """The parts of ``obj`` this process holds.

    ``rank`` and ``world_size`` are the pusher's: plain tensors (DDP
    replicas, FSDP buffers, a plain module in a multi-rank run) are split
    between the run's ranks along dim 0.
    """
    if isinstance(obj, nn.Module):
        module = unwrap(obj)
        if _is_fsdp1(module):
            # FSDP1 builds ShardedTensors from its flat parameters; the
            # local shards are copies, so changes are loaded back.
            with _fsdp1_sharded(module):
                sd = module.state_dict()
            parts = list(_parts_of_dict(sd, rank, world_size, strip_module=False))

            def commit(module: nn.Module = module, sd: dict[str, Any] = sd) -> None:
                with _fsdp1_sharded(module):
                    module.load_state_dict(sd)

            return LocalState(parts, commit)
        sd = module.state_dict()
        return LocalState(list(_parts_of_dict(sd, rank, world_size, strip_module=False)))
    if isinstance(obj, Mapping):
        return LocalState(list(_parts_of_dict(obj, rank, world_size, strip_module=True)))
    raise TypeError(f"push takes an nn.Module or a state dict, not {type(obj).__name__}")


def _parts_of_dict(
    sd: Mapping[str, Any], rank: int, world_size: int, *, strip_module: bool
) -> Iterator[LocalPart]:
    keys = list(sd)
    # A DDP state dict saved as is: every key under `module.` (as torch's
    # consume_prefix_in_state_dict_if_present decides).
    drop_module = strip_module and bool(keys) and all(k.startswith("module.") for k in keys)
    dtensor = _dtensor_type()
    sharded = _sharded_tensor_type()
    for key in keys:
        value = sd[key]
        name = canonical_name(key[len("module.") :] if drop_module else key)
        if dtensor is not None and isinstance(value, dtensor):
            yield _dtensor_part(name, value)
        elif sharded is not None and isinstance(value, sharded):
            part = _sharded_tensor_part(name, value)
            if part is not None:
                yield part
        elif isinstance(value, torch.Tensor):
            t = value.detach()
            yield LocalPart(name, t, tuple(t.shape), (0,) * t.dim(), (rank, world_size))
        # Anything else (extra state, metadata) is not a tensor to average.


def _dtensor_part(name: str, t: Any) -> LocalPart:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = t.device_mesh
    placements = tuple(t.placements)
    for p in placements:
        if p.is_partial():
            raise PolyakError(
                f"`{name}` is a DTensor with a Partial placement; redistribute it first",
                code="unsupported_placement",
            )
        if type(p).__name__ == "_StridedShard":
            raise PolyakError(
                f"`{name}` uses strided sharding ({p}), whose local rows are not one "
                "rectangular chunk; push the tensor after redistributing it",
                code="unsupported_placement",
            )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise PolyakError(f"this rank is not in the device mesh of `{name}`", code="not_in_mesh")
    shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    local = t.to_local().detach()
    if tuple(local.shape) != tuple(shape):
        raise PolyakError(
            f"`{name}`: local tensor {list(local.shape)} but torch computes {list(shape)}",
            code="unsupported_placement",
        )
    index, count = 0, 1
    for dim, p in enumerate(placements):
        if p.is_replicate():
            size = mesh.size(dim)
            index = index * size + coordinate[dim]
            count *= size
    return LocalPart(
        name,
        local,
        tuple(t.shape),
        tuple(int(o) for o in offsets),
        (index, count),
        sharded=any(p.is_shard() for p in placements),
    )


def _sharded_tensor_part(name: str, t: Any) -> LocalPart | None:
    global_shape = tuple(int(d) for d in t.metadata().size)
    shards = sorted(t.local_shards(), key=lambda s: tuple(s.metadata.shard_offsets))
    if not shards:
        if not global_shape:
            return None
        # This rank holds no rows (an uneven split); it pushes an empty chunk
        # so that every rank has the same names.
        dtype = t.metadata().tensor_properties.dtype
        empty = torch.empty((0, *global_shape[1:]), dtype=dtype)
        return LocalPart(
            name,
            empty,
            global_shape,
            (global_shape[0],) + (0,) * (len(global_shape) - 1),
            sharded=True,
        )
    if len(shards) > 1:
        # Several local shards: one chunk only if they follow each other along dim 0.
        first = shards[0].metadata
        row = first.shard_offsets[0]
        for s in shards:
            md = s.metadata
            if (
                md.shard_offsets[0] != row
                or list(md.shard_offsets[1:]) != list(first.shard_offsets[1:])
                or list(md.shard_sizes[1:]) != list(first.shard_sizes[1:])
            ):
                raise PolyakError(
                    f"`{name}` has {len(shards)} local shards that are not one contiguous chunk",
                    code="unsupported_placement",
                )
            row += md.shard_sizes[0]
        local = torch.cat([s.tensor.detach() for s in shards])
        return LocalPart(
            name, local, global_shape, tuple(int(o) for o in first.shard_offsets), sharded=True
        )
    md = shards[0].metadata
    return LocalPart(
        name,
        shards[0].tensor.detach(),
        global_shape,
        tuple(int(o) for o in md.shard_offsets),
        sharded=True,
    )


def split_range(n: int, index: int, count: int) -> tuple[int, int]:
    """``(start, size)`` of part ``index`` of ``count`` of ``n`` rows, as
    ``torch.tensor_split`` divides them (the first ``n % count`` get one more)."""
    q, r = divmod(n, count)
    start = index * q + min(index, r)
    return start, q + (1 if index < r else 0)


def matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def push_pieces(parts: Sequence[LocalPart], skip: Sequence[str] = ()) -> list[Piece]:
    """What this process pushes: each part, minus skipped names, with
    replicated data split between its holders."""
    pieces: list[Piece] = []
    for part in parts:
        if skip and matches(part.name, skip):
            continue
        tensor, offsets = part.tensor, part.offsets
        index, count = part.replica
        split = False
        if count > 1:
            if tensor.dim() == 0:
                if index != 0:
                    continue  # a scalar: held by the first replica only
            else:
                start, size = split_range(tensor.shape[0], index, count)
                tensor = tensor.narrow(0, start, size)
                offsets = (offsets[0] + start, *offsets[1:])
                split = True
        # A name is a chunk on every rank or whole on every rank (the server
        # refuses a mix when it assembles a snapshot): a rank that holds all
        # of a sharded or split tensor (one row split over two ranks) still
        # says where its chunk sits.
        chunked = part.sharded or split or tuple(tensor.shape) != part.global_shape
        chunk = Chunk(part.global_shape, tuple(offsets)) if chunked else None
        pieces.append(Piece(part.name, tensor, chunk))
    return pieces


def tied_pieces(pieces: Sequence[Piece]) -> tuple[list[Piece], dict[str, str]]:
    """Pieces that are the same tensor under several names (tied weights:
    HF's ``lm_head.weight`` and ``transformer.wte.weight``) are pushed once:
    returns the pieces to push and ``{alias: pushed name}`` for the rest.
    Only exact views count (same memory, shape, strides, dtype, chunk), so
    a tensor that merely overlaps another is pushed as itself."""
    first: dict[tuple[Any, ...], str] = {}
    kept: list[Piece] = []
    aliases: dict[str, str] = {}
    for p in pieces:
        t = p.tensor
        if t.numel() == 0:
            kept.append(p)
            continue
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), p.chunk)
        if key in first:
            aliases[p.name] = first[key]
        else:
            first[key] = p.name
            kept.append(p)
    return kept, aliases


def _overlap(
    dst: torch.Tensor, dst_offsets: Sequence[int], src: torch.Tensor, src_offsets: Sequence[int]
) -> tuple[tuple[slice, ...], tuple[slice, ...], int] | None:
    dst_idx, src_idx, numel = [], [], 1
    for d in range(dst.dim()):
        lo = max(dst_offsets[d], src_offsets[d])
        hi = min(dst_offsets[d] + dst.shape[d], src_offsets[d] + src.shape[d])
        if hi <= lo:
            return None
        dst_idx.append(slice(lo - dst_offsets[d], hi - dst_offsets[d]))
        src_idx.append(slice(lo - src_offsets[d], hi - src_offsets[d]))
        numel *= hi - lo
    return tuple(dst_idx), tuple(src_idx), numel


def copy_into_parts(
    parts: Sequence[LocalPart],
    sources: Iterable[tuple[dict[str, torch.Tensor], Mapping[str, Chunk]]],
) -> list[str]:
    """Copies every overlap between the EMA chunks in ``sources`` (one
    ``(tensors, chunks)`` per fetched rank file) and the regions the
    ``parts`` cover. Returns the names of parts not fully covered."""
    by_name: dict[str, list[tuple[torch.Tensor, tuple[int, ...]]]] = {}
    for tensors, chunks in sources:
        for name, t in tensors.items():
            chunk = chunks.get(name)
            offsets = chunk.offsets if chunk is not None else (0,) * t.dim()
            by_name.setdefault(name, []).append((t, tuple(offsets)))
    missing: list[str] = []
    with torch.no_grad():
        for part in parts:
            dst = part.tensor
            need = dst.numel()
            got = 0
            for src, src_offsets in by_name.get(part.name, []):
                if dst.dim() == 0:
                    if src.dim() == 0:
                        dst.copy_(src)
                        got = 1
                    continue
                hit = _overlap(dst, part.offsets, src, src_offsets)
                if hit is None:
                    continue
                dst_idx, src_idx, n = hit
                dst[dst_idx].copy_(src[src_idx])
                got += n
            if got < need:
                missing.append(part.name)
    return missing


def assemble(
    files: Iterable[tuple[dict[str, torch.Tensor], Mapping[str, Chunk]]],
) -> dict[str, torch.Tensor]:
    """Whole tensors from rank files (each ``(tensors, chunks)``): chunks are
    placed by their offsets and must tile each tensor exactly once."""
    whole: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    order: list[str] = []
    for tensors, chunks in files:
        for name, t in tensors.items():
            chunk = chunks.get(name)
            if chunk is None:
                if name not in whole:
                    order.append(name)
                    whole[name] = t.clone()
                    covered[name] = torch.ones(t.shape, dtype=torch.bool)
                continue
            if name not in whole:
                order.append(name)
                whole[name] = torch.empty(chunk.global_shape, dtype=t.dtype)
                covered[name] = torch.zeros(chunk.global_shape, dtype=torch.bool)
            if t.numel() == 0:
                continue
            region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, t.shape, strict=True))
            if bool(covered[name][region].any()):
                raise PolyakError(f"chunks of `{name}` overlap", code="invalid_shards")
            whole[name][region] = t
            covered[name][region] = True
    for name, mask in covered.items():
        if not bool(mask.all()):
            raise PolyakError(
                f"chunks of `{name}` cover {int(mask.sum())} of {mask.numel()} elements",
                code="invalid_shards",
            )
    return {name: whole[name] for name in order}
