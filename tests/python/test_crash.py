"""Crash recovery: kill -9 the server while snapshots are being written.

After every restart, each snapshot listed as complete downloads and matches
its recorded sha256, none is pending or half-written, and the ranks resume
from the newest restorable snapshot (and accept the next step). A graceful
stop persists the state, and a restart restores it exactly.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time

import httpx
import safetensors.torch
import torch

# Run on every catalog and store pair (see polyak_testing.plugin).
BACKEND_MATRIX = True

RUN = "crashy"
WORLD = 2


def body(step: int, rank: int) -> bytes:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return safetensors.torch.save(
        {
            "w": torch.randn(256, 512, generator=g),  # 512 KiB per rank and push
            "b": torch.randn(512, generator=g),
            "n": torch.tensor(step),
        }
    )


class Pusher(threading.Thread):
    """Pushes steps for both ranks until stopped; survives server deaths."""

    def __init__(self, url: str, start: int):
        super().__init__(daemon=True)
        self.url, self.step, self.stop = url, start, threading.Event()
        self.applied = 0

    def run(self):
        with httpx.Client(base_url=self.url, timeout=5) as c:
            while not self.stop.is_set():
                try:
                    for rank in range(WORLD):
                        r = c.put(
                            f"/v1/runs/{RUN}/ranks/{rank}/steps/{self.step}",
                            content=body(self.step, rank),
                        )
                        if r.status_code == 200 and r.json()["applied"]:
                            self.applied += 1
                    self.step += 1
                except httpx.HTTPError:
                    time.sleep(0.05)


def verify(c: httpx.Client, store) -> dict:
    """Every complete snapshot's parts match their recorded sha256, read
    through the API and straight from the store; nothing is pending,
    half-written, left over from an unlisted snapshot, or still uploading."""
    snaps = c.get(f"/v1/runs/{RUN}/snapshots").json()["snapshots"]
    assert all(s["status"] != "pending" for s in snaps), [
        s for s in snaps if s["status"] == "pending"
    ]
    complete = [s for s in snaps if s["status"] == "complete"]
    for s in complete:
        files = c.get(f"/v1/runs/{RUN}/snapshots/{s['id']}").json()["files"]
        assert files, s
        for f in files:
            r = c.get(
                f"/v1/runs/{RUN}/snapshots/{s['id']}/download",
                params={"layout": "rank", "rank": f["rank"], "profile": f["part"]},
            )
            assert r.status_code == 200, r.text
            assert hashlib.sha256(r.content).hexdigest() == f["sha256"], (s["id"], f)
            assert hashlib.sha256(store.read(f["path"])).hexdigest() == f["sha256"], f
            safetensors.torch.load(r.content)  # parses whole
    keys = store.keys("runs/")
    # Nothing half-written remains.
    assert not [k for k in keys if ".tmp" in k.rsplit("/", 1)[-1]], sorted(keys)
    listed = {s["id"] for s in complete}
    stored_ids = {
        k.split("/")[3]
        for k in keys
        if k.startswith(f"runs/{RUN}/snapshots/") and k.count("/") >= 4
    }
    assert stored_ids <= listed, stored_ids - listed
    # No multipart upload is left open.
    assert store.open_uploads() == [], store.open_uploads()
    return {"complete": complete, "snaps": snaps}


def test_kill_9_in_a_loop(fresh_server, backends):
    """Ten SIGKILLs at random points while pushes apply and snapshot parts
    are written (streamed to S3 on the ``-s3`` pairs)."""
    srv = fresh_server
    srv.start()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(
            "/v1/runs",
            json={
                "name": RUN,
                "world_size": WORLD,
                "mirror": True,
                "snapshot_every": 3,
                "persist_every_secs": 1,
                "retention": {"keep_last": 3},
                "profiles": [
                    {"name": "a", "kind": "constant", "beta": 0.9},
                    {"name": "b", "kind": "power", "sigma_rel": 0.1},
                ],
            },
        )
        assert r.status_code == 201, r.text
    rng = random.Random(1234)
    start = 0
    restored_any = False
    for i in range(10):
        pusher = Pusher(srv.url, start)
        pusher.start()
        time.sleep(rng.uniform(1.2, 2.5))
        srv.kill()  # SIGKILL at a random point of pushing and writing
        pusher.stop.set()
        pusher.join(10)
        srv.start(same_port=True)
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            seen = verify(c, backends.store_of(srv))
            ranks = c.get(f"/v1/runs/{RUN}/ranks").json()
            restorable = [s for s in seen["complete"]]
            if restorable:
                # Each rank from the snapshot holding its newest capture:
                # without a resume, its furthest step (never the snapshot
                # that happened to complete last).
                newest: dict[int, tuple[int, str]] = {}
                for snap in restorable:
                    files = c.get(f"/v1/runs/{RUN}/snapshots/{snap['id']}").json()["files"]
                    for f in files:
                        if f["step"] > newest.get(f["rank"], (-1, ""))[0]:
                            newest[f["rank"]] = (f["step"], snap["id"])
                want = {rank: step for rank, (step, _) in newest.items()}
                got = {x["rank"]: x["last_step"] for x in ranks if x["status"] == "live"}
                assert got == want, (i, newest, got, want)
                restored_any = True
                # The restored EMA is the snapshot's, byte for byte.
                for rank, (step, sid) in newest.items():
                    live = c.get(
                        f"/v1/runs/{RUN}/ranks/{rank}/ema", params={"profile": "a"}
                    ).content
                    stored = c.get(
                        f"/v1/runs/{RUN}/snapshots/{sid}/download",
                        params={"layout": "rank", "rank": rank, "profile": "a"},
                    ).content
                    assert safetensors.torch.load(live)["w"].equal(
                        safetensors.torch.load(stored)["w"]
                    )
                    assert int(safetensors.torch.load(live)["n"]) == step
            # Pushing goes on after the restored step.
            last = max([x["last_step"] or 0 for x in ranks] + [0])
            start = last + 1
            r = c.put(f"/v1/runs/{RUN}/ranks/0/steps/{start}", content=body(start, 0))
            assert r.status_code == 200 and r.json()["applied"], r.text
            r = c.put(f"/v1/runs/{RUN}/ranks/1/steps/{start}", content=body(start, 1))
            assert r.status_code == 200 and r.json()["applied"], r.text
            start += 1
    assert restored_any, "no snapshot completed in 10 rounds"


def test_graceful_stop_persists_and_restores_exactly(fresh_server):
    srv = fresh_server
    srv.start()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(
            "/v1/runs",
            json={"name": RUN, "world_size": WORLD, "persist_every_secs": 0, "mirror": True},
        )
        assert r.status_code == 201
        for step in range(7):
            for rank in range(WORLD):
                assert (
                    c.put(
                        f"/v1/runs/{RUN}/ranks/{rank}/steps/{step}", content=body(step, rank)
                    ).status_code
                    == 200
                )
        before = [c.get(f"/v1/runs/{RUN}/ranks/{rank}/ema").content for rank in range(WORLD)]
    srv.restart()  # SIGTERM: waits for requests, persists, exits
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        after = [c.get(f"/v1/runs/{RUN}/ranks/{rank}/ema").content for rank in range(WORLD)]
        assert before == after
        snaps = c.get(f"/v1/runs/{RUN}/snapshots", params={"kind": "state"}).json()["snapshots"]
        assert len(snaps) == 1 and snaps[0]["status"] == "complete"
        events = c.get(
            f"/v1/runs/{RUN}/events",
            headers={"Accept": "application/json"},
            params={"kinds": "restored"},
        ).json()
        assert events and events[-1]["detail"]["rank_steps"] == {"0": 6, "1": 6}
        # The same step with the same bytes is still a duplicate; the next applies.
        r = c.put(f"/v1/runs/{RUN}/ranks/0/steps/6", content=body(6, 0))
        assert r.json()["duplicate"] is True
        r = c.put(f"/v1/runs/{RUN}/ranks/0/steps/7", content=body(7, 0))
        assert r.json()["applied"] is True
