// #/compare?runs=a,b&metric=loss&x=step|time&smooth=0.6: runs side by
// side. One colour per run, the smoothed line (TensorBoard's EMA) over the
// raw one drawn faint; the legend shows each run's value at the cursor.
// Every choice lives in the URL, so a view can be shared.

import { api, isAbort, runPath, withQuery } from '../api.js';
import { alignByX, chartCard, color, createChart, fade, smoothEma } from '../charts.js';
import { emptyBox, errorBox, h, loadingBox, setCrumbs } from '../dom.js';
import { fmtNum, fmtStep } from '../format.js';
import { bestPerMetric, bestText } from './evals.js';
import { matches } from './runs.js';

/** Points per run and series fetched at most. */
const LIMIT = 10000;

export function render(root, { query }, ctx) {
  setCrumbs([{ text: 'Runs', href: '#/runs' }, { text: 'Compare runs' }]);
  const state = {
    runs: (query.get('runs') || '').split(',').filter(Boolean),
    metric: query.get('metric') || '',
    x: query.get('x') === 'time' ? 'time' : 'step',
    smooth: query.has('smooth') ? Math.min(0.99, Math.max(0, Number(query.get('smooth')) || 0)) : 0.6,
    filter: query.get('q') || '',
  };
  const picker = h('div', { class: 'run-picker', dataset: { testid: 'run-picker' } });
  const filter = h('input', { type: 'search', placeholder: 'filter runs by name, tag or note', value: state.filter, 'aria-label': 'filter runs', dataset: { testid: 'compare-filter' } });
  const metric = h('select', { 'aria-label': 'metric', dataset: { testid: 'metric' } });
  const xSel = h('select', { 'aria-label': 'x axis', dataset: { testid: 'x-axis' } }, h('option', { value: 'step', selected: state.x === 'step' }, 'x: step'), h('option', { value: 'time', selected: state.x === 'time' }, 'x: wall time'));
  const slider = h('input', { type: 'range', min: '0', max: '0.99', step: '0.01', value: String(state.smooth), 'aria-label': 'smoothing', dataset: { testid: 'smoothing' } });
  const card = chartCard('Runs side by side', 'smoothed (solid) over raw (faint); legend: value at the cursor');
  const status = h('div', {});
  root.append(
    h(
      'div',
      { class: 'page' },
      h('div', { class: 'page-head' }, h('div', { class: 'title-row' }, h('h1', {}, 'Compare runs'))),
      h('section', { class: 'card' }, h('div', { class: 'card-head' }, h('h2', {}, 'Runs'), filter), picker),
      h('div', { class: 'compare-controls' }, metric, xSel, h('label', { class: 'slider' }, 'smoothing ', slider)),
      status,
      card.el,
    ),
  );

  let allRuns = [];
  let chart = null;
  let series = {}; // run -> points of the chosen metric
  let bests = {}; // run -> its best evaluated value per metric (legend)

  function keepInUrl() {
    const params = new URLSearchParams();
    if (state.runs.length) params.set('runs', state.runs.join(','));
    if (state.metric) params.set('metric', state.metric);
    if (state.x !== 'step') params.set('x', state.x);
    params.set('smooth', String(state.smooth));
    if (state.filter) params.set('q', state.filter);
    history.replaceState(null, '', `#/compare?${params.toString()}`);
  }

  function drawPicker() {
    const shown = allRuns.filter((r) => state.runs.includes(r.name) || matches(r, { q: state.filter }));
    picker.replaceChildren(
      ...shown.map((r) =>
        h(
          'label',
          { dataset: { run: r.name } },
          h('input', {
            type: 'checkbox',
            checked: state.runs.includes(r.name),
            onchange: (e) => {
              state.runs = e.target.checked ? [...state.runs, r.name] : state.runs.filter((n) => n !== r.name);
              keepInUrl();
              loadSeries();
            },
          }),
          ' ',
          r.name,
          (r.tags || []).length ? h('span', { class: 'muted small' }, ` ${r.tags.join(', ')}`) : null,
        ),
      ),
    );
    if (!shown.length) picker.append(h('span', { class: 'muted' }, 'No run matches.'));
  }

  function draw() {
    if (chart) chart.destroy();
    chart = null;
    card.body.querySelectorAll('.chart-controls').forEach((n) => n.remove());
    const runs = state.runs.filter((r) => series[r] && series[r].length);
    if (!runs.length || !state.metric) {
      card.note.textContent = state.runs.length ? `No run has a series \`${state.metric}\`.` : 'Pick runs above.';
      return;
    }
    card.note.textContent = `${state.metric} · ${runs.length} run${runs.length === 1 ? '' : 's'}`;
    const byTime = state.x === 'time';
    const list = runs.map((r) => ({ xs: series[r].map((p) => (byTime ? p[2] / 1000 : p[0])), ys: series[r].map((p) => p[1]) }));
    const aligned = alignByX(list);
    const data = [aligned[0]];
    const defs = [];
    runs.forEach((r, i) => {
      defs.push({ label: `${r} (raw)`, color: fade(color(i), 0.25), width: 1 });
      // The run's best evaluation per metric, where it has any.
      const best = bests[r] && Object.keys(bests[r]).length ? ` · ${bestText(bests[r])}` : '';
      defs.push({ label: `${r}${best}`, color: color(i), width: 2 });
      data.push(aligned[i + 1], smoothEma(aligned[i + 1], state.smooth));
    });
    chart = createChart(card.body, 'compare-runs', {
      series: defs,
      x: byTime ? { label: 'wall time', time: true } : { label: 'step', integer: true, fmt: fmtStep },
      y: { legend: fmtNum, label: state.metric },
      height: 320,
    });
    chart.update(data);
    chart.plot.polyak.runs = runs;
    chart.plot.polyak.metric = state.metric;
    chart.plot.polyak.bests = Object.fromEntries(runs.map((r) => [r, bests[r] || {}]));
  }

  async function loadSeries() {
    drawPicker();
    status.replaceChildren();
    const names = new Set();
    series = {};
    try {
      const answers = await Promise.all(
        state.runs.map((r) => api(withQuery(runPath(r, '/metrics'), { rank: 'run', limit: LIMIT, ...(state.metric ? { names: state.metric } : {}) }), { signal: ctx.signal }).then((d) => [r, d])),
      );
      if (!ctx.active) return;
      // Evaluations are optional: a run without any (or a server without
      // the endpoint) shows no best.
      const evalBests = await Promise.all(state.runs.map((r) => bestPerMetric(r, ctx.signal).catch(() => ({}))));
      if (!ctx.active) return;
      bests = Object.fromEntries(state.runs.map((r, i) => [r, evalBests[i]]));
      // The metric names of every chosen run (one more call when the first answer was filtered).
      for (const [r, d] of answers) {
        d.names.forEach((n) => names.add(n));
        const s = d.series.find((x) => x.name === state.metric && x.rank === null);
        if (s) series[r] = s.points;
      }
      if (!state.metric && names.size) {
        state.metric = names.has('loss') ? 'loss' : [...names].sort()[0];
        keepInUrl();
        return loadSeries();
      }
    } catch (err) {
      if (isAbort(err) || !ctx.active) return;
      status.replaceChildren(errorBox(err, loadSeries));
      return;
    }
    const sorted = [...names].sort();
    metric.replaceChildren(...sorted.map((n) => h('option', { value: n, selected: n === state.metric }, n)));
    draw();
  }

  filter.addEventListener('input', () => {
    state.filter = filter.value.trim();
    keepInUrl();
    drawPicker();
  });
  metric.addEventListener('change', () => {
    state.metric = metric.value;
    keepInUrl();
    loadSeries();
  });
  xSel.addEventListener('change', () => {
    state.x = xSel.value;
    keepInUrl();
    draw();
  });
  slider.addEventListener('input', () => {
    state.smooth = Number(slider.value);
    keepInUrl();
    draw();
  });

  (async () => {
    picker.replaceChildren(loadingBox('Loading runs…'));
    try {
      allRuns = (await api('/v1/runs', { signal: ctx.signal })).runs.sort((a, b) => b.created_at_ms - a.created_at_ms);
    } catch (err) {
      if (!isAbort(err) && ctx.active) picker.replaceChildren(errorBox(err));
      return;
    }
    if (!ctx.active) return;
    if (!allRuns.length) {
      picker.replaceChildren(emptyBox('No runs yet.'));
      return;
    }
    keepInUrl();
    loadSeries();
  })();
  ctx.onCleanup(() => chart && chart.destroy());
}
