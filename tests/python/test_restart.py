"""A restart is a failover to itself: a server killed with SIGKILL and
started again on the same data dir restores each rank from its newest
stored state that reads back, says what the EMA lost (the rank's
``failover`` record, a ``failover`` event, the metric, a ``steps_lost``
alert and the run's health until it is acknowledged), and applies the
trainer's next push with the decay of its whole interval since the
restored step.

Also the ways a restart could go backwards silently: a corrupt newest
state (the next newest that verifies is taken), a wall clock stepped back
(the newest state is decided by an order the server keeps, never the
clock), and a graceful stop held by an open event stream (the final state
write starts at once and live streams close).
"""

from __future__ import annotations

import itertools
import signal
import sqlite3
import threading
import time

import httpx
import pytest
import safetensors.torch
import torch
from polyak_testing.backends import StoreView
from polyak_testing.clockshim import Clock
from polyak_testing.refs import power_beta

GAMMA = 6.94
BETA = 0.9


def state_at(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def body(step: int) -> bytes:
    return safetensors.torch.save(state_at(step))


def create(c: httpx.Client, run: str, **extra) -> None:
    r = c.post(
        "/v1/runs",
        json={
            "name": run,
            "world_size": 1,
            "profiles": [
                {"name": "c", "kind": "constant", "beta": BETA},
                {"name": "p", "kind": "power", "gamma": GAMMA},
            ],
            **extra,
        },
    )
    assert r.status_code == 201, r.text


def push(c: httpx.Client, run: str, step: int) -> dict:
    r = c.put(f"/v1/runs/{run}/ranks/0/steps/{step}", content=body(step))
    assert r.status_code == 200, r.text
    return r.json()


def persist(c: httpx.Client, run: str) -> str:
    r = c.post(f"/v1/runs/{run}/persist")
    assert r.status_code == 200, r.text
    return r.json()["snapshot"]


def reference(steps: list[int]) -> dict[str, dict[str, torch.Tensor]]:
    """The EMA the server must hold after applying exactly ``steps``, in
    order: the constant profile lerps by 1 - beta per applied push, the
    power profile by EDM2's power function over each whole interval."""
    c = {k: v.clone().double() for k, v in state_at(steps[0]).items()}
    p = {k: v.clone().double() for k, v in state_at(steps[0]).items()}
    for prev, step in itertools.pairwise(steps):
        w = {k: v.double() for k, v in state_at(step).items()}
        beta_p = power_beta(GAMMA, step + 1, step - prev)
        for k in w:
            c[k] = w[k].lerp(c[k], BETA)
            p[k] = w[k].lerp(p[k], beta_p)
    return {"c": c, "p": p}


def assert_ema(c: httpx.Client, run: str, steps: list[int]) -> None:
    want = reference(steps)
    for profile in ("c", "p"):
        r = c.get(f"/v1/runs/{run}/ranks/0/ema", params={"profile": profile})
        assert r.status_code == 200, r.text
        got = safetensors.torch.load(r.content)
        for k, v in want[profile].items():
            err = (got[k].double() - v).abs().max().item()
            assert err < 1e-6, (profile, k, err)


def rank_view(c: httpx.Client, run: str) -> dict:
    return c.get(f"/v1/runs/{run}/ranks/0").json()


def metric(c: httpx.Client, name: str, run: str) -> float:
    text = c.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(f'{name}{{run="{run}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def caught_up(run: str, srv, step: int) -> None:
    """Waits until the catalog records ``step`` as the rank's last (the
    writer batches every 200 ms): what a crash then leaves in it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with sqlite3.connect(srv.data_dir / "polyak.db") as db:
            row = db.execute(
                "SELECT last_step FROM ranks WHERE run = ? AND rank = 0", (run,)
            ).fetchone()
        if row and row[0] == step:
            return
        time.sleep(0.05)
    raise AssertionError(f"the catalog never recorded step {step}")


def flip_a_bit(srv, key: str) -> None:
    """One bit of a stored part's tensor data flipped, its size unchanged."""
    view = StoreView(srv, None)
    bad = bytearray(view.read(key))
    bad[len(bad) - 5] ^= 0x04
    view.write(key, bytes(bad))


def test_a_crash_is_a_failover_to_itself(fresh_server):
    srv = fresh_server
    srv.start()
    run = "crash-self"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        create(c, run, persist_every_secs=0)
        for step in range(5):
            push(c, run, step)
        sid = persist(c, run)
        for step in range(5, 10):
            push(c, run, step)
        caught_up(run, srv, 9)
    srv.kill()
    srv.start(same_port=True)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        f = rank_view(c, run)["failover"]
        assert f is not None, "a restart must say what it restored"
        assert f["restart"] is True
        assert (f["snapshot"], f["restored_step"], f["last_seen_step"]) == (sid, 4, 9), f
        assert f["resumed_step"] is None and f["lost_steps"] is None, f
        events = c.get(
            f"/v1/runs/{run}/events",
            headers={"Accept": "application/json"},
            params={"kinds": "failover"},
        ).json()
        assert [e["detail"]["restored_step"] for e in events] == [4], events

        # The trainer dropped steps 10 and 11 while the server was away and
        # comes back at 12: the gap is bridged, 5..=11 are lost.
        push(c, run, 12)
        f = rank_view(c, run)["failover"]
        assert (f["resumed_step"], f["lost_steps"]) == (12, 7), f
        for step in (13, 14):
            push(c, run, step)
        assert_ema(c, run, [0, 1, 2, 3, 4, 12, 13, 14])
        assert metric(c, "polyak_failover_steps_lost_total", run) == 7

        # Said out loud until someone acknowledges it.
        deadline = time.monotonic() + 10
        alerts = []
        while time.monotonic() < deadline:
            alerts = [
                a
                for a in c.get(f"/v1/runs/{run}/alerts").json()["alerts"]
                if a["kind"] == "steps_lost"
            ]
            if alerts:
                break
            time.sleep(0.1)
        assert len(alerts) == 1 and alerts[0]["state"] == "firing", alerts
        assert "lost 7 update steps" in alerts[0]["message"], alerts[0]
        assert c.get(f"/v1/runs/{run}").json()["health"] == "degraded"
        r = c.post(f"/v1/runs/{run}/alerts/{alerts[0]['id']}/ack")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "resolved"
        assert c.get(f"/v1/runs/{run}").json()["health"] == "healthy"
        # The record stays on the rank view.
        assert rank_view(c, run)["failover"]["lost_steps"] == 7


def test_a_corrupt_newest_state_falls_back_to_the_next_that_verifies(fresh_server, backends):
    srv = fresh_server
    srv.start()
    run = "crash-flip"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        create(c, run, persist_every_secs=0)
        for step in range(5):
            push(c, run, step)
        r = c.post(f"/v1/runs/{run}/snapshots", json={"step": 4})
        assert r.status_code == 202, r.text
        manual = r.json()["id"]
        deadline = time.monotonic() + 30
        while c.get(f"/v1/runs/{run}/snapshots/{manual}").json()["status"] != "complete":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        state = persist(c, run)  # the same step, captured later: newest
        files = c.get(f"/v1/runs/{run}/snapshots/{state}").json()["files"]
        key = next(f["path"] for f in files if f["part"] == "c")
        caught_up(run, srv, 4)
    flip_a_bit(srv, key)
    srv.kill()
    srv.start(same_port=True)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        ranks = c.get(f"/v1/runs/{run}/ranks").json()
        assert ranks[0]["status"] == "live", ranks
        f = rank_view(c, run)["failover"]
        assert (f["snapshot"], f["restored_step"]) == (manual, 4), f
        corrupt = c.get(
            f"/v1/runs/{run}/events",
            headers={"Accept": "application/json"},
            params={"kinds": "snapshot_corrupt"},
        ).json()
        assert [e["detail"]["snapshot"] for e in corrupt] == [state], corrupt
        assert corrupt[0]["detail"]["during"] == "restore"
        push(c, run, 5)
        f = rank_view(c, run)["failover"]
        assert (f["resumed_step"], f["lost_steps"]) == (5, 0), f
        assert_ema(c, run, [0, 1, 2, 3, 4, 5])


def test_no_state_that_reads_back_restarts_the_ema_loudly(fresh_server):
    srv = fresh_server
    srv.start()
    run = "crash-none"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        create(c, run, persist_every_secs=0)
        for step in range(4):
            push(c, run, step)
        state = persist(c, run)
        files = c.get(f"/v1/runs/{run}/snapshots/{state}").json()["files"]
        key = next(f["path"] for f in files if f["part"] == "p")
        caught_up(run, srv, 3)
    flip_a_bit(srv, key)
    srv.kill()
    srv.start(same_port=True)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        f = rank_view(c, run)["failover"]
        assert (f["snapshot"], f["restored_step"], f["last_seen_step"]) == (None, None, 3), f
        push(c, run, 4)
        f = rank_view(c, run)["failover"]
        # Every update step before 4 is lost: the EMA starts again at 4.
        assert (f["resumed_step"], f["lost_steps"]) == (4, 4), f
        assert_ema(c, run, [4])
        deadline = time.monotonic() + 10
        while c.get(f"/v1/runs/{run}").json()["health"] != "degraded":
            assert time.monotonic() < deadline, "the loss must show in the run's health"
            time.sleep(0.1)


def test_a_wall_clock_stepped_back_never_picks_an_older_state(fresh_server, tmp_path):
    clock = Clock(tmp_path / "clock")
    srv = fresh_server
    srv.env.update(clock.env)
    srv.start()
    run = "crash-clock"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        create(c, run, persist_every_secs=0)
        for step in range(10):
            push(c, run, step)
        persist(c, run)
        clock.step(-600_000)  # an NTP step back of ten minutes
        for step in range(10, 20):
            push(c, run, step)
        newest = persist(c, run)
        caught_up(run, srv, 19)
    srv.kill()
    srv.start(same_port=True)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert rank_view(c, run)["last_step"] == 19, "restored an older state"
        f = rank_view(c, run)["failover"]
        assert (f["snapshot"], f["restored_step"]) == (newest, 19), f
        push(c, run, 20)
        assert rank_view(c, run)["failover"]["lost_steps"] == 0
        assert_ema(c, run, list(range(21)))


def test_sigterm_writes_the_final_state_first_whatever_streams_are_open(fresh_server):
    """An open ``/events`` stream must not hold the final state write: a
    SIGKILL 10 s after SIGTERM (well inside Kubernetes' 30 s grace, with
    the server's shutdown timeout at 30 s) still finds every step
    persisted."""
    srv = fresh_server
    srv.args += ["--shutdown-timeout-secs", "30"]
    srv.start()
    run = "term-sse"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        create(c, run, persist_every_secs=0)
        for step in range(6):
            push(c, run, step)
    opened = threading.Event()
    ended = threading.Event()

    def listen():
        try:
            with httpx.Client(base_url=srv.url, timeout=None) as s:
                with s.stream("GET", f"/v1/runs/{run}/events") as r:
                    opened.set()
                    for _ in r.iter_lines():
                        pass
        except httpx.HTTPError:
            pass
        ended.set()

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    assert opened.wait(10)
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(10)
    except Exception:
        pass
    srv.kill()  # the grace period is over
    assert ended.wait(5), "the live stream must end when the server stops"
    srv.start(same_port=True)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert rank_view(c, run)["last_step"] == 5, "the final state was not written"
        f = rank_view(c, run)["failover"]
        assert f["restored_step"] == 5, f
        push(c, run, 6)
        assert rank_view(c, run)["failover"]["lost_steps"] == 0
        assert_ema(c, run, list(range(7)))


@pytest.mark.slow
def test_the_default_persist_interval_loses_seconds(fresh_server):
    """With the run's defaults, a SIGKILL loses at most what a few seconds
    of pushes hold: state is written again once the last write finished
    and the interval passed."""
    srv = fresh_server
    srv.start()
    run = "crash-default"
    every = 0.05  # 20 pushes a second
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        create(c, run)
        interval = c.get(f"/v1/runs/{run}").json()["config"]["persist_every_secs"]
        step = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 12:
            push(c, run, step)
            step += 1
            time.sleep(every)
        last = step - 1
        time.sleep(0.5)
    srv.kill()
    srv.start(same_port=True)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        push(c, run, last + 1)
        f = rank_view(c, run)["failover"]
        lost_seconds = f["lost_steps"] * every
        print(
            f"default persist_every_secs={interval}: {f['lost_steps']} of {last + 1} steps lost "
            f"(about {lost_seconds:.1f} s of pushes at {1 / every:.0f}/s)"
        )
        assert f["lost_steps"] <= (interval + 2) / every, f


def rank_state(rank: int, step: int) -> dict[str, torch.Tensor]:
    """A rank's 1 MiB shard at ``step``."""
    g = torch.Generator().manual_seed(7919 * rank + step)
    return {"w": torch.randn(512, 512, generator=g)}


def test_a_state_write_copies_its_ranks_one_at_a_time_within_the_backlog(fresh_server):
    """A state write copies a rank, writes it and frees it while it copies
    the next, within ``--capture-backlog``: with room for one rank's copy
    it never holds two (``polyak_state_write_held_bytes``). Each rank is
    restored at its own step, exactly, after a SIGKILL."""
    srv = fresh_server
    srv.start("--capture-backlog", "3MiB")
    run = "state-one-rank-at-a-time"
    last = {0: 4, 1: 5, 2: 6, 3: 7}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(
            "/v1/runs",
            json={
                "name": run,
                "world_size": 4,
                "persist_every_secs": 0,
                "profiles": [
                    {"name": "c", "kind": "constant", "beta": BETA},
                    {"name": "s", "kind": "constant", "beta": 0.5},
                ],
            },
        )
        assert r.status_code == 201, r.text
        for rank, top in last.items():
            for step in range(top + 1):
                r = c.put(
                    f"/v1/runs/{run}/ranks/{rank}/steps/{step}",
                    content=safetensors.torch.save(rank_state(rank, step)),
                )
                assert r.status_code == 200, r.text
        sid = persist(c, run)
        row = c.get(f"/v1/runs/{run}/snapshots/{sid}").json()
        assert row["step"] == 7, row
        assert row["detail"]["rank_steps"] == {str(k): v for k, v in last.items()}, row
        # Two profiles of 1 MiB each: one rank's copy is 2 MiB; two would
        # pass the 3 MiB backlog.
        one_rank = 2 * 512 * 512 * 4
        held = metric(c, "polyak_state_write_held_bytes", run)
        assert held == one_rank, f"the state write held {held} bytes of copies at once"
        deadline = time.monotonic() + 10
        while True:
            with sqlite3.connect(srv.data_dir / "polyak.db") as db:
                seen = dict(db.execute("SELECT rank, last_step FROM ranks WHERE run = ?", (run,)))
            if seen == last:
                break
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
    srv.kill()
    srv.start("--capture-backlog", "3MiB", same_port=True)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for rank, top in last.items():
            f = c.get(f"/v1/runs/{run}/ranks/{rank}").json()["failover"]
            assert (f["snapshot"], f["restored_step"], f["last_seen_step"]) == (sid, top, top), f
            for profile, beta in (("c", BETA), ("s", 0.5)):
                want = rank_state(rank, 0)["w"].double()
                for step in range(1, top + 1):
                    want = rank_state(rank, step)["w"].double().lerp(want, beta)
                r = c.get(f"/v1/runs/{run}/ranks/{rank}/ema", params={"profile": profile})
                assert r.status_code == 200, r.text
                got = safetensors.torch.load(r.content)["w"].double()
                assert (got - want).abs().max().item() < 1e-6, (rank, profile)
