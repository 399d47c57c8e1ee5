"""Evaluations on the dashboard, in headless Chromium against the real
server: the run page's Evaluations chart draws the API's evaluations (one
line per candidate family), the snapshots table has a sortable column per
metric with the best marked, the post-hoc tab draws the metric against
sigma_rel (its points are the evaluations, poorly fitted ones hollow, the
best marked, a click opens its download), and compare runs shows each
run's best value in the legend. Screenshots at 1280 and 800 px."""

from __future__ import annotations

import time

import httpx
import pytest
import safetensors.torch
import torch
from dashkit import screenshot
from playwright.sync_api import Page, expect

RUN = "evals-view"
OTHER = "evals-view-b"
SIGMAS = [0.01, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2]
PROFILES = [
    {"name": "p05", "kind": "power", "sigma_rel": 0.05},
    {"name": "p10", "kind": "power", "sigma_rel": 0.10},
    {"name": "c", "kind": "constant", "beta": 0.9},
]


def loss(step: int, sigma: float | None, offset: float) -> float:
    """A curve with a minimum near sigma_rel 0.07, falling with the step."""
    base = 3.0 - step / 20
    return base + offset if sigma is None else base + 40 * (sigma - 0.07) ** 2


def make_run(c: httpx.Client, name: str, shift: float) -> dict:
    r = c.post(
        "/v1/runs",
        json={
            "name": name,
            "world_size": 1,
            "mirror": True,
            "snapshot_every": 5,
            "profiles": PROFILES,
        },
    )
    assert r.status_code == 201, r.text
    gen = torch.Generator().manual_seed(3)
    w = torch.zeros(32, 8)
    for step in range(21):
        w = w + 0.05 + 0.02 * torch.randn(32, 8, generator=gen)
        r = c.put(f"/v1/runs/{name}/ranks/0/steps/{step}", content=safetensors.torch.save({"w": w}))
        assert r.status_code == 200, r.text
    c.post(f"/v1/runs/{name}/metrics", json={"step": 20, "values": {"loss": 1.0 + shift}})
    c.post(f"/v1/runs/{name}/metrics", json={"step": 10, "values": {"loss": 2.0 + shift}})
    for _ in range(600):
        snaps = c.get(f"/v1/runs/{name}/snapshots", params={"status": "complete"}).json()[
            "snapshots"
        ]
        if len(snaps) == 5:
            break
        time.sleep(0.05)
    assert [s["step"] for s in snaps] == [0, 5, 10, 15, 20]
    sweep = c.post(f"/v1/runs/{name}/posthoc", json={"sigma_rel": SIGMAS}).json()["snapshots"]
    for _ in range(600):
        rows = [c.get(f"/v1/runs/{name}/snapshots/{s['id']}").json() for s in sweep]
        if all(r["status"] == "complete" for r in rows):
            break
        time.sleep(0.05)
    assert all(r["status"] == "complete" for r in rows)
    offsets = {"p05": 0.05, "p10": 0.02, "c": 0.1, "online": 0.3}
    for s in snaps:
        for profile in ("p05", "p10", "c", "online"):
            sigma = {"p05": 0.05, "p10": 0.10}.get(profile)
            value = loss(s["step"], sigma, offsets[profile]) + shift
            metrics = {"val_loss": value, "acc": 1 / value}
            r = c.post(
                f"/v1/runs/{name}/evals",
                json={"snapshot": s["id"], "profile": profile, "metrics": metrics},
            )
            assert r.status_code == 201, r.text
    for row in rows:
        value = loss(20, row["detail"]["sigma_rel"], 0) + shift
        r = c.post(
            f"/v1/runs/{name}/evals",
            json={
                "snapshot": row["id"],
                "profile": "posthoc",
                "metrics": {"val_loss": value, "acc": 1 / value},
            },
        )
        assert r.status_code == 201, r.text
    return {"snaps": snaps, "posthoc": rows}


@pytest.fixture(scope="module")
def evals_run(dash_server):
    with httpx.Client(base_url=dash_server.url, timeout=60) as c:
        made = make_run(c, RUN, 0.0)
        make_run(c, OTHER, 0.5)
    return made


def api_evals(url: str, run: str = RUN, **params) -> list[dict]:
    return httpx.get(f"{url}/v1/runs/{run}/evals", params=params, timeout=30).json()["evals"]


