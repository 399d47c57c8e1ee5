// Charts of the trainer's metrics (`run.log`), one per name with a series
// per rank, smoothed by the slider; loaded every 15 s and fed by the
// stream's `metrics` events.

import { api, isAbort, runPath, withQuery } from '../../api.js';
import { alignByX, chartCard, color, createChart, fade, smoothEma } from '../../charts.js';
import { emptyBox, errorBox, h, loadingBox } from '../../dom.js';
import { fmtNum, fmtStep } from '../../format.js';
import { upsert } from './series.js';
import { loadSetting, saveSetting } from './settings.js';

const TRAINER_REFRESH_MS = 15000;
const TRAINER_POINTS = 5000;
// The server's own series share the metrics listing: their panel shows them.
const isServerSeries = (name) => name.startsWith('ema_drift/') || name.startsWith('ingest/');

/** The trainer's charts: `{el, start(), onEvent(e), reload()}`. */
export function trainerPanel(ctx, run) {
  const weightLabel = h('output', { class: 'mono' });
  const slider = h('input', { type: 'range', min: '0', max: '0.99', step: '0.01', 'aria-label': 'smoothing', dataset: { testid: 'smoothing' } });
  slider.value = String(loadSetting('smoothing', 0.6));
  weightLabel.textContent = Number(slider.value).toFixed(2);
  const grid = h('div', { class: 'chart-grid' }, loadingBox('Loading metrics…'));
  const el = h(
    'section',
    { class: 'card' },
    h('div', { class: 'card-head' }, h('h2', {}, 'Training metrics'), h('label', { class: 'slider' }, 'smoothing ', slider, weightLabel)),
    grid,
  );
  // name -> Map(source key -> {rank, xs, ys}); source key 'run' or the rank.
  const series = new Map();
  const charts = new Map(); // name -> {chart, sources: string}
  const dirty = new Set();
  let flushTimer = null;
  let loaded = false;

  function add(name, rank, step, value) {
    if (isServerSeries(name) || !Number.isFinite(value)) return;
    if (!series.has(name)) series.set(name, new Map());
    const key = rank === null || rank === undefined ? 'run' : String(rank);
    const byRank = series.get(name);
    if (!byRank.has(key)) byRank.set(key, { rank: key === 'run' ? null : Number(key), xs: [], ys: [] });
    upsert(byRank.get(key), step, value);
    dirty.add(name);
  }

  function sourcesOf(name) {
    return [...series.get(name).values()].sort((a, b) => (a.rank === null ? -1 : b.rank === null ? 1 : a.rank - b.rank));
  }

  function draw(name) {
    const sources = sourcesOf(name);
    const key = sources.map((s) => s.rank).join(',');
    let entry = charts.get(name);
    if (!entry || entry.key !== key) {
      if (entry) {
        entry.chart.destroy();
        entry.card.el.remove();
      }
      for (const state of grid.querySelectorAll(':scope > .state')) state.remove();
      const card = chartCard(name, sources.length > 1 ? `${sources.length} series` : '');
      card.el.dataset.metric = name;
      // Keep `loss` first, then alphabetical.
      const names = [...charts.keys(), name].sort((a, b) => (a === 'loss' ? -1 : b === 'loss' ? 1 : a.localeCompare(b)));
      const next = names[names.indexOf(name) + 1];
      if (next && charts.has(next)) grid.insertBefore(card.el, charts.get(next).card.el);
      else grid.append(card.el);
      const defs = sources.flatMap((s, i) => {
        const label = s.rank === null ? name : `${name} · rank ${s.rank}`;
        return [
          { label, color: fade(color(i), 0.35), width: 1 },
          { label: `${label} (smoothed)`, color: color(i), width: 2 },
        ];
      });
      const chart = createChart(card.body, `metric:${name}`, {
        series: defs,
        x: { label: 'step', fmt: fmtStep, integer: true },
        y: { legend: (v) => fmtNum(v) },
      });
      const latest = h('span', { class: 'latest mono small' });
      card.head.append(latest);
      entry = { chart, card, key, latest };
      charts.set(name, entry);
    }
    const aligned = alignByX(sources.map((s) => ({ xs: s.xs, ys: s.ys })));
    const w = Number(slider.value);
    const data = [aligned[0]];
    aligned.slice(1).forEach((col) => data.push(col, smoothEma(col, w)));
    entry.chart.update(data);
    // The newest value of the first series, raw and smoothed.
    const first = sources[0];
    const n = first.xs.length;
    if (n) {
      const smoothed = data[2].filter((v) => v !== null);
      entry.latest.textContent = `${fmtNum(first.ys[n - 1])} (smoothed ${fmtNum(smoothed[smoothed.length - 1])}) @ step ${fmtStep(first.xs[n - 1])}`;
    }
  }

  function flush() {
    flushTimer = null;
    if (!ctx.active) return;
    for (const name of dirty) draw(name);
    dirty.clear();
  }

  function schedule() {
    if (!flushTimer) flushTimer = setTimeout(flush, 250);
  }

  slider.addEventListener('input', () => {
    weightLabel.textContent = Number(slider.value).toFixed(2);
    saveSetting('smoothing', Number(slider.value));
    for (const name of series.keys()) dirty.add(name);
    schedule();
  });

  function ingest(resp) {
    for (const s of resp.series) for (const [step, value] of s.points) add(s.name, s.rank, step, value);
  }

  let since = null;
  async function load() {
    const names = (await api(withQuery(runPath(run, '/metrics'), { limit: 1 }), { signal: ctx.signal })).names.filter((n) => !isServerSeries(n));
    if (names.length) {
      const resp = await api(withQuery(runPath(run, '/metrics'), { names: names.join(','), limit: TRAINER_POINTS, since_step: since }), { signal: ctx.signal });
      ingest(resp);
      // Next time only what is at or after the oldest series' last step.
      const lasts = [...series.values()].flatMap((m) => [...m.values()].map((s) => s.xs[s.xs.length - 1]));
      if (lasts.length) since = Math.min(...lasts);
    }
    loaded = true;
    if (!series.size) {
      grid.replaceChildren(
        emptyBox(h('p', {}, 'No trainer metrics yet. Post them from the training loop: ', h('code', {}, 'run.log(step, loss=loss.item())'), ' (', h('code', {}, 'POST /v1/runs/{run}/metrics'), ').')),
      );
    } else {
      flush();
    }
  }

  async function firstLoad() {
    try {
      await load();
    } catch (err) {
      if (!isAbort(err) && ctx.active) grid.replaceChildren(errorBox(err, firstLoad));
    }
  }

  ctx.onCleanup(() => {
    clearTimeout(flushTimer);
    for (const entry of charts.values()) entry.chart.destroy();
  });

  return {
    el,
    start() {
      firstLoad();
      ctx.every(TRAINER_REFRESH_MS, load);
    },
    /** A `metrics` event from the stream. */
    onEvent(e) {
      for (const [name, value] of Object.entries(e.detail.values || {})) add(name, e.rank, e.step, value);
      if (loaded) schedule();
    },
    reload: load,
  };
}
