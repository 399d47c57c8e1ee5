// Evaluations of EMA candidates on the dashboard: the run page's
// "Evaluations" chart (each metric against step, one line per candidate
// family: the online weights and each profile), the snapshots table's
// metric columns, the post-hoc tab's metric against sigma_rel (log x:
// live power profiles as points, post-hoc results as a curve, poorly
// fitted ones hollow, the best marked, a click opens its download), and
// each run's best value per metric for the compare page.

import { api, authUrl, isAbort, runPath, withQuery } from '../api.js';
import { alignByX, chartCard, color, createChart, fade, fmtTick, registry } from '../charts.js';
import { badge, emptyBox, errorBox, h, loadingBox, tableWrap } from '../dom.js';
import { fmtNum, fmtStep } from '../format.js';

const REFRESH_MS = 15000;
/** A post-hoc length with a larger fit residual is drawn hollow (the client's threshold too). */
export const POORLY_FITTED = 0.05;
/** Metrics where higher is better; every other metric is a loss (lower is better). */
const HIGHER_IS_BETTER = /(^|[^a-z])(acc|accuracy|auc|f1|bleu|rouge|score|precision|recall|map|iou|reward)([^a-z]|$)/i;

/** Whether `metric` is best at its minimum (`min`) or maximum (`max`). */
export function modeOf(metric) {
  return HIGHER_IS_BETTER.test(metric) ? 'max' : 'min';
}

/** The better of two values under `mode`. */
const better = (mode, a, b) => (mode === 'max' ? a > b : a < b);

/** `fn` called once, 300 ms after the last of a burst of calls. */
function debounced(fn) {
  let timer = null;
  return {
    call() {
      clearTimeout(timer);
      timer = setTimeout(fn, 300);
    },
    cancel: () => clearTimeout(timer),
  };
}

/** Every metric name the evaluations hold, sorted. */
export function metricNames(evals) {
  return [...new Set(evals.flatMap((e) => Object.keys(e.metrics)))].sort((a, b) => a.localeCompare(b));
}

/** The evaluation with the best value of `metric` (ties: the earliest listed, as the server's /best). */
export function bestOf(evals, metric, mode = modeOf(metric)) {
  let best = null;
  for (const e of evals) {
    const v = e.metrics[metric];
    if (v === undefined) continue;
    if (!best || better(mode, v, best.metrics[metric])) best = e;
  }
  return best;
}

/** The family of a candidate on the step chart: `online`, or its profile. */
function family(e) {
  const base = e.kind === 'online' ? 'online' : e.profile;
  return e.evaluator ? `${base} · ${e.evaluator}` : base;
}

/** A candidate in a few words: its family, or `post-hoc σ_rel 0.07`. */
export function candidateName(e) {
  if (e.kind !== 'posthoc') return family(e);
  const base = `post-hoc σ_rel ${e.sigma_rel === null || e.sigma_rel === undefined ? '?' : fmtNum(e.sigma_rel, 4)}`;
  return e.evaluator ? `${base} · ${e.evaluator}` : base;
}

/** The server's best candidate of `metric` (`GET /v1/runs/{run}/best`), in the metric's mode. */
export async function loadBest(run, metric, signal) {
  return api(withQuery(runPath(run, '/best'), { metric, mode: modeOf(metric) }), { signal });
}

/**
 * Line styles that keep every family readable where lines coincide (two
 * profiles with the same value at every step): dashes sparser and markers
 * smaller in drawing order, so a line drawn later leaves the earlier one
 * showing between its dashes and as a ring around its markers.
 */
const DASHES = [undefined, [14, 4], [7, 7], [2, 7], [1, 10]];
export function familyStyle(label, index) {
  const online = label.startsWith('online');
  return {
    color: online ? '#495057' : color(index),
    width: 2,
    dash: online ? [6, 4] : DASHES[index % DASHES.length],
    marker: { size: Math.max(5, 13 - 2 * index) },
  };
}

/** Download URL of a candidate's weights (with the token for a browser link). */
export function downloadUrl(run, e) {
  return authUrl(withQuery(runPath(run, `/snapshots/${encodeURIComponent(e.snapshot)}/download`), { profile: e.profile }));
}

export async function loadEvals(run, signal, params = {}) {
  return (await api(withQuery(runPath(run, '/evals'), params), { signal })).evals;
}

/**
 * The step chart's series of `metric`: per family (online first, then the
 * profiles in `profileOrder`), the points `[step, value]` of the cuts'
 * candidates (`ema` and `online`), by step.
 */
