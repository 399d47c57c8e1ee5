"""Every dashboard page and ``/docs`` at 1280 and 800 px, on a large run with
long names (1024 ranks, long run, profile and tensor names): nothing
overflows the window sideways, no number is cut short (the run header's
figures included), a name cut short carries its full text as a tooltip,
no control is narrower than its text, and every chart has exactly one
toolbar, also after the post-hoc tab's sigma_rel and step change and the
compare tab's chart is redrawn."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import safetensors.torch
import torch
from dashkit import SCREENSHOTS, WIDTHS
from playwright.sync_api import Page, expect

RUN = "gpt-medium-pretraining-lr3e-4-bs1024-warmup2000-cosine-seed1234-dec06"
OTHER = "gpt-medium-pretraining-lr1e-4-bs1024-warmup2000-cosine-seed1234-dec06"
WORLD_SIZE = 1024
STEPS = 2  # 0 and 1, a snapshot at each
PROFILES = [
    {"name": "p05", "kind": "power", "sigma_rel": 0.05},
    {"name": "p10", "kind": "power", "sigma_rel": 0.10},
    {"name": "ema-0.9999-warmup-inverse-gamma-1-power-0.75", "kind": "warmup", "beta": 0.9999},
]
TENSORS = (
    "model.transformer.encoder.layers.23.self_attention.query_key_value.weight",
    "model.transformer.encoder.layers.23.mlp.dense_4h_to_h.bias",
)

# A figure: digits with separators, units, ratios, percentages.
NUMBER = re.compile(r"[\d\s.,/%×+\-]*\d[\d\s.,/%×+\-]*(\s?[A-Za-z]{1,3}(/s)?)?")


def push_all(c: httpx.Client, run: str, world_size: int, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    base = {name: torch.randn(8, 4, generator=gen) for name in TENSORS}

    local = threading.local()
    clients: list[httpx.Client] = []

    def rank(r: int) -> None:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=str(c.base_url), timeout=120)
            clients.append(local.client)
        for step in range(steps):
            body = safetensors.torch.save(
                {n: (t + 0.01 * step + r).contiguous() for n, t in base.items()}
            )
            answer = local.client.put(f"/v1/runs/{run}/ranks/{r}/steps/{step}", content=body)
            assert answer.status_code == 200, answer.text

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(rank, range(world_size)))
    for own in clients:
        own.close()


@pytest.fixture(scope="module")
def large_run(dash_server):
    with httpx.Client(base_url=dash_server.url, timeout=120) as c:
        for name, size in ((RUN, WORLD_SIZE), (OTHER, 2)):
            r = c.post(
                "/v1/runs",
                json={
                    "name": name,
                    "world_size": size,
                    "snapshot_every": 1,
                    "drift_every": 1,
                    "profiles": PROFILES,
                },
            )
            assert r.status_code == 201, r.text
            push_all(c, name, size, STEPS, seed=len(name))
            for step in range(STEPS):
                r = c.post(
                    f"/v1/runs/{name}/metrics",
                    json={"step": step, "values": {"loss": 1.0 / (step + 1)}},
                )
                assert r.status_code < 300, r.text
        deadline = time.monotonic() + 120
        while True:
            snaps = c.get(
                f"/v1/runs/{RUN}/snapshots", params={"status": "complete", "kind": "periodic"}
            ).json()
            if len(snaps["snapshots"]) == STEPS or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert [s["step"] for s in snaps["snapshots"]] == [0, 1]
        ids = [s["id"] for s in snaps["snapshots"]]
    return {"snapshots": ids}


def settle(page: Page) -> None:
    """Waits until nothing on the page says it is loading, then two frames
    (charts follow their container one frame after a resize)."""
    page.wait_for_function(
        "() => !document.querySelector('.state.loading, .spinner')"
        " && !/Loading/.test(document.getElementById('content')?.textContent || '')"
    )
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


# Runs in the page: what would make it look unfinished at this width.
INSPECT = """() => {
  const doc = document.documentElement;
  const cut = [];
  for (const el of document.querySelectorAll('body *')) {
    if (el.scrollWidth <= el.clientWidth + 1 || !el.getClientRects().length) continue;
    const cs = getComputedStyle(el);
    const clips = cs.textOverflow === 'ellipsis' || cs.overflowX === 'hidden' || cs.overflowX === 'clip';
    if (!clips) continue;
    const text = (el.textContent || '').trim();
    if (!text || el.querySelector('canvas')) continue;
    const titled = el.closest('[title]');
    cut.push({ tag: el.tagName, cls: String(el.className), text: text.slice(0, 120),
               title: titled ? titled.getAttribute('title') : '',
               inStat: Boolean(el.closest('.stat')) });
  }
  const narrow = [];
  for (const s of document.querySelectorAll('select')) {
    if (!s.getClientRects().length || !s.selectedOptions.length) continue;
    // The width the chosen option's text asks for.
    const clone = s.cloneNode(false);
    clone.append(s.selectedOptions[0].cloneNode(true));
    clone.style.cssText = 'position:absolute;visibility:hidden;width:auto;min-width:0;max-width:none;flex:none';
    document.body.append(clone);
    const natural = clone.getBoundingClientRect().width;
    clone.remove();
    const width = s.getBoundingClientRect().width;
    if (width + 1 < natural) narrow.push({ label: s.getAttribute('aria-label'), text: s.selectedOptions[0].textContent, width, natural });
  }
  const bodies = [...document.querySelectorAll('.chart-body')].filter((b) => b.querySelector('.uplot'));
  const toolbars = bodies.map((b) => [b.querySelectorAll('.uplot').length, b.querySelectorAll('.chart-controls').length]);
  const stats = [...document.querySelectorAll('.stat-value')].map((v) => [v.textContent, v.scrollWidth, v.clientWidth]);
  return { scrollWidth: doc.scrollWidth, clientWidth: doc.clientWidth, cut, narrow, toolbars, stats };
}"""


def check(page: Page, name: str, full_page: bool = True) -> dict:
    """Every check at both widths; a screenshot of each (of the window
    only with ``full_page=False``: /docs is tens of thousands of px tall)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    seen = {}
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        settle(page)
        got = page.evaluate(INSPECT)
        page.screenshot(path=str(SCREENSHOTS / f"layout-{name}-{width}.png"), full_page=full_page)
        where = f"{name} at {width} px"
        assert got["scrollWidth"] <= got["clientWidth"], (
            f"{where}: the page is {got['scrollWidth']} px wide in a {got['clientWidth']} px window"
        )
        for c in got["cut"]:
            assert not c["inStat"] and not NUMBER.fullmatch(c["text"]), (
                f"{where}: a figure is cut: {c}"
            )
            assert c["title"] and c["text"].rstrip("…") in c["title"], (
                f"{where}: a name is cut with no tooltip holding it: {c}"
            )
        assert got["narrow"] == [], f"{where}: selects narrower than their text: {got['narrow']}"
        for text, scroll, client in got["stats"]:
            assert scroll <= client + 1, f"{where}: the figure {text!r} does not fit its box"
        assert all(t == [1, 1] for t in got["toolbars"]), (
            f"{where}: toolbars per chart: {got['toolbars']}"
        )
        seen[width] = got
    page.set_viewport_size({"width": WIDTHS[0], "height": 900})
    return seen


