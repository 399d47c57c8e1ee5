"""A finished run on the dashboard: health and ranks say ``finished`` (not
degraded or stale), the run page says at which step; and the snapshots
table shows no stray ``null`` under it."""

from __future__ import annotations

import polyak
import torch
from playwright.sync_api import Page, expect

RUN = "finished-run"


def test_finished_run_shows_finished(page: Page, dash_server):
    with polyak.Client(dash_server.url) as client:
        run = client.create_run(RUN, world_size=2, exist_ok=True)
        torch.manual_seed(60)
        model = torch.nn.Linear(4, 2)
        pushers = [run.pusher(rank=r) for r in (0, 1)]
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(0.1)
            for p in pushers:
                p.push(model, step)
        for p in pushers:
            p.close()
        answer = run.finish()
        assert answer["snapshot"]["status"] == "complete"
        assert run.refresh()["health"] == "finished"

    page.goto(f"{dash_server.url}/#/runs")
    row = page.locator(f'tr[data-run="{RUN}"]')
    expect(row.locator('[data-field="health"]')).to_have_text("finished")

    page.goto(f"{dash_server.url}/#/runs/{RUN}")
    expect(page.get_by_test_id("finished")).to_have_text("finished at step 2")
    for rank in range(2):
        tile = page.locator(f'.rank-tile[data-rank="{rank}"]')
        expect(tile.locator(".rank-status")).to_have_text("finished")

    page.goto(f"{dash_server.url}/#/runs/{RUN}/snapshots")
    final = page.locator("tbody tr", has_text="final")
    expect(final).to_have_attribute("data-status", "complete")
    card = page.locator("section.card", has=page.locator("table.snapshots-table"))
    expect(card).not_to_contain_text("null")
