// The run's configuration and its profiles, as created.

import { badge, h, tableWrap } from '../../dom.js';
import { fmtInt, fmtNum, fmtSeconds, fmtTime } from '../../format.js';

/** A profile's parameters, one unbreakable `name value` each: the cell wraps between them, never cuts one. */
function profileParams(p) {
  const skip = new Set(['name', 'kind']);
  const parts = Object.entries(p)
    .filter(([k, v]) => !skip.has(k) && v !== null && v !== undefined)
    .map(([k, v]) => `${k} ${typeof v === 'number' ? fmtNum(v, 6) : typeof v === 'object' ? JSON.stringify(v) : v}`);
  if (!parts.length) return ['—'];
  return parts.flatMap((part, i) => [i ? ' · ' : '', h('span', { class: 'param' }, part)]);
}

/** The configuration card of the run view `view`. */
export function configPanel(view) {
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
        { class: 'table compact profiles-table' },
        h('thead', {}, h('tr', {}, h('th', {}, 'name'), h('th', {}, 'kind'), h('th', {}, 'parameters'))),
        h(
          'tbody',
          {},
          c.profiles.map((p) => h('tr', { dataset: { profile: p.name } }, h('td', { class: 'mono profile-name' }, p.name), h('td', {}, badge(p.kind, 'info')), h('td', { class: 'mono small params', dataset: { field: 'parameters' } }, ...profileParams(p)))),
        ),
      ),
    ),
  );
}
