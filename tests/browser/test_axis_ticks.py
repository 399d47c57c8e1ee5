"""Chart tick labels sit on their gridlines: each label drawn on an axis
is the value of the tick it stands for, written with as many decimals as
the tick spacing needs (a tick at 0.025 is not labelled 0.03, the β axis
of Insight's averaging window reads 0.25 and 0.75 where its gridlines
are, not 0.3 and 0.8).

uPlot draws axes on a canvas: the tests read, from the chart instance the
page exposes, the ticks uPlot computed (``axis._splits``) and the labels it
drew for them (``axis._values``), and look in the canvas for the gridline
drawn at each tick's position."""

from __future__ import annotations

import httpx
import pytest
import safetensors.torch
import torch
from playwright.sync_api import Page

RUN = "axis-ticks"
STEPS = 40
PROFILES = [
    {"name": "p05", "kind": "power", "sigma_rel": 0.05},
    {"name": "c", "kind": "constant", "beta": 0.99},
]
# A loss between 0 and 0.1: its axis steps by 0.025.
LOSS = [0.1 * (1 - step / (STEPS - 1)) ** 2 for step in range(STEPS)]


@pytest.fixture(scope="module")
def ticks_run(dash_server):
    with httpx.Client(base_url=dash_server.url, timeout=60) as c:
        r = c.post(
            "/v1/runs",
            json={"name": RUN, "world_size": 1, "drift_every": 1, "profiles": PROFILES},
        )
        assert r.status_code == 201, r.text
        w = torch.zeros(8, 4)
        for step in range(STEPS):
            w = w + 0.01
            r = c.put(
                f"/v1/runs/{RUN}/ranks/0/steps/{step}", content=safetensors.torch.save({"w": w})
            )
            assert r.status_code == 200, r.text
            r = c.post(
                f"/v1/runs/{RUN}/metrics", json={"step": step, "values": {"loss": LOSS[step]}}
            )
            assert r.status_code < 300, r.text
    return RUN


# Each axis of a chart: its scale, the ticks uPlot computed, the labels it
# drew for them and, per tick, what the canvas holds where the tick stands:
# the tick mark beside the plot (always visible, no line crosses it) and
# the share of the plot's width (or height) in the gridline's colour.
READ_AXES = """(name) => {
  const u = window.polyak.charts[name];
  const grid = [0xec, 0xee, 0xf2]; // charts.js AXIS.grid.stroke
  const tick = [0xe3, 0xe6, 0xec]; // charts.js AXIS.ticks.stroke
  const { left, top, width, height } = u.bbox; // canvas pixels
  const img = u.ctx.getImageData(0, 0, u.ctx.canvas.width, u.ctx.canvas.height);
  const is = (rgb, x, y) => {
    const o = (y * img.width + x) * 4;
    return [0, 1, 2].every((k) => Math.abs(img.data[o + k] - rgb[k]) <= 3);
  };
  return u.axes.map((a, i) => {
    if (!a.show || !a._splits) return null;
    const horizontal = a.side % 2 === 0;
    // The tick marks' strip beside the plot, on the axis's side.
    const strip = a.side === 3 ? [left - 8, left - 2] : a.side === 1 ? [left + width + 2, left + width + 8]
      : a.side === 2 ? [top + height + 2, top + height + 8] : [top - 8, top - 2];
    const marks = [];
    const gridline = a._splits.map((v) => {
      const p = u.valToPos(v, a.scale, true);
      const [lo, hi] = horizontal ? [left, left + width] : [top, top + height];
      let mark = 0;
      let best = 0;
      for (const at of [Math.floor(p) - 1, Math.floor(p), Math.ceil(p)]) {
        let m = 0;
        for (let s = Math.ceil(strip[0]); s <= strip[1]; s += 1) m += (horizontal ? is(tick, at, s) : is(tick, s, at)) ? 1 : 0;
        mark = Math.max(mark, m);
        let n = 0;
        if (horizontal) for (let y = Math.ceil(top); y < top + height; y += 1) n += is(grid, at, y) ? 1 : 0;
        else for (let x = Math.ceil(left); x < left + width; x += 1) n += is(grid, x, at) ? 1 : 0;
        best = Math.max(best, n / (horizontal ? height : width));
      }
      marks.push(p < lo - 1 || p > hi + 1 ? null : mark);
      return p < lo + 2 || p > hi - 2 ? null : best; // on the plot's edge: the frame
    });
    return { axis: i, scale: a.scale, splits: Array.from(a._splits), values: Array.from(a._values),
             gridline, marks };
  }).filter(Boolean);
}"""


