"""The run page's Evaluations chart, in headless Chromium against the real
server: its y range is not set by the evaluation of the initial weights
(0.85 at step 0 beside values near 0.17, which must stay apart on the
chart), its "best" is the candidate ``GET /v1/runs/{run}/best`` names (a
post-hoc one included), and two families with the same value at every
step both stay visible (their pixels counted on the canvas)."""

from __future__ import annotations

import time

import httpx
import pytest
import safetensors.torch
import torch
from playwright.sync_api import Page, expect

RUN = "evals-chart"
PROFILES = [
    {"name": "p05", "kind": "power", "sigma_rel": 0.05},
    {"name": "p10", "kind": "power", "sigma_rel": 0.10},
    {"name": "c", "kind": "constant", "beta": 0.9},
]
STEP0 = 0.85  # every candidate at step 0: the initial weights
# val_loss per family at steps 5, 10, 15, 20; `c` equals `p10` at every step.
CURVES = {
    "online": [0.30, 0.26, 0.24, 0.22],
    "p05": [0.25, 0.21, 0.195, 0.186],
    "p10": [0.24, 0.20, 0.18, 0.169],
    "c": [0.24, 0.20, 0.18, 0.169],
}
POSTHOC_SIGMA = 0.07
POSTHOC_LOSS = 0.16  # the run's best: a post-hoc EMA at step 20


@pytest.fixture(scope="module")
def chart_run(dash_server):
    with httpx.Client(base_url=dash_server.url, timeout=60) as c:
        r = c.post(
            "/v1/runs",
            json={
                "name": RUN,
                "world_size": 1,
                "mirror": True,
                "snapshot_every": 5,
                "profiles": PROFILES,
            },
        )
        assert r.status_code == 201, r.text
        gen = torch.Generator().manual_seed(41)
        w = torch.zeros(16, 8)
        for step in range(21):
            w = w + 0.05 + 0.02 * torch.randn(16, 8, generator=gen)
            r = c.put(
                f"/v1/runs/{RUN}/ranks/0/steps/{step}", content=safetensors.torch.save({"w": w})
            )
            assert r.status_code == 200, r.text
        for _ in range(600):
            snaps = c.get(f"/v1/runs/{RUN}/snapshots", params={"status": "complete"}).json()
            if len(snaps["snapshots"]) == 5:
                break
            time.sleep(0.05)
        snaps = snaps["snapshots"]
        assert [s["step"] for s in snaps] == [0, 5, 10, 15, 20]
        (posthoc,) = c.post(f"/v1/runs/{RUN}/posthoc", json={"sigma_rel": [POSTHOC_SIGMA]}).json()[
            "snapshots"
        ]
        for _ in range(600):
            posthoc = c.get(f"/v1/runs/{RUN}/snapshots/{posthoc['id']}").json()
            if posthoc["status"] == "complete":
                break
            time.sleep(0.05)
        assert posthoc["status"] == "complete"

        def post(snapshot: str, profile: str, loss: float) -> None:
            metrics = {"val_loss": loss, "acc": 1 - loss}
            r = c.post(
                f"/v1/runs/{RUN}/evals",
                json={"snapshot": snapshot, "profile": profile, "metrics": metrics},
            )
            assert r.status_code == 201, r.text

        for i, s in enumerate(snaps):
            for family, curve in CURVES.items():
                post(s["id"], family, STEP0 if i == 0 else curve[i - 1])
        post(posthoc["id"], "posthoc", POSTHOC_LOSS)
    return RUN


def open_chart(page: Page, url: str, metric: str = "val_loss") -> None:
    page.goto(f"{url}/#/runs/{RUN}")
    page.wait_for_function(
        "(n) => window.polyak.charts[n] && window.polyak.charts[n].data[0].length === 5",
        arg=f"evals:{metric}",
    )
    page.locator(f'[data-metric="{metric}"]').scroll_into_view_if_needed()
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


SCALE = """(n) => { const u = window.polyak.charts[n];
  return {min: u.scales.y.min, max: u.scales.y.max, height: u.bbox.height / devicePixelRatio,
          gap: Math.abs(u.valToPos(0.169, 'y') - u.valToPos(0.186, 'y'))}; }"""


def test_range_is_not_set_by_the_step0_evaluation(page: Page, dash_server, chart_run):
    open_chart(page, dash_server.url)
    got = page.evaluate(SCALE, "evals:val_loss")
    # Every value after step 0 is drawn; the outlier is left out of the range.
    assert got["min"] <= 0.169 and got["max"] >= 0.30, got
    assert got["max"] < STEP0, f"the y range reaches the step-0 outlier: {got}"
    # 0.169 and 0.186 (the two best profiles at step 20) stand apart.
    assert got["gap"] >= 10, f"0.169 and 0.186 are {got['gap']:.1f} px apart: {got}"
    # The chart's range button shows every point, the outlier included.
    card = page.locator('[data-metric="val_loss"]')
    robust = card.locator('[data-control="robust"]')
    expect(robust).to_have_attribute("aria-pressed", "true")
    robust.click()
    expect(robust).to_have_attribute("aria-pressed", "false")
    assert page.evaluate(SCALE, "evals:val_loss")["max"] >= STEP0


@pytest.mark.parametrize(("metric", "mode"), [("val_loss", "min"), ("acc", "max")])
def test_best_is_the_servers_best(page: Page, dash_server, chart_run, metric, mode):
    best = httpx.get(
        f"{dash_server.url}/v1/runs/{RUN}/best", params={"metric": metric, "mode": mode}
    ).json()
    assert best["evaluation"]["kind"] == "posthoc"
    assert best["evaluation"]["sigma_rel"] == pytest.approx(POSTHOC_SIGMA)
    open_chart(page, dash_server.url, metric)
    shown = page.locator(f'[data-metric="{metric}"] [data-testid="evals-best"]')
    expect(shown).to_have_attribute("data-evaluation", str(best["evaluation"]["id"]))
    value = round(best["value"], 4)
    expect(shown).to_have_text(f"best {value:g}: post-hoc σ_rel {POSTHOC_SIGMA:g} @ step 20")


# The pixels of the plot in each series' colour (within a few levels).
PIXELS = """(n) => {
  const u = window.polyak.charts[n];
  const { left, top, width, height } = u.bbox;
  const img = u.ctx.getImageData(left, top, width, height).data;
  return u.series.slice(1).map((s, k) => {
    const hex = typeof s.stroke === 'function' ? s.stroke(u, k + 1) : s.stroke;
    const rgb = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
    let n = 0;
    for (let o = 0; o < img.length; o += 4) {
      if (Math.abs(img[o] - rgb[0]) <= 12 && Math.abs(img[o + 1] - rgb[1]) <= 12 && Math.abs(img[o + 2] - rgb[2]) <= 12) n += 1;
    }
    return { label: s.label, color: hex, pixels: n };
  });
}"""


def test_coincident_lines_both_stay_visible(page: Page, dash_server, chart_run):
    open_chart(page, dash_server.url)
    # Hover nothing: the cursor's focus would fade the other lines.
    page.mouse.move(0, 0)
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    counts = page.evaluate(PIXELS, "evals:val_loss")
    assert [c["label"] for c in counts] == ["online", "p05", "p10", "c"]
    assert len({c["color"] for c in counts}) == 4
    by = {c["label"]: c["pixels"] for c in counts}
    # p10 is drawn first, c on top of it along the same points: both show.
    assert by["p10"] >= 40 and by["c"] >= 40, counts
    assert by["online"] >= 40 and by["p05"] >= 40, counts
