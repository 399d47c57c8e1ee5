// Charts on uPlot (static/vendor/uplot, loaded as the global `uPlot`).
// Every chart is registered in `window.polyak.charts[name]` as its uPlot
// instance, so tests and curious users can read `chart.data`.

const PALETTE = ['#3451b2', '#d9480f', '#2b8a3e', '#ae3ec9', '#0c8599', '#e67700', '#c2255c', '#5c940d', '#495057', '#7048e8'];

export function color(i) {
  return PALETTE[i % PALETTE.length];
}

/** `#rrggbb` with an alpha, as rgba(). */
export function fade(hex, alpha) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${(n >> 16) & 255}, ${(n >> 8) & 255}, ${n & 255}, ${alpha})`;
}

export function registry() {
  window.polyak = window.polyak || {};
  window.polyak.charts = window.polyak.charts || {};
  return window.polyak.charts;
}

/**
 * TensorBoard's smoothing: an exponential moving average with weight `w`
 * in [0, 1), debiased for the first points; non-finite values pass through.
 */
export function smoothEma(values, w) {
  if (!(w > 0)) return values.slice();
  const out = new Array(values.length);
  let last = 0;
  let n = 0;
  for (let i = 0; i < values.length; i += 1) {
    const v = values[i];
    if (v === null || !Number.isFinite(v)) {
      out[i] = v;
      continue;
    }
    last = last * w + (1 - w) * v;
    n += 1;
    out[i] = last / (1 - w ** n);
  }
  return out;
}

/**
 * Series with their own x values -> uPlot's aligned data: the sorted union
 * of every x, each series null where it has no point.
 * `list`: `[{xs: number[], ys: number[]}]`.
 */
export function alignByX(list) {
  const all = new Set();
  for (const s of list) for (const x of s.xs) all.add(x);
  const xs = Float64Array.from(all).sort();
  const index = new Map();
  xs.forEach((x, i) => index.set(x, i));
  const columns = list.map((s) => {
    const col = new Array(xs.length).fill(null);
    s.xs.forEach((x, i) => {
      col[index.get(x)] = s.ys[i];
    });
    return col;
  });
  return [Array.from(xs), ...columns];
}

/**
 * The decimals that write `incr` exactly: 5 -> 0, 0.25 -> 2, 0.025 -> 3.
 * uPlot steps its ticks by 1, 2, 2.5 and 5 times a power of ten, so a tick
 * needs as many decimals as its step, not as the step's order of magnitude
 * (0.025 written with two would be 0.03, off its gridline).
 */
export function decimalsOf(incr) {
  if (!(incr > 0) || !Number.isFinite(incr)) return 2;
  for (let d = 0; d <= 12; d += 1) {
    const scaled = incr * 10 ** d;
    if (Math.abs(scaled - Math.round(scaled)) <= 1e-6 * Math.max(1, scaled)) return d;
  }
  return 12;
}

/** A tick label with as many decimals as the tick spacing needs. */
export function fmtTick(v, incr) {
  if (v === null || v === undefined) return '';
  if (v === 0) return '0';
  const a = Math.abs(v);
  if (a >= 1e6 || a < 1e-4) {
    const exponent = Math.floor(Math.log10(a));
    const digits = incr > 0 ? decimalsOf(incr / 10 ** exponent) : 2;
    return v.toExponential(Math.min(6, digits)).replace('e+', 'e');
  }
  return v.toFixed(decimalsOf(incr));
}

/** A tick of a log axis (1, 2, 5 times a power of ten): its significant digits only. */
function fmtLogTick(v) {
  if (v === null || v === undefined) return '';
  const exact = Number(v.toPrecision(6)); // a split's float error dropped
  const a = Math.abs(exact);
  return a >= 1e6 || a < 1e-4 ? exact.toExponential().replace('e+', 'e') : String(exact);
}

/**
 * uPlot's padded range, except that a nearly flat series (a learning rate
 * changing in its ninth digit) gets a visible band around it instead of a
 * zero-height scale that draws nothing.
 */
function linearRange(u, min, max) {
  if (min === null || max === null || !Number.isFinite(min) || !Number.isFinite(max)) return [0, 1];
  const [lo, hi] = uPlot.rangeNum(min, max, 0.1, true);
  if (hi - lo > Math.abs(hi) * 1e-9 && hi > lo) return [lo, hi];
  const pad = Math.abs(max) * 0.01 || 1;
  return [min - pad, max + pad];
}

/** Step axes tick at whole steps: 1, 2, 5, 10, 20, 50, ... */
const STEP_INCRS = Array.from({ length: 30 }, (_, i) => [1, 2, 5][i % 3] * 10 ** Math.floor(i / 3));

/** Time axes step by whole seconds at least. */
const TIME_INCRS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800];

function axisSize(self, values) {
  if (!values || !values.length) return 50;
  const longest = Math.max(...values.map((v) => (v === null || v === undefined ? 0 : String(v).length)));
  return Math.max(40, longest * 7 + 18);
}

const AXIS = { stroke: '#5b6474', grid: { stroke: '#eceef2', width: 1 }, ticks: { stroke: '#e3e6ec', width: 1 } };

/**
 * @typedef {(v: number) => string} Fmt
 * @typedef {object} ChartSeries
 * @property {string} label
 * @property {string} [color]
 * @property {number} [width]
 * @property {number[]} [dash]
 * @property {string} [scale]
 * @property {Fmt} [fmt]
 * @property {boolean} [bars]
 * @property {string} [fill]
 * @property {{size?: number, fill?: string}} [marker] The points' size and fill (when shown).
 * @typedef {object} ChartX
 * @property {string} [label]
 * @property {boolean} [time]
 * @property {boolean} [integer]
 * @property {Fmt} [fmt]
 * @property {(u: any, splits: number[]) => string[]} [values]
 * @property {any} [range] A uPlot scale range.
 * @property {object} [axis] uPlot axis options laid over ours.
 * @typedef {object} ChartY
 * @property {Fmt} [fmt]
 * @property {Fmt} [legend]
 * @property {boolean} [log]
 * @property {boolean} [zero]
 * @property {string} [label]
 * @property {boolean} [robust] Start with the range that ignores outliers.
 */

/**
 * A line (or bar) chart in `container`.
 *
 * - `series`: `[{label, color, width?, dash?, scale?, fmt?, bars?, fill?}]` (y series).
 * - `x`: `{label, time?, integer?, fmt?, values?, range?, axis?}`; `time: true` wants seconds since
 *   the epoch, `integer: true` ticks at whole numbers (steps).
 * - `y`: `{fmt?, legend?, log?, zero?, label?, robust?}` (`fmt` for ticks and legend, `legend` for the legend
 *   only, `zero` to start the axis at 0, as bars want, `robust` to start with the range that ignores
 *   outliers); `y2`: a second axis on the right for series with `scale: 'y2'`.
 *   Without `fmt`, a tick is written with the decimals of the tick spacing (`fmtTick`).
 *
 * Returns `{plot, update(data), destroy()}`; `update` keeps the user's zoom.
 * @param {HTMLElement} container
 * @param {string} name
 * @param {object} options
 * @param {ChartSeries[]} options.series
 * @param {ChartX} [options.x]
 * @param {ChartY} [options.y]
 * @param {ChartY | null} [options.y2]
 * @param {number} [options.height]
 * @param {boolean} [options.controls]
 */
export function createChart(container, name, { series, x = {}, y = {}, y2 = null, height = 220, controls = true }) {
  // What the user chose with the chart's controls; a rebuild keeps it.
  const view = { log: Boolean(y.log), robust: Boolean(y.robust) };
  let plot = null;
  let source = null; // the data as given, before the log axis drops values <= 0
  let zoomed = false;

  function build() {
    const width = Math.max(240, container.clientWidth || 600);
    const yFmt = y.fmt || y.legend || ((v) => String(v));
    const yTick = y.fmt ? (v) => /** @type {Fmt} */ (y.fmt)(v) : view.log ? fmtLogTick : fmtTick;
    const yRange = y.zero ? (u, min, max) => [0, max > 0 ? max * 1.08 : 1] : linearRange;
    const scales = { x: { time: Boolean(x.time) } };
    if (view.log) scales.y = { distr: 3, ...(view.robust ? { range: (u, min, max) => robustRange(u, 'y', min, max, true) } : {}) };
    else if (view.robust) scales.y = { auto: true, range: (u, min, max) => robustRange(u, 'y', min, max, false) };
    else scales.y = { auto: true, range: yRange };
    if (x.range) scales.x.range = x.range;
    const axes = [
      {
        ...AXIS,
        label: x.label,
        labelSize: x.label ? 18 : 0,
        ...(x.time ? { incrs: TIME_INCRS, space: 60 } : { values: x.values || ((u, splits) => splits.map((v) => (x.fmt ? x.fmt(v) : String(v)))) }),
        ...(x.integer ? { incrs: STEP_INCRS } : {}),
        ...(x.axis || {}),
      },
      {
        ...AXIS,
        scale: 'y',
        label: y.label,
        labelSize: y.label ? 18 : 0,
        values: (u, splits, axisIdx, space, incr) => splits.map((v) => (v === null ? '' : yTick(v, incr))),
        size: axisSize,
      },
    ];
    if (y2) {
      scales.y2 = { auto: true, range: linearRange };
      axes.push({
        ...AXIS,
        scale: 'y2',
        side: 1,
        grid: { show: false },
        label: y2.label,
        labelSize: y2.label ? 18 : 0,
        values: (u, splits, axisIdx, space, incr) => splits.map((v) => (v === null ? '' : y2.fmt ? y2.fmt(v) : fmtTick(v, incr))),
        size: axisSize,
      });
    }
    const opts = {
      width,
      height,
      scales,
      axes,
      cursor: { drag: { x: true, y: false }, focus: { prox: 24 } },
      // Zoomed: the x scale shows less than the data (a drag); a reset or
      // new data drawn in full clears it.
      hooks: {
        setScale: [
          (u, key) => {
            if (key !== 'x') return;
            const d = u.data[0];
            zoomed = d.length > 1 && (u.scales.x.min > d[0] || u.scales.x.max < d[d.length - 1]);
            if (resetButton) resetButton.disabled = !zoomed;
          },
        ],
      },
      focus: { alpha: 0.4 },
      legend: { live: true },
      series: [
        {
          label: x.label || 'x',
          value: (u, v) => (v === null || v === undefined ? '—' : x.time ? new Date(v * 1000).toLocaleTimeString() : x.fmt ? x.fmt(v) : String(v)),
        },
        ...series.map((s) => ({
          label: s.label,
          scale: s.scale || 'y',
          stroke: s.color,
          width: s.width ?? 1.5,
          dash: s.dash,
          fill: s.fill,
          spanGaps: true,
          points: { show: s.bars ? false : (u, si) => u.data[0].length < 40, ...(s.marker || {}) },
          paths: s.bars ? uPlot.paths.bars({ size: [0.7, 64], align: 0 }) : undefined,
          value: (u, v) => (v === null || v === undefined ? '—' : (s.fmt || yFmt)(v)),
        })),
      ],
    };
    const empty = [[], ...series.map(() => [])];
    const old = plot;
    plot = new uPlot(opts, drawn(source) || empty, container);
    if (old) old.destroy();
    plot.polyak = { name, labels: series.map((s) => s.label), log: view.log, robust: view.robust };
    registry()[name] = plot;
  }

  /** On a log axis, values <= 0 cannot be drawn: they become gaps. */
  function drawn(data) {
    if (!data) return null;
    if (!view.log) return data;
    return data.map((col, i) => {
      if (i === 0) return col;
      const s = series[i - 1];
      if (s && s.scale === 'y2') return col;
      return Array.from(col, (v) => (v === null || v === undefined || !(v > 0) ? null : v));
    });
  }

  let resetButton = null;
  // The controls live beside the plot in `container`: a chart rebuilt in
  // the same container (a new σ_rel, another profile) must take its own
  // row away, or every rebuild stacks another one.
  let bar = null;
  if (controls) {
    bar = document.createElement('div');
    bar.className = 'chart-controls';
    const button = (label, title, onClick, testid) => {
      const b = document.createElement('button');
      b.type = 'button';
      b.className = 'btn tiny';
      b.textContent = label;
      b.title = title;
      b.dataset.control = testid;
      b.addEventListener('click', onClick);
      bar.append(b);
      return b;
    };
    const logButton = button(view.log ? 'log' : 'linear', 'y axis: linear or log', () => {
      view.log = !view.log;
      logButton.textContent = view.log ? 'log' : 'linear';
      logButton.setAttribute('aria-pressed', String(view.log));
      build();
    }, 'log');
    logButton.setAttribute('aria-pressed', String(view.log));
    const robustButton = button(view.robust ? 'robust range' : 'auto range', 'y range: every point, or ignoring outliers (past the 2nd-98th percentiles or 1.5 IQR beyond the quartiles)', () => {
      view.robust = !view.robust;
      robustButton.textContent = view.robust ? 'robust range' : 'auto range';
      robustButton.setAttribute('aria-pressed', String(view.robust));
      build();
    }, 'robust');
    robustButton.setAttribute('aria-pressed', String(view.robust));
    resetButton = button('reset zoom', 'show every point (or double-click the chart)', () => {
      zoomed = false;
      resetButton.disabled = true;
      plot.setData(plot.data, true);
    }, 'reset');
    resetButton.disabled = true;
    button('CSV', 'download the data drawn as CSV', () => download(`${fileName(name)}.csv`, 'text/csv', toCsv(plot)), 'csv');
    button('JSON', 'download the data drawn as JSON', () => download(`${fileName(name)}.json`, 'application/json', JSON.stringify(toJson(plot))), 'json');
    container.append(bar);
  }
  build();

  const resize = new ResizeObserver(() => {
    const w = container.clientWidth;
    if (w > 0 && Math.abs(w - plot.width) > 1) plot.setSize({ width: w, height });
  });
  resize.observe(container);

  return {
    get plot() {
      return plot;
    },
    update(data) {
      source = data;
      plot.setData(drawn(data), !zoomed);
      if (zoomed) plot.redraw(false, true);
    },
    destroy() {
      resize.disconnect();
      plot.destroy();
      if (bar) bar.remove();
      if (registry()[name] === plot) delete registry()[name];
    },
  };
}

/**
 * The y range of the points drawn, ignoring outliers: the 2% at each end,
 * and any point past Tukey's fences (1.5 interquartile ranges beyond the
 * quartiles), so that a few points far off (an evaluation of the initial
 * weights at step 0) do not flatten the rest.
 */
function robustRange(u, scale, min, max, log) {
  const values = [];
  u.series.forEach((s, i) => {
    if (i === 0 || s.scale !== scale || !u.data[i]) return;
    for (const v of u.data[i]) if (v !== null && Number.isFinite(v) && (!log || v > 0)) values.push(log ? Math.log10(v) : v);
  });
  if (values.length < 2) return log ? [min || 1, max || 10] : linearRange(u, min, max);
  values.sort((a, b) => a - b);
  const at = (q) => values[Math.min(values.length - 1, Math.max(0, Math.round(q * (values.length - 1))))];
  let lo = at(0.02);
  let hi = at(0.98);
  const iqr = at(0.75) - at(0.25);
  if (iqr > 0) {
    const inside = values.filter((v) => v >= at(0.25) - 1.5 * iqr && v <= at(0.75) + 1.5 * iqr);
    lo = Math.max(lo, inside[0]);
    hi = Math.min(hi, inside[inside.length - 1]);
  }
  const pad = (hi - lo) * 0.1 || Math.abs(hi) * 0.01 || 1;
  lo -= pad;
  hi += pad;
  return log ? [10 ** lo, 10 ** hi] : [lo, hi];
}

function fileName(name) {
  return String(name).replace(/[^A-Za-z0-9._-]+/g, '_');
}

function cell(v) {
  return v === null || v === undefined || Number.isNaN(v) ? '' : String(v);
}

/** The chart's data as drawn: a header of labels, then one row per x. */
export function toCsv(plot) {
  const labels = plot.series.map((s) => `"${String(s.label).replace(/"/g, '""')}"`);
  const rows = [labels.join(',')];
  const xs = plot.data[0] || [];
  for (let i = 0; i < xs.length; i += 1) rows.push(plot.data.map((col) => cell(col[i])).join(','));
  return `${rows.join('\n')}\n`;
}