export function stepSeries(evals, metric, profileOrder = []) {
  const byFamily = new Map();
  for (const e of evals) {
    if (e.kind !== 'ema' && e.kind !== 'online') continue;
    const v = e.metrics[metric];
    if (v === undefined) continue;
    const key = family(e);
    if (!byFamily.has(key)) byFamily.set(key, new Map());
    byFamily.get(key).set(e.step, v); // a later evaluation of the same step wins
  }
  const rank = (k) => (k.startsWith('online') ? -1 : profileOrder.indexOf(k.split(' · ')[0]));
  return [...byFamily.entries()]
    .sort(([a], [b]) => rank(a) - rank(b) || a.localeCompare(b))
    .map(([label, points]) => {
      const xs = [...points.keys()].sort((a, b) => a - b);
      return { label, xs, ys: xs.map((x) => points.get(x)) };
    });
}

// --- the run page's Evaluations card ----------------------------------------

export function evalsPanel(ctx, run, config) {
  const grid = h('div', { class: 'chart-grid' }, loadingBox('Loading evaluations…'));
  const summary = h('span', { class: 'muted small', dataset: { testid: 'evals-summary' } });
  const el = h('section', { class: 'card', dataset: { testid: 'evals' } }, h('div', { class: 'card-head' }, h('h2', {}, 'Evaluations'), summary), grid);
  const profileOrder = config.profiles.map((p) => p.name);
  const charts = new Map(); // metric -> {chart, card, key}

  function draw(evals, bests) {
    const metrics = metricNames(evals);
    if (!metrics.length) {
      for (const entry of charts.values()) entry.chart.destroy();
      charts.clear();
      grid.replaceChildren(
        emptyBox(
          h('p', {}, 'No evaluations yet. Evaluate every snapshot as it is written: ', h('code', {}, `python -m polyak eval ${run} --script eval.py --follow`), ' (', h('code', {}, 'POST /v1/runs/{run}/evals'), ').'),
        ),
      );
      summary.textContent = '';
      return;
    }
    for (const state of grid.querySelectorAll(':scope > .state')) state.remove();
    summary.textContent = `${evals.length} evaluation${evals.length === 1 ? '' : 's'} · ${metrics.length} metric${metrics.length === 1 ? '' : 's'}`;
    for (const metric of metrics) {
      const series = stepSeries(evals, metric, profileOrder);
      const key = series.map((s) => s.label).join('|');
      let entry = charts.get(metric);
      if (!entry || entry.key !== key) {
        if (entry) {
          entry.chart.destroy();
          entry.card.el.remove();
        }
        const mode = modeOf(metric);
        const card = chartCard(metric, `${mode === 'min' ? 'lower' : 'higher'} is better · one line per candidate family · y range without outliers`);
        card.el.dataset.metric = metric;
        grid.append(card.el);
        const chart = createChart(card.body, `evals:${metric}`, {
          series: series.map((s, i) => ({ label: s.label, ...familyStyle(s.label, i) })),
          x: { label: 'step', fmt: fmtStep, integer: true },
          // An evaluation of the initial weights (step 0) is far off the
          // rest: the range leaves such outliers out (the button shows all).
          y: { legend: (v) => fmtNum(v), robust: true },
        });
        const best = h('span', { class: 'latest mono small', dataset: { testid: 'evals-best' } });
        card.head.append(best);
        entry = { chart, card, key, best };
        charts.set(metric, entry);
      }
      entry.chart.update(series.length ? alignByX(series) : [[]]);
      // The run's best is the server's (`/best`): every candidate, post-hoc ones included.
      const best = bests.get(metric);
      const b = best ? best.evaluation : null;
      entry.best.textContent = b ? `best ${fmtNum(best.value)}: ${candidateName(b)} @ step ${fmtStep(b.step)}` : '';
      entry.best.title = b ? `snapshot ${b.snapshot} · profile ${b.profile} · evaluation ${b.id}` : '';
      entry.best.dataset.evaluation = b ? String(b.id) : '';
    }
    for (const [metric, entry] of charts) {
      if (!metrics.includes(metric)) {
        entry.chart.destroy();
        entry.card.el.remove();
        charts.delete(metric);
      }
    }
  }

  async function load() {
    try {
      const evals = await loadEvals(run, ctx.signal);
      const metrics = metricNames(evals);
      const answers = await Promise.all(metrics.map((m) => loadBest(run, m, ctx.signal).catch((err) => (isAbort(err) ? Promise.reject(err) : null))));
      if (ctx.active) draw(evals, new Map(metrics.map((m, i) => [m, answers[i]])));
    } catch (err) {
      if (!isAbort(err) && ctx.active && !charts.size) grid.replaceChildren(errorBox(err, load));
    }
  }

  const soon = debounced(load);
  ctx.onCleanup(() => {
    soon.cancel();
    for (const entry of charts.values()) entry.chart.destroy();
  });

  return {
    el,
    start() {
      load();
      ctx.every(REFRESH_MS, load);
    },
    /** An `eval` event from the stream: reload soon (several come together). */
    onEvent: soon.call,
  };
}