def test_run_pages_fit_at_1280_and_800(page: Page, dash_server, large_run):
    base = f"{dash_server.url}/#/runs/{RUN}"
    page.goto(f"{dash_server.url}/#/runs")
    expect(page.locator(f'tr[data-run="{RUN}"]')).to_be_visible()
    check(page, "runs")

    page.goto(base)
    expect(page.get_by_test_id("ranks-seen")).to_have_text(f"{WORLD_SIZE} / {WORLD_SIZE}")
    expect(page.get_by_test_id("last-step")).to_have_text("1")
    check(page, "run")

    page.goto(f"{base}/snapshots")
    expect(page.locator("tbody tr").first).to_be_visible()
    check(page, "snapshots")

    a, b = large_run["snapshots"]
    page.goto(f"{base}/compare?a={a}&b={b}")
    expect(page.get_by_test_id("summary-rel-diff")).to_be_visible()
    check(page, "compare")

    page.goto(f"{base}/insight")
    expect(page.locator(".heatmap-row").first).to_be_visible()
    check(page, "insight")

    page.goto(f"{dash_server.url}/#/compare?runs={RUN},{OTHER}&metric=loss")
    page.wait_for_function("() => window.polyak.charts['compare-runs']")
    check(page, "compare-runs")

    page.goto(f"{dash_server.url}/#/nodes")
    check(page, "nodes")


def test_docs_fit_at_1280_and_800(page: Page, dash_server):
    page.goto(f"{dash_server.url}/docs")
    expect(page.locator("section.op").first).to_be_visible()
    check(page, "docs", full_page=False)


def test_one_toolbar_per_chart_after_redraws(page: Page, dash_server, large_run):
    page.goto(f"{dash_server.url}/#/runs/{RUN}/posthoc")
    rows = page.get_by_test_id("coefficients").locator("tbody tr")
    expect(rows.first).to_be_visible()
    # Five sigma_rel changes, then another step (other sources, another chart).
    for sigma in ("0.06", "0.07", "0.08", "0.09", "0.11"):
        page.get_by_test_id("sigma-value").fill(sigma)
        expect(page.get_by_test_id("plan-sigma")).to_contain_text(sigma)
    page.get_by_test_id("posthoc-step").select_option("0")
    expect(page.get_by_test_id("posthoc-step")).to_have_value("0")
    page.get_by_test_id("sigma-value").fill("0.12")
    expect(page.get_by_test_id("plan-sigma")).to_contain_text("0.12")
    assert page.locator(".chart-controls").count() == page.locator(".uplot").count() == 1
    check(page, "posthoc")

    # The compare tab redraws its chart when the scale or the filter changes.
    a, b = large_run["snapshots"]
    page.goto(f"{dash_server.url}/#/runs/{RUN}/compare?a={a}&b={b}")
    expect(page.get_by_test_id("summary-rel-diff")).to_be_visible()
    for _ in range(3):
        page.get_by_label("log").first.click()
    assert page.locator(".chart-controls").count() == page.locator(".uplot").count()
    check(page, "compare-redrawn")
