"""The post-hoc EMA panel in headless Chromium against the real server: the
weights it shows for a chosen sigma_rel are the API's, the bar chart draws
them, and it produces downloadable derived snapshots (one length and a
sweep, with progress)."""

from __future__ import annotations

import itertools
import math
import time

import httpx
import pytest
import safetensors.torch
import torch
from dashkit import SCREENSHOTS, screenshot
from playwright.sync_api import Page, expect

RUN = "posthoc-panel"


def fed_power_run(
    url: str, name: str, *, world_size: int, snapshot_every: int, steps: int, seed: int
) -> list[int]:
    """A run of two power profiles, steps ``0..steps-1`` pushed by every
    rank; the steps of its complete snapshots, once all are written."""
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(
            "/v1/runs",
            json={
                "name": name,
                "world_size": world_size,
                "snapshot_every": snapshot_every,
                "profiles": [
                    {"name": "p05", "kind": "power", "sigma_rel": 0.05},
                    {"name": "p10", "kind": "power", "sigma_rel": 0.10},
                ],
            },
        )
        assert r.status_code == 201, r.text
        gen = torch.Generator().manual_seed(seed)
        w = torch.zeros(64, 16)
        for step in range(steps):
            w = w + 0.05 + 0.02 * torch.randn(64, 16, generator=gen)
            for rank in range(world_size):
                body = safetensors.torch.save({"w": w + rank, "b": w[0] * 0.5})
                r = c.put(f"/v1/runs/{name}/ranks/{rank}/steps/{step}", content=body)
                assert r.status_code == 200, r.text
        want = len(range(0, steps, snapshot_every))
        for _ in range(600):
            snaps = c.get(f"/v1/runs/{name}/snapshots", params={"status": "complete"}).json()
            if len(snaps["snapshots"]) == want:
                break
            time.sleep(0.05)
        return [s["step"] for s in snaps["snapshots"]]


@pytest.fixture(scope="module")
def power_run(dash_server):
    """Two power profiles, a snapshot every 5 steps, steps 0..30 pushed by
    two ranks."""
    steps = fed_power_run(dash_server.url, RUN, world_size=2, snapshot_every=5, steps=31, seed=1)
    assert steps == [0, 5, 10, 15, 20, 25, 30]
    return RUN


def carrying(answer: dict) -> int:
    """How many sources of a plan carry weight (the rows the table lists)."""
    return sum(abs(w) > 1e-6 for w in answer["targets"][0]["weights"])


