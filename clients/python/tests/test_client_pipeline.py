"""Pipelined pushes against the real server: pushes that name their
predecessor (``Polyak-Prev-Step``) are applied in step order whatever order
they arrive in, a predecessor that never comes times out with a clear
error, and a pipelining pusher's EMA equals the sequential one exactly."""

from __future__ import annotations

import threading
import time

import httpx
import polyak
import torch
from polyak.wire import HostBody, TensorSpec, WireLayout, read_safetensors


def _body(w: torch.Tensor) -> bytes:
    body = HostBody(WireLayout([TensorSpec("w", w.dtype, tuple(w.shape))]))
    body.fill([w])
    return bytes(body.memory)


def _put(url: str, run: str, step: int, body: bytes, prev: int | None) -> httpx.Response:
    headers = {"Content-Type": "application/octet-stream"}
    if prev is not None:
        headers["Polyak-Prev-Step"] = str(prev)
    return httpx.put(
        f"{url}/v1/runs/{run}/ranks/0/steps/{step}", content=body, headers=headers, timeout=60
    )


def _ema(client: polyak.Client, run: str) -> torch.Tensor:
    r = client.request("GET", f"/v1/runs/{run}/ranks/0/ema", params={"profile": "ema"})
    return read_safetensors(r.content)[0]["w"]


def test_out_of_order_arrival_is_applied_in_order_and_a_gap_times_out(fresh_server):
    srv = fresh_server.start("--pipeline-timeout-secs", "1.5")
    profiles = [{"name": "ema", "kind": "constant", "beta": 0.5}]
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(1000, generator=g) for _ in range(4)]
    with polyak.Client(srv.url) as client:
        client.create_run("seq", profiles=profiles)
        client.create_run("pipe", profiles=profiles)
        for step, w in enumerate(weights):
            assert _put(srv.url, "seq", step, _body(w), None).json()["applied"]
        assert _put(srv.url, "pipe", 0, _body(weights[0]), None).json()["applied"]
        # Step 3 arrives first, then step 2, then step 1: each waits for
        # its predecessor, and all three are applied, in order.
        answers: dict[int, httpx.Response] = {}

        def send(step: int) -> None:
            answers[step] = _put(srv.url, "pipe", step, _body(weights[step]), step - 1)

        threads = []
        for step in (3, 2, 1):
            t = threading.Thread(target=send, args=(step,))
            t.start()
            threads.append(t)
            time.sleep(0.2)
        for t in threads:
            t.join()
        for step in (1, 2, 3):
            r = answers[step]
            assert r.status_code == 200, r.text
            assert r.json()["applied"] and r.json()["last_step"] == step
        # The same EMA as the sequential run, bit for bit, and the
        # reference lerp chain.
        ref = weights[0].clone()
        for w in weights[1:]:
            ref = ref.lerp(w, 0.5)
        assert torch.equal(_ema(client, "pipe"), _ema(client, "seq"))
        torch.testing.assert_close(_ema(client, "pipe"), ref, rtol=1e-6, atol=1e-7)
        # A gap that never fills: step 6 names step 5, which never comes.
        started = time.monotonic()
        r = _put(srv.url, "pipe", 6, _body(weights[0]), 5)
        waited = time.monotonic() - started
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "predecessor_timeout"
        assert "step 5" in r.json()["error"]["message"]
        assert waited >= 1.4
        assert client.run("pipe").rank(0)["last_step"] == 3
        # A predecessor named at or after the step is refused at once.
        r = _put(srv.url, "pipe", 7, _body(weights[0]), 7)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_header"


def test_pipelining_pusher_matches_the_sequential_one_exactly(client, run_name):
    profiles = [
        {"name": "ema", "kind": "constant", "beta": 0.99},
        {"name": "pw", "kind": "power", "sigma_rel": 0.1},
    ]
    seq = client.create_run(run_name + "-seq", profiles=profiles)
    pipe = client.create_run(run_name + "-pipe", profiles=profiles)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    with seq.pusher(rank=0, pipeline=1) as a, pipe.pusher(rank=0, pipeline=3, max_queue=4) as b:
        for step in range(40):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-2)
            a.push(model, step)
            b.push(model, step)
        a.flush()
        b.flush()
        stats = b.stats()
    assert stats.applied == 40 and stats.rejected == 0
    for profile in ("ema", "pw"):
        for name in ("0.weight", "2.bias"):
            ra = client.request(
                "GET", f"/v1/runs/{seq.name}/ranks/0/ema", params={"profile": profile}
            )
            rb = client.request(
                "GET", f"/v1/runs/{pipe.name}/ranks/0/ema", params={"profile": profile}
            )
            assert torch.equal(
                read_safetensors(ra.content)[0][name], read_safetensors(rb.content)[0][name]
            )
    assert pipe.rank(0)["last_step"] == 39