// --- the snapshots table's metric columns --------------------------------------

/**
 * Metric columns for a table of snapshots: `load()` fetches the
 * evaluations; `headers(onSort)` and `cells(row, profile)` add one column per
 * metric (the value of the candidate `profile` of the row, the best one
 * marked ★); `sort(rows)` orders rows by the column clicked last.
 */
export function snapshotMetricColumns(run) {
  let evals = [];
  let sortBy = null; // {metric, dir: 1 | -1}
  const byCandidate = new Map();

  function valueOf(row, profile, metric) {
    const e = byCandidate.get(`${row.id}\u0000${profile}`);
    return e && e.metrics[metric] !== undefined ? e.metrics[metric] : null;
  }

  return {
    async load(signal) {
      evals = await loadEvals(run, signal);
      byCandidate.clear();
      for (const e of evals) byCandidate.set(`${e.snapshot}\u0000${e.profile}`, e);
    },
    metrics: () => metricNames(evals),
    headers(onSort) {
      return metricNames(evals).map((m) =>
        h(
          'th',
          {
            class: 'num sortable',
            title: `sort by ${m} (${modeOf(m) === 'min' ? 'lower' : 'higher'} is better)`,
            dataset: { metric: m, sort: sortBy && sortBy.metric === m ? (sortBy.dir > 0 ? 'asc' : 'desc') : '' },
            onclick: () => {
              sortBy = sortBy && sortBy.metric === m ? { metric: m, dir: -sortBy.dir } : { metric: m, dir: modeOf(m) === 'min' ? 1 : -1 };
              onSort();
            },
          },
          m,
          sortBy && sortBy.metric === m ? (sortBy.dir > 0 ? ' ▲' : ' ▼') : '',
        ),
      );
    },
    cells(row, profile) {
      return metricNames(evals).map((m) => {
        const v = valueOf(row, profile, m);
        const best = bestOf(evals, m);
        const isBest = Boolean(best && best.snapshot === row.id && best.profile === profile);
        const all = row.profiles
          .concat(['online'])
          .map((p) => [p, valueOf(row, p, m)])
          .filter(([, x]) => x !== null)
          .map(([p, x]) => `${p}: ${x}`)
          .join('\n');
        return h(
          'td',
          { class: `num${isBest ? ' best' : ''}`, title: all, dataset: { metric: m, value: v === null ? '' : String(v), best: isBest ? 'true' : null } },
          v === null ? '—' : fmtNum(v),
          isBest ? h('span', { class: 'best-mark', title: `best ${m} of the run` }, ' ★') : null,
        );
      });
    },
    sort(rows, profileOf) {
      if (!sortBy) return rows;
      const { metric, dir } = sortBy;
      return [...rows].sort((a, b) => {
        const va = valueOf(a, profileOf(a), metric);
        const vb = valueOf(b, profileOf(b), metric);
        if (va === null) return vb === null ? 0 : 1;
        if (vb === null) return -1;
        return dir * (va - vb);
      });
    },
  };
}

// --- the post-hoc tab: metric against sigma_rel --------------------------------

/**
 * The points of the sigma_rel chart for `metric`: the newest step that has
 * post-hoc evaluations (else the newest with live power-profile ones), its
 * live power profiles (`live`) and post-hoc results (`posthoc`, by
 * sigma_rel; one per length, the newest), and the best of them.
 */
export function sigmaPoints(evals, metric, mode = modeOf(metric)) {
  const has = (e) => e.metrics[metric] !== undefined && e.sigma_rel !== null && e.sigma_rel !== undefined;
  const posthocAll = evals.filter((e) => e.kind === 'posthoc' && has(e));
  const liveAll = evals.filter((e) => e.kind === 'ema' && has(e));
  const steps = (posthocAll.length ? posthocAll : liveAll).map((e) => e.step);
  if (!steps.length) return null;
  const step = Math.max(...steps);
  const newestBySigma = (list) => {
    const m = new Map();
    for (const e of list.filter((x) => x.step === step)) {
      const prev = m.get(e.sigma_rel);
      if (!prev || e.id > prev.id) m.set(e.sigma_rel, e);
    }
    return [...m.values()].sort((a, b) => a.sigma_rel - b.sigma_rel);
  };
  const posthoc = newestBySigma(posthocAll);
  const live = newestBySigma(liveAll);
  const best = bestOf([...live, ...posthoc], metric, mode);
  return { step, metric, mode, live, posthoc, best };
}

