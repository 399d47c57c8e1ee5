"""The run page shows a failover: two nodes share a PostgreSQL catalog and
an S3 store, the run's two ranks one on each. Node b persists its rank's
state and acknowledges two more steps, then is killed; a takes the rank
over from b's state snapshot. The rank's tile names a's node, says where
the rank came from and the steps it lost (from the rank view, on the node
that never held it before), and the ranks summary counts the failover."""

from __future__ import annotations

import time

import polyak
import pytest
import torch
from playwright.sync_api import Page, expect
from polyak import RetryPolicy
from polyak_testing import Backends, state_step, wait_for

LEASE = 2.0


@pytest.fixture(scope="module")
def backends():
    # Its own services, stopped when the module ends (the session's would
    # keep running through the other browser tests).
    with Backends() as b:
        yield b


@pytest.mark.slow
def test_the_run_page_shows_a_rank_taken_over(page: Page, tmp_path, backends: Backends):
    _, (a, b) = backends.cluster(tmp_path / "nodes", 2, "--lease-secs", str(LEASE))
    a.start()
    b.start()
    try:
        run_name = "failover-view"
        with polyak.Client(a.url) as client:
            run = client.create_run(
                run_name,
                world_size=2,
                persist_every_secs=2,
                profiles=[{"name": "e", "kind": "constant", "beta": 0.9}],
            )
            lost = next(r for r, p in run.placement().items() if p["node"] == "node-b")
            retry = RetryPolicy(base_delay=0.05, max_delay=0.5)
            pushers = [run.pusher(rank=r, retry=retry, split_replicated=False) for r in range(2)]

            def push(step: int) -> None:
                for p in pushers:
                    p.push({"w": torch.full((8,), float(step))}, step)
                for p in pushers:
                    p.flush()

            for step in range(4):
                push(step)
            wait_for(lambda: state_step(a.url, run_name, lost) == 3, 30, "b's state snapshot")
            push(4)
            push(5)
            b.kill()
            push(6)  # delivered to a once it holds the rank
            for p in pushers:
                p.close()

            def reported():
                f = run.rank(lost).get("failover")
                return f if f and f.get("lost_steps") is not None else None

            failover = wait_for(reported, 30, "the failover report")
        assert failover["from_node"] == "node-b" and failover["resumed_step"] == 6
        restored = failover["restored_step"]
        lost_steps = failover["lost_steps"]
        assert lost_steps == 6 - restored - 1

        page.goto(f"{a.url}/#/runs/{run_name}")
        tile = page.locator(f'.rank-tile[data-rank="{lost}"]')
        expect(tile.locator('[data-field="node"]')).to_have_text("node-a")
        shown = tile.locator('[data-field="failover"]')
        word = "step" if lost_steps == 1 else "steps"
        expect(shown).to_have_text(f"from node-b @ {restored} · {lost_steps} {word} lost")
        assert "epoch 2" in (shown.get_attribute("title") or "")
        other = page.locator(f'.rank-tile[data-rank="{1 - lost}"] [data-field="failover"]')
        expect(other).to_have_text("—")
        summary = page.locator('[data-testid="ranks"]').locator("xpath=..").locator(".card-head")
        expect(summary).to_contain_text(f"1 taken over · {lost_steps} {word} lost")
    finally:
        page.goto("about:blank")  # no polling of servers being stopped
        a.stop()
        b.stop()


@pytest.mark.slow
def test_the_run_page_shows_a_rank_restored_after_a_restart(page: Page, tmp_path):
    """A server killed and started again: the rank's tile says it was
    restored after a restart and the steps lost, the summary counts it, and
    the run is `degraded` until the `steps_lost` alert is acknowledged."""
    from polyak_testing import PolyakServer

    srv = PolyakServer(tmp_path / "data")
    srv.start()
    try:
        run_name = "restart-view"
        with polyak.Client(srv.url) as client:
            run = client.create_run(
                run_name,
                persist_every_secs=0,
                profiles=[{"name": "e", "kind": "constant", "beta": 0.9}],
            )
            with run.pusher(policy="block") as pusher:
                for step in range(4):
                    pusher.push({"w": torch.full((8,), float(step))}, step)
                pusher.flush(timeout=30)
                client.request("POST", f"/v1/runs/{run_name}/persist")
                for step in range(4, 7):
                    pusher.push({"w": torch.full((8,), float(step))}, step)
                pusher.flush(timeout=30)
            wait_for(lambda: run.rank(0)["last_step"] == 6, 10, "step 6 applied")
            time.sleep(1)  # the catalog's writer records step 6
        srv.kill()
        srv.start(same_port=True)
        with polyak.Client(srv.url) as client:
            run = client.run(run_name)
            with run.pusher(policy="block") as pusher:
                pusher.push({"w": torch.full((8,), 9.0)}, 9)
                pusher.flush(timeout=30)
            f = wait_for(
                lambda: (
                    (run.rank(0).get("failover") or {}).get("lost_steps") is not None
                    and run.rank(0)["failover"]
                ),
                30,
                "the restart's report",
            )
        assert (f["restart"], f["restored_step"], f["resumed_step"], f["lost_steps"]) == (
            True,
            3,
            9,
            5,
        ), f

        page.goto(f"{srv.url}/#/runs/{run_name}")
        shown = page.locator('.rank-tile[data-rank="0"] [data-field="failover"]')
        expect(shown).to_have_text("restarted @ 3 · 5 steps lost")
        assert "restarted" in (shown.get_attribute("title") or "")
        summary = page.locator('[data-testid="ranks"]').locator("xpath=..").locator(".card-head")
        expect(summary).to_contain_text("1 restored after a restart · 5 steps lost")
        expect(page.locator("[data-health]").first).to_have_attribute("data-health", "degraded")
        again = polyak.Client(srv.url).run(run_name)
        alert = next(a for a in again.alerts()["alerts"] if a["kind"] == "steps_lost")
        acked = again.ack_alert(alert["id"])
        assert acked["state"] == "resolved", acked
        expect(page.locator("[data-health]").first).to_have_attribute(
            "data-health", "healthy", timeout=15000
        )
    finally:
        page.goto("about:blank")
        srv.stop()
