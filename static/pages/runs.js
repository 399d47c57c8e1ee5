// #/runs: every run the caller may read, refreshed every few seconds.
// A filter (name, tag, note; `#/runs?q=..&tag=..&since=..`) narrows the
// list; checked runs open side by side in #/compare.

import { api } from '../api.js';
import { badge, emptyBox, errorBox, h, healthBadge, loadingBox, setCrumbs, tableWrap } from '../dom.js';
import { fmtBytes, fmtRelative, fmtStep, fmtTime } from '../format.js';
import { runHref } from './common.js';

const REFRESH_MS = 5000;

/** Created within: the time filter's choices, in milliseconds. */
const SINCE = [
  ['', 'any time'],
  ['3600000', 'last hour'],
  ['86400000', 'last day'],
  ['604800000', 'last week'],
];

function profileChips(profiles) {
  return h(
    'span',
    { class: 'chips' },
    profiles.map((p) => h('span', { class: 'chip', title: `${p.name}: ${p.kind}` }, p.name, h('span', { class: 'chip-kind' }, p.kind))),
  );
}

/** Whether a run passes the filter: every word of `q` in its name, tags or note; the tag; the age. */
export function matches(run, { q = '', tag = '', since = '' }) {
  const tags = run.tags || [];
  if (tag && !tags.includes(tag)) return false;
  if (since && Date.now() - run.created_at_ms > Number(since)) return false;
  const hay = [run.name, ...tags, run.note || ''].join(' ').toLowerCase();
  return q
    .toLowerCase()
    .split(/\s+/)
    .filter(Boolean)
    .every((w) => hay.includes(w));
}

function tagChips(tags, active, onTag) {
  return h(
    'span',
    { class: 'tags' },
    (tags || []).map((t) =>
      h('button', { type: 'button', class: t === active ? 'tag active' : 'tag', dataset: { tag: t }, title: `show runs tagged ${t}`, onclick: () => onTag(t === active ? '' : t) }, t),
    ),
  );
}

function row(run, filter, onTag, selected, onSelect) {
  const c = run.config;
  return h(
    'tr',
    { dataset: { run: run.name } },
    h(
      'td',
      {},
      h('input', { type: 'checkbox', 'aria-label': `select ${run.name}`, checked: selected.has(run.name), dataset: { select: run.name }, onchange: (e) => onSelect(run.name, e.target.checked) }),
    ),
    h(
      'td',
      { class: 'name' },
      h('a', { href: runHref(run.name) }, run.name),
      run.alerts_firing ? h('span', {}, ' ', badge(`${run.alerts_firing} alert${run.alerts_firing === 1 ? '' : 's'}`, 'bad', { dataset: { field: 'alerts' } })) : null,
      run.note ? h('div', { class: 'run-note', title: run.note, dataset: { field: 'note' } }, run.note) : null,
    ),
    h('td', { dataset: { field: 'tags' } }, tagChips(run.tags, filter.tag, onTag)),
    h('td', { title: fmtTime(run.created_at_ms), dataset: { field: 'created' } }, fmtRelative(run.created_at_ms)),
    h('td', { class: 'num', dataset: { field: 'world_size' } }, c.world_size, run.ranks_seen < c.world_size ? h('span', { class: 'muted small' }, ` (${run.ranks_seen} seen)`) : null),
    h('td', { class: 'num', dataset: { field: 'last_step' } }, fmtStep(run.last_step)),
    h('td', { dataset: { field: 'profiles' } }, profileChips(c.profiles)),
    h('td', { class: 'num', dataset: { field: 'resident_bytes' } }, fmtBytes(run.resident_bytes)),
    h('td', { dataset: { field: 'device' } }, badge(c.device, 'muted')),
    h('td', { dataset: { field: 'health' } }, healthBadge(run.health)),
  );
}

function table(runs, filter, onTag, selected, onSelect) {
  return tableWrap(
    h(
      'table',
      { class: 'table runs-table' },
      h(
        'thead',
        {},
        h(
          'tr',
          {},
          ['', 'Name', 'Tags', 'Created', 'World size', 'Last step', 'Profiles', 'EMA bytes', 'Device', 'Health'].map((t, i) =>
            h('th', { class: [4, 5, 7].includes(i) ? 'num' : null }, t),
          ),
        ),
      ),
      h(
        'tbody',
        {},
        runs.map((r) => row(r, filter, onTag, selected, onSelect)),
      ),
    ),
  );
}

function quickStart() {
  return emptyBox(
    h('p', {}, h('strong', {}, 'No runs yet.'), ' Create one from your training script:'),
    h(
      'pre',
      { class: 'code' },
      `import polyak
run = polyak.Client("${location.origin}").create_run(
    "exp1", world_size=1, profiles=[{"name": "ema", "kind": "constant", "beta": 0.999}],
    tags=["baseline"])
pusher = run.pusher()
pusher.attach(optimizer, model)   # pushes after every optimizer.step()`,
    ),
  );
}