/** uPlot points-only series (no line). */
function pointsOnly(label, stroke, fill, size) {
  return { label, stroke, fill, width: 2, paths: () => null, points: { show: true, size, stroke, fill, width: 2 }, spanGaps: false };
}

/**
 * A card with the metric against sigma_rel (log x) for the post-hoc tab.
 * `openUrl` opens a download (a test may replace it).
 */
export function sigmaPanel(ctx, run, { openUrl = (url) => window.open(url, '_blank') } = {}) {
  const metricSelect = h('select', { 'aria-label': 'metric', dataset: { testid: 'sigma-metric' } });
  const card = chartCard('Metric against σ_rel', 'live power profiles as points · post-hoc EMAs as a curve · hollow: poorly fitted · ★ best · click a point to download it');
  card.el.dataset.testid = 'sigma-chart';
  card.head.append(h('label', { class: 'muted small' }, 'metric ', metricSelect));
  const table = h('div', {});
  const el = h('div', {}, card.el, h('section', { class: 'card' }, h('div', { class: 'card-head' }, h('h3', {}, 'Evaluated lengths')), table));
  let plot = null;
  let evals = [];
  let current = null;

  function destroy() {
    if (plot) {
      if (registry().sigma === plot) delete registry().sigma;
      plot.destroy();
    }
    plot = null;
  }

  function draw() {
    const metric = metricSelect.value;
    current = metric ? sigmaPoints(evals, metric) : null;
    destroy();
    if (!current) {
      card.body.replaceChildren(emptyBox('No evaluations with a σ_rel yet: evaluate the power profiles\' snapshots, or run ', h('code', {}, 'run.posthoc_search([...], evaluate, model)'), '.'));
      table.replaceChildren();
      window.polyak.sigma = null;
      return;
    }
    card.body.replaceChildren();
    const { live, posthoc, best } = current;
    const all = [...live, ...posthoc];
    const xs = [...new Set(all.map((e) => e.sigma_rel))].sort((a, b) => a - b);
    const col = (list) => xs.map((x) => {
      const e = list.find((p) => p.sigma_rel === x);
      return e ? e.metrics[metric] : null;
    });
    const good = posthoc.filter((e) => !(e.residual > POORLY_FITTED));
    const poor = posthoc.filter((e) => e.residual > POORLY_FITTED);
    const data = [xs, col(posthoc), col(good), col(poor), col(live), col(best ? [best] : [])];
    const width = Math.max(240, card.body.clientWidth || 600);
    const accent = color(0);
    const opts = {
      width,
      height: 260,
      scales: { x: { distr: 3, time: false }, y: { auto: true } },
      axes: [
        { label: 'σ_rel', labelSize: 18, stroke: '#5b6474', values: (u, splits) => splits.map((v) => (v === null ? '' : fmtNum(v, 3))) },
        { label: metric, labelSize: 18, stroke: '#5b6474', size: 60, values: (u, splits, axisIdx, space, incr) => splits.map((v) => (v === null ? '' : fmtTick(v, incr))) },
      ],
      cursor: { drag: { x: false, y: false }, focus: { prox: 24 } },
      legend: { live: true },
      series: [
        { label: 'σ_rel', value: (u, v) => (v === null || v === undefined ? '—' : fmtNum(v, 4)) },
        { label: 'post-hoc', stroke: fade(accent, 0.8), width: 2, spanGaps: true, points: { show: false } },
        pointsOnly('well fitted', accent, accent, 7),
        pointsOnly(`poorly fitted (residual > ${POORLY_FITTED})`, accent, '#ffffff', 8),
        pointsOnly('live power profiles', color(1), color(1), 9),
        pointsOnly('best', '#e67700', 'rgba(0,0,0,0)', 16),
      ],
    };
    plot = new uPlot(opts, data, card.body);
    plot.polyak = { name: 'sigma', metric };
    registry().sigma = plot;
    plot.over.addEventListener('click', () => {
      const idx = plot.cursor.idx;
      if (idx === null || idx === undefined) return;
      const x = xs[idx];
      // A live point and a post-hoc one may share a length: the nearer in y.
      const top = plot.cursor.top;
      const candidates = all.filter((e) => e.sigma_rel === x);
      const pick = candidates.sort((a, b) => Math.abs(plot.valToPos(a.metrics[metric], 'y') - top) - Math.abs(plot.valToPos(b.metrics[metric], 'y') - top))[0];
      if (pick) openUrl(downloadUrl(run, pick));
    });
    // What the chart shows, for tests and scripts.
    window.polyak.sigma = {
      step: current.step,
      metric,
      live: live.map((e) => ({ id: e.id, sigma_rel: e.sigma_rel, value: e.metrics[metric] })),
      posthoc: posthoc.map((e) => ({ id: e.id, sigma_rel: e.sigma_rel, value: e.metrics[metric], residual: e.residual, hollow: e.residual > POORLY_FITTED })),
      best: best ? { id: best.id, sigma_rel: best.sigma_rel, value: best.metrics[metric] } : null,
      xs,
    };
    const rows = [...all].sort((a, b) => a.sigma_rel - b.sigma_rel || a.kind.localeCompare(b.kind));
    table.replaceChildren(
      tableWrap(
        h(
          'table',
          { class: 'table', dataset: { testid: 'sigma-table' } },
          h('thead', {}, h('tr', {}, h('th', { class: 'num' }, 'σ_rel'), h('th', {}, 'Candidate'), h('th', { class: 'num' }, metric), h('th', { class: 'num' }, 'Residual'), h('th', {}, 'Download'))),
          h(
            'tbody',
            {},
            rows.map((e) =>
              h(
                'tr',
                { dataset: { id: String(e.id), best: best && best.id === e.id ? 'true' : null, hollow: e.residual > POORLY_FITTED ? 'true' : null } },
                h('td', { class: 'num' }, fmtNum(e.sigma_rel, 4)),
                h('td', {}, badge(e.kind === 'posthoc' ? 'post-hoc' : e.profile, e.kind === 'posthoc' ? 'info' : 'muted'), e.residual > POORLY_FITTED ? badge('poorly fitted', 'warn') : null),
                h('td', { class: 'num' }, fmtNum(e.metrics[metric]), best && best.id === e.id ? h('span', { class: 'best-mark' }, ' ★') : null),
                h('td', { class: 'num' }, e.residual === null || e.residual === undefined ? '—' : fmtNum(e.residual, 3)),
                h('td', {}, h('a', { href: downloadUrl(run, e), download: '', dataset: { layout: 'full' } }, 'full')),
              ),
            ),
          ),
        ),
      ),
    );
  }

  async function load() {
    try {
      const list = await loadEvals(run, ctx.signal);
      if (!ctx.active) return;
      evals = list;
      const metrics = metricNames(evals.filter((e) => e.sigma_rel !== null && e.sigma_rel !== undefined));
      const keep = metricSelect.value;
      if ([...metricSelect.options].map((o) => o.value).join() !== metrics.join()) {
        metricSelect.replaceChildren(...metrics.map((m) => h('option', { value: m }, m)));
      }
      if (metrics.includes(keep)) metricSelect.value = keep;
      draw();
    } catch (err) {
      if (!isAbort(err) && ctx.active) card.body.replaceChildren(errorBox(err, load));
    }
  }

  metricSelect.addEventListener('change', draw);
  card.body.replaceChildren(loadingBox('Loading evaluations…'));
  const soon = debounced(load);
  ctx.onCleanup(() => {
    soon.cancel();
    destroy();
  });
  return {
    el,
    load,
    start() {
      load();
      ctx.every(REFRESH_MS, load);
    },
    /** An `eval` event: reload soon (a sweep posts several together). */
    onEvent: soon.call,
  };
}

// --- compare runs: each run's best per metric ----------------------------------

/** `{metric: {value, mode, evaluation}}`: a run's best evaluated candidate per metric. */
export async function bestPerMetric(run, signal) {
  const evals = await loadEvals(run, signal);
  const out = {};
  for (const m of metricNames(evals)) {
    const mode = modeOf(m);
    const e = bestOf(evals, m, mode);
    out[m] = { value: e.metrics[m], mode, evaluation: e };
  }
  return out;
}

/** "val_loss 0.312 · acc 0.91 (max)": a run's bests for a legend. */
export function bestText(best) {
  return Object.entries(best)
    .map(([m, b]) => `best ${m} ${fmtNum(b.value)}`)
    .join(' · ');
}