def _rejections(url: str, run: str, code: str) -> float:
    """``polyak_rejections_total{run, code}`` (0 when never counted)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("polyak_rejections_total{") and f'run="{run}"' in line:
            if f'code="{code}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_retried_predecessor_refuses_its_waiting_successor_at_once(fresh_server):
    # An in-flight byte budget smaller than one body: while one body is
    # held, another is answered 429.
    srv = fresh_server.start("--inflight-bytes", "64KiB", "--retry-after-secs", "0")
    w = torch.randn(100_000, generator=torch.Generator().manual_seed(2))  # 400 kB
    with polyak.Client(srv.url) as client:
        client.create_run("gate")
        assert _put(srv.url, "gate", 0, _body(w), None).json()["applied"]
        # Step 2 arrives first and waits for step 1, holding its body.
        answers: dict[int, httpx.Response] = {}
        started = time.monotonic()
        waiter = threading.Thread(
            target=lambda: answers.setdefault(2, _put(srv.url, "gate", 2, _body(w + 2), 1))
        )
        waiter.start()
        time.sleep(0.5)
        # Step 1 finds the budget taken: 429. Step 2, which waited for it,
        # is refused at once (it used to wait out its 30 s timeout while
        # every retry of step 1 was refused for the budget it held).
        r = _put(srv.url, "gate", 1, _body(w + 1), 0)
        assert r.status_code == 429 and r.json()["error"]["code"] == "busy", r.text
        waiter.join(timeout=20)
        assert not waiter.is_alive() and time.monotonic() - started < 20
        r = answers[2]
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "predecessor_retry"
        assert "step 1" in r.json()["error"]["message"] and "retry-after" in r.headers
        # Sent again in order, both apply.
        assert _put(srv.url, "gate", 1, _body(w + 1), 0).json()["applied"]
        assert _put(srv.url, "gate", 2, _body(w + 2), 1).json()["applied"]
        assert client.run("gate").rank(0)["last_step"] == 2
        assert _rejections(srv.url, "gate", "predecessor_timeout") == 0


def test_a_pipelining_pusher_gets_through_429s_without_stalling(fresh_server):
    # The same budget with a pusher of two slots (the default): the second
    # body in flight is refused 429 all the time; the pusher holds later
    # steps back while one waits for its retry, and every push applies, in
    # order, with no predecessor_timeout.
    srv = fresh_server.start("--inflight-bytes", "256KiB", "--retry-after-secs", "0")
    beta = 0.5
    profiles = [{"name": "ema", "kind": "constant", "beta": beta}]
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(1024, 1024, generator=g) for _ in range(10)]  # 4 MiB bodies
    with polyak.Client(srv.url) as client:
        run = client.create_run("retried", profiles=profiles)
        started = time.monotonic()
        with run.pusher(rank=0, max_queue=len(weights)) as p:
            assert p.pipeline == 2
            for step, w in enumerate(weights):
                p.push({"w": w}, step)
            p.flush()
            stats = p.stats()
        elapsed = time.monotonic() - started
        assert stats.applied == len(weights) and stats.rejected == 0
        assert stats.retries > 0  # the 429 path was taken
        assert run.rank(0)["last_step"] == len(weights) - 1
        assert _rejections(srv.url, "retried", "predecessor_timeout") == 0
        # Well below the 30 s a stranded successor waited.
        assert elapsed < 20, elapsed
        ref = weights[0].clone()
        for w in weights[1:]:
            ref = ref.lerp(w, 1 - beta)
        torch.testing.assert_close(_ema(client, "retried"), ref, rtol=1e-6, atol=1e-7)


def test_deleting_a_run_forgets_its_pipelined_order(fresh_server):
    srv = fresh_server.start("--pipeline-timeout-secs", "2")
    w = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    with polyak.Client(srv.url) as client:
        client.create_run("again")
        for step in range(6):
            assert _put(srv.url, "again", step, _body(w + step), None).json()["applied"]
        # A push waiting for a step that never comes when the run is deleted
        # is answered at once, not after its timeout.
        answers: dict[str, httpx.Response] = {}
        waiter = threading.Thread(
            target=lambda: answers.setdefault("r", _put(srv.url, "again", 20, _body(w), 19))
        )
        waiter.start()
        time.sleep(0.5)
        client.delete_run("again")
        waiter.join()
        r = answers["r"]
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "pipeline_reset"
        # Made again under the same name: step 5 answered in the deleted run
        # does not count, so a push naming step 2 (never pushed here) waits
        # for it and times out instead of being applied out of order.
        client.create_run("again")
        assert _put(srv.url, "again", 0, _body(w), None).json()["applied"]
        r = _put(srv.url, "again", 3, _body(w), 2)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "predecessor_timeout"
        assert client.run("again").rank(0)["last_step"] == 0
