// #/runs/NAME: the run's figures, its ranks (live over SSE), charts of the
// trainer's metrics and of the server's own series (EMA drift, ingest),
// an events log and the run's configuration. Each panel loads on its own,
// so a slow request only delays the panel that waits for it.

import { api, byStreamOrder, isAbort, openEvents, runPath, withQuery } from '../api.js';
import { alignByX, chartCard, color, createChart, fade, smoothEma } from '../charts.js';
import { badge, emptyBox, errorBox, h, healthBadge, loadingBox, rankStatusText, rankTone, setCrumbs, stat, tableWrap } from '../dom.js';
import { fmtAge, fmtBytes, fmtClock, fmtInt, fmtNum, fmtRate, fmtRelative, fmtSeconds, fmtStep, fmtTime } from '../format.js';
import { runHeader, setConnection } from './common.js';
import { evalsPanel } from './evals.js';
import { runExtras } from './runextras.js';

const RUN_REFRESH_MS = 3000;
const SERVER_SERIES_REFRESH_MS = 5000;
const TRAINER_REFRESH_MS = 15000;
const STALE_AFTER_S = 60; // the server's STALE_AFTER_MS, when a rank does not say
const COMPACT_RANKS = 32; // above this many ranks, tiles become squares
const TRAINER_POINTS = 5000;
const SERVER_POINTS = 5000;
const LOG_SHOWN = 200;
const LOG_KEPT_PER_KIND = 500;
const RARE_KINDS = ['run_created', 'rank_registered', 'rejection', 'snapshot', 'restored', 'resumed', 'alert'];
const LOG_KINDS = [...RARE_KINDS, 'push', 'metrics'];
const INGEST = ['ingest/bytes_per_second', 'ingest/pushes_per_second', 'ingest/push_seconds'];
const isServerSeries = (name) => name.startsWith('ema_drift/') || name.startsWith('ingest/');

function loadSetting(key, fallback) {
  try {
    const v = localStorage.getItem(`polyak.${key}`);
    return v === null ? fallback : JSON.parse(v);
  } catch {
    return fallback;
  }
}

function saveSetting(key, value) {
  try {
    localStorage.setItem(`polyak.${key}`, JSON.stringify(value));
  } catch {
    // Not persisted; the page still works.
  }
}

/** Inserts (or replaces) `[x, y]` in a series kept sorted by x. */
function upsert(series, x, y) {
  const xs = series.xs;
  if (!xs.length || x > xs[xs.length - 1]) {
    xs.push(x);
    series.ys.push(y);
    return;
  }
  let lo = 0;
  let hi = xs.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  if (xs[lo] === x) series.ys[lo] = y;
  else {
    xs.splice(lo, 0, x);
    series.ys.splice(lo, 0, y);
  }
}

function profileParams(p) {
  const skip = new Set(['name', 'kind']);
  const parts = Object.entries(p)
    .filter(([k, v]) => !skip.has(k) && v !== null && v !== undefined)
    .map(([k, v]) => `${k} ${typeof v === 'number' ? fmtNum(v, 6) : v}`);
  return parts.join(' · ') || '—';
}

// --- stats ---------------------------------------------------------------

