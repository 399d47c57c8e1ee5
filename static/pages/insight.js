// #/runs/NAME/insight: what only an EMA service can show. Per profile, the
// EMA drift of every tensor over the sampled steps as a heatmap (one row
// per tensor); each profile's effective averaging window (beta and the
// implied half-life in steps); every rank's step over wall time, so a
// straggler stands out; and the trainer's system metrics per rank.

import { api, isAbort, runPath, withQuery } from '../api.js';
import { alignByX, chartCard, color, createChart } from '../charts.js';
import { emptyBox, errorBox, h, loadingBox, setCrumbs } from '../dom.js';
import { fmtBytes, fmtNum, fmtStep } from '../format.js';
import { runHeader } from './common.js';

const REFRESH_MS = 5000;

function heatmaps() {
  window.polyak = window.polyak || {};
  window.polyak.heatmaps = window.polyak.heatmaps || {};
  return window.polyak.heatmaps;
}

/** Viridis-like ramp from dark blue (low) to yellow (high), t in [0, 1]. */
function ramp(t) {
  const stops = [
    [68, 1, 84],
    [59, 82, 139],
    [33, 145, 140],
    [94, 201, 98],
    [253, 231, 37],
  ];
  const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  const f = x - i;
  return stops[i].map((a, k) => Math.round(a + (stops[i + 1][k] - a) * f));
}

const ROW_PX = 14;

/** A heatmap card for one profile: `{el, update(data)}`. */
function heatmapCard(profile) {
  const card = chartCard(`Drift per tensor · ${profile}`, '‖EMA − online‖ / ‖online‖, log colour scale; columns are sampled steps');
  const labels = h('div', { class: 'heatmap-labels' });
  const canvas = h('canvas', { 'aria-label': `drift heatmap of ${profile}`, dataset: { profile } });
  const scale = h('div', { class: 'heatmap-scale muted' });
  const grid = h('div', { class: 'heatmap', dataset: { testid: `heatmap-${profile}` } }, labels, h('div', {}, canvas, scale));
  card.body.append(grid);
  let last = null;
  canvas.addEventListener('mousemove', (e) => {
    if (!last) return;
    const r = canvas.getBoundingClientRect();
    const col = Math.floor(((e.clientX - r.left) / r.width) * last.steps.length);
    const row = Math.floor((e.clientY - r.top) / ROW_PX);
    const v = last.values[row] && last.values[row][col];
    canvas.title = row < last.tensors.length && col < last.steps.length ? `${last.tensors[row]} @ step ${fmtStep(last.steps[col])}: ${v === null || v === undefined ? '—' : fmtNum(v)}` : '';
  });
  return {
    el: card.el,
    update(data) {
      last = data;
      heatmaps()[profile] = data;
      const { tensors, steps, values } = data;
      card.note.textContent = steps.length ? `${tensors.length} tensors · ${steps.length} samples (steps ${fmtStep(steps[0])}–${fmtStep(steps[steps.length - 1])})` : 'No drift samples yet (the run samples every drift_every updates).';
      labels.replaceChildren(...tensors.map((t) => h('div', { class: 'heatmap-row', title: t, dataset: { tensor: t } }, t)));
      const finite = values.flat().filter((v) => v !== null && v > 0);
      const lo = finite.length ? Math.log10(Math.min(...finite)) : 0;
      const hi = finite.length ? Math.log10(Math.max(...finite)) : 1;
      canvas.width = Math.max(1, steps.length);
      canvas.height = Math.max(1, tensors.length);
      canvas.style.height = `${tensors.length * ROW_PX}px`;
      const g = canvas.getContext('2d');
      const img = g.createImageData(canvas.width, canvas.height);
      values.forEach((row, i) =>
        row.forEach((v, j) => {
          const o = (i * canvas.width + j) * 4;
          if (v === null || !(v > 0)) {
            img.data.set([236, 238, 242, 255], o);
            return;
          }
          const [r, gg, b] = ramp(hi > lo ? (Math.log10(v) - lo) / (hi - lo) : 0.5);
          img.data.set([r, gg, b, 255], o);
        }),
      );
      g.putImageData(img, 0, 0);
      scale.replaceChildren(h('span', {}, finite.length ? fmtNum(10 ** lo) : ''), h('span', {}, 'low → high drift'), h('span', {}, finite.length ? fmtNum(10 ** hi) : ''));
    },
  };
}

/** One chart with one series per rank of the named metric, over wall time or steps. */
function perRank(series, name, byTime) {
  const mine = series.filter((s) => s.name === name && s.rank !== null).sort((a, b) => a.rank - b.rank);
  const list = mine.map((s) => ({ xs: s.points.map((p) => (byTime ? p[2] / 1000 : p[0])), ys: s.points.map((p) => p[1]) }));
  return { ranks: mine.map((s) => s.rank), data: alignByX(list) };
}

