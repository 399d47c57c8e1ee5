// #/runs/NAME/compare?a=ID&b=ID|live&profile=P&profile_b=Q: two EMA states
// side by side, per tensor (norms, relative difference, cosine), as a
// sortable, filterable table and a bar chart of the relative difference.

import { api, isAbort, runPath, withQuery } from '../api.js';
import { categoryAxis, chartCard, color, createChart, fade } from '../charts.js';
import { emptyBox, errorBox, h, loadingBox, setCrumbs, stat, tableWrap } from '../dom.js';
import { fmtInt, fmtNum, fmtRelative, fmtShape, fmtStep } from '../format.js';
import { runHeader, runHref } from './common.js';

const COLUMNS = [
  { key: 'index', label: '#', num: true, fmt: (v) => String(v + 1) },
  { key: 'name', label: 'Tensor', fmt: (v) => v },
  { key: 'numel', label: 'Shape', num: true, fmt: (v, t) => fmtShape(t.shape) },
  { key: 'norm_a', label: '‖A‖', num: true, fmt: (v) => fmtNum(v) },
  { key: 'norm_b', label: '‖B‖', num: true, fmt: (v) => fmtNum(v) },
  { key: 'norm_diff', label: '‖A − B‖', num: true, fmt: (v) => fmtNum(v) },
  { key: 'rel_diff', label: 'rel. diff', num: true, fmt: (v) => fmtNum(v), title: '‖A − B‖ / ‖A‖' },
  { key: 'cosine', label: 'cosine', num: true, fmt: (v) => (v === null ? '—' : fmtNum(v, 6)) },
  { key: 'max_abs_diff', label: 'max |A − B|', num: true, fmt: (v) => fmtNum(v) },
];

function snapshotLabel(s) {
  return `step ${fmtStep(s.step)} · ${s.label || s.id} · ${s.kind} · ${fmtRelative(s.created_at_ms)}`;
}

