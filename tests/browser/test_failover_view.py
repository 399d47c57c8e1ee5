"""The run page shows a failover: two nodes share a PostgreSQL catalog and
an S3 store, the run's two ranks one on each. Node b persists its rank's
state and acknowledges two more steps, then is killed; a takes the rank
over from b's state snapshot. The rank's tile names a's node, says where
the rank came from and the steps it lost (from the rank view, on the node
that never held it before), and the ranks summary counts the failover."""

from __future__ import annotations

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