/** The same as JSON: `{x: {label, values}, series: [{label, values}]}`. */
export function toJson(plot) {
  return {
    x: { label: plot.series[0].label, values: Array.from(plot.data[0] || []) },
    series: plot.series.slice(1).map((s, i) => ({ label: s.label, values: Array.from(plot.data[i + 1] || []) })),
  };
}

function download(name, type, text) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = document.createElement('a');
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

/** The axes' font (uPlot's default size), so that labels can be measured. */
const AXIS_FONT_PX = 12;
const AXIS_FONT = `${AXIS_FONT_PX}px system-ui, -apple-system, "Segoe UI", Roboto, sans-serif`;
/** Slanted category labels: the angle, and the room across their baselines. */
const SLANT_DEG = 45;
const SLANT_LINE_PX = AXIS_FONT_PX + 4;

/** @type {CanvasRenderingContext2D | null} */
let measurer = null;
function textWidth(text) {
  if (!measurer) {
    measurer = /** @type {CanvasRenderingContext2D} */ (document.createElement('canvas').getContext('2d'));
    measurer.font = AXIS_FONT;
  }
  return measurer.measureText(text).width;
}

/**
 * The x options of a bar chart over categories `labels` (x = 0, 1, ...):
 * a half-bar margin on each side, `short(label)` for the tick text, level
 * labels while each fits its category, slanted ones past `slantAfter`, and
 * only every n-th label where even slanted ones would touch.
 *
 * Slanted labels are parallel strings: two ticks `d` px apart put their
 * baselines `d * sin(angle)` apart, so a tick needs `line / sin(angle)` px
 * whatever the labels' lengths; level labels need their own width.
 */
