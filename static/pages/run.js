// #/runs/NAME: the run's figures, its ranks (live over SSE), charts of the
// trainer's metrics and of the server's own series (EMA drift, ingest),
// an events log and the run's configuration. Each panel loads on its own,
// so a slow request only delays the panel that waits for it. The panels are
// in run/, one module each; this page loads the run, feeds them its view and
// the event stream, and refreshes the run.

import { api, byStreamOrder, isAbort, openEvents, runPath, withQuery } from '../api.js';
import { badge, errorBox, h, healthBadge, loadingBox, setCrumbs } from '../dom.js';
import { fmtStep } from '../format.js';
import { runHeader, setConnection } from './common.js';
import { evalsPanel } from './evals.js';
import { configPanel } from './run/config.js';
import { eventsPanel, RARE_KINDS } from './run/events.js';
import { ranksPanel } from './run/ranks.js';
import { serverPanel } from './run/server.js';
import { statsStrip } from './run/stats.js';
import { trainerPanel } from './run/trainer.js';
import { runExtras } from './runextras.js';

const RUN_REFRESH_MS = 3000;
const STALE_AFTER_S = 60; // the server's STALE_AFTER_MS, when a rank does not say

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