function statsStrip() {
  const values = {};
  const cell = (key, label) => {
    values[key] = h('span', { dataset: { testid: key } }, '—');
    return stat(label, values[key]);
  };
  const el = h(
    'div',
    { class: 'stats' },
    cell('last-step', 'Last step'),
    cell('min-step', 'Slowest rank at'),
    cell('ranks-seen', 'Ranks seen'),
    cell('throughput', 'Ingest'),
    cell('resident', 'EMA resident'),
    cell('wire', 'Wire ratio'),
    cell('codec', 'Encode / decode'),
    cell('device', 'Device'),
    cell('created', 'Created'),
  );
  return {
    el,
    update(view, ranks) {
      values['last-step'].textContent = fmtStep(view.last_step);
      values['min-step'].textContent = fmtStep(view.min_step);
      values['ranks-seen'].textContent = `${view.ranks_seen} / ${view.config.world_size}`;
      const rate = ranks.reduce((sum, r) => sum + (r.status === 'live' && r.bytes_per_second ? r.bytes_per_second : 0), 0);
      values.throughput.textContent = fmtRate(rate);
      values.resident.textContent = fmtBytes(view.resident_bytes);
      // The ranks' wire figures summed (the run view's `wire`).
      const w = view.wire || {};
      values.wire.textContent = w.ratio ? `${w.ratio.toFixed(2)}×` : '—';
      values.wire.title = w.wire_bytes ? `${fmtInt(w.wire_bytes)} wire bytes for ${fmtInt(w.logical_bytes)} logical bytes` : '';
      values.codec.textContent = w.wire_bytes ? `${fmtSeconds(w.encode_seconds || 0)} / ${fmtSeconds(w.decode_seconds || 0)}` : '—';
      values.codec.title = 'encode (client-reported) / decode (server) seconds, all pushes of all ranks';
      values.codec.classList.toggle('bad-text', (w.mirror_mismatches || 0) > 0);
      values.device.textContent = view.config.device;
      values.device.title = `EMA kept as ${view.config.ema_dtype} on ${view.config.device}`;
      values.created.textContent = fmtRelative(view.created_at_ms);
      values.created.title = fmtTime(view.created_at_ms);
    },
  };
}

// --- ranks ---------------------------------------------------------------

/** A rank's failover in a few words: where from, and what was lost. */
function failoverText(f) {
  const lost = f.lost_steps === null || f.lost_steps === undefined ? 'loss known at next push' : `${fmtInt(f.lost_steps)} step${f.lost_steps === 1 ? '' : 's'} lost`;
  return `from ${f.from_node || '?'} @ ${f.restored_step === null ? 'empty' : fmtStep(f.restored_step)} · ${lost}`;
}

function failoverTitle(f) {
  return [
    `taken over from ${f.from_node || 'a lost node'} (epoch ${f.epoch})`,
    f.snapshot ? `restored from snapshot ${f.snapshot} at step ${f.restored_step}` : 'no snapshot held the rank: its EMA restarted',
    f.last_seen_step !== null ? `last step the catalog saw: ${f.last_seen_step}` : null,
    f.resumed_step !== null ? `next push at step ${f.resumed_step}` : null,
  ]
    .filter(Boolean)
    .join('\n');
}