def numeric(label: str) -> float | None:
    try:
        return float(label.replace(",", ""))
    except ValueError:
        return None  # a label with a unit (bytes, seconds)


def check_labels(axes: list[dict], where: str) -> list[float]:
    """Every numeric label is its tick's value; returns the ticks checked."""
    checked = []
    for a in axes:
        for split, label in zip(a["splits"], a["values"], strict=True):
            if split is None or label in ("", None):
                continue
            value = numeric(str(label))
            if value is None:
                continue
            assert abs(value - split) <= 1e-9 * max(1.0, abs(split)), (
                f"{where} axis {a['axis']} ({a['scale']}): the tick at {split} is labelled "
                f"{label!r}: ticks {a['splits']}, labels {a['values']}"
            )
            checked.append(split)
    return checked


def check_gridlines(a: dict, where: str) -> None:
    """Each labelled tick has its tick mark drawn where its label stands,
    and the gridlines run at those positions."""
    for split, label, mark in zip(a["splits"], a["values"], a["marks"], strict=True):
        if label in ("", None) or mark is None:
            continue
        assert mark >= 3, f"{where}: no tick mark at the tick {split} ({label!r})"
    # Lines may run along a gridline and hide it: most ticks still show theirs.
    drawn = [s for s, share in zip(a["splits"], a["gridline"], strict=True) if (share or 0) > 0.5]
    assert len(drawn) >= 2, f"{where}: gridlines found at {drawn} of {a['splits']}: {a['gridline']}"


def test_tick_labels_have_the_precision_of_their_spacing(page: Page, dash_server, ticks_run):
    page.goto(f"{dash_server.url}/#/runs/{RUN}")
    name = "metric:loss"
    page.wait_for_function(
        f"(n) => window.polyak.charts[n] && window.polyak.charts[n].data[0].length === {STEPS}",
        arg=name,
    )
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    axes = page.evaluate(READ_AXES, name)
    y = next(a for a in axes if a["scale"] == "y")
    # The loss spans 0 to 0.1: uPlot steps its ticks by 0.025.
    assert any(abs(s - 0.025) < 1e-12 for s in y["splits"]), y["splits"]
    labels = dict(zip(y["splits"], y["values"], strict=True))
    assert labels[next(s for s in y["splits"] if abs(s - 0.025) < 1e-12)] == "0.025"
    checked = check_labels(axes, name)
    assert len(checked) >= 6
    check_gridlines(y, f"{name} y")
    # Every other chart of the page too (step axes, drift, pushes/s).
    for other in page.evaluate("() => Object.keys(window.polyak.charts)"):
        check_labels(page.evaluate(READ_AXES, other), other)


def test_insight_beta_axis_is_labelled_at_its_ticks(page: Page, dash_server, ticks_run):
    page.goto(f"{dash_server.url}/#/runs/{RUN}/insight")
    page.wait_for_function(
        "() => window.polyak.charts.window && window.polyak.charts.window.data[0].length > 10"
    )
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    axes = page.evaluate(READ_AXES, "window")
    beta = next(a for a in axes if a["scale"] == "y")
    # β runs from 0 to 0.99: ticks a quarter apart, each labelled with its value.
    assert [s for s in beta["splits"] if 0 <= s <= 1] == [0, 0.25, 0.5, 0.75, 1.0], beta
    assert [v for s, v in zip(beta["splits"], beta["values"], strict=True) if 0 <= s <= 1] == [
        "0",
        "0.25",
        "0.50",
        "0.75",
        "1.00",
    ]
    check_labels(axes, "window")
    check_gridlines(beta, "window β")