export function render(root, { run, query }, ctx) {
  setCrumbs([{ text: 'Runs', href: '#/runs' }, { text: run, href: runHref(run) }, { text: 'Compare' }]);
  const header = runHeader(run, 'compare');
  const body = h('div', { class: 'page-body' }, loadingBox('Loading snapshots…'));
  root.append(h('div', { class: 'page' }, header.el, body));

  let snapshots = [];
  let runProfiles = [];

  async function load() {
    body.replaceChildren(loadingBox('Loading snapshots…'));
    try {
      const [list, view] = await Promise.all([
        api(withQuery(runPath(run, '/snapshots'), { status: 'complete' }), { signal: ctx.signal }),
        api(runPath(run), { signal: ctx.signal }),
      ]);
      if (!ctx.active) return;
      snapshots = [...list.snapshots].sort((a, b) => b.step - a.step || b.created_at_ms - a.created_at_ms);
      runProfiles = view.config.profiles.map((p) => p.name);
      build();
    } catch (err) {
      if (!isAbort(err) && ctx.active) body.replaceChildren(errorBox(err, load));
    }
  }

  function build() {
    if (!snapshots.length) {
      body.replaceChildren(
        emptyBox(
          h('p', {}, 'Compare needs at least one complete snapshot (side A is always a snapshot; side B may be the live EMA).'),
          h('p', {}, h('a', { class: 'btn primary', href: runHref(run, '/snapshots') }, 'Take a snapshot')),
        ),
      );
      return;
    }
    const byId = new Map(snapshots.map((s) => [s.id, s]));
    const pick = (want, fallback) => (want && (byId.has(want) || want === 'live') ? want : fallback);
    const state = {
      a: pick(query.get('a'), snapshots[snapshots.length > 1 ? 1 : 0].id),
      b: pick(query.get('b'), snapshots.length > 1 ? snapshots[0].id : 'live'),
      profile: query.get('profile') || '',
      profile_b: query.get('profile_b') || '',
    };
    if (state.a === 'live') state.a = snapshots[0].id;

    const selA = h('select', { 'aria-label': 'side A', dataset: { testid: 'side-a' } }, snapshots.map((s) => h('option', { value: s.id }, snapshotLabel(s))));
    const selB = h(
      'select',
      { 'aria-label': 'side B', dataset: { testid: 'side-b' } },
      h('option', { value: 'live' }, 'live EMA (now)'),
      snapshots.map((s) => h('option', { value: s.id }, snapshotLabel(s))),
    );
    const profA = h('select', { 'aria-label': 'profile A', dataset: { testid: 'profile-a' } });
    const profB = h('select', { 'aria-label': 'profile B', dataset: { testid: 'profile-b' } });
    const swap = h('button', { class: 'btn ghost', type: 'button', title: 'Swap A and B (A must be a snapshot)' }, '⇄ swap');
    const results = h('div', { class: 'compare-results' });

    const profilesOf = (id) => (id === 'live' ? runProfiles : (byId.get(id) || {}).profiles || runProfiles);
    function fillProfiles(select, id, wanted) {
      const list = profilesOf(id);
      select.replaceChildren(...list.map((p) => h('option', { value: p }, p)));
      select.value = list.includes(wanted) ? wanted : list[0];
    }

    selA.value = state.a;
    selB.value = state.b;
    fillProfiles(profA, state.a, state.profile);
    fillProfiles(profB, state.b, state.profile_b || profA.value);

    function syncState() {
      state.a = selA.value;
      state.b = selB.value;
      state.profile = profA.value;
      state.profile_b = profB.value;
      swap.disabled = state.b === 'live';
      // Shareable, without reloading the page (replaceState fires no hashchange).
      history.replaceState(null, '', withQuery(`${runHref(run, '/compare')}`, state));
    }

    selA.addEventListener('change', () => {
      fillProfiles(profA, selA.value, profA.value);
      syncState();
      compare();
    });
    selB.addEventListener('change', () => {
      fillProfiles(profB, selB.value, profB.value);
      syncState();
      compare();
    });
    profA.addEventListener('change', () => {
      syncState();
      compare();
    });
    profB.addEventListener('change', () => {
      syncState();
      compare();
    });
    swap.addEventListener('click', () => {
      if (selB.value === 'live') return;
      const [a, b, pa, pb] = [selA.value, selB.value, profA.value, profB.value];
      selA.value = b;
      selB.value = a;
      fillProfiles(profA, b, pb);
      fillProfiles(profB, a, pa);
      syncState();
      compare();
    });

    const form = h(
      'section',
      { class: 'card compare-form' },
      h('div', { class: 'side' }, h('span', { class: 'side-tag a' }, 'A'), selA, profA),
      swap,
      h('div', { class: 'side' }, h('span', { class: 'side-tag b' }, 'B'), selB, profB),
    );
    body.replaceChildren(form, results);
    syncState();

    let seq = 0;
    let inflight = null;
    async function compare() {
      const mine = ++seq;
      if (inflight) inflight.abort();
      inflight = new AbortController();
      const abortWithPage = () => inflight && inflight.abort();
      ctx.signal.addEventListener('abort', abortWithPage, { once: true });
      results.replaceChildren(loadingBox(state.b === 'live' ? 'Comparing with the live EMA…' : 'Comparing…'));
      try {
        const params = { a: state.a, b: state.b, profile: state.profile, profile_b: state.profile_b };
        const resp = await api(withQuery(runPath(run, '/compare'), params), { signal: inflight.signal, timeoutMs: 120_000 });
        if (mine !== seq || !ctx.active) return;
        showResult(results, resp, state);
      } catch (err) {
        if (isAbort(err) || mine !== seq || !ctx.active) return;
        results.replaceChildren(errorBox(err, compare));
      } finally {
        ctx.signal.removeEventListener('abort', abortWithPage);
      }
    }
    compare();
  }

  let chart = null;
  ctx.onCleanup(() => chart && chart.destroy());

  function showResult(results, resp, state) {
    const tensors = resp.tensors.map((t, index) => ({ ...t, index, numel: t.shape.reduce((a, b) => a * b, 1) }));
    const s = resp.summary;
    const strip = h(
      'div',
      { class: 'stats' },
      stat('Tensors', fmtInt(s.tensors)),
      stat('Elements', fmtInt(s.numel)),
      stat('rel. diff (all)', fmtNum(s.rel_diff), { title: '‖A − B‖ / ‖A‖ over every tensor', dataset: { testid: 'summary-rel-diff' } }),
      stat('cosine (all)', s.cosine === null ? '—' : fmtNum(s.cosine, 6)),
      stat('max |A − B|', fmtNum(s.max_abs_diff)),
      stat('moved most', s.max_rel_diff_tensor || '—'),
    );
    const only = [];
    if (s.only_in_a.length) only.push(h('div', { class: 'notice warn' }, `Only in A (not compared): ${s.only_in_a.join(', ')}`));
    if (s.only_in_b.length) only.push(h('div', { class: 'notice warn' }, `Only in B (not compared): ${s.only_in_b.join(', ')}`));

    const card = chartCard('Relative difference per tensor', `A = ${resp.a} (${resp.profile}) · B = ${resp.b} (${resp.profile_b})`);
    const logToggle = h('input', { type: 'checkbox', 'aria-label': 'log scale' });
    /** @type {HTMLElement} */ (card.el.querySelector('.card-head')).append(h('label', { class: 'check' }, logToggle, ' log scale'));
    card.note.hidden = true;

    const filter = h('input', { type: 'search', placeholder: 'filter tensors (e.g. attn, weight)', 'aria-label': 'filter tensors', dataset: { testid: 'tensor-filter' } });
    const shownCount = h('span', { class: 'muted small' });
    const tbody = h('tbody');
    const sort = { key: 'index', dir: 1 };
    const heads = COLUMNS.map((c) =>
      h(
        'th',
        {
          class: `${c.num ? 'num ' : ''}sortable`,
          title: c.title || `sort by ${c.label}`,
          dataset: { key: c.key },
          tabindex: '0',
          onclick: () => sortBy(c.key),
          onkeydown: (ev) => (ev.key === 'Enter' || ev.key === ' ') && (ev.preventDefault(), sortBy(c.key)),
        },
        c.label,
      ),
    );
    const table = h('table', { class: 'table compare-table', dataset: { testid: 'compare-table' } }, h('thead', {}, h('tr', {}, heads)), tbody);
    const tableCard = h(
      'section',
      { class: 'card' },
      h('div', { class: 'card-head' }, h('h2', {}, 'Per tensor'), h('span', { class: 'spacer' }), filter, shownCount),
      tableWrap(table),
    );
    results.replaceChildren(strip, ...only, card.el, tableCard);

    function visible() {
      const q = filter.value.trim().toLowerCase();
      return q ? tensors.filter((t) => t.name.toLowerCase().includes(q)) : tensors;
    }

    function sortBy(key) {
      sort.dir = sort.key === key ? -sort.dir : key === 'name' || key === 'index' ? 1 : -1;
      sort.key = key;
      drawTable();
    }

    function drawTable() {
      const list = [...visible()].sort((x, y) => {
        const a = x[sort.key];
        const b = y[sort.key];
        if (a === b) return x.index - y.index;
        if (a === null || a === undefined) return 1;
        if (b === null || b === undefined) return -1;
        return (typeof a === 'string' ? a.localeCompare(b) : a - b) * sort.dir;
      });
      heads.forEach((th, i) => th.setAttribute('aria-sort', COLUMNS[i].key === sort.key ? (sort.dir > 0 ? 'ascending' : 'descending') : 'none'));
      const top = Math.max(...tensors.map((t) => t.rel_diff), 0) || 1;
      tbody.replaceChildren(
        ...list.map((t) =>
          h(
            'tr',
            { dataset: { name: t.name, relDiff: String(t.rel_diff) } },
            COLUMNS.map((c) =>
              c.key === 'rel_diff'
                ? h('td', { class: 'num rel-cell', dataset: { field: c.key } }, h('span', { class: 'rel-bar', style: `width:${Math.round((t.rel_diff / top) * 55)}%` }), h('span', { class: 'rel-text' }, c.fmt(t[c.key], t)))
                : h('td', { class: `${c.num ? 'num' : 'mono'}${c.key === 'name' ? ' tensor-name' : ''}`, title: c.key === 'name' ? t.name : null, dataset: { field: c.key } }, c.fmt(t[c.key], t)),
            ),
          ),
        ),
      );
      shownCount.textContent = list.length === tensors.length ? `${fmtInt(tensors.length)} tensors` : `${fmtInt(list.length)} of ${fmtInt(tensors.length)} tensors`;
    }

    function drawChart() {
      if (chart) chart.destroy();
      const list = visible();
      const names = list.map((t) => t.name);
      const log = logToggle.checked;
      const short = (n) => (n.length > 22 ? `…${n.slice(-21)}` : n);
      chart = createChart(card.body, 'compare', {
        series: [{ label: 'rel. diff', color: color(0), fill: fade(color(0), 0.55), bars: true, fmt: (v) => fmtNum(v) }],
        x: categoryAxis('tensor', names, { short }),
        y: { legend: (v) => fmtNum(v), log, zero: true },
        height: 260,
      });
      const ys = list.map((t) => (log && !(t.rel_diff > 0) ? null : t.rel_diff));
      chart.update([list.map((_, i) => i), ys]);
    }

    filter.addEventListener('input', () => {
      drawTable();
      drawChart();
    });
    logToggle.addEventListener('change', drawChart);
    drawTable();
    drawChart();
    window.polyak.compare = { request: { ...state }, response: resp };
  }

  load();
}
