"""The run page's rank tiles show what the wire carried: the ratio of
logical to wire bytes, the push kind, quantisation and encoding, and the
encode / decode time per push."""

from __future__ import annotations

import re

import polyak
import pytest
import torch
from playwright.sync_api import Page, expect
from polyak_testing import check_wire_totals

pytest.importorskip("zstandard")

RUN = "wire-run"


def test_rank_tile_shows_wire_ratio_and_codec(page: Page, dash_server):
    with polyak.Client(dash_server.url) as client:
        run = client.create_run(RUN, mirror=True, keyframe_every=50, exist_ok=True)
        torch.manual_seed(61)
        model = torch.nn.Linear(256, 64)
        with run.pusher(rank=0, codec="bgz", delta="fp8_e4m3") as p:
            for step in range(4):
                with torch.no_grad():
                    model.weight.add_(torch.randn_like(model.weight) * 1e-3)
                p.push(model, step)
        wire = run.rank(0)["wire"]
        engine = run.placement()[0]["engine"]
        node = run.placement()[0]["node"]
    assert wire["last_kind"] == "delta" and wire["last_quant"] == "fp8_e4m3/128"
    page.goto(f"{dash_server.url}/#/runs/{RUN}")
    tile = page.locator('.rank-tile[data-rank="0"]')
    ratio = tile.locator('[data-field="wire"]')
    expect(ratio).to_have_text(f"{wire['ratio']:.2f}× (delta · fp8_e4m3/128 · polyak-bgz)")
    expect(ratio).to_have_attribute(
        "title", re.compile(r"^[\d,]+ wire bytes for [\d,]+ logical bytes$")
    )
    expect(tile.locator('[data-field="codec"]')).to_have_text(re.compile(r"^\S.* / \S.*$"))
    # The engine holding the rank (the placement's), e.g. `cpu` or `cpu#1`.
    expect(tile.locator('[data-field="engine"]')).to_have_text(engine)
    # And the node holding it (this server, the only node).
    expect(tile.locator('[data-field="node"]')).to_have_text(node)
    assert node


def test_run_stats_show_the_ranks_wire_figures_summed(page: Page, dash_server):
    name = "wire-sum-run"
    with polyak.Client(dash_server.url) as client:
        run = client.create_run(name, world_size=2, mirror=True, keyframe_every=50, exist_ok=True)
        torch.manual_seed(62)
        model = torch.nn.Linear(256, 64)
        # Two ranks, two encodings: the run's figures are their sum.
        with (
            run.pusher(rank=0, codec="bgz", delta="int8") as p0,
            run.pusher(rank=1, compress=3) as p1,
        ):
            for step in range(3):
                with torch.no_grad():
                    model.weight.add_(torch.randn_like(model.weight) * 1e-3)
                p0.push(model, step)
                p1.push(model, step)
        view = run.refresh()
        ranks = [run.rank(r)["wire"] for r in (0, 1)]
    wire = view["wire"]
    check_wire_totals(wire, ranks)
    assert ranks[0]["wire_bytes"] > 0 and ranks[1]["wire_bytes"] > 0
    page.goto(f"{dash_server.url}/#/runs/{name}")
    cell = page.locator('[data-testid="wire"]')
    expect(cell).to_have_text(f"{wire['ratio']:.2f}×")
    expect(cell).to_have_attribute(
        "title",
        f"{wire['wire_bytes']:,} wire bytes for {wire['logical_bytes']:,} logical bytes",
    )
    expect(page.locator('[data-testid="codec"]')).to_have_text(re.compile(r"^\S.* / \S.*$"))
