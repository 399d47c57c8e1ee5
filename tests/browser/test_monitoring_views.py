"""The monitoring views in headless Chromium: runs side by side, chart
controls (log axis, exports), tags and the runs filter, alerts, and the
insight page (drift per tensor, averaging window, ingest per rank, system
metrics). The runs are fed by the real client from background processes.

Screenshots of each view at 1280 and 800 px go to artifacts/screenshots/.
"""

from __future__ import annotations

import csv
import io
import re

import httpx
import polyak
import pytest
import torch
from dashkit import RUN, Feeder, screenshot
from playwright.sync_api import Page, expect

# A second run: a short training job with another seed, tagged, posting
# its system metrics.
OTHER = "browser-sweep"
OTHER_STEPS = 25
MODEL_TENSORS = 6  # tests/browser/feeder.py: TinyMLP


@pytest.fixture(scope="module")
def other_run(dash_server, feeder):
    client = polyak.Client(dash_server.url)
    client.create_run(
        OTHER,
        world_size=1,
        profiles=[{"name": "ema", "kind": "constant", "beta": 0.9}],
        tags=["sweep", "seed-1"],
        note="lr sweep, seed 1",
    )
    client.close()
    feed = Feeder(
        dash_server.url,
        OTHER,
        "--steps",
        str(OTHER_STEPS),
        "--seed",
        "1",
        "--interval",
        "0.05",
        "--system-metrics",
    )
    try:
        feed.wait_step(OTHER_STEPS - 1)
        assert feed.proc.wait(60) == 0
        yield OTHER
    finally:
        feed.stop()


def api_series(url: str, run: str, name: str) -> dict[int, float]:
    got = httpx.get(
        f"{url}/v1/runs/{run}/metrics", params={"names": name, "rank": "run"}, timeout=30
    ).json()
    (series,) = got["series"]
    return {p[0]: p[1] for p in series["points"]}


def chart_columns(page: Page, name: str) -> dict:
    return page.evaluate(
        """(name) => { const c = window.polyak.charts[name];
           return {labels: c.series.map(s => s.label),
                   data: c.data.map(col => Array.from(col)),
                   runs: c.polyak.runs || null}; }""",
        name,
    )


def test_two_runs_overlaid_on_one_chart(page: Page, dash_server, feeder, other_run):
    page.goto(f"{dash_server.url}/#/compare?runs={RUN},{OTHER}&metric=loss&smooth=0.5")
    page.wait_for_function(
        "() => window.polyak.charts['compare-runs'] && window.polyak.charts['compare-runs'].data[0].length > 5"
    )
    got = chart_columns(page, "compare-runs")
    assert got["runs"] == [RUN, OTHER]
    assert got["labels"] == ["step", f"{RUN} (raw)", RUN, f"{OTHER} (raw)", OTHER]
    steps = got["data"][0]
    for run, col in ((RUN, 1), (OTHER, 3)):
        want = api_series(dash_server.url, run, "loss")
        drawn = {int(x): y for x, y in zip(steps, got["data"][col], strict=False) if y is not None}
        assert len(drawn) >= 5
        # Every raw point drawn is the API's value at that step.
        assert all(want[x] == y for x, y in drawn.items()), run
    assert set(api_series(dash_server.url, OTHER, "loss")) == {
        int(x) for x, y in zip(steps, got["data"][3], strict=False) if y is not None
    }
    # The selection is in the URL; the legend names each run.
    assert f"runs={RUN},{OTHER}" in page.url.replace("%2C", ",")
    legend = page.locator(".u-legend")
    expect(legend).to_contain_text(OTHER)
    # Wall time as x: same values, seconds since the epoch.
    page.get_by_label("x axis").select_option("time")
    page.wait_for_function("() => window.polyak.charts['compare-runs'].data[0][0] > 1e9")
    assert "x=time" in page.url
    page.get_by_label("x axis").select_option("step")
    page.wait_for_function("() => window.polyak.charts['compare-runs'].data[0][0] < 1e9")
    screenshot(page, "compare-runs")


