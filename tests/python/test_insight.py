"""Tags and notes, alert rules (each kind fires and clears at the right
step), the alert webhook, per-tensor EMA drift, the effective averaging
window, and the client's system-metrics sampler."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import polyak
import pytest
import safetensors.torch
import torch
from polyak_testing import wait_for


@pytest.fixture()
def c(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def push(c, run, rank, step, state, status=200):
    r = c.put(f"/v1/runs/{run}/ranks/{rank}/steps/{step}", content=safetensors.torch.save(state))
    assert r.status_code == status, r.text
    return r.json()


def alert(c, run, key, state=None):
    for a in c.get(f"/v1/runs/{run}/alerts").json()["alerts"]:
        if a["key"] == key and (state is None or a["state"] == state):
            return a
    return None


def test_tags_and_note_through_the_client_and_patch(server, fresh_server):
    client = polyak.Client(server.url)
    run = client.create_run("tagged", tags=["baseline", "lr-3e-4", "baseline"], note="first try")
    assert run.info["tags"] == ["baseline", "lr-3e-4"]
    assert run.info["note"] == "first try"
    listed = {r["name"]: r for r in client.request("GET", "/v1/runs").json()["runs"]}
    assert listed["tagged"]["tags"] == ["baseline", "lr-3e-4"]
    meta = run.annotate(tags=["sweep"], note="better: see loss")
    assert meta["tags"] == ["sweep"] and meta["note"] == "better: see loss"
    got = client.request("GET", "/v1/runs/tagged").json()
    assert (got["tags"], got["note"]) == (["sweep"], "better: see loss")
    # Only what is given changes.
    assert run.annotate(note="")["tags"] == ["sweep"]
    with httpx.Client(base_url=server.url) as c:
        bad = c.patch("/v1/runs/tagged", json={"tags": [" "]})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "tags[0]"
        bad = c.patch("/v1/runs/tagged", json={"alerts": {"webhook": "ftp://x"}})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "alerts.webhook"
        assert c.patch("/v1/runs/nope", json={}).status_code == 404
    client.close()
    # Stored: a restarted server still has them.
    fresh_server.start()
    fc = polyak.Client(fresh_server.url)
    fc.create_run("kept", tags=["a"], note="n")
    fresh_server.restart()
    again = fc.request("GET", "/v1/runs/kept").json()
    assert (again["tags"], again["note"]) == (["a"], "n")
    fc.close()


def test_metric_rules_fire_and_clear_at_the_right_step(c):
    rules = {
        "metrics": [
            {"metric": "loss", "above": 2.0, "patience": 3},
            {"metric": "acc", "below": 0.5, "mode": "max"},
        ]
    }
    assert (
        c.post("/v1/runs", json={"name": "al-m", "world_size": 1, "alerts": rules}).status_code
        == 201
    )
    loss = [1.0, 0.5, 3.0, 0.6, 0.7, 0.8, 0.4]
    acc = [0.6, 0.4, 0.7, 0.7, 0.7, 0.7, 0.7]
    for step, (lv, av) in enumerate(zip(loss, acc, strict=False)):
        r = c.post("/v1/runs/al-m/metrics", json={"step": step, "values": {"loss": lv, "acc": av}})
        assert r.status_code == 202
    above = wait_for(lambda: alert(c, "al-m", "metric_above:loss", "resolved"), what="above")
    assert (above["fired_step"], above["resolved_step"]) == (2, 3)
    stalled = wait_for(lambda: alert(c, "al-m", "no_improvement:loss", "resolved"), what="stall")
    assert (stalled["fired_step"], stalled["resolved_step"]) == (4, 6)
    below = wait_for(lambda: alert(c, "al-m", "metric_below:acc", "resolved"), what="below")
    assert (below["fired_step"], below["resolved_step"]) == (1, 2)
    # Each transition is an event.
    events = c.get(
        "/v1/runs/al-m/events", params={"kinds": "alert"}, headers={"accept": "application/json"}
    ).json()
    states = [(e["detail"]["key"], e["detail"]["state"]) for e in events]
    assert states.count(("metric_above:loss", "firing")) == 1
    assert states.count(("metric_above:loss", "resolved")) == 1


def test_nonfinite_stale_disk_and_snapshot_alerts(c):
    spec = {
        "name": "al-k",
        "world_size": 1,
        "snapshot_timeout_secs": 1,
        "alerts": {"stale_after_seconds": 1.5},
    }
    assert c.post("/v1/runs", json=spec).status_code == 201
    good = {"w": torch.ones(4)}
    push(c, "al-k", 0, 0, good)
    # Non-finite values rejected: fires at the step, clears at the next push.
    push(c, "al-k", 0, 1, {"w": torch.tensor([1.0, float("nan"), 1.0, 1.0])}, status=422)
    nf = wait_for(lambda: alert(c, "al-k", "nonfinite:0", "firing"), what="nonfinite")
    assert nf["fired_step"] == 1 and nf["rank"] == 0
    metrics = httpx.get(f"{c.base_url}/metrics").text
    assert 'polyak_alerts_firing{kind="nonfinite",run="al-k"} 1' in metrics
    push(c, "al-k", 0, 2, good)
    nf = wait_for(lambda: alert(c, "al-k", "nonfinite:0", "resolved"), what="nonfinite cleared")
    assert nf["resolved_step"] == 2
    # A stale rank: fires after its threshold, clears when the rank pushes.
    stale = wait_for(lambda: alert(c, "al-k", "stale_rank:0", "firing"), what="stale")
    assert stale["fired_step"] == 2
    push(c, "al-k", 0, 3, good)
    stale = wait_for(lambda: alert(c, "al-k", "stale_rank:0", "resolved"), what="stale cleared")
    assert stale["resolved_step"] == 3
    c.patch("/v1/runs/al-k", json={"alerts": {"stale_after_seconds": 0}})
    # Disk: a threshold above any free space fires, a zero one clears.
    c.patch("/v1/runs/al-k", json={"alerts": {"stale_after_seconds": 0, "disk_free_below": 1.0}})
    disk = wait_for(lambda: alert(c, "al-k", "disk_full", "firing"), what="disk")
    assert "free" in disk["message"]
    c.patch("/v1/runs/al-k", json={"alerts": {"stale_after_seconds": 0, "disk_free_below": 0.0}})
    wait_for(lambda: alert(c, "al-k", "disk_full", "resolved"), what="disk cleared")
    # A snapshot that never completes fails (timeout), a later one clears it.
    assert c.post("/v1/runs/al-k/snapshots", json={"step": 1000}).status_code == 202
    failed = wait_for(lambda: alert(c, "al-k", "snapshot_failed", "firing"), what="snapshot")
    assert "failed" in failed["message"]
    assert c.post("/v1/runs/al-k/snapshots", json={"step": 4}).status_code == 202
    push(c, "al-k", 0, 4, good)
    cleared = wait_for(lambda: alert(c, "al-k", "snapshot_failed", "resolved"), what="snap cleared")
    assert cleared["resolved_step"] == 4
    # Acknowledging keeps the alert, marked.
    acked = c.post(f"/v1/runs/al-k/alerts/{failed['id']}/ack").json()
    assert acked["acknowledged"] is True
    assert alert(c, "al-k", "snapshot_failed")["acknowledged"] is True
    assert c.post("/v1/runs/al-k/alerts/999999/ack").status_code == 404


class Receiver:
    """A webhook receiver on loopback that refuses its first delivery."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.statuses: list[int] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                status = 500 if not outer.statuses else 200
                outer.statuses.append(status)
                outer.bodies.append(body)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_webhook_is_delivered_and_retried_after_a_failure(c):
    rx = Receiver()
    try:
        rules = {"webhook": rx.url, "metrics": [{"metric": "loss", "above": 1.0}]}
        assert (
            c.post("/v1/runs", json={"name": "al-w", "world_size": 1, "alerts": rules}).status_code
            == 201
        )
        c.post("/v1/runs/al-w/metrics", json={"step": 7, "values": {"loss": 5.0}})
        wait_for(lambda: len(rx.statuses) >= 2, what="webhook retry")
        assert rx.statuses[:2] == [500, 200]
        first, second = rx.bodies[:2]
        assert first == second
        assert first["run"] == "al-w"
        assert first["alert"]["key"] == "metric_above:loss"
        assert first["alert"]["state"] == "firing" and first["alert"]["fired_step"] == 7
        c.post("/v1/runs/al-w/metrics", json={"step": 8, "values": {"loss": 0.5}})
        wait_for(lambda: len(rx.bodies) >= 3, what="resolved delivery")
        assert rx.bodies[2]["alert"]["state"] == "resolved"
        assert rx.bodies[2]["alert"]["resolved_step"] == 8
    finally:
        rx.close()