def plan_of(url: str, run: str, **params) -> dict:
    r = httpx.get(f"{url}/v1/runs/{run}/posthoc/plan", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def plan(url: str, **params) -> dict:
    return plan_of(url, RUN, **params)


def test_panel_shows_the_weights_and_synthesises(page: Page, dash_server, power_run, tmp_path):
    page.goto(f"{dash_server.url}/#/runs/{RUN}/posthoc")
    rows = page.get_by_test_id("coefficients").locator("tbody tr")
    # 7 snapshots x 2 profiles at the newest step 30; the table lists those
    # that carry weight.
    expect(page.get_by_test_id("posthoc-step")).to_have_value("30")
    expect(rows).to_have_count(carrying(plan(dash_server.url, sigma_rel="0.1", step=30)))

    # Type a length: the table and the chart show the API's weights for it.
    page.get_by_test_id("sigma-value").fill("0.07")
    expect(page.get_by_test_id("plan-sigma")).to_contain_text("0.07")
    want = plan(dash_server.url, sigma_rel="0.07", step=30)
    assert len(want["sources"]) == 14
    expect(rows).to_have_count(carrying(want))
    listed = rows.evaluate_all("rs => rs.map(r => [Number(r.dataset.index), r.dataset.weight])")
    weights = want["targets"][0]["weights"]
    assert [float(w) for _, w in listed] == [weights[i] for i, _ in listed]
    assert [i for i, _ in listed] == [i for i, w in enumerate(weights) if abs(w) > 1e-6]
    residual = page.get_by_test_id("plan-residual").get_attribute("data-residual")
    assert float(residual) == want["targets"][0]["residual"]
    drawn = page.evaluate(
        "() => window.polyak.charts.posthoc.data.slice(1).map(col => col.map(v => v))"
    )
    # One bar series per profile; every source's weight in its own profile's series.
    for i, src in enumerate(want["sources"]):
        col = ["p05", "p10"].index(src["profile"])
        assert drawn[col][i] == want["targets"][0]["weights"][i]
        assert drawn[1 - col][i] is None
    assert abs(sum(weights) - 1) < 1e-12

    # The slider moves sigma_rel on a log axis and the weights follow.
    slider = page.get_by_test_id("sigma-slider")
    before = float(page.get_by_test_id("sigma-value").input_value())
    slider.focus()
    for _ in range(40):
        slider.press("ArrowRight")
    after = float(page.get_by_test_id("sigma-value").input_value())
    assert after > before * 1.1
    want = plan(dash_server.url, sigma_rel=str(after), step=30)
    expect(page.get_by_test_id("plan-sigma")).to_contain_text(f"{after:.4g}"[:4])
    page.wait_for_function(
        "(w) => window.polyak.posthoc && window.polyak.posthoc.plan.targets[0].weights[0] === w",
        arg=want["targets"][0]["weights"][0],
    )

    # Another step: only the sources up to it.
    page.get_by_test_id("posthoc-step").select_option("15")
    page.get_by_test_id("sigma-value").fill("0.07")
    expect(page.get_by_test_id("plan-sigma")).to_contain_text("0.07")
    at15 = plan(dash_server.url, sigma_rel="0.07", step=15)
    assert len(at15["sources"]) == 8
    expect(rows).to_have_count(carrying(at15))
    screenshot(page, "posthoc")

    # Synthesise: a derived snapshot appears, completes and downloads.
    page.get_by_test_id("synthesise").click()
    derived = page.get_by_test_id("derived").locator("tbody tr")
    expect(derived).to_have_count(1)
    row = derived.first
    expect(row).to_have_attribute("data-status", "complete", timeout=60_000)
    sid = row.get_attribute("data-id")
    snap = httpx.get(f"{dash_server.url}/v1/runs/{RUN}/snapshots/{sid}").json()
    assert (snap["kind"], snap["step"], snap["detail"]["sigma_rel"]) == ("posthoc", 15, 0.07)
    with page.expect_download() as info:
        row.locator('a[data-layout="full"]').click()
    path = tmp_path / info.value.suggested_filename
    info.value.save_as(path)
    got = safetensors.torch.load_file(str(path))
    api = safetensors.torch.load(
        httpx.get(f"{dash_server.url}/v1/runs/{RUN}/snapshots/{sid}/download").content
    )
    assert set(got) == {"w", "b"} and all(torch.equal(got[k], api[k]) for k in api)

    # A sweep: one snapshot per value, progress shown, all complete.
    page.get_by_test_id("sweep-values").fill("0.06, 0.08, 0.12")
    page.get_by_test_id("start-sweep").click()
    expect(derived).to_have_count(4)
    for i in range(3):
        expect(derived.nth(i)).to_have_attribute("data-status", "complete", timeout=60_000)
    sigmas = sorted(float(s) for s in derived.locator('[data-field="sigma"]').all_inner_texts())
    assert sigmas == [0.06, 0.07, 0.08, 0.12]
    progress = page.get_by_test_id("posthoc-progress")
    page.wait_for_function(
        "() => { const p = document.querySelector('[data-testid=\"posthoc-progress\"]');"
        " return p && p.value === p.max; }"
    )
    assert progress.is_visible()
    expect(page.locator(".notice")).to_contain_text("3 derived snapshots ready")
    screenshot(page, "posthoc-sweep")


def test_panel_refuses_a_bad_length_with_the_reason(page: Page, console, dash_server, power_run):
    console.allow(r"status of 422")
    page.goto(f"{dash_server.url}/#/runs/{RUN}/posthoc?sigma_rel=0.05")
    expect(page.get_by_test_id("plan-sigma")).to_contain_text("0.05")
    # The panel's other reads settle first: a render they cause would put
    # back the form's values (seen once in a full run: the sweep went out
    # as 0.05 alone and nothing was refused).
    page.wait_for_load_state("networkidle")
    page.get_by_test_id("sweep-values").fill("0.05, 0.5")
    expect(page.get_by_test_id("sweep-values")).to_have_value("0.05, 0.5")
    page.get_by_test_id("start-sweep").click()
    expect(page.locator(".notice")).to_contain_text("sigma_rel: 0.5 is out of range")


MANY = "posthoc-many-sources"

# The x axis of the source chart as drawn: each label's tick position, its
# text's width in the axis font, and the slant.
AXIS_LABELS = """() => {
  const u = window.polyak.charts.posthoc;
  const ax = u.axes[0];
  const measure = document.createElement('canvas').getContext('2d');
  measure.font = ax.font[0];
  return { rotate: ax._rotate || 0, px: ax.font[1],
           labels: ax._splits.map((i, k) => ({ x: u.valToPos(i, 'x'), text: ax._values[k],
                                               width: measure.measureText(ax._values[k]).width })) };
}"""


@pytest.fixture(scope="module")
def many_sources(dash_server):
    """Two power profiles snapshotted at each of 15 steps: 30 sources."""
    steps = fed_power_run(dash_server.url, MANY, world_size=1, snapshot_every=1, steps=15, seed=2)
    assert steps == list(range(15))
    return MANY


def test_many_sources_list_what_carries_weight_and_labels_never_overlap(
    page: Page, dash_server, many_sources
):
    page.goto(f"{dash_server.url}/#/runs/{MANY}/posthoc?sigma_rel=0.07")
    expect(page.get_by_test_id("plan-sigma")).to_contain_text("0.07")
    want = plan_of(dash_server.url, MANY, sigma_rel="0.07", step=14)
    weights = want["targets"][0]["weights"]
    assert len(weights) == 30
    heavy = [i for i, w in enumerate(weights) if abs(w) > 1e-6]
    # Sources far from the length get weights like 1e-40: counted, not listed.
    assert 0 < len(heavy) < 30
    rows = page.get_by_test_id("coefficients").locator("tbody tr")
    expect(rows).to_have_count(len(heavy))
    assert rows.evaluate_all("rs => rs.map(r => Number(r.dataset.index))") == heavy
    note = page.get_by_test_id("unlisted-sources")
    expect(note).to_have_attribute("data-count", str(30 - len(heavy)))
    expect(note).to_contain_text(f"{30 - len(heavy)} more sources")

    for width in (1280, 800):
        page.set_viewport_size({"width": width, "height": 900})
        page.wait_for_function(
            "(w) => { const u = window.polyak.charts.posthoc;"
            " return u && Math.abs(u.width - u.root.parentElement.clientWidth) <= 1; }",
            arg=width,
        )
        page.evaluate(
            "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"
        )
        axis = page.evaluate(AXIS_LABELS)
        labels = axis["labels"]
        assert len(labels) >= 8, labels  # thinned, not emptied
        angle = math.radians(abs(axis["rotate"]))
        for a, b in itertools.pairwise(labels):
            gap = b["x"] - a["x"]
            if angle:
                # Parallel slanted strings: their baselines are gap * sin apart,
                # and need a line's height (1.2 em) between them.
                assert gap * math.sin(angle) >= 1.2 * axis["px"], (width, axis["rotate"], a, b)
            else:
                assert gap >= (a["width"] + b["width"]) / 2 + 2, (width, a, b)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"posthoc-many-{width}.png"), full_page=True)
    page.set_viewport_size({"width": 1280, "height": 900})
