"""The dashboard in headless Chromium against the real server, fed by a
training process that pushes a small model with the Python client.

Each page is screenshotted at 1280 and 800 px into artifacts/screenshots/.
"""

from __future__ import annotations

import re

import httpx
import polyak
import pytest
import safetensors.torch
import torch
from dashkit import RUN, WORLD_SIZE, screenshot
from playwright.sync_api import Page, expect
from polyak_testing import PolyakServer

# The feeder's model (tests/browser/feeder.py: TinyMLP).
MODEL_SHAPES = {
    "embed.weight": (32, 16),
    "embed.bias": (32,),
    "norm.weight": (32,),
    "norm.bias": (32,),
    "head.weight": (4, 32),
    "head.bias": (4,),
}


def step_number(text: str) -> int:
    return int(text.replace(",", "").strip())


def test_runs_list_shows_the_run(page: Page, dash_server, feeder):
    page.goto(f"{dash_server.url}/#/runs")
    row = page.locator(f'tr[data-run="{RUN}"]')
    expect(row).to_be_visible()
    expect(row.locator('[data-field="world_size"]')).to_have_text(str(WORLD_SIZE))
    expect(row.locator('[data-field="profiles"]')).to_contain_text("ema")
    expect(row.locator('[data-field="profiles"]')).to_contain_text("edm")
    expect(row.locator('[data-field="device"]')).to_have_text("cpu")
    expect(row.locator('[data-field="health"]')).to_have_text("healthy")
    expect(row.locator('[data-field="created"]')).to_contain_text("ago")
    # The data dir's free space and the reserve, from /livez.
    expect(page.locator("#disk-free")).to_contain_text(
        re.compile(r"disk free [\d.]+ \w+ \(reserve 512 MiB\)")
    )
    expect(row.locator('[data-field="resident_bytes"]')).to_have_text(
        re.compile(r"^\d[\d.]* (B|KiB)$")
    )
    assert step_number(row.locator('[data-field="last_step"]').inner_text()) >= 0
    screenshot(page, "runs")
    row.get_by_role("link", name=RUN).click()
    expect(page).to_have_url(re.compile(rf"#/runs/{RUN}$"))
    expect(page.locator("h1")).to_have_text(RUN)


def test_run_page_shows_every_rank_and_steps_rise_live(page: Page, dash_server, feeder):
    page.goto(f"{dash_server.url}/#/runs/{RUN}")
    tiles = page.locator('[data-testid="ranks"] .rank-tile')
    expect(tiles).to_have_count(WORLD_SIZE)
    for rank in range(WORLD_SIZE):
        tile = page.locator(f'.rank-tile[data-rank="{rank}"]')
        expect(tile.locator(".rank-status")).to_have_text("live")
        expect(tile.locator('[data-field="last_step"]')).to_have_text(re.compile(r"^\d[\d,]*$"))
    expect(page.locator("#conn")).to_have_text("live")
    expect(page.locator('.event[data-kind="rank_registered"]')).to_have_count(WORLD_SIZE)

    # The last-step figure rises with no reload: a marker on `window` survives.
    page.evaluate("() => { window.__sameDocument = true; }")
    first = step_number(page.get_by_test_id("last-step").inner_text())
    page.wait_for_function(
        """(first) => Number(document.querySelector('[data-testid="last-step"]')
                .textContent.replace(/,/g, '')) >= first + 3""",
        arg=first,
    )
    for rank in range(WORLD_SIZE):
        page.wait_for_function(
            """([rank, first]) => Number(document.querySelector(
                `.rank-tile[data-rank="${rank}"] [data-field="last_step"]`)
                .textContent.replace(/,/g, '')) >= first + 3""",
            arg=[rank, first],
        )
    assert page.evaluate("() => window.__sameDocument") is True
    # The figure is the server's own (give or take the steps pushed meanwhile).
    server_step = httpx.get(f"{dash_server.url}/v1/runs/{RUN}").json()["last_step"]
    shown = step_number(page.get_by_test_id("last-step").inner_text())
    assert first + 3 <= shown <= server_step + 50
    screenshot(page, "run")


