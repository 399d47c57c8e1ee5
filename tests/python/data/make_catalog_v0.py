"""Writes ``catalog-v0/``: a data dir (SQLite catalog and snapshot files) made
by a polyak binary from before the catalog backends and ULID snapshot ids,
kept so that ``test_catalog.py`` checks a newer server reads it.

    POLYAK_BIN=<old polyak> python tests/python/data/make_catalog_v0.py

Run ``catalog-v0`` holds one rank with two float32 tensors pushed at steps
0..4 (values ``w_s = (s + 1) * base``) into a ``constant`` profile with
beta 0.5, a manual snapshot at step 2 and a state snapshot at step 4 (the
graceful stop); the test recomputes both EMAs itself.
"""

from __future__ import annotations

import io
import shutil
import sqlite3
import sys
from pathlib import Path

import httpx
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "clients" / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "clients" / "python-testing"))
from polyak_testing import PolyakServer

OUT = Path(__file__).resolve().parent / "catalog-v0"


def base() -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7.0,
        "b": torch.tensor([1.5, -2.25, 0.125], dtype=torch.float32),
    }


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    srv = PolyakServer(OUT).start()
    try:
        c = httpx.Client(base_url=srv.url, timeout=60)
        r = c.post(
            "/v1/runs",
            json={
                "name": "catalog-v0",
                "world_size": 1,
                "device": "cpu",
                "profiles": [{"name": "ema", "kind": "constant", "beta": 0.5}],
            },
        )
        r.raise_for_status()
        snap = c.post("/v1/runs/catalog-v0/snapshots", json={"step": 2, "label": "v0"}).json()
        for step in range(5):
            body = {k: v * (step + 1) for k, v in base().items()}
            buf = safetensors.torch.save(body)
            r = c.put(
                f"/v1/runs/catalog-v0/ranks/0/steps/{step}", content=io.BytesIO(buf).getvalue()
            )
            r.raise_for_status()
        r = c.get(f"/v1/runs/catalog-v0/snapshots/{snap['id']}")
        print(r.json()["status"], snap["id"])
    finally:
        srv.stop()
    db = sqlite3.connect(OUT / "polyak.db")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.execute("PRAGMA journal_mode=DELETE")
    db.close()
    for extra in ("polyak.db-wal", "polyak.db-shm"):
        (OUT / extra).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
