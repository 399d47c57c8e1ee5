"""The download's query: ``max_shard_size`` as transformers spells it, and
a bad value of any query parameter named in its ``400 invalid_query``.

``max_shard_size`` takes what ``save_pretrained(max_shard_size=...)``
takes (``"500KB"``, ``"5GB"``, ``"5GiB"``, ``"5Gb"`` in bits) and plain
bytes; each form gives the shards that its size in bytes, as
``transformers.utils.convert_file_size_to_int`` computes it in this test,
gives."""

from __future__ import annotations

import io
import json
import tarfile

import httpx
import pytest
import torch
from transformers.utils.hub import convert_file_size_to_int

#: Five tensors of 1 to 5 KiB (float32): small sizes give several shards.
TENSORS = {f"layer{i}.weight": torch.full((256 * i,), float(i)) for i in range(1, 6)}


@pytest.fixture(scope="module")
def snapshot(server):
    import polyak

    with polyak.Client(server.url) as client:
        run = client.create_run("shard-sizes", world_size=1)
        with run.pusher(0) as pusher:
            pusher.push(TENSORS, 0)
            pusher.flush()
        snap = run.snapshot()
        yield client, run, snap


def get(client, run, snap, **params) -> httpx.Response:
    return httpx.get(f"{client.url}{run.path}/snapshots/{snap.id}/download", params=params)


def shards(client, run, snap, **params) -> tuple[dict[str, str], dict[str, int]]:
    """The HF index's weight map and each shard file's size."""
    r = get(client, run, snap, layout="hf", **params)
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        index = json.load(tar.extractfile("model.safetensors.index.json"))
        sizes = {m.name: m.size for m in tar.getmembers() if m.name.endswith(".safetensors")}
    return index["weight_map"], sizes


@pytest.mark.parametrize(
    "size", ["5KB", "5kb", "5Kb", "2KiB", "2kib", "3KB", "1_0KB", " 4 KB", "0MB", "1MB", "1Mb"]
)
def test_max_shard_size_in_transformers_forms(snapshot, size):
    client, run, snap = snapshot
    bytes_ = convert_file_size_to_int(size)
    assert isinstance(bytes_, int)
    want = shards(client, run, snap, max_shard_size=str(bytes_))
    assert shards(client, run, snap, max_shard_size=size) == want
    # layout=full with the size set: the same shards.
    r = get(client, run, snap, layout="full", max_shard_size=size)
    assert r.status_code == 200
    weight_map, _ = want
    assert set(weight_map) == set(TENSORS)


def test_sizes_shard_as_their_bytes(snapshot):
    """The forms are told apart: 6KB, 6KiB and 6Kb give different shards."""
    client, run, snap = snapshot
    counts = {
        s: len(shards(client, run, snap, max_shard_size=s)[1]) for s in ("6KB", "6KiB", "6Kb")
    }
    # Tensors of 1, 2, 3, 4, 5 KiB packed in order: 6000 B holds 1+2 KiB
    # (3 no longer fits), 6144 B holds 1+2+3 KiB, 750 B holds one each.
    assert counts == {"6KB": 4, "6KiB": 3, "6Kb": 5}, counts


@pytest.mark.parametrize(
    ("params", "field", "value"),
    [
        ({"layout": "hf", "max_shard_size": "500XB"}, "max_shard_size", "500XB"),
        ({"layout": "hf", "max_shard_size": "5.5GB"}, "max_shard_size", "5.5GB"),
        ({"layout": "hf", "max_shard_size": "-5GB"}, "max_shard_size", "-5GB"),
        ({"layout": "hf", "max_shard_size": "abc"}, "max_shard_size", "abc"),
        ({"layout": "rank", "rank": "first"}, "rank", "first"),
    ],
)
def test_a_bad_query_value_is_named(snapshot, params, field, value):
    client, run, snap = snapshot
    r = get(client, run, snap, **params)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "invalid_query"
    assert error["field"] == field
    assert f"{field}=`{value}`" in error["message"], error["message"]


def test_every_query_names_its_bad_parameter(snapshot):
    """Another route's query: the same error, naming its parameter."""
    client, run, _ = snapshot
    r = httpx.get(f"{client.url}{run.path}/metrics", params={"limit": "many"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["code"], error["field"]) == ("invalid_query", "limit")
    assert "limit=`many`" in error["message"], error["message"]
