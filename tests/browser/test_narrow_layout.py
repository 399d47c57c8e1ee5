"""What a narrow window (800 px) must still show whole, measured in
headless Chromium: every figure of a rank tile inside its tile (a long wire
ratio "0.26× (delta · fp8_e4m3/128 · polyak-bgz)" wraps instead of running
past the tile's edge), the runs table's right-hand columns (EMA bytes,
device, health) inside the window rather than scrolled out of sight, and
every parameter of every profile in the configuration panel (at 1280 px
too: the panel is a narrow column beside the events)."""

from __future__ import annotations

import polyak
import pytest
import torch
from playwright.sync_api import Page, expect

pytest.importorskip("zstandard")

RUN = "narrow-layout-gpt-medium-lr3e-4-bs1024-warmup2000-cosine-seed1234"
PROFILES = [
    {"name": "p05", "kind": "power", "sigma_rel": 0.05},
    {
        "name": "ema-0.9999-warmup-inverse-gamma-1-power-0.75",
        "kind": "warmup",
        "beta": 0.9999,
        "inv_gamma": 1.0,
        "power": 0.75,
    },
    {"name": "c", "kind": "constant", "beta": 0.99},
]


@pytest.fixture(scope="module")
def narrow_run(dash_server):
    with polyak.Client(dash_server.url) as client:
        run = client.create_run(
            RUN,
            world_size=2,
            mirror=True,
            keyframe_every=50,
            profiles=PROFILES,
            tags=["baseline", "lr-sweep"],
            note="the 800 px layout: long names, every column",
        )
        torch.manual_seed(41)
        model = torch.nn.Linear(256, 64)
        # A delta push, quantised and encoded: the longest wire figure.
        with (
            run.pusher(rank=0, codec="bgz", delta="fp8_e4m3") as p0,
            run.pusher(rank=1, codec="bgz", delta="fp8_e4m3") as p1,
        ):
            for step in range(4):
                with torch.no_grad():
                    model.weight.add_(torch.randn_like(model.weight) * 1e-3)
                p0.push(model, step)
                p1.push(model, step)
        view = run.refresh()
        wires = [run.rank(r)["wire"] for r in (0, 1)]
    return {"view": view, "wires": wires}


def at_width(page: Page, width: int) -> None:
    page.set_viewport_size({"width": width, "height": 900})
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


# Where the text of an element is drawn (its glyphs, not its box).
TEXT_BOX = """(el) => { const r = document.createRange(); r.selectNodeContents(el);
  const b = r.getBoundingClientRect(); return {left: b.left, right: b.right}; }"""

RANK_TILES = f"""() => [...document.querySelectorAll('.rank-tile')].map((tile) => {{
  const box = tile.getBoundingClientRect();
  const textBox = {TEXT_BOX};
  return {{
    rank: tile.dataset.rank, left: box.left, right: box.right,
    scroll: [tile.scrollWidth, tile.clientWidth],
    values: [...tile.querySelectorAll('dd, .rank-step, .rank-head > *')].map((el) => ({{
      field: el.dataset.field || el.className, text: el.textContent, ...textBox(el),
      box: el.getBoundingClientRect().right }})),
  }};
}})"""


def test_rank_tile_values_stay_inside_their_tile_at_800(page: Page, dash_server, narrow_run):
    page.goto(f"{dash_server.url}/#/runs/{RUN}")
    wire = narrow_run["wires"][0]
    ratio = f"{wire['ratio']:.2f}× (delta · fp8_e4m3/128 · polyak-bgz)"
    expect(page.locator('.rank-tile[data-rank="0"] [data-field="wire"]')).to_have_text(ratio)
    at_width(page, 800)
    tiles = page.evaluate(RANK_TILES)
    assert [t["rank"] for t in tiles] == ["0", "1"]
    for t in tiles:
        assert t["scroll"][0] <= t["scroll"][1] + 1, f"rank {t['rank']}: the tile scrolls: {t}"
        for v in t["values"]:
            assert t["left"] - 0.5 <= v["left"] and v["right"] <= t["right"] + 0.5, (
                f"rank {t['rank']}: {v['field']} {v['text']!r} runs past its tile "
                f"({v['left']:.0f}..{v['right']:.0f} in {t['left']:.0f}..{t['right']:.0f})"
            )
            assert v["box"] <= t["right"] + 0.5, f"rank {t['rank']}: {v} past the tile"
    # The whole figure is there, wrapped, not cut.
    wire_cell = next(v for v in tiles[0]["values"] if v["field"] == "wire")
    assert wire_cell["text"] == ratio