# float32 takes the fused CPU kernel; float64 the libtorch path (as on CUDA).
@pytest.mark.parametrize("ema_dtype", ["float32", "float64"])
def test_drift_per_tensor_matches_torch(c, ema_dtype):
    beta = 0.8
    run = f"td-{ema_dtype}"
    spec = {
        "name": run,
        "world_size": 2,
        "drift_every": 1,
        "ema_dtype": ema_dtype,
        "profiles": [{"name": "ema", "kind": "constant", "beta": beta}],
    }
    assert c.post("/v1/runs", json=spec).status_code == 201
    gen = torch.Generator().manual_seed(3)
    ema = None
    want: dict[str, list[float]] = {"a": [], "b": []}
    for step in range(4):
        full = {"a": torch.randn(6, 3, generator=gen), "b": torch.randn(5, generator=gen)}
        ema = {k: v.clone() for k, v in full.items()} if ema is None else ema
        if step:
            for k in ema:
                ema[k].lerp_(full[k], 1 - beta)
        for k in want:
            want[k].append(float((ema[k] - full[k]).norm() / full[k].norm()))
        # Tensor a is split between the ranks along dim 0; b lives on rank 1.
        for rank in range(2):
            part = {"a": full["a"][3 * rank : 3 * rank + 3].contiguous()}
            meta = {"a": {"global_shape": [6, 3], "offsets": [3 * rank, 0]}}
            if rank == 1:
                part["b"] = full["b"]
            body = safetensors.torch.save(part, metadata={"polyak.shards": json.dumps(meta)})
            r = c.put(f"/v1/runs/{run}/ranks/{rank}/steps/{step}", content=body)
            assert r.status_code == 200, r.text

    def complete():
        d = c.get(f"/v1/runs/{run}/drift/tensors").json()
        done = d["steps"] == [0, 1, 2, 3] and all(v is not None for r in d["values"] for v in r)
        return done and d

    # Rows are stored in the background: wait for both ranks' last sample.
    got = wait_for(complete, what="drift rows")
    assert got["profile"] == "ema"
    assert sorted(got["tensors"]) == ["a", "b"]
    for name, values in zip(got["tensors"], got["values"], strict=False):
        assert values == pytest.approx(want[name], rel=1e-5, abs=1e-7)
    assert c.get(f"/v1/runs/{run}/drift/tensors", params={"profile": "x"}).status_code == 404