export function render(root, { run }, ctx) {
  setCrumbs([{ text: 'Runs', href: '#/runs' }, { text: run, href: `#/runs/${encodeURIComponent(run)}` }, { text: 'Insight' }]);
  const header = runHeader(run, 'insight');
  const body = h('div', { class: 'page-body' }, loadingBox('Loading…'));
  root.append(h('div', { class: 'page' }, header.el, body));
  const charts = {};
  const maps = {};
  let ingestRanks = '';
  let sysKey = null;
  const windowCard = chartCard('Effective averaging window', 'β per update (left) · half-life in steps (right, dashed)');
  const ingestCard = chartCard('Ingest per rank', 'each rank’s step over wall time: a straggler is the lower line');
  const sysBox = h('div', { class: 'chart-grid', dataset: { testid: 'system-metrics' } });
  const heatBox = h('div', {});

  async function refresh(config) {
    const profiles = config.profiles.map((p) => p.name);
    const [drifts, win, metrics] = await Promise.all([
      Promise.all(profiles.map((p) => api(withQuery(runPath(run, '/drift/tensors'), { profile: p }), { signal: ctx.signal }))),
      api(withQuery(runPath(run, '/window'), { points: 200 }), { signal: ctx.signal }),
      api(withQuery(runPath(run, '/metrics'), { limit: 2000 }), { signal: ctx.signal }),
    ]);
    if (!ctx.active) return;
    drifts.forEach((d) => {
      if (!maps[d.profile]) {
        maps[d.profile] = heatmapCard(d.profile);
        heatBox.append(maps[d.profile].el);
      }
      maps[d.profile].update(d);
    });

    if (!charts.window) {
      charts.window = createChart(windowCard.body, 'window', {
        series: win.profiles.flatMap((p, i) => [
          { label: `β ${p.profile}`, color: color(i), width: 2 },
          { label: `half-life ${p.profile}`, color: color(i), dash: [5, 4], scale: 'y2', fmt: (v) => `${fmtNum(v)} steps` },
        ]),
        x: { label: 'step', integer: true, fmt: fmtStep },
        y: { legend: fmtNum, label: 'β' },
        y2: { label: 'half-life (steps)' },
      });
    }
    const xs = win.profiles.length ? win.profiles[0].points.map((p) => p[0]) : [];
    charts.window.update([xs, ...win.profiles.flatMap((p) => [p.points.map((q) => q[1]), p.points.map((q) => q[2])])]);

    const ingest = perRank(metrics.series, 'ingest/rank_step', true);
    if (ingest.ranks.join() !== ingestRanks) {
      if (charts.ingest) charts.ingest.destroy();
      ingestCard.body.replaceChildren();
      ingestRanks = ingest.ranks.join();
      charts.ingest = createChart(ingestCard.body, 'ingest-ranks', {
        series: ingest.ranks.map((r, i) => ({ label: `rank ${r}`, color: color(i), width: 2 })),
        x: { label: 'time', time: true },
        y: { legend: fmtStep, label: 'step' },
      });
    }
    ingestCard.note.textContent = ingest.ranks.length ? '' : 'No pushes sampled yet.';
    charts.ingest.update(ingest.data);

    const sysNames = [...new Set(metrics.series.filter((s) => s.name.startsWith('sys/') && s.rank !== null).map((s) => s.name))].sort();
    const key = sysNames.map((n) => `${n}:${perRank(metrics.series, n, true).ranks.join()}`).join('|');
    if (key !== sysKey) {
      sysKey = key;
      for (const [n, c] of Object.entries(charts)) {
        if (n.startsWith('sys:')) {
          c.destroy();
          delete charts[n];
        }
      }
      sysBox.replaceChildren(...(sysNames.length ? [] : [emptyBox(h('p', {}, 'No system metrics. Enable them in the trainer: ', h('code', {}, 'run.enable_system_metrics(rank)'), '.'))]));
      for (const n of sysNames) {
        const card = chartCard(n, 'per rank');
        sysBox.append(card.el);
        const ranks = perRank(metrics.series, n, true).ranks;
        const bytes = n.endsWith('_bytes');
        charts[`sys:${n}`] = createChart(card.body, `sys:${n}`, {
          series: ranks.map((r, i) => ({ label: `rank ${r}`, color: color(i), width: 1.5 })),
          x: { label: 'time', time: true },
          y: bytes ? { fmt: fmtBytes } : { legend: fmtNum },
        });
      }
    }
    for (const n of sysNames) charts[`sys:${n}`].update(perRank(metrics.series, n, true).data);
  }

  (async () => {
    let view;
    try {
      view = await api(runPath(run), { signal: ctx.signal });
    } catch (err) {
      if (!isAbort(err) && ctx.active) body.replaceChildren(errorBox(err));
      return;
    }
    if (!ctx.active) return;
    body.replaceChildren(
      h('section', { class: 'section' }, h('h2', {}, 'EMA drift per tensor'), heatBox),
      windowCard.el,
      ingestCard.el,
      h('section', { class: 'section' }, h('h2', {}, 'Trainer system metrics'), sysBox),
    );
    const tick = async () => {
      try {
        await refresh(view.config);
      } catch (err) {
        if (!isAbort(err) && ctx.active) windowCard.note.textContent = `not refreshing: ${err.message}`;
      }
    };
    await tick();
    ctx.every(REFRESH_MS, tick);
  })();
  ctx.onCleanup(() => Object.values(charts).forEach((c) => c.destroy()));
}
