// The server's own series of the run: EMA drift per profile, ingest
// throughput and push latency.

import { api, isAbort, runPath, withQuery } from '../../api.js';
import { alignByX, chartCard, color, createChart, fade } from '../../charts.js';
import { h } from '../../dom.js';
import { fmtNum, fmtRate, fmtSeconds, fmtStep } from '../../format.js';
import { upsert } from './series.js';

const SERVER_SERIES_REFRESH_MS = 5000;
const SERVER_POINTS = 5000;
const INGEST = ['ingest/bytes_per_second', 'ingest/pushes_per_second', 'ingest/push_seconds'];

/** The server's charts: `{el, start()}`; `config` names the profiles and the drift sampling. */
export function serverPanel(ctx, run, config) {
  const drift = chartCard('EMA drift', '‖EMA − online‖ / ‖online‖ per profile');
  const throughput = chartCard('Ingest throughput', 'bytes/s (left) · pushes/s (right)');
  const latency = chartCard('Push latency', 'mean seconds per push');
  const grid = h('div', { class: 'chart-grid three' }, drift.el, throughput.el, latency.el);
  const el = h('section', { class: 'card' }, h('div', { class: 'card-head' }, h('h2', {}, 'EMA drift and ingest')), grid);
  const profiles = config.profiles.map((p) => p.name);
  const charts = {};

  function make() {
    charts.drift = createChart(drift.body, 'drift', {
      series: profiles.map((p, i) => ({ label: p, color: color(i), width: 2 })),
      x: { label: 'step', fmt: fmtStep, integer: true },
      y: { legend: (v) => fmtNum(v) },
    });
    charts.throughput = createChart(throughput.body, 'ingest', {
      series: [
        { label: 'bytes/s', color: color(0), width: 2, fmt: fmtRate, fill: fade(color(0), 0.08) },
        { label: 'pushes/s', color: color(1), width: 1.5, scale: 'y2', fmt: (v) => fmtNum(v, 3) },
      ],
      x: { time: true, label: 'time' },
      y: { fmt: fmtRate },
      y2: { fmt: (v) => fmtNum(v, 3) },
    });
    charts.latency = createChart(latency.body, 'push_latency', {
      series: [{ label: 'push latency', color: color(2), width: 2, fmt: fmtSeconds, fill: fade(color(2), 0.08) }],
      x: { time: true, label: 'time' },
      y: { fmt: fmtSeconds },
    });
  }

  // A card without data shows its note instead of empty axes.
  const note = (card, text) => {
    card.note.textContent = text;
    card.note.hidden = !text;
    card.body.hidden = Boolean(text);
  };
  note(drift, 'Loading…');
  note(throughput, 'Loading…');
  note(latency, 'Loading…');

  async function load() {
    const names = [...profiles.map((p) => `ema_drift/${p}`), ...INGEST];
    let resp;
    try {
      resp = await api(withQuery(runPath(run, '/metrics'), { names: names.join(','), rank: 'run', limit: SERVER_POINTS }), { signal: ctx.signal });
    } catch (err) {
      if (isAbort(err) || !ctx.active) return;
      for (const card of [drift, throughput, latency]) note(card, `Could not load: ${err.message}`);
      return;
    }
    if (!ctx.active) return;
    if (!charts.drift) make();
    const byName = new Map(resp.series.filter((s) => s.rank === null).map((s) => [s.name, s.points]));
    // Drift: one point per step (the run-level value is re-sampled as each rank applies).
    const driftSeries = profiles.map((p) => {
      const s = { xs: [], ys: [] };
      for (const [step, value] of byName.get(`ema_drift/${p}`) || []) upsert(s, step, value);
      return s;
    });
    charts.drift.update(alignByX(driftSeries));
    const hasDrift = driftSeries.some((s) => s.xs.length);
    note(
      drift,
      hasDrift ? '' : config.drift_every ? `No samples yet: sampled every ${config.drift_every} applied push${config.drift_every === 1 ? '' : 'es'} of a rank.` : 'Drift sampling is off for this run (drift_every = 0).',
    );
    const timeSeries = (name) => {
      const s = { xs: [], ys: [] };
      for (const [, value, atMs] of byName.get(name) || []) upsert(s, atMs / 1000, value);
      return s;
    };
    charts.throughput.update(alignByX([timeSeries('ingest/bytes_per_second'), timeSeries('ingest/pushes_per_second')]));
    const lat = timeSeries('ingest/push_seconds');
    charts.latency.update([lat.xs, lat.ys]);
    const ingestNote = lat.xs.length ? '' : 'No samples yet: the server samples ingest every 2 s while pushes arrive.';
    note(throughput, ingestNote);
    note(latency, ingestNote);
  }

  ctx.onCleanup(() => {
    for (const c of Object.values(charts)) c.destroy();
  });

  return {
    el,
    start() {
      load();
      ctx.every(SERVER_SERIES_REFRESH_MS, load);
    },
  };
}