def test_evaluations_chart_is_the_apis(page: Page, dash_server, evals_run, console):
    page.goto(f"{dash_server.url}/#/runs/{RUN}")
    name = "evals:val_loss"
    page.wait_for_function(
        "(n) => window.polyak.charts[n] && window.polyak.charts[n].data[0].length === 5", arg=name
    )
    got = page.evaluate(
        "(n) => { const c = window.polyak.charts[n];"
        " return {labels: c.series.map(s => s.label), data: c.data.map(col => Array.from(col))}; }",
        name,
    )
    # One line per family: online first, then the profiles in the run's order.
    assert got["labels"] == ["step", "online", "p05", "p10", "c"]
    want: dict[str, dict[int, float]] = {}
    for e in api_evals(dash_server.url, metric="val_loss"):
        if e["kind"] in ("ema", "online"):
            want.setdefault(e["profile"], {})[e["step"]] = e["metrics"]["val_loss"]
    steps = [int(x) for x in got["data"][0]]
    assert steps == [0, 5, 10, 15, 20]
    for i, family in enumerate(got["labels"][1:], start=1):
        assert dict(zip(steps, got["data"][i], strict=True)) == want[family], family
    expect(page.get_by_test_id("evals-summary")).to_contain_text(
        f"{len(api_evals(dash_server.url))} evaluations"
    )
    # The best named is the server's: the post-hoc EMA at the loss's minimum.
    best = httpx.get(f"{dash_server.url}/v1/runs/{RUN}/best", params={"metric": "val_loss"}).json()
    shown = page.locator('[data-metric="val_loss"] [data-testid="evals-best"]')
    expect(shown).to_have_attribute("data-evaluation", str(best["evaluation"]["id"]))
    expect(shown).to_contain_text("post-hoc σ_rel 0.07 @ step 20")
    page.get_by_test_id("evals").scroll_into_view_if_needed()
    screenshot(page, "evals-run")
    assert not console.unexpected(), console.errors


def test_snapshot_table_metric_columns_sort_and_mark_the_best(
    page: Page, dash_server, evals_run, console
):
    page.goto(f"{dash_server.url}/#/runs/{RUN}/snapshots")
    page.get_by_test_id("download-profile").select_option("p10")
    header = page.locator('th[data-metric="val_loss"]')
    expect(header).to_be_visible()
    best = httpx.get(f"{dash_server.url}/v1/runs/{RUN}/best", params={"metric": "val_loss"}).json()
    marked = page.locator('td[data-metric="val_loss"][data-best="true"]')
    expect(marked).to_have_count(1)
    row = marked.locator("xpath=ancestor::tr")
    assert row.get_attribute("data-id") == best["evaluation"]["snapshot"]
    # Sorted by the metric: ascending values (rows without one last).
    header.click()
    cells = page.locator('tbody td[data-metric="val_loss"]')
    values = [v for v in cells.evaluate_all("cs => cs.map(c => c.dataset.value)")]
    numbers = [float(v) for v in values if v]
    assert numbers == sorted(numbers) and len(numbers) >= 5
    assert all(v for v in values[: len(numbers)])
    page.locator('th[data-metric="val_loss"]').click()
    values = [float(v) for v in cells.evaluate_all("cs => cs.map(c => c.dataset.value)") if v]
    assert values == sorted(values, reverse=True)
    assert not console.unexpected(), console.errors