def test_metrics_chart_draws_the_posted_loss(page: Page, dash_server, feeder):
    feeder.wait_step(20)
    page.goto(f"{dash_server.url}/#/runs/{RUN}")
    series = httpx.get(
        f"{dash_server.url}/v1/runs/{RUN}/metrics", params={"names": "loss", "rank": "run"}
    ).json()["series"]
    posted = [[p[0], p[1]] for p in series[0]["points"]]
    assert len(posted) >= 20
    # Every point the API holds now is in the chart's data, value for value.
    page.wait_for_function(
        """(posted) => {
            const chart = window.polyak.charts['metric:loss'];
            if (!chart || chart.data.length < 3) return false;
            const shown = new Map(Array.from(chart.data[0]).map((x, i) => [x, chart.data[1][i]]));
            return posted.every(([step, value]) => shown.get(step) === value);
        }""",
        arg=posted,
    )
    chart = page.evaluate(
        """() => {
            const c = window.polyak.charts['metric:loss'];
            return {steps: Array.from(c.data[0]), raw: Array.from(c.data[1]),
                    labels: c.series.map(s => s.label), xmin: c.scales.x.min, xmax: c.scales.x.max,
                    drawn: c.root.querySelector('canvas').width > 0};
        }"""
    )
    assert chart["labels"][:3] == ["step", "loss", "loss (smoothed)"]
    assert chart["steps"] == sorted(set(chart["steps"]))
    shown = dict(zip(chart["steps"], chart["raw"], strict=True))
    assert all(shown[step] == value for step, value in posted)
    assert chart["drawn"] and chart["xmin"] <= posted[0][0] and chart["xmax"] >= posted[-1][0]

    # The smoothing slider changes the smoothed line, never the raw one.
    slider = page.get_by_test_id("smoothing")
    slider.fill("0")
    page.wait_for_function(
        """() => { const c = window.polyak.charts['metric:loss'];
                   return c.data[2].every((v, i) => v === c.data[1][i]); }"""
    )
    slider.fill("0.9")
    page.wait_for_function(
        """() => { const c = window.polyak.charts['metric:loss'];
                   return c.data[2].some((v, i) => v !== null && v !== c.data[1][i]); }"""
    )
    assert page.evaluate("() => window.polyak.charts['metric:loss'].data[1][0]") == posted[0][1]

    # The server's series: EMA drift per profile, ingest throughput, push latency.
    page.wait_for_function(
        """() => { const c = window.polyak.charts;
                   return c.drift && c.drift.data[0].length > 0 && c.ingest && c.ingest.data[0].length > 0
                       && c.push_latency && c.push_latency.data[0].length > 0; }""",
        timeout=30_000,
    )
    assert page.evaluate("() => window.polyak.charts.drift.series.map(s => s.label)") == [
        "step",
        "ema",
        "edm",
    ]
    lr = page.locator('[data-metric="lr"]')
    expect(lr).to_be_visible()


def test_take_snapshot_and_download_full(page: Page, dash_server, feeder, tmp_path):
    page.goto(f"{dash_server.url}/#/runs/{RUN}/snapshots")
    page.get_by_test_id("snapshot-label").fill("from-the-browser")
    page.get_by_test_id("take-snapshot").click()
    row = page.locator("tbody tr", has_text="from-the-browser")
    expect(row).to_have_count(1)
    expect(row).to_have_attribute("data-status", "complete", timeout=60_000)
    snap_id = row.get_attribute("data-id")
    assert snap_id
    snap = httpx.get(f"{dash_server.url}/v1/runs/{RUN}/snapshots/{snap_id}").json()
    assert (snap["kind"], snap["label"], snap["status"]) == (
        "manual",
        "from-the-browser",
        "complete",
    )
    expect(row.locator('[data-field="step"]')).to_have_text(f"{snap['step']:,}")
    expect(row.locator('[data-field="kind"]')).to_have_text("manual")
    expect(row.locator('[data-field="size"]')).to_have_text(re.compile(r"KiB$"))
    expect(row.locator('a[data-layout="sharded"]')).to_have_attribute(
        "href", re.compile(r"layout=sharded")
    )

    with page.expect_download() as info:
        row.locator('a[data-layout="full"]').click()
    download = info.value
    path = tmp_path / download.suggested_filename
    download.save_as(path)
    assert path.suffix == ".safetensors"
    tensors = safetensors.torch.load_file(str(path))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == MODEL_SHAPES
    # The same bytes the Python client downloads for that snapshot.
    client = polyak.Client(dash_server.url)
    try:
        ref = client.run(RUN).download(snap_id, profile="ema")
    finally:
        client.close()
    for name, tensor in tensors.items():
        assert torch.equal(tensor, ref[name]), name
    screenshot(page, "snapshots")


