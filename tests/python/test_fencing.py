"""Durable writes under pauses and outages: fenced state, bounded captures,
one final snapshot, a quick 503 while the catalog is away.

- A node paused (SIGSTOP) past its lease while it is writing a ``state``
  snapshot wakes up after another node took its rank over and persisted
  it: the catalog refuses the paused node's parts (their placement epoch
  is stale), so that snapshot fails, and a later failover restores the
  newest state (the new owner's), losing nothing it does not report.
- With the object store stopped and ``persist_every_secs: 1``, a run has
  at most one state snapshot in flight; the due ones are skipped and
  counted, and the server's memory does not grow with each interval.
- Concurrent ``finish`` calls take one final snapshot and all answer it.
- With PostgreSQL stopped, ``/readyz`` and the catalog-backed listings
  answer ``503`` within ``--catalog-timeout-secs``.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest
import safetensors.torch
import torch
from polyak_testing import Backends, PolyakServer, PostgresService, state_step, wait_for

LEASE = 3.0


def _body(step: int, rank: int, shape=(64, 64)) -> bytes:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return safetensors.torch.save({"w": torch.randn(*shape, generator=g)})


def _push(url: str, run: str, rank: int, step: int, body: bytes | None = None) -> dict:
    """One push, following a redirect to the rank's owner."""
    r = httpx.put(
        f"{url}/v1/runs/{run}/ranks/{rank}/steps/{step}",
        content=body if body is not None else _body(step, rank),
        timeout=30,
        follow_redirects=True,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _create_run(url: str, run: str, **fields) -> None:
    body = {"name": run, "profiles": [{"name": "c", "kind": "constant", "beta": 0.9}], **fields}
    r = httpx.post(f"{url}/v1/runs", json=body, timeout=30)
    assert r.status_code in (200, 201), r.text


def _placement(url: str, run: str) -> dict:
    return httpx.get(f"{url}/v1/runs/{run}/placement", timeout=10).json()


def _states(url: str, run: str) -> list[dict]:
    r = httpx.get(f"{url}/v1/runs/{run}/snapshots", params={"kind": "state"}, timeout=10)
    return r.json()["snapshots"]


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _rss(pid: int) -> int:
    """The process's resident memory in bytes."""
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _own_s3(backends: Backends):
    s3 = backends.s3()
    if getattr(s3, "proc", None) is None:
        pytest.skip("needs a SeaweedFS of its own to pause")
    return s3


@pytest.mark.slow
def test_a_paused_node_completes_no_stale_state(tmp_path, backends: Backends):
    """Node a is paused while its state snapshot of rank 0 is being written
    (the object store is held stopped until a has captured it), b takes
    rank 0 over and persists it further; a, resumed, must not complete its
    snapshot. Then b is killed: a restores rank 0 from b's newest state and
    the failover reports exactly what is lost (nothing)."""
    s3 = _own_s3(backends)
    run = "fenced"
    _, (a, b) = backends.cluster(tmp_path / "nodes", 2, "--lease-secs", str(LEASE))
    a.start()
    b.start()
    paused: list[int] = []
    try:
        _create_run(a.url, run, world_size=2, persist_every_secs=1)
        owners = {int(k): v["node"] for k, v in _placement(a.url, run).items()}
        assert owners == {0: "node-a", 1: "node-b"}, owners
        for step in range(5):
            for rank in (0, 1):
                _push(a.url, run, rank, step)
        wait_for(lambda: state_step(a.url, run, 0) == 4, 30, "a's state snapshot at step 4")

        # The store stops answering: a's next state snapshot of rank 0 is
        # captured and then hangs in its upload.
        os.kill(s3.proc.pid, signal.SIGSTOP)
        paused.append(s3.proc.pid)
        for step in range(5, 8):
            for rank in (0, 1):
                _push(a.url, run, rank, step)

        def writing() -> list[str]:
            return [
                s["id"]
                for s in _states(a.url, run)
                if s["status"] == "pending" and s["detail"]["rank_steps"].get("0", 0) > 4
            ]

        stale = wait_for(writing, 30, "a's state snapshot of rank 0 being written")
        os.kill(a.pid, signal.SIGSTOP)
        paused.append(a.pid)
        os.kill(s3.proc.pid, signal.SIGCONT)
        paused.remove(s3.proc.pid)

        # b takes rank 0 over (epoch 2) and persists it past a's steps.
        wait_for(
            lambda: (
                _placement(b.url, run)["0"]["node"] == "node-b"
                and _placement(b.url, run)["0"]["epoch"] == 2
            ),
            60,
            "b taking rank 0 over",
        )
        for step in range(8, 13):
            for rank in (0, 1):
                _push(b.url, run, rank, step)
        wait_for(lambda: state_step(b.url, run, 0) == 12, 30, "b's state snapshot at step 12")

        os.kill(a.pid, signal.SIGCONT)
        paused.remove(a.pid)

        def settled() -> dict[str, dict | None] | None:
            listed = {s["id"]: s for s in _states(b.url, run)}
            if any((listed.get(sid) or {}).get("status") == "pending" for sid in stale):
                return None
            # Absent: completed, then pruned by retention as older state.
            return {sid: listed.get(sid) for sid in stale}

        ended = wait_for(settled, 60, "a's stale snapshot to end")
        for sid, s in ended.items():
            assert s is not None and s["status"] == "failed", (sid, s)
        reasons = [s["reason"] or "" for s in ended.values() if s is not None]
        if all(r.startswith("fenced:") for r in reasons):
            assert _metric(a.url, "polyak_snapshot_parts_fenced_total") >= 1
        else:
            # On a loaded machine the node just resumed can time out a
            # catalog query on the way to the fence (its first queries race
            # its lease renewal and sync): the write fails before the fence
            # is reached, which lists nothing either. What follows checks
            # the outcome that matters: b's state is what a restores.
            assert all(r.startswith("fenced:") or "catalog" in r for r in reasons), reasons
        # a let rank 0 go once it renewed.
        wait_for(lambda: _placement(a.url, run)["0"]["node"] == "node-b", 30, "a to see b's rank 0")

        # b dies: a takes both ranks over, rank 0 from b's state at step 12.
        b.kill()

        def taken_again() -> dict | None:
            view = httpx.get(f"{a.url}/v1/runs/{run}/ranks/0", timeout=10).json()
            failover = view.get("failover") or {}
            return failover if failover.get("epoch") == 3 else None

        failover = wait_for(taken_again, 60, "a taking rank 0 over from b")
        assert failover["from_node"] == "node-b" and failover["epoch"] == 3, failover
        assert failover["restored_step"] == 12, failover
        assert failover["snapshot"] not in stale
        _push(a.url, run, 0, 13)
        view = httpx.get(f"{a.url}/v1/runs/{run}/ranks/0", timeout=10).json()
        assert view["failover"]["resumed_step"] == 13
        assert view["failover"]["lost_steps"] == 0, view["failover"]
        assert view["last_step"] == 13
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
        a.stop()
        b.stop()


@pytest.mark.slow
def test_state_captures_stay_bounded_while_the_store_hangs(tmp_path, backends: Backends):
    """SeaweedFS stopped, ``persist_every_secs: 1``, a 16 MiB model with a
    mirror (32 MiB per capture): one state snapshot in flight, the due
    ones skipped and counted, memory growth within a few captures, and
    persistence back once the store is."""
    s3 = _own_s3(backends)
    run = "bounded"
    srv = backends.server("sqlite-s3", tmp_path / "data")
    srv.start()
    paused = False
    shape = (2048, 2048)  # 16 MiB of float32
    capture = 2 * 4 * shape[0] * shape[1]
    try:
        _create_run(srv.url, run, world_size=1, mirror=True, persist_every_secs=1)
        bodies = [_body(i, 0, shape) for i in range(4)]
        step = 0
        for _ in range(4):
            _push(srv.url, run, 0, step, bodies[step % 4])
            step += 1
        wait_for(lambda: state_step(srv.url, run, 0) == step - 1, 60, "a first state snapshot")
        # A second round, so the baseline holds what a written capture leaves.
        _push(srv.url, run, 0, step, bodies[step % 4])
        step += 1
        wait_for(lambda: state_step(srv.url, run, 0) == step - 1, 60, "a second state snapshot")
        base = _rss(srv.pid)

        os.kill(s3.proc.pid, signal.SIGSTOP)
        paused = True

        def check_bounds() -> None:
            # One capture in flight (its copy, its serialised part, its
            # upload buffers) and the allocator's slack: never a capture
            # per interval.
            pending = [s for s in _states(srv.url, run) if s["status"] == "pending"]
            assert len(pending) <= 1, [s["id"] for s in pending]
            grown = _rss(srv.pid) - base
            assert grown < 4 * capture, f"RSS grew {grown >> 20} MiB"

        # Keep the run dirty until several due snapshots were skipped.
        deadline = time.monotonic() + 120
        while _metric(srv.url, "polyak_state_persist_skipped_total", f'{{run="{run}"}}') < 6:
            assert time.monotonic() < deadline, "due state snapshots were never counted as skipped"
            _push(srv.url, run, 0, step, bodies[step % 4])
            step += 1
            check_bounds()
            time.sleep(0.2)
        check_bounds()

        os.kill(s3.proc.pid, signal.SIGCONT)
        paused = False
        last = step - 1
        wait_for(lambda: state_step(srv.url, run, 0) == last, 120, "state persisted again")
    finally:
        if paused:
            os.kill(s3.proc.pid, signal.SIGCONT)
        srv.stop()


@pytest.mark.parametrize("pair", Backends.PAIRS)
def test_concurrent_finishes_take_one_final_snapshot(tmp_path, backends: Backends, pair: str):
    srv = backends.server(pair, tmp_path / "data")
    srv.start()
    try:
        _finish_concurrently([srv.url], trials=5)
    finally:
        srv.stop()


def test_concurrent_finishes_across_nodes_take_one_final_snapshot(tmp_path, backends: Backends):
    """Eight callers, four on each of two nodes, finish a run whose ranks
    are spread over both: one final snapshot, every caller answered with
    it (the finish holds a lock in the catalog, so the second node's
    callers find the first's finish there)."""
    _, nodes = backends.cluster(tmp_path / "nodes", 2)
    for node in nodes:
        node.start()
    try:
        _finish_concurrently([n.url for n in nodes], trials=4, spread=True)
    finally:
        for node in reversed(nodes):
            node.stop()


def _finish_concurrently(urls: list[str], trials: int, spread: bool = False) -> None:
    """``trials`` runs of two ranks at step 2, each finished by eight
    callers at once over ``urls`` (round robin): all answered 200 with the
    same final snapshot at step 2, the only one the run lists."""
    for trial in range(trials):
        run = f"finish-{trial}"
        _create_run(urls[0], run, world_size=2)
        if spread:
            owners = {p["node"] for p in _placement(urls[0], run).values()}
            assert len(owners) == 2, owners
        for step in range(3):
            for rank in (0, 1):
                _push(urls[0], run, rank, step)
        callers = 8
        barrier = threading.Barrier(callers)
        answers: list[httpx.Response | Exception] = [None] * callers  # type: ignore[list-item]

        def finish(i: int, run: str = run, barrier=barrier, answers=answers) -> None:
            url = urls[i % len(urls)]
            barrier.wait()
            try:
                answers[i] = httpx.post(f"{url}/v1/runs/{run}/finish", json={}, timeout=60)
            except Exception as e:  # reported below
                answers[i] = e

        threads = [threading.Thread(target=finish, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for a in answers:
            assert isinstance(a, httpx.Response) and a.status_code == 200, a
        got = {(a.json()["snapshot"]["id"], a.json()["snapshot"]["step"]) for a in answers}
        assert len(got) == 1, (trial, got)
        ((sid, step),) = got
        assert step == 2
        for url in urls:
            snaps = httpx.get(f"{url}/v1/runs/{run}/snapshots", timeout=10).json()
            final = [s for s in snaps["snapshots"] if s["kind"] != "state"]
            assert [s["id"] for s in final] == [sid], (trial, url, final)
            finished = httpx.get(f"{url}/v1/runs/{run}", timeout=10).json()["finished"]
            assert finished["snapshot"] == sid, (trial, url, finished)


def test_the_catalog_away_answers_503_quickly(tmp_path):
    """PostgreSQL stopped: ``/readyz`` and the catalog-backed calls answer
    ``503`` before a 5 s client timeout (``--catalog-timeout-secs 2``, the
    default) instead of hanging."""
    pg = PostgresService()
    if pg.external:
        pytest.skip("needs a PostgreSQL of its own to stop")
    pg.start()
    srv = PolyakServer(tmp_path / "data", "--catalog", pg.new_database())
    try:
        srv.start()
        run = "away"
        _create_run(srv.url, run, world_size=1)
        _push(srv.url, run, 0, 0)
        assert httpx.get(f"{srv.url}/readyz", timeout=5).status_code == 200
        pg.stop(keep_data=True)

        with httpx.Client(base_url=srv.url, timeout=5) as c:
            ready = c.get("/readyz")
            assert ready.status_code == 503, ready.text
            assert ready.json()["status"] == "unavailable"
            calls = [
                ("GET", f"/v1/runs/{run}/snapshots"),
                ("GET", f"/v1/runs/{run}/events"),
                ("POST", f"/v1/runs/{run}/persist"),
                ("GET", "/v1/nodes"),
            ]
            for method, path in calls:
                r = c.request(method, path, headers={"Accept": "application/json"}, json=None)
                assert r.status_code == 503, (path, r.status_code, r.text)
                assert r.json()["error"]["code"] == "catalog_unavailable", (path, r.text)
                assert r.headers.get("Retry-After"), path
    finally:
        srv.kill()
        pg.stop()
