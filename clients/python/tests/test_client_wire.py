"""The push body writer, the reader, and the shard bookkeeping, without a server."""

from __future__ import annotations

import json
import struct

import polyak
import pytest
import safetensors.torch
import torch
from polyak.shards import canonical_name, local_state, push_pieces, split_range
from polyak.wire import HostBody, TensorSpec, WireLayout, parse_chunks, read_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=g),
        "half": torch.randn(7, generator=g).half(),
        "steps": torch.tensor(12345678901, dtype=torch.int64),
        "b.bias": torch.randn(4, generator=g).bfloat16(),
        "mask": torch.rand(2, 3, generator=g) > 0.5,
        "bytes": torch.arange(5, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
        "double": torch.randn(2, generator=g, dtype=torch.float64),
        "counts": torch.arange(3, dtype=torch.int32),
    }


def test_body_is_a_safetensors_file_grouped_by_dtype_and_aligned():
    tensors = _tensors()
    chunk = polyak.Chunk((9, 5), (6, 0))
    specs = [
        TensorSpec(k, v.dtype, tuple(v.shape), chunk if k == "a.weight" else None)
        for k, v in tensors.items()
    ]
    layout = WireLayout(specs)
    body = HostBody(layout)
    body.fill(list(tensors.values()))
    data = bytes(body.memory)
    assert len(data) == layout.nbytes
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0
    header = json.loads(data[8 : 8 + n])
    # Data order: 8-byte dtypes, then 4, 2, 1; inside a size, a fixed dtype
    # order (floats first), each dtype in the state-dict order.
    order = [k for k in header if k != "__metadata__"]
    starts = [header[k]["data_offsets"][0] for k in order]
    assert starts == sorted(starts)
    assert order == [
        "double", "steps", "a.weight", "empty", "counts", "half", "b.bias", "bytes", "mask"
    ]  # fmt: skip
    for k in order:
        start = 8 + n + header[k]["data_offsets"][0]
        assert start % tensors[k].element_size() == 0
    loaded = safetensors.torch.load(data)
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    got, meta = read_safetensors(data)
    assert parse_chunks(meta) == {"a.weight": chunk}
    assert torch.equal(got["steps"], tensors["steps"])

    # Refilled with new values: same header, new data; same values, same bytes.
    new = {k: (v + 1 if v.dtype != torch.bool else ~v) for k, v in tensors.items()}
    body.fill(list(new.values()))
    assert bytes(body.memory)[: 8 + n] == data[: 8 + n]
    assert torch.equal(safetensors.torch.load(bytes(body.memory))["half"], new["half"])
    body.fill(list(tensors.values()))
    assert bytes(body.memory) == data


def test_cast_on_copy_and_unsupported_dtypes():
    w = torch.randn(4, 4)
    layout = WireLayout([TensorSpec("w", torch.bfloat16, (4, 4))])
    body = HostBody(layout)
    body.fill([w])
    assert torch.equal(safetensors.torch.load(bytes(body.memory))["w"], w.bfloat16())
    with pytest.raises(polyak.PolyakError) as e:
        WireLayout([TensorSpec("z", torch.complex64, (2,))])
    assert e.value.code == "unsupported_dtype" and "`z`" in e.value.message
    with pytest.raises(polyak.PolyakError):
        WireLayout([])


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_split_range_matches_tensor_split(count):
    for n in range(10):
        pieces = torch.tensor_split(torch.arange(n), count)
        for i, piece in enumerate(pieces):
            start, size = split_range(n, i, count)
            assert size == len(piece)
            if size:
                assert start == int(piece[0])


def test_names_and_replicated_tensors():
    assert canonical_name("_orig_mod.block._fsdp_wrapped_module.fc.weight") == "block.fc.weight"
    assert canonical_name("layers.0._checkpoint_wrapped_module.w") == "layers.0.w"
    sd = {"module.w": torch.arange(10.0).reshape(5, 2), "module.n": torch.tensor(3)}
    pieces = {
        r: {p.name: p for p in push_pieces(local_state(sd, rank=r, world_size=2).parts)}
        for r in (0, 1)
    }
    assert set(pieces[0]) == {"w", "n"} and set(pieces[1]) == {"w"}
    assert pieces[0]["w"].chunk == polyak.Chunk((5, 2), (0, 0))
    assert pieces[1]["w"].chunk == polyak.Chunk((5, 2), (3, 0))
    assert torch.equal(pieces[1]["w"].tensor, sd["module.w"][3:])
    assert pieces[0]["n"].chunk is None
    whole = polyak.assemble(
        [
            (
                {k: p.tensor for k, p in pieces[r].items()},
                {k: p.chunk for k, p in pieces[r].items() if p.chunk},
            )
            for r in (0, 1)
        ]
    )
    assert torch.equal(whole["w"], sd["module.w"]) and int(whole["n"]) == 3
    # skip globs
    kept = push_pieces(local_state(sd, rank=0, world_size=1).parts, skip=["*n"])
    assert [p.name for p in kept] == ["w"] and kept[0].chunk is None


def test_assemble_refuses_gaps_and_overlaps():
    a = torch.ones(2, 2)
    gap = [
        ({"w": a}, {"w": polyak.Chunk((5, 2), (0, 0))}),
        ({"w": a}, {"w": polyak.Chunk((5, 2), (3, 0))}),
    ]
    with pytest.raises(polyak.PolyakError, match="cover 8 of 10"):
        polyak.assemble(gap)
    overlap = [
        ({"w": a}, {"w": polyak.Chunk((3, 2), (0, 0))}),
        ({"w": a}, {"w": polyak.Chunk((3, 2), (1, 0))}),
    ]
    with pytest.raises(polyak.PolyakError, match="overlap"):
        polyak.assemble(overlap)