function ranksPanel(worldSize) {
  const compact = worldSize > COMPACT_RANKS;
  const summary = h('span', { class: 'muted small' });
  const grid = h('div', { class: compact ? 'rank-grid compact' : 'rank-grid', dataset: { testid: 'ranks' } });
  const el = h('section', { class: 'card' }, h('div', { class: 'card-head' }, h('h2', {}, 'Ranks'), summary), grid);
  const tiles = [];

  function tile(rank) {
    if (compact) {
      const node = h('div', { class: 'rank-square', dataset: { rank } }, String(rank));
      return { node, fields: {} };
    }
    const fields = {};
    const field = (key, label) => {
      fields[key] = h('dd', { dataset: { field: key } }, '—');
      return [h('dt', {}, label), fields[key]];
    };
    fields.status = h('span', { class: 'badge muted rank-status' }, '…');
    fields.step = h('div', { class: 'rank-step', dataset: { field: 'last_step' } }, '—');
    const node = h(
      'div',
      { class: 'rank-tile', dataset: { rank } },
      h('div', { class: 'rank-head' }, h('span', { class: 'rank-id' }, `rank ${rank}`), fields.status),
      h('div', { class: 'rank-step-label muted small' }, 'last step'),
      fields.step,
      h(
        'dl',
        { class: 'rank-facts' },
        field('lag', 'lag'),
        field('age', 'last push'),
        field('throughput', 'throughput'),
        field('push', 'push latency'),
        field('pushes', 'pushes'),
        field('rejections', 'rejections'),
        field('wire', 'wire ratio'),
        field('codec', 'encode / decode'),
        field('engine', 'engine'),
        field('node', 'node'),
        field('failover', 'failover'),
      ),
    );
    return { node, fields };
  }

  return {
    el,
    /** `ranks`: RankView[] with `age` (seconds, browser-corrected) filled in. */
    update(ranks) {
      while (tiles.length < ranks.length) {
        const t = tile(tiles.length);
        tiles.push(t);
        grid.append(t.node);
      }
      const counts = { live: 0, stale: 0, never_seen: 0, not_restored: 0 };
      let behind = 0;
      ranks.forEach((r, i) => {
        const t = tiles[i];
        const status = r.shownStatus;
        counts[status] = (counts[status] || 0) + 1;
        t.node.dataset.status = status;
        if (r.lag > 0) behind += 1;
        if (compact) {
          t.node.className = `rank-square ${rankTone(status)}${r.lag > 0 ? ' behind' : ''}`;
          t.node.title = `rank ${r.rank}: ${rankStatusText(status)} · step ${fmtStep(r.last_step)} · lag ${fmtInt(r.lag)} · ${fmtAge(r.age)}${r.engine ? ` · ${r.engine}` : ''}${r.node ? ` on ${r.node}` : ''}${r.failover ? ` · ${failoverText(r.failover)}` : ''}`;
          return;
        }
        const f = t.fields;
        f.status.className = `badge ${rankTone(status)} rank-status`;
        f.status.textContent = rankStatusText(status);
        f.step.textContent = fmtStep(r.last_step);
        f.lag.textContent = r.lag === null || r.lag === undefined ? '—' : `${fmtInt(r.lag)} step${r.lag === 1 ? '' : 's'}`;
        f.lag.classList.toggle('warn-text', r.lag > 0);
        f.age.textContent = fmtAge(r.age);
        f.throughput.textContent = fmtRate(r.bytes_per_second);
        f.push.textContent = fmtSeconds(r.push_seconds);
        f.pushes.textContent = fmtInt(r.pushes);
        f.rejections.textContent = fmtInt(r.rejections);
        f.rejections.classList.toggle('bad-text', r.rejections > 0);
        const w = r.wire || {};
        const form = [w.last_kind, w.last_quant, w.last_encoding === 'identity' ? null : w.last_encoding]
          .filter(Boolean)
          .join(' · ');
        f.wire.textContent = w.ratio ? `${w.ratio.toFixed(2)}×${form ? ` (${form})` : ''}` : '—';
        f.wire.title = w.wire_bytes ? `${fmtInt(w.wire_bytes)} wire bytes for ${fmtInt(w.logical_bytes)} logical bytes` : '';
        const pushes = Math.max(1, r.pushes || 0);
        f.codec.textContent = w.wire_bytes
          ? `${fmtSeconds((w.encode_seconds || 0) / pushes)} / ${fmtSeconds((w.decode_seconds || 0) / pushes)}`
          : '—';
        f.codec.classList.toggle('bad-text', (w.mirror_mismatches || 0) > 0);
        f.engine.textContent = r.engine || '—';
        f.node.textContent = r.node || '—';
        f.failover.textContent = r.failover ? failoverText(r.failover) : '—';
        f.failover.classList.toggle('warn-text', Boolean(r.failover && r.failover.lost_steps));
        f.failover.title = r.failover ? failoverTitle(r.failover) : '';
      });
      const failedOver = ranks.filter((r) => r.failover);
      const lost = failedOver.reduce((n, r) => n + (r.failover.lost_steps || 0), 0);
      summary.textContent = [
        counts.finished ? `${counts.finished} finished` : `${counts.live} live`,
        counts.stale ? `${counts.stale} stale` : null,
        counts.never_seen ? `${counts.never_seen} never seen` : null,
        counts.not_restored ? `${counts.not_restored} not restored` : null,
        behind ? `${behind} behind the furthest rank` : null,
        failedOver.length ? `${failedOver.length} taken over · ${fmtInt(lost)} step${lost === 1 ? '' : 's'} lost` : null,
      ]
        .filter(Boolean)
        .join(' · ');
    },
  };
}