export function categoryAxis(label, labels, { short = (s) => s, slantAfter = 6 } = {}) {
  const texts = labels.map((l) => short(String(l)));
  const widest = texts.reduce((w, t) => Math.max(w, textWidth(t)), 0);
  const slanted = labels.length > slantAfter;
  const rad = (SLANT_DEG * Math.PI) / 180;
  const need = slanted ? SLANT_LINE_PX / Math.sin(rad) : widest + 10;
  return {
    label,
    fmt: (i) => labels[Math.round(i)] ?? '',
    range: (u, min, max) => [(min ?? 0) - 0.5, (max ?? 0) + 0.5],
    axis: {
      font: AXIS_FONT,
      rotate: slanted ? -SLANT_DEG : 0,
      // The slanted labels' height, up to a limit (longer ones are cut at the chart's edge).
      size: slanted ? Math.min(160, Math.ceil(widest * Math.sin(rad) + SLANT_LINE_PX * Math.cos(rad) + 16)) : 40,
      splits: (u, axisIdx, min, max) => {
        const first = Math.max(0, Math.ceil(min));
        const last = Math.min(labels.length - 1, Math.floor(max));
        const perCategory = last > first ? (u.valToPos(last, 'x') - u.valToPos(first, 'x')) / (last - first) : Infinity;
        const every = Math.max(1, Math.ceil(need / perCategory));
        const out = [];
        for (let i = first; i <= last; i += every) out.push(i);
        return out;
      },
      values: (u, splits) => splits.map((i) => texts[i] ?? ''),
    },
  };
}

/** A titled card holding a chart: returns `{el, head, body, note}`. */
export function chartCard(title, subtitle = '') {
  const body = document.createElement('div');
  body.className = 'chart-body';
  const note = document.createElement('div');
  note.className = 'chart-note';
  const el = document.createElement('section');
  el.className = 'card chart-card';
  const head = document.createElement('div');
  head.className = 'card-head';
  const h3 = document.createElement('h3');
  h3.textContent = title;
  head.append(h3);
  if (subtitle) {
    const sub = document.createElement('span');
    sub.className = 'muted small';
    sub.textContent = subtitle;
    head.append(sub);
  }
  el.append(head, note, body);
  return { el, head, body, note };
}
