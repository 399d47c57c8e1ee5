"""The EMA on a GPU (``--device cuda``): updates on the device from fp32
and bf16 bodies (host-to-device staging), a cut captured on the device and
downloaded, a restart restoring every rank onto the device, runs placed
on each visible GPU and one run's ranks spread over two (``--devices``). Checked against ``AveragedModel`` references computed
in the test on the CPU.

Skipped, with the reason, where torch sees no CUDA device; ``scripts/gpu-check``
runs this file (and the benchmark's ``--device cuda`` rows) on a GPU machine.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from polyak import Client
from polyak_testing import PolyakServer
from polyak_testing.refs import EmaTrainer, rel_err
from shardsim import check_rank_emas, push_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: scripts/gpu-check runs these on a GPU machine",
)

WORLD = 2
BETAS = {"ema": 0.8, "slow": 0.95}
# The device's lerp may round differently from the CPU's in the last place.
RTOL = 1e-5


def check_live(client: httpx.Client, run: str, want: dict, online: dict) -> None:
    """Every rank's live EMA, from its engine, equals its chunk of the reference."""
    check_rank_emas(client, run, WORLD, want, online, rtol=RTOL)


def create(c: httpx.Client, name: str, device: str) -> None:
    r = c.post(
        "/v1/runs",
        json={
            "name": name,
            "world_size": WORLD,
            "device": device,
            "persist_every_secs": 0,
            "profiles": [{"name": n, "kind": "constant", "beta": b} for n, b in BETAS.items()],
        },
    )
    assert r.status_code == 201, r.text


def test_ema_on_the_gpu_from_fp32_and_bf16_bodies_snapshot_and_restore(tmp_path):
    srv = PolyakServer(tmp_path / "data", "--device", "cuda", "--devices", "cuda:0")
    srv.start()
    try:
        trainers = {"fp32": EmaTrainer(1, BETAS), "bf16": EmaTrainer(2, BETAS, cast=torch.bfloat16)}
        last = {}
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            for name in trainers:
                create(c, name, "cuda")
                place = c.get(f"/v1/runs/{name}/placement").json()
                assert {p["device"] for p in place.values()} == {"cuda:0"}, place
            for step in range(1, 9):
                for name, tr in trainers.items():
                    online = tr.step()
                    push_ranks(c, name, step, online, WORLD)
                    last[name] = online
            for name, tr in trainers.items():
                check_live(c, name, tr.want(), last[name])
            # A cut captured on the device, downloaded whole.
            with Client(srv.url) as pc:
                snap = pc.run("fp32").snapshot(wait=True)
                full = pc.run("fp32").download(snap, profile="slow", progress=False)
            for k, w in trainers["fp32"].want()["slow"].items():
                if w.is_floating_point():
                    assert rel_err(full[k], w) <= RTOL, k
        # Restart: every rank is restored onto the device; pushing goes on.
        srv.restart()
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            for name, tr in trainers.items():
                check_live(c, name, tr.want(), last[name])
                for step in (9, 10):
                    last[name] = tr.step()
                    push_ranks(c, name, step, last[name], WORLD)
                check_live(c, name, tr.want(), last[name])
    finally:
        srv.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_runs_are_placed_on_each_gpu(tmp_path):
    """A run on ``cuda:N`` stays on that GPU; a run on ``cuda`` has its
    ranks spread over every GPU of ``--devices`` (one engine each)."""
    srv = PolyakServer(tmp_path / "data", "--device", "cuda", "--devices", "cuda:0,cuda:1")
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            trainers, last = {}, {}
            for i in range(2):
                name = f"gpu{i}"
                create(c, name, f"cuda:{i}")
                place = c.get(f"/v1/runs/{name}/placement").json()
                assert {p["device"] for p in place.values()} == {f"cuda:{i}"}
                trainers[name] = EmaTrainer(10 + i, BETAS)
            create(c, "spread", "cuda")
            place = c.get("/v1/runs/spread/placement").json()
            assert sorted(p["device"] for p in place.values()) == ["cuda:0", "cuda:1"], place
            trainers["spread"] = EmaTrainer(12, BETAS)
            for step in range(1, 5):
                for name, tr in trainers.items():
                    last[name] = tr.step()
                    push_ranks(c, name, step, last[name], WORLD)
            for name, tr in trainers.items():
                check_live(c, name, tr.want(), last[name])
    finally:
        srv.stop()
