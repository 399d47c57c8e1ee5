// #/runs: every run the caller may read, refreshed every few seconds.

import { api } from '../api.js';
import { badge, emptyBox, errorBox, h, healthBadge, loadingBox, setCrumbs, tableWrap } from '../dom.js';
import { fmtBytes, fmtRelative, fmtStep, fmtTime } from '../format.js';
import { runHref } from './common.js';

const REFRESH_MS = 5000;

function profileChips(profiles) {
  return h(
    'span',
    { class: 'chips' },
    profiles.map((p) => h('span', { class: 'chip', title: `${p.name}: ${p.kind}` }, p.name, h('span', { class: 'chip-kind' }, p.kind))),
  );
}

function row(run) {
  const c = run.config;
  return h(
    'tr',
    { dataset: { run: run.name } },
    h('td', { class: 'name' }, h('a', { href: runHref(run.name) }, run.name)),
    h('td', { title: fmtTime(run.created_at_ms), dataset: { field: 'created' } }, fmtRelative(run.created_at_ms)),
    h('td', { class: 'num', dataset: { field: 'world_size' } }, c.world_size, run.ranks_seen < c.world_size ? h('span', { class: 'muted small' }, ` (${run.ranks_seen} seen)`) : null),
    h('td', { class: 'num', dataset: { field: 'last_step' } }, fmtStep(run.last_step)),
    h('td', { dataset: { field: 'profiles' } }, profileChips(c.profiles)),
    h('td', { class: 'num', dataset: { field: 'resident_bytes' } }, fmtBytes(run.resident_bytes)),
    h('td', { dataset: { field: 'device' } }, badge(c.device, 'muted')),
    h('td', { dataset: { field: 'health' } }, healthBadge(run.health)),
  );
}

function table(runs) {
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
          ['Name', 'Created', 'World size', 'Last step', 'Profiles', 'EMA bytes', 'Device', 'Health'].map((t, i) =>
            h('th', { class: [2, 3, 5].includes(i) ? 'num' : null }, t),
          ),
        ),
      ),
      h('tbody', {}, runs.map(row)),
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
    "exp1", world_size=1, profiles=[{"name": "ema", "kind": "constant", "beta": 0.999}])
pusher = run.pusher()
pusher.attach(optimizer, model)   # pushes after every optimizer.step()`,
    ),
  );
}

export function render(root, _params, ctx) {
  setCrumbs([{ text: 'Runs' }]);
  const summary = h('span', { class: 'muted' });
  // Free space on the server's data dir: snapshots stop at the reserve.
  const disk = h('span', { class: 'muted small', id: 'disk-free', title: 'Free space on the data directory; snapshot and state writes keep the reserve free' });
  const body = h('div', {}, loadingBox('Loading runs…'));
  const updated = h('span', { class: 'muted small', 'aria-live': 'polite' });
  root.append(
    h('div', { class: 'page' }, h('div', { class: 'page-head' }, h('div', { class: 'title-row' }, h('h1', {}, 'Runs'), summary, h('span', { class: 'spacer' }), disk, updated)), body),
  );

  let loaded = false;
  async function load() {
    try {
      const data = await api('/v1/runs', { signal: ctx.signal });
      if (!ctx.active) return;
      const runs = [...data.runs].sort((a, b) => b.created_at_ms - a.created_at_ms);
      const healthy = runs.filter((r) => r.health === 'healthy').length;
      summary.textContent = runs.length ? `${runs.length} run${runs.length === 1 ? '' : 's'} · ${healthy} healthy` : '';
      body.replaceChildren(runs.length ? table(runs) : quickStart());
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
