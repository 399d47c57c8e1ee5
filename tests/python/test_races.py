"""Requests racing on one run name answer the race, never a 5xx: two
creators, a deleter, a snapshotter, a persister and a pusher on one name
for a few seconds; a run deleted (or created again) under a request is 404
or 409. On each catalog and store pair."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import httpx
import safetensors.torch
import torch

# Run on every catalog and store pair (see polyak_testing.plugin).
BACKEND_MATRIX = True

SECONDS = float(os.environ.get("POLYAK_RACE_SECONDS", "6"))
RUN = "raced"
SPEC = {
    "name": RUN,
    "world_size": 1,
    "device": "cpu",
    "profiles": [{"name": "ema", "kind": "constant", "beta": 0.5}],
}
BODY = safetensors.torch.save({"w": torch.ones(256)})

# What each request may answer while the run comes and goes.
ALLOWED = {
    "create": {201, 409},
    "delete": {204, 404},
    "snapshot": {202, 404, 409},
    "persist": {200, 404, 409},
    "push": {200, 404, 409},
}
# A busy server may ask any of them to come back later.
for _allowed in ALLOWED.values():
    _allowed.add(429)


def test_races_on_one_run_name_never_answer_5xx(server):
    stop = time.monotonic() + SECONDS
    seen: dict[str, Counter] = {k: Counter() for k in ALLOWED}
    bad: list[tuple[str, int, str]] = []
    lock = threading.Lock()

    def loop(kind: str, send) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            step = 0
            while time.monotonic() < stop:
                try:
                    r = send(c, step)
                except httpx.RemoteProtocolError:
                    # A push refused before its body was read ends its
                    # connection; the client's next request on it finds it
                    # closed. Not an answer: counted, sent again.
                    with lock:
                        seen[kind]["closed"] += 1
                    continue
                step += 1
                with lock:
                    seen[kind][r.status_code] += 1
                    if r.status_code not in ALLOWED[kind]:
                        bad.append((kind, r.status_code, r.text[:300]))

    senders = {
        "create": lambda c, _: c.post("/v1/runs", json=SPEC),
        "delete": lambda c, _: c.delete(f"/v1/runs/{RUN}"),
        "snapshot": lambda c, _: c.post(f"/v1/runs/{RUN}/snapshots", json={}),
        "persist": lambda c, _: c.post(f"/v1/runs/{RUN}/persist"),
        "push": lambda c, step: c.put(f"/v1/runs/{RUN}/ranks/0/steps/{step}", content=BODY),
    }
    threads = [
        threading.Thread(target=loop, args=(kind, send))
        for kind, send in [("create", senders["create"]), *senders.items()]
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, (bad[:10], seen)
    # The race was run: the run was created and deleted over and over, and
    # requests on it both succeeded and found it gone.
    assert seen["create"][201] >= 2 and seen["delete"][204] >= 2, seen
    assert seen["snapshot"][202] + seen["persist"][200] >= 1, seen
    # The service is whole after it: a run of that name works end to end.
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.delete(f"/v1/runs/{RUN}")
        assert c.post("/v1/runs", json=SPEC).status_code == 201
        for step in range(2):
            r = c.put(f"/v1/runs/{RUN}/ranks/0/steps/{step}", content=BODY)
            assert r.status_code == 200, r.text
        r = c.get(f"/v1/runs/{RUN}")
        assert r.json()["last_step"] == 1
        assert c.delete(f"/v1/runs/{RUN}").status_code == 204