def test_sigma_chart_points_are_the_evaluations_and_open_the_best(
    page: Page, dash_server, evals_run, console
):
    page.goto(f"{dash_server.url}/#/runs/{RUN}/posthoc")
    page.wait_for_function("() => window.polyak.sigma && window.polyak.sigma.posthoc.length === 7")
    shown = page.evaluate("() => window.polyak.sigma")
    assert shown["metric"] == "acc"  # metrics sorted; pick val_loss
    page.get_by_test_id("sigma-metric").select_option("val_loss")
    page.wait_for_function("() => window.polyak.sigma.metric === 'val_loss'")
    shown = page.evaluate("() => window.polyak.sigma")
    posthoc = [
        e for e in api_evals(dash_server.url, kind="posthoc", metric="val_loss") if e["step"] == 20
    ]
    assert [(p["id"], p["sigma_rel"], p["value"], p["residual"]) for p in shown["posthoc"]] == [
        (e["id"], e["sigma_rel"], e["metrics"]["val_loss"], e["residual"])
        for e in sorted(posthoc, key=lambda e: e["sigma_rel"])
    ]
    assert [p["hollow"] for p in shown["posthoc"]] == [
        e["residual"] > 0.05 for e in sorted(posthoc, key=lambda e: e["sigma_rel"])
    ]
    live = [
        e
        for e in api_evals(dash_server.url, kind="ema", metric="val_loss")
        if e["step"] == 20 and e["sigma_rel"]
    ]
    assert sorted((p["sigma_rel"], p["value"]) for p in shown["live"]) == sorted(
        (e["sigma_rel"], e["metrics"]["val_loss"]) for e in live
    )
    # The best marked is the API's best of those candidates.
    candidates = {e["id"]: e for e in [*posthoc, *live]}
    best_id = min(candidates, key=lambda i: candidates[i]["metrics"]["val_loss"])
    assert shown["best"]["id"] == best_id
    api_best = httpx.get(
        f"{dash_server.url}/v1/runs/{RUN}/best", params={"metric": "val_loss", "kind": "posthoc"}
    ).json()
    assert api_best["evaluation"]["id"] == best_id
    # The chart draws exactly these points (x: sigma_rel on a log axis).
    drawn = page.evaluate(
        "() => { const c = window.polyak.charts.sigma; return {x: c.scales.x.distr,"
        " data: c.data.map(col => Array.from(col))}; }"
    )
    assert drawn["x"] == 3
    xs = drawn["data"][0]
    assert xs == sorted({*SIGMAS, 0.05, 0.1})
    best_col = drawn["data"][5]
    assert [x for x, v in zip(xs, best_col, strict=True) if v is not None] == [
        shown["best"]["sigma_rel"]
    ]
    expect(page.locator('[data-testid="sigma-table"] tr[data-best="true"]')).to_have_count(1)
    # A click on the best point opens its download.
    page.evaluate(
        "() => { window.__opened = []; window.open = (u) => { window.__opened.push(u); }; }"
    )
    # The chart in the viewport: the mouse clicks where it is drawn.
    page.get_by_test_id("sigma-chart").scroll_into_view_if_needed()
    pos = page.evaluate(
        """(s) => { const c = window.polyak.charts.sigma;
           const r = c.over.getBoundingClientRect();
           return {x: r.left + c.valToPos(s.sigma_rel, 'x'), y: r.top + c.valToPos(s.value, 'y')}; }""",
        shown["best"],
    )
    page.mouse.move(pos["x"], pos["y"])
    page.mouse.click(pos["x"], pos["y"])
    page.wait_for_function("() => window.__opened.length === 1")
    opened = page.evaluate("() => window.__opened[0]")
    e = candidates[best_id]
    assert f"/snapshots/{e['snapshot']}/download" in opened and f"profile={e['profile']}" in opened
    served = httpx.get(f"{dash_server.url}{opened}" if opened.startswith("/") else opened).content
    assert served == httpx.get(f"{dash_server.url}{api_best['download']}").content
    screenshot(page, "evals-sigma")
    assert not console.unexpected(), console.errors


def test_compare_legend_shows_each_runs_best(page: Page, dash_server, evals_run, console):
    page.goto(f"{dash_server.url}/#/compare?runs={RUN},{OTHER}&metric=loss&smooth=0")
    page.wait_for_function(
        "() => window.polyak.charts['compare-runs'] && window.polyak.charts['compare-runs'].polyak.bests"
    )
    got = page.evaluate(
        "() => { const c = window.polyak.charts['compare-runs'];"
        " return {labels: c.series.map(s => s.label), bests: c.polyak.bests}; }"
    )
    for run in (RUN, OTHER):
        want = httpx.get(
            f"{dash_server.url}/v1/runs/{run}/best", params={"metric": "val_loss"}
        ).json()
        assert got["bests"][run]["val_loss"]["value"] == want["value"]
        acc = httpx.get(
            f"{dash_server.url}/v1/runs/{run}/best", params={"metric": "acc", "mode": "max"}
        ).json()
        assert got["bests"][run]["acc"]["value"] == acc["value"]
        label = next(lbl for lbl in got["labels"] if lbl.startswith(f"{run} ·"))
        assert "best val_loss" in label and "best acc" in label
    expect(page.locator(".u-legend")).to_contain_text("best val_loss")
    assert not console.unexpected(), console.errors
