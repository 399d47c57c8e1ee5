"""Writes the files of `tests/data/format-v0/` with a real server.

Run from the repository root, with the binary to capture (`POLYAK_BIN`, else
`target/debug/polyak`) and the client importable:

    python tests/data/format-v0/produce.py tests/data/format-v0

It creates run `fmt` (world size 2, two constant profiles and an SWA one,
mirror on),
pushes three steps per rank (a keyframe, a delta, a full push) whose tensors
have a tied name, a copied integer tensor, a float16 tensor and a chunk of a
sharded tensor, takes a manual snapshot at step 2 and a `state` snapshot
(`POST .../persist`), stops the server, and copies out:

- `rows.json`: the catalog's `snapshot_files` rows of both snapshots (the
  `state` column verbatim, as the server wrote it) and their kinds;
- `manual.rank-00000.fast.safetensors`, `manual.rank-00000.__mirror__.safetensors`:
  two of the manual snapshot's part files, byte for byte;
- `expected.json`: the values pushed and the EMA torch computes from them
  (`AveragedModel`'s rule: copy the first, then lerp by 1 - beta).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import httpx
import safetensors.torch
import torch
from polyak_testing import PolyakServer

RUN = "fmt"
# name -> beta of a constant profile, or None for an equal-weight average.
PROFILES = {"fast": 0.5, "slow": 0.75, "avg": None}
STEPS = 3


def weights(rank: int, step: int) -> dict[str, torch.Tensor]:
    """The full weights of `rank` at `step`: exact in float16 and float32."""
    k = float(step + 1)
    r = float(rank)
    return {
        # Rows 2*rank..2*rank+2 of a [4, 3] tensor.
        "w": (torch.arange(6, dtype=torch.float32).reshape(2, 3) + 6 * r) * k / 8,
        "b": torch.tensor([1.5, -2.25, 0.125], dtype=torch.float32) * k + r,
        "h": (torch.arange(4, dtype=torch.float16) - 1.5) * k,
        "count": torch.tensor([step, 10 * rank + step], dtype=torch.int64),
    }


def metadata(rank: int, kind: str) -> dict[str, str]:
    return {
        "polyak.kind": kind,
        "polyak.shards": json.dumps({"w": {"global_shape": [4, 3], "offsets": [2 * rank, 0]}}),
        "polyak.aliases": json.dumps({"head": "w"}),
    }


def body(rank: int, step: int) -> bytes:
    now = weights(rank, step)
    if step == 1:
        # A delta: floating point tensors are added to the server's mirror.
        before = weights(rank, step - 1)
        delta = {n: (t - before[n]) if t.is_floating_point() else t for n, t in now.items()}
        return safetensors.torch.save(delta, metadata(rank, "delta"))
    return safetensors.torch.save(now, metadata(rank, "full"))


def ema(rank: int, beta: float | None) -> dict[str, torch.Tensor]:
    out = {n: t.to(torch.float32) for n, t in weights(rank, 0).items() if t.is_floating_point()}
    for step in range(1, STEPS):
        for n, t in weights(rank, step).items():
            if n in out:
                # SWA: the running mean, a lerp by 1 / (pushes so far).
                out[n].lerp_(t.to(torch.float32), 1 - beta if beta is not None else 1 / (step + 1))
    return out


def profile(name: str, beta: float | None) -> dict:
    if beta is None:
        return {"name": name, "kind": "swa"}
    return {"name": name, "kind": "constant", "beta": beta}


def wait_complete(c: httpx.Client, snapshot: str) -> None:
    deadline = time.monotonic() + 60
    while c.get(f"/v1/runs/{RUN}/snapshots/{snapshot}").json()["status"] != "complete":
        assert time.monotonic() < deadline, f"snapshot {snapshot} did not complete"
        time.sleep(0.1)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        srv = PolyakServer(data).start()
        try:
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                r = c.post(
                    "/v1/runs",
                    json={
                        "name": RUN,
                        "world_size": 2,
                        "device": "cpu",
                        "mirror": True,
                        "profiles": [profile(n, b) for n, b in PROFILES.items()],
                    },
                )
                assert r.status_code == 201, r.text
                for step in range(STEPS):
                    for rank in range(2):
                        r = c.put(
                            f"/v1/runs/{RUN}/ranks/{rank}/steps/{step}", content=body(rank, step)
                        )
                        assert r.status_code == 200, r.text
                r = c.post(f"/v1/runs/{RUN}/snapshots", json={"step": STEPS - 1})
                assert r.status_code == 202, r.text
                manual = r.json()["id"]
                wait_complete(c, manual)
                r = c.post(f"/v1/runs/{RUN}/persist")
                assert r.status_code == 200, r.text
                state = r.json()["snapshot"]
                wait_complete(c, state)
        finally:
            srv.stop()
        db = sqlite3.connect(data / "polyak.db")
        kinds = dict(db.execute("SELECT id, kind FROM snapshots"))
        rows = [
            dict(zip(("snapshot", "rank", "part", "path", "step", "state"), row, strict=True))
            for row in db.execute(
                "SELECT snapshot, rank, part, path, step, state FROM snapshot_files "
                "ORDER BY snapshot, rank, part"
            )
        ]
        db.close()
        rows = [row for row in rows if row["snapshot"] in (manual, state)]
        assert (kinds[manual], kinds[state]) == ("manual", "state"), kinds
        for row in rows:
            row["kind"] = kinds[row["snapshot"]]
        (out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
        for row in rows:
            if (
                row["snapshot"] == manual
                and row["rank"] == 0
                and row["part"] in ("fast", "__mirror__")
            ):
                shutil.copy(
                    data / row["path"], out / f"manual.rank-00000.{row['part']}.safetensors"
                )
    expected = {
        "run": RUN,
        "profiles": PROFILES,
        "last_step": STEPS - 1,
        "pushed": {
            str(rank): {n: t.tolist() for n, t in weights(rank, STEPS - 1).items()}
            for rank in range(2)
        },
        "ema": {
            str(rank): {
                p: {n: t.tolist() for n, t in ema(rank, b).items()} for p, b in PROFILES.items()
            }
            for rank in range(2)
        },
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