def test_delete_snapshot_asks_first(page: Page, dash_server, feeder):
    client = polyak.Client(dash_server.url)
    try:
        snap = client.run(RUN).snapshot(label="to-delete")
    finally:
        client.close()
    page.goto(f"{dash_server.url}/#/runs/{RUN}/snapshots")
    row = page.locator(f'tr[data-id="{snap["id"]}"]')
    expect(row).to_have_attribute("data-status", "complete")
    row.locator('[data-action="delete"]').click()
    dialog = page.locator("dialog.modal[open]")
    expect(dialog).to_contain_text(snap["id"])
    dialog.get_by_role("button", name="Cancel").click()
    expect(dialog).to_have_count(0)
    expect(row).to_have_count(1)
    row.locator('[data-action="delete"]').click()
    page.locator("dialog.modal[open]").get_by_role("button", name="Delete").click()
    expect(row).to_have_count(0)
    gone = httpx.get(f"{dash_server.url}/v1/runs/{RUN}/snapshots/{snap['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "snapshot_not_found"


def test_compare_matches_the_api(page: Page, dash_server, feeder):
    client = polyak.Client(dash_server.url)
    try:
        run = client.run(RUN)
        a = run.snapshot(label="compare-a")
        feeder.wait_step(a["step"] + 5)
        b = run.snapshot(label="compare-b")
    finally:
        client.close()
    want = {"a": a["id"], "b": b["id"], "profile": "ema", "profile_b": "edm"}
    api = httpx.get(f"{dash_server.url}/v1/runs/{RUN}/compare", params=want).json()
    assert {t["name"] for t in api["tensors"]} == set(MODEL_SHAPES)

    page.goto(f"{dash_server.url}/#/runs/{RUN}/compare")
    page.get_by_test_id("side-a").select_option(a["id"])
    page.get_by_test_id("side-b").select_option(b["id"])
    page.get_by_test_id("profile-a").select_option("ema")
    page.get_by_test_id("profile-b").select_option("edm")
    page.wait_for_function(
        """(want) => { const c = window.polyak.compare;
                       return c && c.response.a === want.a && c.response.b === want.b
                           && c.response.profile === want.profile && c.response.profile_b === want.profile_b; }""",
        arg=want,
    )
    expect(page).to_have_url(re.compile(rf"compare\?a={a['id']}&b={b['id']}&profile=ema"))
    rows = page.locator('[data-testid="compare-table"] tbody tr')
    expect(rows).to_have_count(len(api["tensors"]))
    shown = page.evaluate(
        """() => Array.from(document.querySelectorAll('[data-testid="compare-table"] tbody tr'))
                 .map(r => [r.dataset.name, Number(r.dataset.relDiff),
                            r.querySelector('[data-field="rel_diff"]').textContent])"""
    )
    expected = {t["name"]: t["rel_diff"] for t in api["tensors"]}
    assert {name: rel for name, rel, _ in shown} == expected
    for name, rel, text in shown:
        assert float(text) == pytest.approx(rel, rel=1e-3), name
    bars = page.evaluate("() => Array.from(window.polyak.charts.compare.data[1])")
    assert bars == [t["rel_diff"] for t in api["tensors"]]

    # Sortable: rel. diff, largest first.
    page.locator('th[data-key="rel_diff"]').click()
    expect(page.locator('th[data-key="rel_diff"]')).to_have_attribute("aria-sort", "descending")
    order = page.evaluate(
        """() => Array.from(document.querySelectorAll('[data-testid="compare-table"] tbody tr'))
                 .map(r => r.dataset.name)"""
    )
    assert order == sorted(expected, key=lambda n: -expected[n])
    # Filterable.
    page.get_by_test_id("tensor-filter").fill("bias")
    expect(rows).to_have_count(sum("bias" in n for n in expected))
    page.get_by_test_id("tensor-filter").fill("")
    expect(rows).to_have_count(len(expected))
    screenshot(page, "compare")


def test_auth_asks_for_a_token_once(page: Page, console, tmp_path):
    srv = PolyakServer(tmp_path / "data", "--token", "admin-secret-0123456789")
    srv.start()
    try:
        created = httpx.post(
            f"{srv.url}/v1/runs",
            json={"name": "secret-run", "world_size": 1},
            headers={"Authorization": "Bearer admin-secret-0123456789"},
        )
        assert created.status_code == 201
        read_token = created.json()["read_token"]
        # The first request answers 401 before the token is entered.
        console.allow(r"status of 401")
        page.goto(f"{srv.url}/#/runs")
        dialog = page.locator("#token-dialog")
        expect(dialog).to_be_visible()
        screenshot(page, "token")
        dialog.get_by_label("token").fill(read_token)
        dialog.get_by_role("button", name="Use token").click()
        expect(page.locator('tr[data-run="secret-run"]')).to_be_visible()
        # Kept for the session: a reload does not ask again.
        page.reload()
        expect(page.locator('tr[data-run="secret-run"]')).to_be_visible()
        expect(page.locator("#token-dialog")).to_have_count(0)
        # The event stream carries it too (EventSource sends no headers).
        page.goto(f"{srv.url}/#/runs/secret-run")
        expect(page.locator("#conn")).to_have_text("live")
        expect(page.locator('.event[data-kind="run_created"]')).to_have_count(1)
        assert page.evaluate("() => sessionStorage.getItem('polyak.token')") == read_token
    finally:
        page.goto("about:blank")  # the page's event stream ends before its server
        srv.stop()


def test_docs_page_and_error_state(page: Page, console, dash_server):
    page.goto(f"{dash_server.url}/docs")
    expect(page.locator("h1")).to_have_text("polyak API")
    expect(page.locator("section.op").first).to_be_visible()
    expect(page.get_by_role("link", name="dashboard")).to_have_attribute("href", "/")
    console.allow(r"status of 404")
    page.goto(f"{dash_server.url}/#/runs/no-such-run")
    expect(page.locator(".state.error")).to_contain_text("run_not_found")
    expect(page.get_by_role("button", name="Retry")).to_be_visible()
