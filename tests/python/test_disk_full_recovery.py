"""The embedded catalog recovers by itself after a full disk.

With the data dir on a small tmpfs filled to the last byte while pushes
apply and snapshots and state are written, SQLite's writes fail (its WAL
cannot grow). Once the space is freed the node serves pushes, snapshots
and every catalog read again within seconds, with no restart: a write that
failed rolled back, the connection that saw it is replaced, and the WAL is
checkpointed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from polyak_testing import PolyakServer


def body(step: int) -> bytes:
    g = torch.Generator().manual_seed(step)
    return safetensors.torch.save({"w": torch.randn(256 * 1024, generator=g)})  # 1 MiB


@pytest.fixture()
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs for a real full disk")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"mount failed: {made.stderr!r}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> Path:
    filler = path / "filler"
    chunk = b"\0" * (1 << 16)
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(chunk)
            f.flush()
    return filler


def test_the_catalog_serves_again_once_space_is_freed(small_disk):
    srv = PolyakServer(small_disk / "data", "--disk-reserve", "0")
    srv.start()
    run = "full"
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = c.post("/v1/runs", json={"name": run, "world_size": 1, "persist_every_secs": 1})
            assert r.status_code == 201, r.text
            step = 0
            for _ in range(3):
                assert c.put(f"/v1/runs/{run}/ranks/0/steps/{step}", content=body(step)).is_success
                step += 1
            filler = fill(small_disk)
            # Work while the disk is full: pushes, snapshots, state writes,
            # events, annotations. Some fail; none may wedge the catalog.
            t0 = time.monotonic()
            while time.monotonic() - t0 < 6:
                c.put(f"/v1/runs/{run}/ranks/0/steps/{step}", content=body(step))
                step += 1
                c.post(f"/v1/runs/{run}/snapshots", json={})
                c.patch(f"/v1/runs/{run}", json={"note": f"full {step}"})
                time.sleep(0.2)
            filler.unlink()
            freed = time.monotonic()
            # Within 10 s of freeing: a push applies, a snapshot completes,
            # catalog reads and writes answer, readiness is ok.
            ok = False
            last = None
            while time.monotonic() - freed < 10 and not ok:
                try:
                    r = c.put(f"/v1/runs/{run}/ranks/0/steps/{step}", content=body(step))
                    step += 1
                    note = c.patch(f"/v1/runs/{run}", json={"note": "space again"})
                    snap = c.post(f"/v1/runs/{run}/snapshots", json={})
                    last = (r.status_code, note.status_code, snap.status_code, snap.text[:300])
                    if r.is_success and note.is_success and snap.status_code == 202:
                        sid = snap.json()["id"]
                        deadline = time.monotonic() + 5
                        while time.monotonic() < deadline:
                            got = c.get(f"/v1/runs/{run}/snapshots/{sid}")
                            last = (got.status_code, got.text[:300])
                            if got.is_success and got.json()["status"] == "complete":
                                ok = True
                                break
                            time.sleep(0.1)
                except httpx.HTTPError as e:
                    last = repr(e)
                if not ok:
                    time.sleep(0.5)
            assert ok, (
                f"not serving {time.monotonic() - freed:.1f} s after space came back: {last}\n"
                + "".join(srv.log[-40:])
            )
            ready = c.get("/readyz")
            assert ready.status_code == 200, ready.text
            # And it stays so: the catalog answers reads.
            assert c.get(
                f"/v1/runs/{run}/events", headers={"Accept": "application/json"}
            ).is_success
    finally:
        srv.stop()
