"""Snapshots: consistent cuts, full/sharded/HF downloads, Range and dtype,
compare, resume. Ranks push FSDP2-style chunks (uneven ``Shard(0)`` splits,
a rank holding zero rows, one tensor split along dim 1)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import tarfile
import time

import httpx
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from polyak_testing import check_compare, wait_settled
from polyak_testing.refs import SmallNet, averaged_state, rel_err
from shardsim import push_ranks
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

# Run on every catalog and store pair (see polyak_testing.plugin).
BACKEND_MATRIX = True

WORLD = 2
DIMS = {"fc1.weight": 1}  # one tensor chunked along dim 1 (assembled, not streamed)


class TinyLM(SmallNet):
    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 8))  # one row: rank 1 holds zero rows

    def forward(self, idx):
        return super().forward(idx) + self.cls.mean()


class Trainer:
    def __init__(self, seed=0):
        torch.manual_seed(seed)
        self.model = TinyLM()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2)
        self.gen = torch.Generator().manual_seed(seed + 7)

    def step(self):
        idx = torch.randint(0, 40, (16, 6), generator=self.gen)
        target = torch.randint(0, 5, (16,), generator=self.gen)
        loss = nn.functional.cross_entropy(self.model(idx), target)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def state(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def checkpoint(self):
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "opt": {
                "state": {
                    k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
                    for k, s in self.opt.state_dict()["state"].items()
                },
                "param_groups": self.opt.state_dict()["param_groups"],
            },
            "gen": self.gen.get_state(),
        }

    def restore(self, ckpt):
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.gen.set_state(ckpt["gen"])


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def create(client, name, **extra):
    body = {
        "name": name,
        "world_size": WORLD,
        "profiles": [
            {"name": "ema", "kind": "constant", "beta": 0.8},
            {"name": "slow", "kind": "constant", "beta": 0.95},
        ],
        **extra,
    }
    r = client.post("/v1/runs", json=body)
    assert r.status_code == 201, r.text


def snapshot(client, run, **body):
    r = client.post(f"/v1/runs/{run}/snapshots", json=body)
    assert r.status_code == 202, r.text
    return r.json()


def download(client, run, sid, **params):
    r = client.get(f"/v1/runs/{run}/snapshots/{sid}/download", params=params)
    assert r.status_code == 200, r.text
    return r


def check_state(got, want, online, rtol=1e-6):
    assert set(got) == set(want), set(got) ^ set(want)
    for k, w in want.items():
        assert got[k].shape == w.shape, k
        if w.is_floating_point():
            assert rel_err(got[k], w) <= rtol, (k, rel_err(got[k], w))
        else:
            assert torch.equal(got[k], online[k]), k


def train_and_push(client, run, steps, trainer, refs, snap_at=()):
    """Pushes steps; returns {step: (reference EMA states, online state)} for ``snap_at``."""
    seen = {}
    for step in steps:
        trainer.step()
        state = trainer.state()
        push_ranks(client, run, step, state, WORLD, dims=DIMS)
        for r in refs.values():
            r.update_parameters(trainer.model)
        if step in snap_at:
            seen[step] = ({k: averaged_state(r) for k, r in refs.items()}, state)
    return seen


def make_refs(model):
    return {
        "ema": AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True),
        "slow": AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.95), use_buffers=True),
    }


def _dcp_load_worker(rank, world, ckpt_dir, shapes, out_path, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for name, (shape, dtype) in shapes.items():
        empty = torch.zeros(shape, dtype=dtype)
        sd[name] = (
            distribute_tensor(empty, mesh, [Shard(0)])
            if len(shape) >= 1 and dtype.is_floating_point
            else empty
        )
    dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(ckpt_dir))
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}
    if rank == 0:
        torch.save(full, out_path)
    dist.barrier()
    dist.destroy_process_group()


def test_snapshot_downloads_full_sharded_and_hf(client, tmp_path):
    run = "snap-dl"
    create(client, run)
    tr = Trainer(seed=3)
    refs = make_refs(tr.model)
    r = client.post(f"/v1/runs/{run}/snapshots", json={"step": 12, "label": "mid"})
    assert r.status_code == 202 and r.json()["step"] == 12 and r.json()["status"] == "pending"
    sid = r.json()["id"]
    seen = train_and_push(client, run, range(20), tr, refs, snap_at={12})
    s = wait_settled(client, run, sid)
    assert s["status"] == "complete", s
    assert s["label"] == "mid" and s["kind"] == "manual" and s["bytes"] > 0
    assert {(f["rank"], f["part"]) for f in s["files"]} == {
        (0, "ema"),
        (0, "slow"),
        (1, "ema"),
        (1, "slow"),
    }
    want, online = seen[12]
    model = TinyLM()
    for profile in ("ema", "slow"):
        full = safetensors.torch.load(download(client, run, sid, profile=profile).content)
        check_state(full, want[profile], online)
        model.load_state_dict(full, strict=True)

    # HF-style shards: a tar of model-0000k-of-0000n + index, same tensors.
    r = download(client, run, sid, profile="ema", layout="hf", max_shard_size=2000)
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = tar.getnames()
        index = json.load(tar.extractfile("model.safetensors.index.json"))
        merged = {}
        for n in names:
            if n.endswith(".safetensors"):
                merged.update(safetensors.torch.load(tar.extractfile(n).read()))
    shard_files = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(shard_files) > 1 and shard_files[0].startswith("model-00001-of-")
    assert set(index["weight_map"]) == set(want["ema"])
    check_state(merged, want["ema"], online)

    # Sharded: one file per rank with DCP_SHARDING_INFO; DCP reshards it.
    r = download(client, run, sid, profile="ema", layout="sharded")
    ckpt = tmp_path / "sharded"
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(ckpt, filter="data")
    assert sorted(os.listdir(ckpt)) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    # World size 1, no process group.
    sd = {k: torch.zeros_like(v) for k, v in want["ema"].items()}
    dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(str(ckpt)))
    check_state(sd, want["ema"], online)
    # World size 3, gloo, DTensors sharded along dim 0.
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in want["ema"].items()}
    out = tmp_path / "ws3.pt"
    mp.spawn(
        _dcp_load_worker,
        args=(3, str(ckpt), shapes, str(out), str(tmp_path / "init")),
        nprocs=3,
        join=True,
    )
    check_state(torch.load(out), want["ema"], online)


def test_consistent_cut_with_a_rank_ahead(client):
    run = "snap-cut"
    create(client, run, snapshot_timeout_secs=2)
    tr = Trainer(seed=4)
    refs = make_refs(tr.model)
    states = {}
    for step in range(11):
        tr.step()
        states[step] = tr.state()
        for r in refs.values():
            r.update_parameters(tr.model)
    # Rank 0 runs ahead to step 10, rank 1 is at step 4.
    for step in range(11):
        push_ranks(client, run, step, states[step], WORLD, ranks=[0], dims=DIMS)
    for step in range(5):
        push_ranks(client, run, step, states[step], WORLD, ranks=[1], dims=DIMS)
    # A snapshot at a step rank 0 already passed is refused at once.
    r = client.post(f"/v1/runs/{run}/snapshots", json={"step": 8})
    assert r.status_code == 409 and "rank 0" in r.json()["error"]["message"]
    # No step: the next update step after the furthest rank.
    snap = snapshot(client, run)
    assert snap["step"] == 11
    for step in range(5, 11):
        push_ranks(client, run, step, states[step], WORLD, ranks=[1], dims=DIMS)
    assert client.get(f"/v1/runs/{run}/snapshots/{snap['id']}").json()["status"] == "pending"
    tr.step()
    states[11] = tr.state()
    for r in refs.values():
        r.update_parameters(tr.model)
    want = {k: averaged_state(r) for k, r in refs.items()}
    push_ranks(client, run, 11, states[11], WORLD, ranks=[1], dims=DIMS)
    assert client.get(f"/v1/runs/{run}/snapshots/{snap['id']}").json()["status"] == "pending"
    # Rank 0 goes on past 11 only after applying it.
    push_ranks(client, run, 11, states[11], WORLD, ranks=[0], dims=DIMS)
    for step in range(12, 15):
        tr.step()
        push_ranks(client, run, step, tr.state(), WORLD, dims=DIMS)
    s = wait_settled(client, run, snap["id"])
    assert s["status"] == "complete", s
    assert {f["step"] for f in s["files"]} == {11}
    full = safetensors.torch.load(download(client, run, snap["id"], profile="slow").content)
    check_state(full, want["slow"], states[11])

    # A rank that never reaches the step fails the snapshot with a reason.
    late = snapshot(client, run, step=100)
    s = wait_settled(client, run, late["id"], timeout=15)
    assert s["status"] == "failed" and "did not reach" in s["reason"], s
    r = client.get(f"/v1/runs/{run}/snapshots/{late['id']}/download")
    assert r.status_code == 409 and r.json()["error"]["code"] == "snapshot_not_complete"


def test_compare_matches_torch(client):
    run = "snap-compare"
    create(client, run)
    tr = Trainer(seed=5)
    refs = make_refs(tr.model)
    a = snapshot(client, run, step=6)
    b = snapshot(client, run, step=14)
    train_and_push(client, run, range(20), tr, refs)
    for s in (a, b):
        assert wait_settled(client, run, s["id"])["status"] == "complete"
    full = {
        (sid, p): safetensors.torch.load(download(client, run, sid, profile=p).content)
        for sid in (a["id"], b["id"])
        for p in ("ema", "slow")
    }
    live = {p: averaged_state(refs[p]) for p in ("ema", "slow")}
    # Integer tensors are copied: the live value is the last pushed one.
    for p in live:
        live[p]["bn.num_batches_tracked"] = tr.state()["bn.num_batches_tracked"]
    r = client.get(f"/v1/runs/{run}/compare", params={"a": a["id"], "b": b["id"], "profile": "ema"})
    assert r.status_code == 200, r.text
    check_compare(r.json(), full[(a["id"], "ema")], full[(b["id"], "ema")])
    # Cached second answer is the same.
    assert (
        client.get(
            f"/v1/runs/{run}/compare", params={"a": a["id"], "b": b["id"], "profile": "ema"}
        ).json()
        == r.json()
    )
    r = client.get(f"/v1/runs/{run}/compare", params={"a": a["id"], "b": "live", "profile": "slow"})
    check_compare(r.json(), full[(a["id"], "slow")], live["slow"])
    r = client.get(
        f"/v1/runs/{run}/compare",
        params={"a": b["id"], "b": b["id"], "profile": "ema", "profile_b": "slow"},
    )
    check_compare(r.json(), full[(b["id"], "ema")], full[(b["id"], "slow")])
    assert r.json()["summary"]["rel_diff"] > 0
    r = client.get(f"/v1/runs/{run}/compare", params={"a": "nope", "b": "live"})
    assert r.status_code == 404


def test_range_etag_and_dtype(client):
    run = "snap-range"
    create(client, run)
    tr = Trainer(seed=6)
    refs = make_refs(tr.model)
    s = snapshot(client, run, step=4)
    train_and_push(client, run, range(6), tr, refs)
    assert wait_settled(client, run, s["id"])["status"] == "complete"
    url = f"/v1/runs/{run}/snapshots/{s['id']}/download"
    whole = client.get(url, params={"profile": "ema"})
    body = whole.content
    assert int(whole.headers["content-length"]) == len(body)
    assert whole.headers["accept-ranges"] == "bytes"
    digest = hashlib.sha256(body).hexdigest()
    rng = random.Random(0)
    pieces = []
    for _ in range(12):
        a = rng.randrange(len(body))
        b = rng.randrange(a, len(body))
        r = client.get(url, params={"profile": "ema"}, headers={"Range": f"bytes={a}-{b}"})
        assert r.status_code == 206
        assert r.headers["content-range"] == f"bytes {a}-{b}/{len(body)}"
        assert r.content == body[a : b + 1]
    # Reassembling the file from consecutive ranges gives the same sha256.
    for a in range(0, len(body), 777):
        pieces.append(
            client.get(
                url, params={"profile": "ema"}, headers={"Range": f"bytes={a}-{a + 776}"}
            ).content
        )
    assert hashlib.sha256(b"".join(pieces)).hexdigest() == digest
    r = client.get(url, params={"profile": "ema"}, headers={"Range": "bytes=-100"})
    assert r.content == body[-100:]
    r = client.get(url, params={"profile": "ema"}, headers={"Range": f"bytes={len(body)}-"})
    assert r.status_code == 416
    etag = whole.headers["etag"]
    r = client.get(url, params={"profile": "ema"}, headers={"If-None-Match": etag})
    assert r.status_code == 304
    # dtype=bf16 equals tensor.to(bfloat16); integer tensors are not cast.
    fp32 = safetensors.torch.load(body)
    bf16 = safetensors.torch.load(
        client.get(url, params={"profile": "ema", "dtype": "bf16"}).content
    )
    for k, v in fp32.items():
        if v.is_floating_point():
            assert bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], v.to(torch.bfloat16)), k
        else:
            assert torch.equal(bf16[k], v)
    fp16 = safetensors.torch.load(
        client.get(url, params={"profile": "ema", "dtype": "fp16"}).content
    )
    assert all(
        torch.equal(fp16[k], v.to(torch.float16)) for k, v in fp32.items() if v.is_floating_point()
    )
    # The stored rank file downloads as is and matches its recorded sha256.
    files = client.get(f"/v1/runs/{run}/snapshots/{s['id']}").json()["files"]
    for f in files:
        r = client.get(url, params={"layout": "rank", "rank": f["rank"], "profile": f["part"]})
        assert hashlib.sha256(r.content).hexdigest() == f["sha256"] and len(r.content) == f["bytes"]


def test_resume_after_a_trainer_crash_is_exact(client):
    run = "snap-resume"
    create(client, run)
    straight = Trainer(seed=8)
    refs = make_refs(straight.model)
    s20 = snapshot(client, run, step=20)
    s40 = snapshot(client, run, step=40)
    ckpt20 = None
    for step in range(41):
        straight.step()
        push_ranks(client, run, step, straight.state(), WORLD, dims=DIMS)
        for r in refs.values():
            r.update_parameters(straight.model)
        if step == 20:
            ckpt20 = straight.checkpoint()
    for s in (s20, s40):
        assert wait_settled(client, run, s["id"])["status"] == "complete"
    want = {p: averaged_state(r) for p, r in refs.items()}
    online40 = straight.state()
    # The trainer crashes and restarts from its own checkpoint at step 20.
    resumed = Trainer(seed=8)
    resumed.restore(ckpt20)
    # Step 25 would silently lose the updates of steps 21..25: refused.
    r = client.post(f"/v1/runs/{run}/resume", json={"step": 25})
    assert r.status_code == 409 and r.json()["error"]["code"] == "snapshot_older", r.text
    r = client.post(f"/v1/runs/{run}/resume", json={"step": 20})
    assert r.status_code == 200, r.text
    assert r.json()["snapshot"] == s20["id"] and r.json()["rank_steps"] == {"0": 20, "1": 20}
    ranks = client.get(f"/v1/runs/{run}/ranks").json()
    assert [x["last_step"] for x in ranks] == [20, 20]
    for step in range(21, 41):
        resumed.step()
        push_ranks(client, run, step, resumed.state(), WORLD, dims=DIMS)
    assert torch.equal(resumed.state()["fc2.weight"], online40["fc2.weight"])
    # The live EMA equals the run that never crashed, and its snapshot at 40.
    for p in ("ema", "slow"):
        check = client.get(
            f"/v1/runs/{run}/compare", params={"a": s40["id"], "b": "live", "profile": p}
        ).json()
        assert check["summary"]["max_abs_diff"] == 0.0, (p, check["summary"])
        full = safetensors.torch.load(download(client, run, s40["id"], profile=p).content)
        check_state(full, want[p], online40)
    r = client.post(f"/v1/runs/{run}/resume", json={"step": 5})
    assert r.status_code == 404 and r.json()["error"]["code"] == "snapshot_not_found"


def test_delete_and_retention(client):
    run = "snap-retain"
    create(client, run, snapshot_every=4, retention={"keep_last": 2, "keep_every": 8})
    tr = Trainer(seed=9)
    refs = make_refs(tr.model)
    train_and_push(client, run, range(21), tr, refs)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        snaps = client.get(f"/v1/runs/{run}/snapshots", params={"kind": "periodic"}).json()[
            "snapshots"
        ]
        if all(s["status"] == "complete" for s in snaps) and {s["step"] for s in snaps} == {
            0,
            8,
            16,
            20,
        }:
            break
        time.sleep(0.1)
    # keep_last=2 keeps 16 and 20; keep_every=8 also keeps 0 and 8; 4 and 12 go.
    assert {s["step"] for s in snaps} == {0, 8, 16, 20}, snaps
    victim = next(s for s in snaps if s["step"] == 8)
    r = client.delete(f"/v1/runs/{run}/snapshots/{victim['id']}")
    assert r.status_code == 204
    assert client.get(f"/v1/runs/{run}/snapshots/{victim['id']}").status_code == 404
    assert client.get(f"/v1/runs/{run}/snapshots/{victim['id']}/download").status_code == 404


def test_periodic_snapshots_skip_past_the_backlog(fresh_server):
    """With a backlog of one byte, one periodic cut at a time may hold
    captured state. While the cut at step 0 waits for rank 1, the cuts due
    at 2, 4, 6 and 8 are skipped: an event and a metric each, no catalog
    row, and no cut opened later for those steps when rank 1 reaches them.
    Once the cut at 0 is written, the next due cut (10) is taken again."""
    srv = fresh_server.start("--periodic-backlog", "1")
    run = "backlog"
    w = safetensors.torch.save({"w": torch.arange(1024, dtype=torch.float32)})
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/runs", json={"name": run, "world_size": 2, "snapshot_every": 2})
        assert r.status_code == 201, r.text

        def push(rank, steps):
            for s in steps:
                r = c.put(f"/v1/runs/{run}/ranks/{rank}/steps/{s}", content=w)
                assert r.status_code == 200 and r.json()["applied"], r.text

        def periodic():
            return c.get(f"/v1/runs/{run}/snapshots", params={"kind": "periodic"}).json()[
                "snapshots"
            ]

        def until_complete(steps):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                snaps = periodic()
                if {s["step"] for s in snaps if s["status"] == "complete"} == steps:
                    return snaps
                time.sleep(0.05)
            raise AssertionError(periodic())

        push(0, range(9))
        deadline = time.monotonic() + 10  # the catalog row is written off the push path
        while not periodic() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(s["step"], s["status"]) for s in periodic()] == [(0, "pending")]
        push(1, range(9))
        assert len(until_complete({0})) == 1
        skipped = c.get(
            f"/v1/runs/{run}/events",
            headers={"Accept": "application/json"},
            params={"kinds": "snapshot"},
        ).json()
        skipped = [e for e in skipped if e["detail"].get("status") == "skipped"]
        assert [e["step"] for e in skipped] == [2, 4, 6, 8], skipped
        assert all("backlog" in e["detail"]["reason"] for e in skipped), skipped
        metrics = c.get("/metrics").text
        assert f'polyak_periodic_snapshots_skipped_total{{run="{run}"}} 4' in metrics

        push(0, [9, 10])
        push(1, [9, 10])
        snaps = until_complete({0, 10})
        assert sorted(s["step"] for s in snaps) == [0, 10], snaps


def test_periodic_snapshots_default_backlog_takes_every_cut(fresh_server):
    """The default backlog (1 GiB) holds many small cuts: the same pushes
    take every periodic snapshot, and none is skipped."""
    srv = fresh_server.start()
    run = "no-backlog"
    w = safetensors.torch.save({"w": torch.arange(1024, dtype=torch.float32)})
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/runs", json={"name": run, "world_size": 2, "snapshot_every": 2})
        assert r.status_code == 201, r.text
        for rank in (0, 1):
            for s in range(9):
                r = c.put(f"/v1/runs/{run}/ranks/{rank}/steps/{s}", content=w)
                assert r.status_code == 200 and r.json()["applied"], r.text
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            snaps = c.get(f"/v1/runs/{run}/snapshots", params={"kind": "periodic"}).json()[
                "snapshots"
            ]
            if all(s["status"] == "complete" for s in snaps) and len(snaps) == 5:
                break
            time.sleep(0.05)
        assert sorted((s["step"], s["status"]) for s in snaps) == [
            (s, "complete") for s in (0, 2, 4, 6, 8)
        ], snaps
        assert (
            f'polyak_periodic_snapshots_skipped_total{{run="{run}"}}' not in c.get("/metrics").text
        )


def test_a_push_that_opens_a_periodic_cut_is_answered_once_it_is_listed(client, run_name):
    """A periodic cut is opened as a rank applies its step, and recorded in
    the catalog by the snapshot writer: the push is answered only once it
    is, so a script that lists the run's snapshots right after a push at a
    `snapshot_every` step finds that step's cut (an evaluation then goes to
    it, rather than to a snapshot of its own)."""
    r = client.post("/v1/runs", json={"name": run_name, "world_size": 1, "snapshot_every": 1})
    assert r.status_code == 201, r.text
    body = safetensors.torch.save({"w": torch.arange(4096, dtype=torch.float32)})
    for step in range(25):
        r = client.put(f"/v1/runs/{run_name}/ranks/0/steps/{step}", content=body)
        assert r.status_code == 200 and r.json()["applied"], r.text
        listed = client.get(f"/v1/runs/{run_name}/snapshots", params={"kind": "periodic"}).json()[
            "snapshots"
        ]
        assert step in {s["step"] for s in listed}, (step, listed)


def test_an_hf_download_changes_its_etag_with_the_model_config(client, run_name):
    """The same stored parts make a different `hf` file once the run's
    `model_config` changed (its `config.json` is in it): the ETag changes
    with it, so a resumed download (`If-Range` with the old ETag) gets the
    whole new file, never old bytes spliced into new ones."""
    create(client, run_name)
    w = safetensors.torch.save({"w": torch.arange(64, dtype=torch.float32)})
    for rank in range(WORLD):
        r = client.put(f"/v1/runs/{run_name}/ranks/{rank}/steps/0", content=w)
        assert r.status_code == 200, r.text
    sid = snapshot(client, run_name, step=0)["id"]
    wait_settled(client, run_name, sid)

    def hf(**headers):
        return client.get(
            f"/v1/runs/{run_name}/snapshots/{sid}/download",
            params={"profile": "ema", "layout": "hf"},
            headers=headers,
        )

    def configure(model_type):
        config = {"model_type": model_type, "hidden_size": 8}
        r = client.patch(f"/v1/runs/{run_name}", json={"model_config": config})
        assert r.status_code == 200, r.text

    configure("a")
    old = hf()
    assert old.status_code == 200, old.text
    configure("b")
    new = hf()
    assert new.status_code == 200, new.text
    assert new.content != old.content
    assert new.headers["etag"] != old.headers["etag"]
    resumed = hf(**{"If-Range": old.headers["etag"], "Range": "bytes=100-"})
    assert resumed.status_code == 200, resumed.status_code
    assert resumed.content == new.content
    same = hf(**{"If-Range": new.headers["etag"], "Range": "bytes=100-"})
    assert same.status_code == 206 and same.content == new.content[100:]