RUNS_TABLE = f"""() => {{
  const textBox = {TEXT_BOX};
  const wrap = document.querySelector('.runs-table').closest('.table-wrap');
  const w = wrap.getBoundingClientRect();
  const fields = ['world_size', 'last_step', 'resident_bytes', 'device', 'health'];
  return {{
    wrap: {{ left: w.left, right: w.right, scroll: wrap.scrollWidth, client: wrap.clientWidth }},
    page: [document.documentElement.scrollWidth, document.documentElement.clientWidth],
    headers: [...document.querySelectorAll('.runs-table th')].map((th) => ({{
      text: th.textContent, ...textBox(th) }})),
    rows: [...document.querySelectorAll('.runs-table tr[data-run]')].map((tr) => ({{
      run: tr.dataset.run,
      cells: fields.map((f) => {{ const td = tr.querySelector(`[data-field="${{f}}"]`);
        const b = td.getBoundingClientRect();
        return {{ field: f, text: td.textContent, left: b.left, right: b.right, text_box: textBox(td),
                  visible: getComputedStyle(td).display !== 'none' && b.width > 0 }}; }}),
    }})),
  }};
}}"""


def test_runs_table_shows_every_column_at_800(page: Page, dash_server, narrow_run):
    page.goto(f"{dash_server.url}/#/runs")
    expect(page.locator(f'tr[data-run="{RUN}"]')).to_be_visible()
    at_width(page, 800)
    got = page.evaluate(RUNS_TABLE)
    wrap = got["wrap"]
    assert got["page"][0] <= got["page"][1], f"the page scrolls sideways: {got['page']}"
    assert wrap["scroll"] <= wrap["client"] + 1, (
        f"the runs table is {wrap['scroll']} px wide in {wrap['client']} px: columns scrolled away"
    )
    for th in got["headers"]:
        if th["text"] in ("EMA bytes", "Device", "Health"):
            assert th["right"] <= wrap["right"] + 0.5, f"header {th} is outside the table's view"
    ours = next(r for r in got["rows"] if r["run"] == RUN)
    by_field = {c["field"]: c for c in ours["cells"]}
    view = narrow_run["view"]
    assert by_field["device"]["text"] == view["config"]["device"]
    assert by_field["health"]["text"] == view["health"]
    assert by_field["resident_bytes"]["text"].endswith(("B", "KiB", "MiB", "GiB"))
    for row in got["rows"]:
        for c in row["cells"]:
            assert c["visible"], f"{row['run']}: {c['field']} hidden"
            assert wrap["left"] - 0.5 <= c["left"] and c["right"] <= wrap["right"] + 0.5, (
                f"{row['run']}: the {c['field']} cell ({c['left']:.0f}..{c['right']:.0f}) is "
                f"outside the table's view ({wrap['left']:.0f}..{wrap['right']:.0f})"
            )
            assert c["text_box"]["right"] <= wrap["right"] + 0.5, f"{row['run']}: {c}"


def fmt_param(v: object) -> str:
    """The panel's number format: six significant digits (`fmtNum(v, 6)`)."""
    return f"{v:.6g}" if isinstance(v, float) else str(v)


CONFIG_PROFILES = f"""() => {{
  const textBox = {TEXT_BOX};
  const card = document.querySelector('.config-card');
  const wrap = card.querySelector('.table-wrap');
  const w = wrap.getBoundingClientRect();
  return {{
    card: card.getBoundingClientRect().right,
    wrap: {{ left: w.left, right: w.right, scroll: wrap.scrollWidth, client: wrap.clientWidth }},
    rows: [...card.querySelectorAll('tr[data-profile]')].map((tr) => {{
      const td = tr.querySelector('td:last-child'); // name, kind, parameters
      const name = tr.querySelector('td:first-child');
      return {{ profile: tr.dataset.profile, text: td.textContent, ...textBox(td),
               scroll: [td.scrollWidth, td.clientWidth], name: textBox(name) }};
    }}),
  }};
}}"""


def test_configuration_panel_shows_every_profile_parameter(page: Page, dash_server, narrow_run):
    page.goto(f"{dash_server.url}/#/runs/{RUN}")
    expect(page.locator('.config-card tr[data-profile="p05"]')).to_be_visible()
    profiles = narrow_run["view"]["config"]["profiles"]
    want = {
        p["name"]: " · ".join(
            f"{k} {fmt_param(v)}"
            for k, v in p.items()
            if k not in ("name", "kind") and v is not None
        )
        for p in profiles
    }
    # The server fills in every parameter of a profile (the warm-up's too).
    assert "update_after_step" in want[PROFILES[1]["name"]]
    for width in (1280, 800):
        at_width(page, width)
        got = page.evaluate(CONFIG_PROFILES)
        wrap = got["wrap"]
        assert wrap["scroll"] <= wrap["client"] + 1, (
            f"at {width} px the profiles table is {wrap['scroll']} px wide in {wrap['client']} px"
        )
        assert {r["profile"]: r["text"] for r in got["rows"]} == want
        for r in got["rows"]:
            for part in ("name", None):
                box = r[part] if part else r
                assert wrap["left"] - 0.5 <= box["left"] and box["right"] <= wrap["right"] + 0.5, (
                    f"at {width} px, {r['profile']}'s {part or 'parameters'} run past the panel: "
                    f"{box['left']:.0f}..{box['right']:.0f} in {wrap['left']:.0f}..{wrap['right']:.0f}"
                )
            assert r["scroll"][0] <= r["scroll"][1] + 1, f"at {width} px: {r}"