def test_effective_window_per_profile(c):
    spec = {
        "name": "win",
        "world_size": 1,
        "update_every": 2,
        "profiles": [
            {"name": "ema", "kind": "constant", "beta": 0.9},
            {"name": "edm", "kind": "power", "sigma_rel": 0.05},
        ],
    }
    assert c.post("/v1/runs", json=spec).status_code == 201
    push(c, "win", 0, 0, {"w": torch.ones(2)})
    push(c, "win", 0, 20, {"w": torch.ones(2)})
    got = c.get("/v1/runs/win/window", params={"points": 11}).json()
    assert got["update_every"] == 2
    ema, edm = got["profiles"]
    assert [p[0] for p in ema["points"]] == list(range(0, 21, 2))
    assert ema["points"][0][1:] == [0.0, 0.0]
    assert ema["points"][5][1] == pytest.approx(0.9)
    assert ema["points"][5][2] == pytest.approx(2 * math.log(0.5) / math.log(0.9))
    # EDM2 power EMA: beta = (1 - 2/t)^(gamma+1) at t = step + 1; its window grows.
    gamma = c.get("/v1/runs/win").json()["config"]["profiles"][1]["gamma"]
    assert edm["points"][10][1] == pytest.approx((1 - 2 / 21) ** (gamma + 1), rel=1e-9)
    halves = [p[2] for p in edm["points"][1:]]
    assert halves == sorted(halves)


def test_system_sampler_posts_at_a_bounded_rate(server):
    client = polyak.Client(server.url)
    run = client.create_run("sysm", world_size=2)
    run.enable_system_metrics(rank=1, min_interval=0.3)
    start = time.monotonic()
    for step in range(40):
        run.log(step, loss=1.0 / (step + 1))
        time.sleep(0.03)
    elapsed = time.monotonic() - start
    series = run._get("/metrics", rank="1")["series"]
    by_name = {s["name"]: s["points"] for s in series}
    rss = by_name["sys/rss_bytes"]
    assert 2 <= len(rss) <= elapsed / 0.3 + 1
    assert all(p[1] > 1e6 for p in rss)
    assert all(0 < p[1] < 1 for p in by_name["sys/host_mem_used_fraction"])
    assert all(p[1] >= 0 for p in by_name["sys/cpu_percent"])
    # Posted with the metrics of the same step.
    steps = {p[0] for p in rss}
    loss_steps = {p[0] for p in run._get("/metrics", names="loss")["series"][0]["points"]}
    assert steps <= loss_steps and 0 in steps
    client.close()
