// #/runs/NAME/snapshots: the run's snapshots, "take snapshot", downloads
// (full safetensors, sharded tar for torch DCP) and delete.

import { api, authUrl, isAbort, openEvents, runPath, withQuery } from '../api.js';
import { badge, confirmDialog, emptyBox, errorBox, h, loadingBox, setCrumbs, snapshotBadge, tableWrap } from '../dom.js';
import { fmtBytes, fmtRelative, fmtStep, fmtTime } from '../format.js';
import { runHeader, runHref, setConnection } from './common.js';
import { snapshotMetricColumns } from './evals.js';

const PENDING_REFRESH_MS = 1500;
const IDLE_REFRESH_MS = 10000;
const DTYPES = [
  ['', 'as stored'],
  ['fp32', 'fp32'],
  ['bf16', 'bf16'],
  ['fp16', 'fp16'],
];
const KINDS = ['manual', 'periodic', 'state', 'posthoc', 'merge'];
const ROWS_SHOWN = 100; // newest first; the rest behind "Show all"

export function render(root, { run }, ctx) {
  setCrumbs([{ text: 'Runs', href: '#/runs' }, { text: run, href: runHref(run) }, { text: 'Snapshots' }]);
  const header = runHeader(run, 'snapshots');

  const label = h('input', { type: 'text', placeholder: 'label (optional)', maxlength: '200', 'aria-label': 'snapshot label', dataset: { testid: 'snapshot-label' } });
  const take = h('button', { class: 'btn primary', type: 'submit', dataset: { testid: 'take-snapshot' } }, 'Take snapshot');
  const profileSelect = h('select', { 'aria-label': 'download profile', dataset: { testid: 'download-profile' } });
  const dtypeSelect = h('select', { 'aria-label': 'download dtype' }, DTYPES.map(([v, t]) => h('option', { value: v }, t)));
  const kindSelect = h('select', { 'aria-label': 'kind filter' }, h('option', { value: '' }, 'all kinds'), KINDS.map((k) => h('option', { value: k }, k)));
  const notice = h('div', { class: 'notice', hidden: true, role: 'status' });
  const body = h('div', {}, loadingBox('Loading snapshots…'));
  const count = h('span', { class: 'muted small' });

  const toolbar = h(
    'section',
    { class: 'card toolbar' },
    h(
      'form',
      {
        class: 'toolbar-group',
        onsubmit: (ev) => {
          ev.preventDefault();
          takeSnapshot();
        },
      },
      label,
      take,
    ),
    h('div', { class: 'toolbar-group' }, h('span', { class: 'muted small' }, 'download'), profileSelect, dtypeSelect),
    h('div', { class: 'toolbar-group' }, h('span', { class: 'muted small' }, 'show'), kindSelect),
  );
  root.append(
    h('div', { class: 'page' }, header.el, h('div', { class: 'page-body' }, toolbar, notice, h('section', { class: 'card' }, h('div', { class: 'card-head' }, h('h2', {}, 'Snapshots'), count), body))),
  );

  let rows = [];
  let showAll = false;
  let profiles = [];
  let loaded = false;
  let pendingTimer = null;
  const deleting = new Set();
  // A column per evaluated metric (the shown profile's value, the best ★).
  const metricCols = snapshotMetricColumns(run);
  const profileOf = (row) => (row.profiles.includes(profileSelect.value) ? profileSelect.value : row.profiles[0]);

  function say(text, tone = 'info') {
    notice.hidden = !text;
    notice.className = `notice ${tone}`;
    notice.textContent = text || '';
  }

  function downloadHref(row, layout) {
    const wanted = profileSelect.value;
    const profile = row.profiles.includes(wanted) ? wanted : row.profiles[0];
    return authUrl(withQuery(runPath(run, `/snapshots/${encodeURIComponent(row.id)}/download`), { profile, layout, dtype: dtypeSelect.value }));
  }

  function downloads(row) {
    if (row.status !== 'complete') return h('span', { class: 'muted' }, '—');
    const wanted = profileSelect.value;
    const profile = row.profiles.includes(wanted) ? wanted : row.profiles[0];
    return h(
      'span',
      { class: 'links' },
      h('a', { href: downloadHref(row, 'full'), download: '', dataset: { layout: 'full' }, title: `${profile}: one safetensors file of whole tensors` }, 'full'),
      h('a', { href: downloadHref(row, 'sharded'), download: '', dataset: { layout: 'sharded' }, title: `${profile}: a tar of per-rank safetensors for torch.distributed.checkpoint` }, 'sharded'),
      profile !== wanted ? h('span', { class: 'muted small' }, ` (${profile})`) : null,
    );
  }

  function statusCell(row) {
    if (row.status === 'pending') {
      return h('span', { class: 'status-cell' }, snapshotBadge('pending'), h('span', { class: 'muted small' }, row.deadline_ms ? ` waits for step ${fmtStep(row.step)}` : ''));
    }
    if (row.status === 'failed') return h('span', { class: 'status-cell', title: row.reason || '' }, snapshotBadge('failed'), h('span', { class: 'small bad-text' }, ` ${row.reason || ''}`));
    return snapshotBadge(row.status);
  }

  function tableRow(row) {
    return h(
      'tr',
      { dataset: { id: row.id, status: row.status, kind: row.kind } },
      h('td', { class: 'num', dataset: { field: 'step' } }, fmtStep(row.step)),
      h('td', { dataset: { field: 'label' } }, row.label ? h('div', {}, row.label) : null, h('div', { class: 'mono muted small' }, row.id)),
      h('td', { dataset: { field: 'kind' } }, badge(row.kind, row.kind === 'manual' ? 'info' : 'muted')),
      h('td', { dataset: { field: 'status' } }, statusCell(row)),
      h('td', { class: 'num', dataset: { field: 'size' } }, row.status === 'complete' ? fmtBytes(row.bytes) : '—'),
      metricCols.cells(row, profileOf(row)),
      h('td', { title: fmtTime(row.created_at_ms), dataset: { field: 'created' } }, fmtRelative(row.created_at_ms)),
      h('td', { dataset: { field: 'download' } }, downloads(row)),
      h(
        'td',
        { class: 'actions' },
        row.status === 'complete' ? h('a', { class: 'btn small ghost', href: `${runHref(run, '/compare')}?a=${encodeURIComponent(row.id)}` }, 'Compare') : null,
        h('button', { class: 'btn small ghost danger', type: 'button', disabled: deleting.has(row.id), onclick: () => remove(row), dataset: { action: 'delete' } }, 'Delete'),
      ),
    );
  }

  function draw() {
    const kind = kindSelect.value;
    const matching = metricCols.sort(
      rows.filter((r) => !kind || r.kind === kind),
      profileOf,
    );
    const shown = showAll ? matching : matching.slice(0, ROWS_SHOWN);
    const complete = rows.filter((r) => r.status === 'complete');
    count.textContent = rows.length ? `${rows.length} total · ${complete.length} complete · ${fmtBytes(complete.reduce((s, r) => s + r.bytes, 0))}` : '';
    if (!shown.length) {
      body.replaceChildren(emptyBox(rows.length ? `No ${kind} snapshots.` : 'No snapshots yet. "Take snapshot" cuts one at the next step every rank pushes.'));
      return;
    }
    body.replaceChildren(
      tableWrap(
        h(
          'table',
          { class: 'table snapshots-table' },
          h(
            'thead',
            {},
            h('tr', {}, h('th', { class: 'num' }, 'Step'), h('th', {}, 'Label / id'), h('th', {}, 'Kind'), h('th', {}, 'Status'), h('th', { class: 'num' }, 'Size'), metricCols.headers(draw), h('th', {}, 'Created'), h('th', {}, 'Download'), h('th', {}, '')),
          ),
          h('tbody', {}, shown.map(tableRow)),
        ),
      ),
      matching.length > shown.length
        ? h(
            'div',
            { class: 'more' },
            h(
              'button',
              {
                class: 'btn small',
                type: 'button',
                onclick: () => {
                  showAll = true;
                  draw();
                },
              },
              `Show all ${matching.length} (${matching.length - shown.length} older)`,
            ),
          )
        : '', // replaceChildren would show a null as the text "null"
    );
  }

  function setProfiles(list) {
    if (list.join() === profiles.join()) return;
    const keep = profileSelect.value;
    profiles = list;
    profileSelect.replaceChildren(...list.map((p) => h('option', { value: p }, p)));
    if (list.includes(keep)) profileSelect.value = keep;
  }

  let loadSeq = 0;
  async function load() {
    const seq = ++loadSeq;
    try {
      const [list, view] = await Promise.all([
        api(runPath(run, '/snapshots'), { signal: ctx.signal }),
        profiles.length ? null : api(runPath(run), { signal: ctx.signal }),
        // Evaluations are extra columns: the table shows without them.
        metricCols.load(ctx.signal).catch(() => {}),
      ]);
      if (!ctx.active || seq !== loadSeq) return;
      if (view) setProfiles(view.config.profiles.map((p) => p.name));
      rows = [...list.snapshots].sort((a, b) => b.created_at_ms - a.created_at_ms || b.step - a.step);
      loaded = true;
      draw();
      followPending();
    } catch (err) {
      if (isAbort(err) || !ctx.active) return;
      if (loaded) say(`Refresh failed: ${err.message}`, 'bad');
      else body.replaceChildren(errorBox(err, load));
    }
  }

  /** While a snapshot is pending, look again soon. */
  function followPending() {
    clearTimeout(pendingTimer);
    if (rows.some((r) => r.status === 'pending')) pendingTimer = setTimeout(load, PENDING_REFRESH_MS);
  }

  async function takeSnapshot() {
    take.disabled = true;
    say('Asking for a snapshot…');
    try {
      const request = label.value.trim() ? { label: label.value.trim() } : {};
      const row = await api(runPath(run, '/snapshots'), { method: 'POST', body: request, signal: ctx.signal });
      if (!ctx.active) return;
      loadSeq += 1; // a list fetched before this answer would not hold the new row
      rows = [row, ...rows.filter((r) => r.id !== row.id)];
      label.value = '';
      say(`Snapshot ${row.id} requested: it completes when every rank has applied step ${fmtStep(row.step)}.`);
      draw();
      followPending();
    } catch (err) {
      if (!isAbort(err) && ctx.active) say(`Could not take a snapshot: ${err.code ? `${err.code}: ` : ''}${err.message}`, 'bad');
    } finally {
      take.disabled = false;
    }
  }

  async function remove(row) {
    const ok = await confirmDialog({
      title: 'Delete snapshot?',
      message: `Delete ${row.id} (step ${fmtStep(row.step)}${row.label ? `, "${row.label}"` : ''})? Its files are removed from the server.`,
      confirmText: 'Delete',
      danger: true,
    });
    if (!ok || !ctx.active) return;
    deleting.add(row.id);
    draw();
    try {
      await api(runPath(run, `/snapshots/${encodeURIComponent(row.id)}`), { method: 'DELETE', signal: ctx.signal });
      rows = rows.filter((r) => r.id !== row.id);
      say(`Deleted ${row.id}.`);
    } catch (err) {
      if (isAbort(err)) return;
      say(`Could not delete ${row.id}: ${err.message}`, 'bad');
    } finally {
      deleting.delete(row.id);
    }
    if (ctx.active) draw();
  }

  profileSelect.addEventListener('change', draw);
  dtypeSelect.addEventListener('change', draw);
  kindSelect.addEventListener('change', draw);

  load();
  ctx.every(IDLE_REFRESH_MS, load);
  // Snapshot events (created, completed, failed, deleted) refresh the table at once.
  let eventTimer = null;
  const stream = openEvents(run, {
    kinds: ['snapshot', 'eval'],
    since: null,
    onEvent: () => {
      clearTimeout(eventTimer);
      eventTimer = setTimeout(load, 200);
    },
    onStatus: (s) => ctx.active && setConnection(s),
  });
  ctx.onCleanup(() => {
    stream.close();
    clearTimeout(eventTimer);
    clearTimeout(pendingTimer);
    setConnection(null);
  });
}