// --- trainer metrics -----------------------------------------------------

function trainerPanel(ctx, run) {
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

// --- server series: EMA drift, ingest ------------------------------------

function serverPanel(ctx, run, config) {
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

// --- events log ----------------------------------------------------------

function describe(e) {
  const d = e.detail || {};
  switch (e.kind) {
    case 'push':
      if (d.duplicate) return 'duplicate (already applied)';
      return [d.applied ? 'applied' : 'not applied (not an update step)', d.bytes !== undefined ? fmtBytes(d.bytes) : null, d.seconds !== undefined ? fmtSeconds(d.seconds) : null, d.skipped && d.skipped.length ? `skipped ${d.skipped.join(', ')}` : null]
        .filter(Boolean)
        .join(' · ');
    case 'rejection':
      return `${d.status || ''} ${d.code || ''}: ${d.message || ''}`.trim();
    case 'snapshot':
      return [d.id, d.kind, d.status, d.bytes ? fmtBytes(d.bytes) : null, d.reason].filter(Boolean).join(' · ');
    case 'rank_registered':
      return [d.tensors !== undefined ? `${fmtInt(d.tensors)} tensors` : null, d.numel !== undefined ? `${fmtInt(d.numel)} elements` : null, d.resident_bytes !== undefined ? `${fmtBytes(d.resident_bytes)} resident` : null]
        .filter(Boolean)
        .join(' · ');
    case 'run_created':
      return `world size ${d.world_size} · ${d.profiles} profile${d.profiles === 1 ? '' : 's'}`;
    case 'alert':
      return [d.state, d.acknowledged ? 'acknowledged' : null, d.message].filter(Boolean).join(' · ');
    case 'metrics':
      return Object.entries(d.values || {})
        .map(([k, v]) => `${k} ${fmtNum(v)}`)
        .join(' · ');
    default:
      return JSON.stringify(d);
  }
}

const KIND_TONE = { rejection: 'bad', snapshot: 'info', rank_registered: 'ok', run_created: 'ok', push: 'muted', metrics: 'muted', restored: 'warn', resumed: 'warn', alert: 'bad' };

function eventsPanel(ctx) {
  const shown = new Set(loadSetting('log_kinds', RARE_KINDS));
  /** @type {Map<string, any[]>} */
  const kept = new Map(LOG_KINDS.map((k) => [k, []]));
  /** @type {Map<string, number>} */
  const counts = new Map(LOG_KINDS.map((k) => [k, 0]));
  const chipBar = h('div', { class: 'chips filter-chips', role: 'group', 'aria-label': 'event kinds' });
  const list = h('ol', { class: 'event-log', dataset: { testid: 'events' } });
  const body = h('div', { class: 'event-body' }, loadingBox('Loading events…'));
  const el = h('section', { class: 'card events-card' }, h('div', { class: 'card-head' }, h('h2', {}, 'Events')), chipBar, body);
  const chips = new Map();
  let timer = null;
  let ready = false;
  // Events arrive in the stream's order (the catalog's, over every node;
  // ids are only ordered within one node): the log shows the newest first.
  let arrived = 0;
  const order = new WeakMap();

  for (const kind of LOG_KINDS) {
    const count = h('span', { class: 'chip-count' }, '0');
    const chip = h(
      'button',
      {
        class: 'chip toggle',
        type: 'button',
        'aria-pressed': String(shown.has(kind)),
        dataset: { kind },
        onclick: () => {
          if (shown.has(kind)) shown.delete(kind);
          else shown.add(kind);
          chip.setAttribute('aria-pressed', String(shown.has(kind)));
          saveSetting('log_kinds', [...shown]);
          render();
        },
      },
      kind.replace('_', ' '),
      count,
    );
    chips.set(kind, count);
    chipBar.append(chip);
  }

  function render() {
    timer = null;
    if (!ready || !ctx.active) return;
    for (const [kind, count] of chips) count.textContent = fmtInt(counts.get(kind) || 0);
    const events = [...shown]
      .flatMap((k) => kept.get(k) || [])
      .sort((a, b) => order.get(b) - order.get(a))
      .slice(0, LOG_SHOWN);
    if (!events.length) {
      body.replaceChildren(emptyBox(counts.size && [...counts.values()].some((c) => c) ? 'No events of the kinds selected.' : 'No events yet.'));
      return;
    }
    list.replaceChildren(
      ...events.map((e) =>
        h(
          'li',
          { class: `event kind-${e.kind}`, dataset: { kind: e.kind, id: e.id } },
          h('time', { class: 'mono muted', datetime: new Date(e.at_ms).toISOString(), title: fmtTime(e.at_ms) }, fmtClock(e.at_ms)),
          badge(e.kind.replace('_', ' '), KIND_TONE[e.kind] || 'muted'),
          h(
            'span',
            { class: 'event-detail' },
            h('span', { class: 'event-where mono' }, [e.rank !== null && e.rank !== undefined ? `rank ${e.rank}` : '', e.step !== null && e.step !== undefined ? `step ${fmtStep(e.step)}` : ''].filter(Boolean).join(' · ')),
            ' ',
            describe(e),
          ),
        ),
      ),
    );
    if (list.parentNode !== body) body.replaceChildren(list);
  }

  function schedule() {
    if (!timer) timer = setTimeout(render, 300);
  }

  ctx.onCleanup(() => clearTimeout(timer));

  return {
    el,
    add(e) {
      if (!kept.has(e.kind)) {
        kept.set(e.kind, []);
        counts.set(e.kind, 0);
      }
      const arr = /** @type {any[]} */ (kept.get(e.kind));
      order.set(e, arrived++);
      arr.push(e);
      if (arr.length > LOG_KEPT_PER_KIND) arr.splice(0, arr.length - LOG_KEPT_PER_KIND);
      counts.set(e.kind, /** @type {number} */ (counts.get(e.kind)) + 1);
      schedule();
    },
    ready() {
      ready = true;
      render();
    },
    fail(err, retry) {
      body.replaceChildren(errorBox(err, retry));
    },
  };
}

// --- configuration -------------------------------------------------------

function configPanel(view) {
  const c = view.config;
  const rows = [
    ['world size', c.world_size],
    ['update every', `${fmtInt(c.update_every)} step${c.update_every === 1 ? '' : 's'}`],
    ['device', c.device],
    ['EMA dtype', c.ema_dtype],
    ['mirror', c.mirror ? 'on (online weights kept)' : 'off'],
    ['snapshot every', c.snapshot_every ? `${fmtInt(c.snapshot_every)} steps` : 'off'],
    ['retention', c.retention && (c.retention.keep_last || c.retention.keep_every) ? `keep last ${c.retention.keep_last} · every ${c.retention.keep_every}` : 'keep all'],
    ['drift every', c.drift_every ? `${fmtInt(c.drift_every)} applied push${c.drift_every === 1 ? '' : 'es'}` : 'off'],
    ['non-finite values', c.nonfinite],
    ['copy patterns', c.copy_patterns && c.copy_patterns.length ? c.copy_patterns.join(', ') : 'none'],
    ['snapshot timeout', fmtSeconds(c.snapshot_timeout_secs)],
    ['persist every', c.persist_every_secs ? fmtSeconds(c.persist_every_secs) : 'off'],
    ['created', fmtTime(view.created_at_ms)],
  ];
  return h(
    'section',
    { class: 'card config-card' },
    h('div', { class: 'card-head' }, h('h2', {}, 'Configuration')),
    h('dl', { class: 'kv' }, rows.map(([k, v]) => [h('dt', {}, k), h('dd', {}, String(v))])),
    h('h3', { class: 'sub' }, `Profiles (${c.profiles.length})`),
    tableWrap(
      h(
        'table',
        { class: 'table compact' },
        h('thead', {}, h('tr', {}, h('th', {}, 'name'), h('th', {}, 'kind'), h('th', {}, 'parameters'))),
        h(
          'tbody',
          {},
          c.profiles.map((p) => h('tr', { dataset: { profile: p.name } }, h('td', { class: 'mono' }, p.name), h('td', {}, badge(p.kind, 'info')), h('td', { class: 'mono small' }, profileParams(p)))),
        ),
      ),
    ),
  );
}

// --- the page ------------------------------------------------------------

export function render(root, { run }, ctx) {
  setCrumbs([{ text: 'Runs', href: '#/runs' }, { text: run }]);
  const header = runHeader(run, 'overview');
  const body = h('div', { class: 'page-body' }, loadingBox('Loading run…'));
  root.append(h('div', { class: 'page' }, header.el, body));

  let view = null;
  let ranks = [];
  let skewMs = 0; // browser clock minus server clock
  let stats = null;
  let ranksUi = null;
  let trainer = null;
  let evalsUi = null;
  let log = null;
  let renderTimer = null;
  let extras = null;

  const serverNow = () => Date.now() - skewMs;

  function refreshRanks() {
    renderTimer = null;
    if (!view || !ctx.active) return;
    const furthest = ranks.reduce((m, r) => (r.last_step !== null && r.last_step > m ? r.last_step : m), -1);
    for (const r of ranks) {
      r.age = r.last_push_at_ms ? Math.max(0, (serverNow() - r.last_push_at_ms) / 1000) : null;
      r.lag = r.last_step === null || furthest < 0 ? null : furthest - r.last_step;
      const staleAfter = r.stale_after_seconds ?? STALE_AFTER_S; // longer for ranks that push rarely
      r.shownStatus = r.status === 'live' && r.age !== null && r.age > staleAfter ? 'stale' : r.status;
    }
    view.last_step = furthest < 0 ? view.last_step : furthest;
    const seen = ranks.filter((r) => r.last_step !== null).map((r) => r.last_step);
    if (seen.length) view.min_step = Math.min(...seen);
    stats.update(view, ranks);
    ranksUi.update(ranks);
  }

  function scheduleRanks() {
    if (!renderTimer) renderTimer = setTimeout(refreshRanks, 100);
  }

  function applyView(next) {
    view = next;
    ranks = next.ranks || [];
    const skews = ranks.filter((r) => r.last_push_at_ms && r.age_seconds !== null).map((r) => Date.now() - (r.last_push_at_ms + r.age_seconds * 1000));
    if (skews.length) skewMs = skews.sort((a, b) => a - b)[skews.length >> 1];
    const badges = [
      healthBadge(next.health),
      badge(`${next.config.world_size} rank${next.config.world_size === 1 ? '' : 's'}`, 'muted'),
    ];
    // replaceChildren(null) would show the text "null".
    if (next.finished) badges.push(badge(next.finished.step === null ? 'finished before any push' : `finished at step ${fmtStep(next.finished.step)}`, 'muted', { dataset: { testid: 'finished' } }));
    header.badges.replaceChildren(...badges);
  }

  async function refreshRun() {
    let next;
    try {
      next = await api(runPath(run), { signal: ctx.signal });
    } catch (err) {
      if (isAbort(err) || !ctx.active) return;
      // Keep what is shown; say it is not current.
      header.badges.replaceChildren(
        healthBadge(view.health),
        badge(`not refreshing: ${err.code || 'error'}`, 'bad', { title: err.message, dataset: { testid: 'refresh-error' } }),
      );
      return;
    }
    if (!ctx.active) return;
    applyView(next);
    refreshRanks();
  }

  function onPush(e) {
    const r = ranks[e.rank];
    if (!r) return;
    // Replayed history is older than the view: it only goes to the log.
    if (r.last_push_at_ms && e.at_ms <= r.last_push_at_ms) return;
    const d = e.detail || {};
    r.last_push_at_ms = e.at_ms;
    r.pushes += 1;
    if (d.duplicate) r.duplicates += 1;
    if (d.bytes) r.bytes_received += d.bytes;
    if (d.applied && (r.last_step === null || e.step > r.last_step)) r.last_step = e.step;
    if (r.status === 'never_seen' || r.status === 'stale') r.status = 'live';
    scheduleRanks();
  }

  function onEvent(e) {
    log.add(e);
    if (e.kind === 'push') onPush(e);
    else if (e.kind === 'metrics') trainer.onEvent(e);
    else if (e.kind === 'alert') extras.refresh();
    else if (e.kind === 'eval') evalsUi.onEvent(e);
    else if (e.kind === 'rank_registered' || e.kind === 'rejection' || e.kind === 'restored' || e.kind === 'resumed' || e.kind === 'finished') refreshRun();
  }

  async function startEvents() {
    // The log's history: the newest events, and the newest of the rarer
    // kinds (pushes would crowd them out); the stream starts after them.
    let since = 0;
    let seen = [];
    try {
      const path = runPath(run, '/events');
      const [recent, rare] = await Promise.all([
        api(withQuery(path, { tail: 200 }), { signal: ctx.signal }),
        api(withQuery(path, { kinds: RARE_KINDS.join(','), tail: 500 }), { signal: ctx.signal }),
      ]);
      if (!ctx.active) return;
      const byId = new Map([...rare, ...recent].map((e) => [e.id, e]));
      const shown = [...byId.values()].sort(byStreamOrder);
      for (const e of shown) log.add(e);
      // The stream starts after the newest event of the whole log (the
      // rarer kinds' listing may hold a newer one: it is in `seen`).
      const newest = [...recent].sort(byStreamOrder).at(-1);
      if (newest) since = newest.id;
      seen = shown.map((e) => e.id);
    } catch (err) {
      if (isAbort(err) || !ctx.active) return;
      log.fail(err, startEvents);
      return;
    }
    log.ready();
    const stream = openEvents(run, {
      since,
      seen,
      onEvent,
      onStatus: (s) => ctx.active && setConnection(s),
      onOpen: () => {
        // Metric events are not replayed: fetch what was posted before the
        // stream (re)started and after the last fetch.
        trainer.reload().catch(() => {});
      },
    });
    ctx.onCleanup(() => {
      stream.close();
      setConnection(null);
    });
  }

  async function load() {
    body.replaceChildren(loadingBox('Loading run…'));
    let first;
    try {
      first = await api(runPath(run), { signal: ctx.signal });
    } catch (err) {
      if (!isAbort(err) && ctx.active) body.replaceChildren(errorBox(err, load), h('p', {}, h('a', { href: '#/runs' }, '← All runs')));
      return;
    }
    if (!ctx.active) return;
    applyView(first);
    stats = statsStrip();
    ranksUi = ranksPanel(first.config.world_size);
    trainer = trainerPanel(ctx, run);
    evalsUi = evalsPanel(ctx, run, first.config);
    const server = serverPanel(ctx, run, first.config);
    log = eventsPanel(ctx);
    extras = runExtras(ctx, run, first);
    header.el.querySelector('.title-row').append(extras.badge);
    body.replaceChildren(stats.el, extras.el, ranksUi.el, trainer.el, evalsUi.el, server.el, h('div', { class: 'split' }, log.el, configPanel(first)));
    refreshRanks();
    trainer.start();
    evalsUi.start();
    server.start();
    startEvents();
    ctx.every(RUN_REFRESH_MS, refreshRun);
    // Ages tick between refreshes.
    const tick = setInterval(() => !document.hidden && refreshRanks(), 1000);
    ctx.onCleanup(() => {
      clearInterval(tick);
      clearTimeout(renderTimer);
    });
  }
  load();
}
