"""Monitoring API: trainer metrics, the server's own series (EMA drift,
ingest), Server-Sent Events (content, ordering, resume, retention)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import safetensors.torch
import torch
from polyak_testing import read_sse


def push(c, run, rank, step, state):
    r = c.put(f"/v1/runs/{run}/ranks/{rank}/steps/{step}", content=safetensors.torch.save(state))
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture()
def mon(fresh_server):
    fresh_server.args = [
        "--metrics-retained",
        "50",
        "--events-retained",
        "30",
        "--prune-interval-secs",
        "1",
    ]
    fresh_server.start()
    with httpx.Client(base_url=fresh_server.url, timeout=30) as c:
        yield c


def test_metrics_post_and_get(mon):
    c = mon
    assert c.post("/v1/runs", json={"name": "m", "world_size": 2}).status_code == 201
    r = c.post("/v1/runs/m/metrics", json={"step": 0, "values": {"loss": 2.5, "lr": 1e-3}})
    assert r.status_code == 202 and r.json() == {"accepted": 2}
    batch = [{"step": s, "values": {"loss": 2.5 - 0.1 * s}} for s in range(1, 10)]
    batch.append({"step": 3, "rank": 1, "values": {"grad_norm": 0.7}})
    assert c.post("/v1/runs/m/metrics", json=batch).json() == {"accepted": 10}
    got = c.get("/v1/runs/m/metrics", params={"names": "loss"}).json()
    assert got["names"] == ["grad_norm", "loss", "lr"]
    (loss,) = got["series"]
    assert loss["name"] == "loss" and loss["rank"] is None
    assert [p[0] for p in loss["points"]] == list(range(10))
    assert [round(p[1], 6) for p in loss["points"]] == [round(2.5 - 0.1 * s, 6) for s in range(10)]
    since = c.get("/v1/runs/m/metrics", params={"names": "loss", "since_step": 7}).json()["series"][
        0
    ]
    assert [p[0] for p in since["points"]] == [7, 8, 9]
    ranked = c.get("/v1/runs/m/metrics", params={"rank": "1"}).json()["series"]
    assert [(s["name"], s["rank"], s["points"][0][:2]) for s in ranked] == [
        ("grad_norm", 1, [3, 0.7])
    ]
    run_level = c.get("/v1/runs/m/metrics", params={"rank": "run"}).json()["series"]
    assert {s["name"] for s in run_level} == {"loss", "lr"}
    for bad, code in [
        ({"step": 1, "values": {"loss": "high"}}, "invalid_config"),
        ({"step": 1, "values": {"x" * 200: 1.0}}, "invalid_metrics"),
        ({"step": 1, "rank": 2, "values": {"loss": 1.0}}, "invalid_metrics"),
        ({"step": -1, "values": {"loss": 1.0}}, "invalid_config"),
    ]:
        r = c.post("/v1/runs/m/metrics", json=bad)
        assert r.status_code == 422 and r.json()["error"]["code"] == code, (bad, r.text)
    assert (
        len(c.get("/v1/runs/m/metrics", params={"names": "loss"}).json()["series"][0]["points"])
        == 10
    )


def test_metrics_retention(mon):
    c = mon
    assert c.post("/v1/runs", json={"name": "keep", "world_size": 1}).status_code == 201
    c.post(
        "/v1/runs/keep/metrics",
        json=[{"step": s, "values": {"loss": float(s)}} for s in range(120)],
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pts = c.get("/v1/runs/keep/metrics", params={"names": "loss"}).json()["series"][0]["points"]
        if len(pts) == 50:
            break
        time.sleep(0.2)
    assert [p[0] for p in pts] == list(range(70, 120)), "the newest 50 points are kept"


def test_drift_series_matches_torch(mon):
    c = mon
    r = c.post(
        "/v1/runs",
        json={
            "name": "drift",
            "world_size": 2,
            "drift_every": 1,
            "profiles": [{"name": "ema", "kind": "constant", "beta": 0.5}],
        },
    )
    assert r.status_code == 201
    g = torch.Generator().manual_seed(0)
    ema = {}
    for step in range(4):
        states = {rank: {"w": torch.randn(6, 5, generator=g)} for rank in range(2)}
        for rank, st in states.items():
            out = push(c, "drift", rank, step, st)
            e = ema.get(rank)
            ema[rank] = st["w"].clone() if e is None else e.lerp(st["w"], 0.5)
            want = ((ema[rank] - st["w"]).norm() / st["w"].norm()).item()
            assert (
                abs(out["drift"][0]["diff_sq"] ** 0.5 / out["drift"][0]["online_sq"] ** 0.5 - want)
                < 1e-5
            )
    time.sleep(0.5)
    series = c.get("/v1/runs/drift/metrics", params={"names": "ema_drift/ema"}).json()["series"]
    per_rank = {s["rank"]: s for s in series}
    diff = sum((ema[r] - states[r]["w"]).pow(2).sum() for r in range(2))
    online = sum(states[r]["w"].pow(2).sum() for r in range(2))
    combined = per_rank[None]["points"][-1]
    assert combined[0] == 3 and abs(combined[1] - (diff / online).sqrt().item()) < 1e-5
    assert per_rank[0]["points"][0][1] == 0.0  # the first push copies
    rank_view = c.get("/v1/runs/drift/ranks/1").json()
    # Pushes seconds apart: the stale threshold is the 60 s floor.
    assert rank_view["status"] == "live" and rank_view["stale_after_seconds"] == 60.0
    assert (
        abs(
            rank_view["drift"]["ema"]
            - ((ema[1] - states[1]["w"]).norm() / states[1]["w"].norm()).item()
        )
        < 1e-5
    )
    metrics = httpx.get(c.base_url.join("/metrics")).text
    assert 'polyak_ema_drift{profile="ema",run="drift"}' in metrics
    # Ingest series are sampled while pushes arrive.
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        names = c.get("/v1/runs/drift/metrics").json()["names"]
        if "ingest/bytes_per_second" in names:
            break
        time.sleep(0.3)
    assert {"ingest/bytes_per_second", "ingest/pushes_per_second", "ingest/push_seconds"} <= set(
        names
    )


def test_sse_content_order_and_resume(mon):
    c = mon
    assert c.post("/v1/runs", json={"name": "sse", "world_size": 2}).status_code == 201
    got: list[dict] = []
    listener = threading.Thread(
        target=lambda: got.extend(
            read_sse(str(c.base_url.join("/v1/runs/sse/events?since=0")), 9, 30)
        ),
        daemon=True,
    )
    listener.start()
    time.sleep(0.5)
    w = {"w": torch.ones(3)}
    for step in range(3):
        for rank in range(2):
            push(c, "sse", rank, step, w)
    c.put("/v1/runs/sse/ranks/0/steps/9", content=b"garbage")
    c.post("/v1/runs/sse/metrics", json={"step": 2, "values": {"loss": 1.0}})
    listener.join(30)
    kinds = [e["event"] for e in got]
    assert kinds[0] == "run_created"
    assert kinds.count("rank_registered") == 2
    pushes = [e for e in got if e["event"] == "push"]
    assert [(e["rank"], e["step"]) for e in pushes][:3] == [(0, 0), (1, 0), (0, 1)]
    assert pushes[0]["detail"]["bytes"] > 0 and pushes[0]["detail"]["applied"] is True
    ids = [e["id"] for e in got]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # Resume from the fourth event: exactly what came after it, in order.
    cut = got[3]["id"]
    again = read_sse(
        str(c.base_url.join("/v1/runs/sse/events")), 3, 10, headers={"Last-Event-ID": str(cut)}
    )
    assert [e["id"] for e in again] == [e["id"] for e in got if e["id"] > cut][:3]
    rejections = c.get(
        "/v1/runs/sse/events", headers={"Accept": "application/json"}, params={"kinds": "rejection"}
    ).json()
    assert rejections[-1]["detail"]["code"] == "invalid_safetensors" and rejections[-1]["step"] == 9


def test_event_retention(mon):
    c = mon
    assert c.post("/v1/runs", json={"name": "ev", "world_size": 1}).status_code == 201
    for step in range(40):
        push(c, "ev", 0, step, {"w": torch.full((2,), float(step))})
    time.sleep(2.5)  # a retention pass
    events = c.get("/v1/runs/ev/events", headers={"Accept": "application/json"}).json()
    assert len(events) == 30
    assert events[-1]["kind"] == "push" and events[-1]["step"] == 39
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)
