// The run's events log, newest first, filtered by kind (chips remembered
// in the browser); the page feeds it the history and the stream.

import { badge, emptyBox, errorBox, h, loadingBox } from '../../dom.js';
import { fmtBytes, fmtClock, fmtInt, fmtNum, fmtSeconds, fmtStep, fmtTime } from '../../format.js';
import { loadSetting, saveSetting } from './settings.js';

const LOG_SHOWN = 200;
const LOG_KEPT_PER_KIND = 500;
export const RARE_KINDS = ['run_created', 'rank_registered', 'rejection', 'snapshot', 'restored', 'resumed', 'alert'];
const LOG_KINDS = [...RARE_KINDS, 'push', 'metrics'];

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

/** The log: `{el, add(e), ready(), fail(err, retry)}`; it shows nothing before `ready()`. */
export function eventsPanel(ctx) {
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