export function render(root, { query }, ctx) {
  setCrumbs([{ text: 'Runs' }]);
  const filter = { q: query.get('q') || '', tag: query.get('tag') || '', since: query.get('since') || '' };
  const selected = new Set();
  const summary = h('span', { class: 'muted' });
  // Free space on the server's data dir: snapshots stop at the reserve.
  const disk = h('span', { class: 'muted small', id: 'disk-free', title: 'Free space on the data directory; snapshot and state writes keep the reserve free' });
  const body = h('div', {}, loadingBox('Loading runs…'));
  const updated = h('span', { class: 'muted small', 'aria-live': 'polite' });
  const search = h('input', { type: 'search', placeholder: 'filter by name, tag or note', 'aria-label': 'filter runs', value: filter.q, dataset: { testid: 'runs-filter' } });
  const since = h(
    'select',
    { 'aria-label': 'created within', dataset: { testid: 'runs-since' } },
    SINCE.map(([v, t]) => h('option', { value: v, selected: v === filter.since }, t)),
  );
  const tagNote = h('span', { class: 'muted small' });
  const compare = h('a', { class: 'btn small', href: '#/compare', dataset: { testid: 'compare-selected' } }, 'Compare selected');
  root.append(
    h(
      'div',
      { class: 'page' },
      h('div', { class: 'page-head' }, h('div', { class: 'title-row' }, h('h1', {}, 'Runs'), summary, h('span', { class: 'spacer' }), disk, updated)),
      h('div', { class: 'runs-filter' }, search, since, tagNote, h('span', { class: 'spacer' }), compare),
      body,
    ),
  );

  let all = [];
  function keepInUrl() {
    const params = new URLSearchParams();
    for (const [k, v] of Object.entries(filter)) if (v) params.set(k, v);
    const qs = params.toString();
    history.replaceState(null, '', `#/runs${qs ? `?${qs}` : ''}`);
  }
  function updateCompare() {
    const names = [...selected];
    compare.href = `#/compare${names.length ? `?runs=${names.map(encodeURIComponent).join(',')}` : ''}`;
    compare.textContent = names.length ? `Compare ${names.length} selected` : 'Compare runs';
  }
  function draw() {
    const shown = all.filter((r) => matches(r, filter));
    const healthy = all.filter((r) => r.health === 'healthy').length;
    summary.textContent = all.length ? `${shown.length === all.length ? all.length : `${shown.length} of ${all.length}`} run${all.length === 1 ? '' : 's'} · ${healthy} healthy` : '';
    tagNote.replaceChildren(filter.tag ? h('span', {}, 'tag ', h('button', { type: 'button', class: 'tag active', title: 'clear the tag filter', onclick: () => setTag('') }, `${filter.tag} ×`)) : '');
    if (!all.length) body.replaceChildren(quickStart());
    else if (!shown.length) body.replaceChildren(emptyBox(h('p', {}, 'No run matches the filter.')));
    else body.replaceChildren(table(shown, filter, setTag, selected, onSelect));
  }
  function setTag(tag) {
    filter.tag = tag;
    keepInUrl();
    draw();
  }
  function onSelect(name, on) {
    if (on) selected.add(name);
    else selected.delete(name);
    updateCompare();
  }
  search.addEventListener('input', () => {
    filter.q = search.value.trim();
    keepInUrl();
    draw();
  });
  since.addEventListener('change', () => {
    filter.since = since.value;
    keepInUrl();
    draw();
  });
  updateCompare();

  // A refresh that lands between a button's press and release would replace
  // the pressed button, and the click would be lost: hold the redraw until
  // the press ends (and its click has run).
  let pressed = false;
  let drawAfterPress = false;
  body.addEventListener('pointerdown', () => {
    pressed = true;
  });
  const release = () => {
    if (!pressed) return;
    pressed = false;
    if (drawAfterPress) {
      drawAfterPress = false;
      setTimeout(draw, 0);
    }
  };
  window.addEventListener('pointerup', release, { signal: ctx.signal });
  window.addEventListener('pointercancel', release, { signal: ctx.signal });

  let loaded = false;
  async function load() {
    try {
      const data = await api('/v1/runs', { signal: ctx.signal });
      if (!ctx.active) return;
      all = [...data.runs].sort((a, b) => b.created_at_ms - a.created_at_ms);
      if (pressed) drawAfterPress = true;
      else draw();
      const health = await api('/livez', { signal: ctx.signal }).catch(() => null);
      if (health && health.disk_free_bytes != null) {
        const low = health.disk_free_bytes < 2 * health.disk_reserve_bytes;
        disk.textContent = `disk free ${fmtBytes(health.disk_free_bytes)} (reserve ${fmtBytes(health.disk_reserve_bytes)})`;
        disk.classList.toggle('warn', low);
      }
      updated.textContent = `updated ${new Date().toLocaleTimeString()}`;
      loaded = true;
    } catch (err) {
      if (!ctx.active) return;
      if (loaded) {
        // Keep the last table; say that it is not current.
        updated.textContent = `refresh failed: ${err.message}`;
      } else {
        body.replaceChildren(errorBox(err, load));
      }
    }
  }
  load();
  ctx.every(REFRESH_MS, load);
}
