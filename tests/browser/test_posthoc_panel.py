"""The post-hoc EMA panel in headless Chromium against the real server: the
weights it shows for a chosen sigma_rel are the API's, the bar chart draws
them, and it produces downloadable derived snapshots (one length and a
sweep, with progress)."""

from __future__ import annotations

import time

import httpx
import pytest
import safetensors.torch
import torch
from dashkit import screenshot
from playwright.sync_api import Page, expect

RUN = "posthoc-panel"


@pytest.fixture(scope="module")
def power_run(dash_server):
    """Two power profiles, a snapshot every 5 steps, steps 0..30 pushed by
    two ranks."""
    with httpx.Client(base_url=dash_server.url, timeout=60) as c:
        r = c.post(
            "/v1/runs",
            json={
                "name": RUN,
                "world_size": 2,
                "snapshot_every": 5,
                "profiles": [
                    {"name": "p05", "kind": "power", "sigma_rel": 0.05},
                    {"name": "p10", "kind": "power", "sigma_rel": 0.10},
                ],
            },
        )
        assert r.status_code == 201, r.text
        gen = torch.Generator().manual_seed(1)
        w = torch.zeros(64, 16)
        for step in range(31):
            w = w + 0.05 + 0.02 * torch.randn(64, 16, generator=gen)
            for rank in range(2):
                body = safetensors.torch.save({"w": w + rank, "b": w[0] * 0.5})
                r = c.put(f"/v1/runs/{RUN}/ranks/{rank}/steps/{step}", content=body)
                assert r.status_code == 200, r.text
        for _ in range(600):
            snaps = c.get(f"/v1/runs/{RUN}/snapshots", params={"status": "complete"}).json()
            if len(snaps["snapshots"]) == 7:
                break
            time.sleep(0.05)
        assert [s["step"] for s in snaps["snapshots"]] == [0, 5, 10, 15, 20, 25, 30]
    return RUN


def plan(url: str, **params) -> dict:
    r = httpx.get(f"{url}/v1/runs/{RUN}/posthoc/plan", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_panel_shows_the_weights_and_synthesises(page: Page, dash_server, power_run, tmp_path):
    page.goto(f"{dash_server.url}/#/runs/{RUN}/posthoc")
    rows = page.get_by_test_id("coefficients").locator("tbody tr")
    expect(rows).to_have_count(14)  # 7 snapshots x 2 profiles, at the newest step 30
    expect(page.get_by_test_id("posthoc-step")).to_have_value("30")

    # Type a length: the table and the chart show the API's weights for it.
    page.get_by_test_id("sigma-value").fill("0.07")
    expect(page.get_by_test_id("plan-sigma")).to_contain_text("0.07")
    want = plan(dash_server.url, sigma_rel="0.07", step=30)
    weights = [float(w) for w in rows.evaluate_all("rs => rs.map(r => r.dataset.weight)")]
    assert weights == want["targets"][0]["weights"]
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
    expect(rows).to_have_count(8)
    page.get_by_test_id("sigma-value").fill("0.07")
    expect(page.get_by_test_id("plan-sigma")).to_contain_text("0.07")
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
    page.get_by_test_id("sweep-values").fill("0.05, 0.5")
    page.get_by_test_id("start-sweep").click()
    expect(page.locator(".notice")).to_contain_text("sigma_rel: 0.5 is out of range")