def test_log_axis_toggles_and_zoom_resets(page: Page, dash_server, feeder):
    page.goto(f"{dash_server.url}/#/runs/{RUN}")
    page.wait_for_function(
        "() => window.polyak.charts['metric:loss'] && window.polyak.charts['metric:loss'].data[0].length > 2"
    )
    card = page.locator(".chart-card", has=page.locator("h3", has_text=re.compile("^loss$")))
    log = card.locator('[data-control="log"]')
    expect(log).to_have_text("linear")
    log.click()
    expect(log).to_have_text("log")
    assert page.evaluate("() => window.polyak.charts['metric:loss'].scales.y.distr") == 3
    assert page.evaluate("() => window.polyak.charts['metric:loss'].polyak.log") is True
    log.click()
    expect(log).to_have_text("linear")
    assert page.evaluate("() => window.polyak.charts['metric:loss'].scales.y.distr") == 1
    # Outlier-ignoring range and zoom reset.
    card.locator('[data-control="robust"]').click()
    assert page.evaluate("() => window.polyak.charts['metric:loss'].polyak.robust") is True
    reset = card.locator('[data-control="reset"]')
    expect(reset).to_be_disabled()
    card.scroll_into_view_if_needed()
    box = page.evaluate(
        """() => { const r = window.polyak.charts['metric:loss'].over.getBoundingClientRect();
           return {x: r.x, y: r.y, w: r.width, h: r.height}; }"""
    )
    page.mouse.move(box["x"] + box["w"] * 0.3, box["y"] + box["h"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["w"] * 0.6, box["y"] + box["h"] / 2, steps=5)
    page.mouse.up()
    expect(reset).to_be_enabled()
    reset.click()
    expect(reset).to_be_disabled()
    scale = page.evaluate(
        """() => { const c = window.polyak.charts['metric:loss'];
           return [c.scales.x.min, c.scales.x.max, c.data[0][0], c.data[0][c.data[0].length - 1]]; }"""
    )
    assert scale[0] <= scale[2] and scale[1] >= scale[3]


def test_csv_export_equals_the_api_series(page: Page, dash_server, other_run):
    page.goto(f"{dash_server.url}/#/compare?runs={OTHER}&metric=loss&smooth=0")
    page.wait_for_function(
        f"() => window.polyak.charts['compare-runs'] && window.polyak.charts['compare-runs'].data[0].length === {OTHER_STEPS}"
    )
    with page.expect_download() as dl:
        page.locator('[data-control="csv"]').click()
    rows = list(csv.reader(io.StringIO(dl.value.path().read_text())))
    assert rows[0] == ["step", f"{OTHER} (raw)", OTHER]
    want = api_series(dash_server.url, OTHER, "loss")
    assert {int(r[0]): float(r[1]) for r in rows[1:]} == want
    # Smoothing 0: the smoothed line is the raw one.
    assert all(r[1] == r[2] for r in rows[1:])
    with page.expect_download() as dl:
        page.locator('[data-control="json"]').click()
    import json

    data = json.loads(dl.value.path().read_text())
    assert data["x"]["values"] == sorted(want)
    assert data["series"][0]["values"] == [want[s] for s in sorted(want)]


def test_tag_filter_narrows_the_runs_list(page: Page, dash_server, feeder, other_run):
    page.goto(f"{dash_server.url}/#/runs")
    rows = page.locator("tbody tr[data-run]")
    expect(page.locator(f'tr[data-run="{OTHER}"]')).to_be_visible()
    total = rows.count()
    assert total >= 2
    other = page.locator(f'tr[data-run="{OTHER}"]')
    expect(other.locator('[data-field="note"]')).to_have_text("lr sweep, seed 1")
    other.locator('[data-tag="sweep"]').click()
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-run", OTHER)
    assert "tag=sweep" in page.url
    screenshot(page, "runs-filtered")
    # Clearing the tag, then the text filter matches names, tags and notes.
    page.locator(".runs-filter .tag.active").click()
    expect(rows).to_have_count(total)
    # Words of its note and tags (other tests' runs on this server have
    # "seed" and "1" in their names, none has "sweep").
    page.get_by_label("filter runs").fill("sweep seed")
    expect(rows).to_have_count(1)
    page.get_by_label("filter runs").fill(RUN)
    expect(page.locator(f'tr[data-run="{RUN}"]')).to_be_visible()
    expect(page.locator(f'tr[data-run="{OTHER}"]')).to_have_count(0)
    # Selected runs open side by side.
    page.get_by_label("filter runs").fill("")
    page.locator(f'input[data-select="{RUN}"]').check()
    page.locator(f'input[data-select="{OTHER}"]').check()
    page.locator('[data-testid="compare-selected"]').click()
    expect(page).to_have_url(re.compile(r"#/compare\?runs="))
    page.wait_for_function("() => window.polyak.charts['compare-runs']")


def test_a_refresh_during_a_press_does_not_lose_the_click(
    page: Page, dash_server, feeder, other_run
):
    """The list refreshes every 5 s by redrawing its table. A press that
    spans a refresh (button down, the table redrawn, button up) must still
    click the tag: the redraw waits for the release."""
    page.goto(f"{dash_server.url}/#/runs")
    rows = page.locator("tbody tr[data-run]")
    updated = page.locator('span[aria-live="polite"]')
    expect(updated).to_contain_text("updated")
    chip = page.locator(f'tr[data-run="{OTHER}"] [data-tag="sweep"]')
    box = chip.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    stamp = updated.text_content()
    page.mouse.down()
    # A refresh lands while the button is held (the list polls every 5 s).
    expect(updated).not_to_have_text(stamp or "", timeout=12_000)
    page.mouse.up()
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-run", OTHER)
    assert "tag=sweep" in page.url


def test_tags_and_note_edit_on_the_run_page(page: Page, dash_server, other_run):
    page.goto(f"{dash_server.url}/#/runs/{OTHER}")
    tags = page.get_by_label("tags", exact=True)
    expect(tags).to_have_value("sweep, seed-1")
    tags.fill("sweep, seed-1, keep")
    page.get_by_label("note", exact=True).fill("best of the sweep")
    page.locator('[data-testid="save-annotations"]').click()
    expect(page.locator('[data-saved="true"]')).to_be_visible()
    got = httpx.get(f"{dash_server.url}/v1/runs/{OTHER}").json()
    assert got["tags"] == ["sweep", "seed-1", "keep"]
    assert got["note"] == "best of the sweep"


def expect_alerts_badge(page: Page, run: polyak.Run, firing: int) -> None:
    """The run page's alerts badge counts ``firing`` alerts; if not, the
    failure lists the run's alerts as the server has them."""
    badge = page.locator('[data-testid="alerts-badge"]')
    try:
        expect(badge).to_have_attribute("data-firing", str(firing), timeout=10_000)
        if firing:
            expect(badge).to_have_text(f"{firing} alert{'' if firing == 1 else 's'}")
        else:
            expect(badge).to_have_text("")
    except AssertionError as err:
        alerts = run.alerts()
        listed = "\n".join(f"  {a['key']} {a['state']}: {a['message']}" for a in alerts["alerts"])
        raise AssertionError(
            f"{err}\nthe server has {alerts['firing']} firing for `{run.name}`:\n{listed}"
        ) from err


def test_stale_rank_alert_appears_and_clears(page: Page, dash_server):
    threshold = 2.0
    client = polyak.Client(dash_server.url)
    # Only the stale-rank rule may fire here: the disk rule (on by default)
    # follows the free space of the disk holding the data dir, which is the
    # test machine's business, and would add its own alert to the count.
    run = client.create_run(
        "browser-stale",
        world_size=1,
        alerts={"stale_after_seconds": threshold, "disk_free_below": 0},
    )
    pusher = run.pusher(rank=0)
    model = torch.nn.Linear(4, 2)
    try:
        pusher.push(model, 0)
        pusher.flush(timeout=30)
        page.goto(f"{dash_server.url}/#/runs/browser-stale")
        firing = page.locator(
            '[data-testid="alerts"] li[data-alert-key="stale_rank:0"][data-state="firing"]'
        )
        expect(firing).to_be_visible(timeout=threshold * 1000 + 10_000)
        expect_alerts_badge(page, run, 1)
        (alert,) = [a for a in run.alerts()["alerts"] if a["key"] == "stale_rank:0"]
        # Fired past the threshold after the push the server recorded, within
        # the evaluator's one-second tick (and some slack).
        pushed_at_ms = run.rank(0)["last_push_at_ms"]
        assert threshold < (alert["fired_at_ms"] - pushed_at_ms) / 1000 <= threshold + 3
        assert alert["fired_step"] == 0
        screenshot(page, "run-alerts")
        pusher.push(model, 1)
        pusher.flush(timeout=30)
        # The rank pushed: the alert clears. A longer threshold keeps the
        # now idle rank from going stale again while the page is checked.
        run.annotate(alerts={"stale_after_seconds": 600, "disk_free_below": 0})
        resolved = page.locator(
            '[data-testid="alerts"] li[data-alert-key="stale_rank:0"][data-state="resolved"]'
        )
        expect(resolved).to_be_visible(timeout=10_000)
        (cleared,) = [a for a in run.alerts()["alerts"] if a["id"] == alert["id"]]
        assert (cleared["state"], cleared["resolved_step"]) == ("resolved", 1)
        expect_alerts_badge(page, run, 0)
        page.locator(f'[data-testid="alerts"] [data-ack="{alert["id"]}"]').click()
        expect(resolved.locator("text=acknowledged")).to_be_visible()
    finally:
        pusher.close()
        client.close()


def test_insight_page_drift_heatmap_window_and_ingest(page: Page, dash_server, feeder, other_run):
    page.goto(f"{dash_server.url}/#/runs/{RUN}/insight")
    labels = page.locator('[data-testid="heatmap-ema"] .heatmap-row')
    expect(labels).to_have_count(MODEL_TENSORS)
    page.wait_for_function("() => window.polyak.heatmaps && window.polyak.heatmaps.ema")
    shown = page.evaluate("() => window.polyak.heatmaps.ema")
    api = httpx.get(
        f"{dash_server.url}/v1/runs/{RUN}/drift/tensors", params={"profile": "ema"}
    ).json()
    assert shown["tensors"] == api["tensors"]
    assert [labels.nth(i).get_attribute("data-tensor") for i in range(MODEL_TENSORS)] == api[
        "tensors"
    ]
    # The feeder keeps pushing: compare the steps both have, complete on the page.
    api_at = {s: [row[j] for row in api["values"]] for j, s in enumerate(api["steps"])}
    common = 0
    for j, s in enumerate(shown["steps"]):
        column = [row[j] for row in shown["values"]]
        if s in api_at and None not in column:
            assert column == api_at[s]
            common += 1
    assert common >= 3
    # Each profile's window, and the ingest timeline with both ranks.
    expect(page.locator('[data-testid="heatmap-edm"] .heatmap-row')).to_have_count(MODEL_TENSORS)
    page.wait_for_function(
        "() => window.polyak.charts.window && window.polyak.charts.window.data[0].length > 1"
    )
    labels_w = page.evaluate("() => window.polyak.charts.window.series.map(s => s.label)")
    assert labels_w[1:] == ["β ema", "half-life ema", "β edm", "half-life edm"]
    betas = page.evaluate("() => Array.from(window.polyak.charts.window.data[1]).slice(1)")
    assert all(b == pytest.approx(0.99) for b in betas)
    page.wait_for_function(
        "() => window.polyak.charts['ingest-ranks'] && window.polyak.charts['ingest-ranks'].series.length === 3"
    )
    screenshot(page, "insight")
    # The sweep run posted system metrics for rank 0.
    page.goto(f"{dash_server.url}/#/runs/{OTHER}/insight")
    page.wait_for_function("() => window.polyak.charts['sys:sys/rss_bytes']")
    rss = page.evaluate("() => Array.from(window.polyak.charts['sys:sys/rss_bytes'].data[1])")
    assert rss and all(v is None or v > 1e6 for v in rss)
    assert (
        page.evaluate("() => window.polyak.charts['sys:sys/rss_bytes'].series[1].label") == "rank 0"
    )
    screenshot(page, "insight-system")
