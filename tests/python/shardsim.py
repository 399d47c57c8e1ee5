"""Rank chunks of a full state dict, as FSDP2 (``fully_shard``) lays them
out: ``torch.chunk`` along a dimension, so splits are uneven and trailing
ranks may hold zero rows. Used by the snapshot tests to push many ranks
from one process; the client tests run real FSDP.
"""

from __future__ import annotations

import json

import httpx
import safetensors.torch
import torch


def chunk_bounds(size: int, world: int, rank: int) -> tuple[int, int]:
    """``torch.chunk`` semantics: chunks of ceil(size / world)."""
    per = -(-size // world) if size else 0
    start = min(rank * per, size)
    return start, min(start + per, size)


def rank_chunks(
    state: dict[str, torch.Tensor], world: int, rank: int, dims: dict[str, int] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """This rank's chunk of every floating point tensor of rank >= 1 (along
    ``dims[name]``, default 0); other tensors whole (replicated)."""
    dims = dims or {}
    out: dict[str, torch.Tensor] = {}
    shards: dict[str, dict] = {}
    for name, t in state.items():
        if not t.is_floating_point() or t.dim() == 0:
            out[name] = t.contiguous()
            continue
        d = dims.get(name, 0)
        start, end = chunk_bounds(t.shape[d], world, rank)
        out[name] = t.narrow(d, start, end - start).contiguous()
        offsets = [0] * t.dim()
        offsets[d] = start
        shards[name] = {"global_shape": list(t.shape), "offsets": offsets}
    return out, shards


def push_ranks(
    client: httpx.Client,
    run: str,
    step: int,
    state: dict[str, torch.Tensor],
    world: int,
    ranks=None,
    dims: dict[str, int] | None = None,
) -> list[dict]:
    out = []
    for rank in range(world) if ranks is None else ranks:
        tensors, shards = rank_chunks(state, world, rank, dims)
        body = safetensors.torch.save(tensors, metadata={"polyak.shards": json.dumps(shards)})
        r = client.put(f"/v1/runs/{run}/ranks/{rank}/steps/{step}", content=body)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


def check_rank_emas(
    client: httpx.Client,
    run: str,
    world: int,
    want: dict[str, dict[str, torch.Tensor]],
    online: dict[str, torch.Tensor],
    rtol: float = 1e-6,
) -> None:
    """Every rank's live EMA of every profile in ``want`` (full reference
    state dicts) equals its chunk of the reference; tensors that are not
    averaged equal the rank's chunk of ``online``."""
    from polyak_testing.refs import rel_err

    for rank in range(world):
        copied, _ = rank_chunks(online, world, rank)
        for profile, full in want.items():
            r = client.get(f"/v1/runs/{run}/ranks/{rank}/ema", params={"profile": profile})
            assert r.status_code == 200, r.text
            got = safetensors.torch.load(r.content)
            chunk, _ = rank_chunks(full, world, rank)
            for k, w in chunk.items():
                if not w.is_floating_point():
                    assert torch.equal(got[k], copied[k]), (rank, profile, k)
                elif w.numel():
                    err = rel_err(got[k].float(), w)
                    assert err <= rtol, (rank, profile, k, err)
