// #/nodes: every server of the service (the nodes sharing one catalog),
// with its URL, engines, the ranks and bytes it holds and its lease,
// refreshed every few seconds. The lease bar fills as the lease ages; a
// node whose lease ran out is `expired`, one that stopped cleanly `left`.

import { api } from '../api.js';
import { badge, emptyBox, errorBox, h, loadingBox, setCrumbs, tableWrap } from '../dom.js';
import { fmtBytes, fmtInt, fmtRelative, fmtTime } from '../format.js';

const REFRESH_MS = 2000;
const STATUS_TONE = { live: 'ok', expired: 'bad', left: 'muted' };

function leaseCell(n) {
  const share = n.lease_seconds > 0 ? Math.min(1, n.lease_age_seconds / n.lease_seconds) : 1;
  const tone = n.status === 'live' ? (share > 0.67 ? 'warn' : 'ok') : 'bad';
  return h(
    'td',
    { dataset: { field: 'lease' }, title: `renewed ${n.lease_age_seconds.toFixed(1)} s ago; a lease lasts ${n.lease_seconds} s` },
    h('span', { class: `lease-bar ${tone}` }, h('span', { style: `width: ${(100 * share).toFixed(0)}%` })),
    h('span', { class: 'small' }, ` ${n.lease_age_seconds.toFixed(1)} s`),
  );
}

function row(n) {
  return h(
    'tr',
    { dataset: { node: n.node } },
    h('td', { class: 'name' }, n.node, n.this ? h('span', { class: 'muted small' }, ' (this server)') : null),
    h('td', { dataset: { field: 'url' } }, h('a', { href: n.url }, n.url)),
    h('td', { dataset: { field: 'engines' } }, h('span', { class: 'chips' }, n.engines.map((e) => h('span', { class: 'chip' }, e)))),
    h('td', { class: 'num', dataset: { field: 'ranks' } }, fmtInt(n.ranks)),
    h('td', { class: 'num', dataset: { field: 'resident_bytes' }, title: `budget ${fmtBytes(n.memory_budget)}` }, fmtBytes(n.resident_bytes)),
    leaseCell(n),
    h('td', { title: fmtTime(n.started_at_ms) }, fmtRelative(n.started_at_ms)),
    h('td', { dataset: { field: 'status' } }, badge(n.status, STATUS_TONE[n.status] || 'muted')),
  );
}

export function render(root, _params, ctx) {
  setCrumbs([{ text: 'Nodes' }]);
  const summary = h('span', { class: 'muted' });
  const body = h('div', {}, loadingBox('Loading nodes…'));
  root.append(h('div', { class: 'page' }, h('div', { class: 'page-head' }, h('div', { class: 'title-row' }, h('h1', {}, 'Nodes'), summary)), body));

  async function load() {
    let data;
    try {
      data = await api('/v1/nodes', { signal: ctx.signal });
    } catch (err) {
      if (ctx.active) body.replaceChildren(errorBox(err, load));
      return;
    }
    if (!ctx.active) return;
    const nodes = data.nodes;
    const live = nodes.filter((n) => n.status === 'live').length;
    summary.textContent = `${nodes.length} node${nodes.length === 1 ? '' : 's'} · ${live} live`;
    if (!nodes.length) {
      body.replaceChildren(emptyBox(h('p', {}, 'No node has registered.')));
      return;
    }
    body.replaceChildren(
      tableWrap(
        h(
          'table',
          { class: 'table nodes-table', dataset: { testid: 'nodes' } },
          h('thead', {}, h('tr', {}, ['Node', 'URL', 'Engines', 'Ranks', 'Resident', 'Lease', 'Started', 'Status'].map((t, i) => h('th', { class: [3, 4].includes(i) ? 'num' : null }, t)))),
          h('tbody', {}, nodes.map(row)),
        ),
      ),
    );
  }
  load();
  ctx.every(REFRESH_MS, load);
}
