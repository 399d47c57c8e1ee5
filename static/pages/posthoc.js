// #/runs/NAME/posthoc: post-hoc EMA (EDM2). Pick a step and a sigma_rel
// (a slider on a log axis) and see at once the weights of the stored
// power-profile snapshots that synthesise it, as a bar chart, with the fit
// residual; synthesise one length or a sweep, follow its progress, download
// the results.

import { api, authUrl, isAbort, openEvents, runPath, withQuery } from '../api.js';
import { categoryAxis, chartCard, color, createChart, fade } from '../charts.js';
import { badge, emptyBox, errorBox, h, loadingBox, setCrumbs, snapshotBadge, stat, tableWrap } from '../dom.js';
import { fmtBytes, fmtNum, fmtRelative, fmtStep } from '../format.js';
import { runHeader, runHref, setConnection } from './common.js';
import { sigmaPanel } from './evals.js';

// The slider spans these sigma_rel on a log axis (EDM2's range of interest;
// 0.3 is the largest a power EMA can have).
const SIGMA_MIN = 0.005;
const SIGMA_MAX = 0.3;
const SLIDER_STEPS = 1000;
const PLAN_DEBOUNCE_MS = 120;
const PENDING_REFRESH_MS = 1500;
const MAX_SWEEP = 32;
// Sources whose |weight| is at most this are counted, not listed.
const WEIGHT_LISTED = 1e-6;

const sliderToSigma = (v) => 10 ** (Math.log10(SIGMA_MIN) + (v / SLIDER_STEPS) * (Math.log10(SIGMA_MAX) - Math.log10(SIGMA_MIN)));
const sigmaToSlider = (s) => Math.round(((Math.log10(s) - Math.log10(SIGMA_MIN)) / (Math.log10(SIGMA_MAX) - Math.log10(SIGMA_MIN))) * SLIDER_STEPS);
const roundSigma = (s) => Number(s.toPrecision(3));

/** How well the stored snapshots express a length, from the fit residual. */
function fitTone(residual) {
  if (residual < 0.02) return ['good fit', 'ok'];
  if (residual < 0.1) return ['fair fit', 'warn'];
  return ['snapshots too sparse for this length', 'bad'];
}

export function render(root, { run, query }, ctx) {
  setCrumbs([{ text: 'Runs', href: '#/runs' }, { text: run, href: runHref(run) }, { text: 'Post-hoc EMA' }]);
  const header = runHeader(run, 'posthoc');

  const stepSelect = h('select', { 'aria-label': 'target step', dataset: { testid: 'posthoc-step' } });
  const slider = h('input', { type: 'range', min: '0', max: String(SLIDER_STEPS), step: '1', 'aria-label': 'sigma_rel (log scale)', dataset: { testid: 'sigma-slider' } });
  const sigmaInput = h('input', { type: 'number', min: String(SIGMA_MIN), max: String(SIGMA_MAX), step: 'any', 'aria-label': 'sigma_rel', class: 'sigma-input', dataset: { testid: 'sigma-value' } });
  const profileBox = h('span', { class: 'toolbar-group', dataset: { testid: 'posthoc-profiles' } });
  const synth = h('button', { class: 'btn primary', type: 'button', dataset: { testid: 'synthesise' } }, 'Synthesise');
  const sweepInput = h('input', { type: 'text', value: '0.05, 0.07, 0.1, 0.15', 'aria-label': 'sweep of sigma_rel values', dataset: { testid: 'sweep-values' } });
  const sweepBtn = h('button', { class: 'btn', type: 'button', dataset: { testid: 'start-sweep' } }, 'Start sweep');
  const notice = h('div', { class: 'notice', hidden: true, role: 'status' });
  const progressBar = h('progress', { max: '1', value: '0', dataset: { testid: 'posthoc-progress' } });
  const progressText = h('span', { class: 'muted small' });
  const progressBox = h('div', { class: 'toolbar-group', hidden: true }, h('span', { class: 'muted small' }, 'writing'), progressBar, progressText);
  const stats = h('div', { class: 'stats' });
  const card = chartCard('Source weights', 'each stored EMA\'s coefficient; they sum to 1');
  const planTable = h('div', {});
  const results = h('div', {}, loadingBox('Loading derived snapshots…'));
  const sigmaUi = sigmaPanel(ctx, run);

  root.append(
    h(
      'div',
      { class: 'page' },
      header.el,
      h(
        'div',
        { class: 'page-body' },
        h(
          'section',
          { class: 'card toolbar' },
          h('div', { class: 'toolbar-group' }, h('span', { class: 'muted small' }, 'step'), stepSelect),
          h('div', { class: 'toolbar-group sigma-group' }, h('span', { class: 'muted small' }, 'σ_rel'), slider, sigmaInput),
          profileBox,
        ),
        notice,
        stats,
        card.el,
        h('section', { class: 'card' }, h('div', { class: 'card-head' }, h('h3', {}, 'Sources')), planTable),
        h(
          'section',
          { class: 'card toolbar' },
          h('div', { class: 'toolbar-group' }, synth),
          h('div', { class: 'toolbar-group' }, h('span', { class: 'muted small' }, 'sweep'), sweepInput, sweepBtn),
          progressBox,
        ),
        h('section', { class: 'card' }, h('div', { class: 'card-head' }, h('h2', {}, 'Derived snapshots')), results),
        sigmaUi.el,
      ),
    ),
  );

  let chart = null;
  let chartShape = null;
  let plan = null;
  let powerProfiles = [];
  let planSeq = 0;
  let planTimer = null;
  let derived = [];
  let pendingTimer = null;
  const watching = new Set(); // ids of derived snapshots this page started

  function say(text, tone = 'info') {
    notice.hidden = !text;
    notice.className = `notice ${tone}`;
    notice.textContent = text || '';
  }

  function sigma() {
    const v = Number(sigmaInput.value);
    return Number.isFinite(v) && v > 0 ? v : null;
  }

  function chosenProfiles() {
    const boxes = [...profileBox.querySelectorAll('input[type="checkbox"]')];
    return boxes.filter((b) => b.checked).map((b) => b.value);
  }

  function profilesParam() {
    const chosen = chosenProfiles();
    return chosen.length === powerProfiles.length ? null : chosen.join(',');
  }

  function schedulePlan() {
    clearTimeout(planTimer);
    planTimer = setTimeout(loadPlan, PLAN_DEBOUNCE_MS);
  }

  async function loadPlan() {
    const s = sigma();
    if (s === null) return;
    const seq = ++planSeq;
    try {
      const p = await api(withQuery(runPath(run, '/posthoc/plan'), { sigma_rel: s, step: stepSelect.value || null, profiles: profilesParam() }), { signal: ctx.signal });
      if (!ctx.active || seq !== planSeq) return;
      plan = p;
      say('');
      setSteps(p.usable_steps, p.step);
      drawPlan();
    } catch (err) {
      if (isAbort(err) || !ctx.active || seq !== planSeq) return;
      plan = null;
      say(`${err.code ? `${err.code}: ` : ''}${err.message}`, err.status === 404 ? 'warn' : 'bad');
      drawPlan();
    }
  }

  function setSteps(steps, chosen) {
    const have = [...stepSelect.options].map((o) => Number(o.value));
    if (have.join() !== steps.join()) {
      stepSelect.replaceChildren(...steps.slice().reverse().map((s) => h('option', { value: String(s) }, `step ${fmtStep(s)}`)));
    }
    stepSelect.value = String(chosen);
  }

  function drawPlan() {
    if (!plan) {
      stats.replaceChildren();
      planTable.replaceChildren(emptyBox('No weights to show.'));
      if (chart) chart.destroy();
      chart = null;
      return;
    }
    const target = plan.targets[0];
    const [fitText, tone] = fitTone(target.residual);
    stats.replaceChildren(
      stat('target step', fmtStep(plan.step)),
      stat('σ_rel', fmtNum(target.sigma_rel, 4), { dataset: { testid: 'plan-sigma' } }),
      stat('γ (power exponent)', fmtNum(target.gamma, 4)),
      h(
        'div',
        { class: 'stat', dataset: { testid: 'plan-residual', residual: String(target.residual) } },
        h('div', { class: 'stat-label' }, 'fit residual'),
        h('div', { class: 'stat-value' }, fmtNum(target.residual, 3)),
        badge(fitText, tone),
      ),
      stat('sources', String(plan.sources.length), { title: 'stored snapshots the fit may use' }),
    );
    const labels = plan.sources.map((s) => `${s.profile}@${fmtStep(s.step)}`);
    const names = [...new Set(plan.sources.map((s) => s.profile))];
    // The same sources (another σ_rel): the chart keeps its controls' state
    // and only its data changes; other sources make another chart.
    const shape = JSON.stringify([names, labels]);
    if (!chart || chartShape !== shape) {
      if (chart) chart.destroy();
      chart = createChart(card.body, 'posthoc', {
        series: names.map((n, i) => ({ label: n, color: color(i), fill: fade(color(i), 0.55), bars: true, fmt: (v) => fmtNum(v, 5) })),
        x: categoryAxis('source (profile@step)', labels, { slantAfter: 8 }),
        y: { legend: (v) => fmtNum(v, 3) },
        height: 260,
      });
      chartShape = shape;
    }
    // One bar series per profile, null where the source is another profile's.
    const xs = plan.sources.map((_, i) => i);
    const columns = names.map((n) => plan.sources.map((s, i) => (s.profile === n ? target.weights[i] : null)));
    chart.update([xs, ...columns]);
    card.note.textContent = `Σ weights = ${fmtNum(
      target.weights.reduce((a, b) => a + b, 0),
      6,
    )}. A residual near 0 means the stored profiles express this length well; a large one asks for denser snapshots.`;
    // The table lists the sources that carry weight; the solve leaves most
    // of a long run's at 1e-40 or so, which only bury the few that count.
    const listed = plan.sources.map((s, i) => ({ s, i })).filter(({ i }) => Math.abs(target.weights[i]) > WEIGHT_LISTED);
    const unlisted = plan.sources.length - listed.length;
    const unlistedNote = unlisted
      ? h(
          'p',
          { class: 'muted small', dataset: { testid: 'unlisted-sources', count: String(unlisted) } },
          `${unlisted} more source${unlisted === 1 ? '' : 's'} with |weight| ≤ ${WEIGHT_LISTED.toExponential()} (in the chart, not listed).`,
        )
      : '';
    planTable.replaceChildren(
      tableWrap(
        h(
          'table',
          { class: 'table', dataset: { testid: 'coefficients' } },
          h('thead', {}, h('tr', {}, h('th', { class: 'num' }, 'Step'), h('th', {}, 'Profile'), h('th', { class: 'num' }, 'σ_rel'), h('th', { class: 'num' }, 'Weight'), h('th', {}, 'Snapshot'))),
          h(
            'tbody',
            {},
            listed.map(({ s, i }) =>
              h(
                'tr',
                { dataset: { index: String(i), step: String(s.step), profile: s.profile, weight: String(target.weights[i]) } },
                h('td', { class: 'num' }, fmtStep(s.step)),
                h('td', {}, s.profile),
                h('td', { class: 'num' }, fmtNum(s.sigma_rel, 4)),
                h('td', { class: 'num' }, fmtNum(target.weights[i], 6)),
                h('td', { class: 'mono muted small' }, s.snapshot),
              ),
            ),
          ),
        ),
      ),
      unlistedNote,
    );
    window.polyak.posthoc = { plan };
  }

  function setSigma(s, from) {
    const v = Math.min(SIGMA_MAX, Math.max(SIGMA_MIN, s));
    if (from !== 'slider') slider.value = String(sigmaToSlider(v));
    if (from !== 'input') sigmaInput.value = String(roundSigma(v));
    schedulePlan();
  }

  function parseSweep() {
    const values = sweepInput.value
      .split(/[,\s]+/)
      .filter(Boolean)
      .map(Number);
    if (!values.length || values.some((v) => !Number.isFinite(v))) throw new Error('the sweep is a list of numbers, e.g. "0.05, 0.07, 0.1"');
    if (values.length > MAX_SWEEP) throw new Error(`at most ${MAX_SWEEP} values in one sweep`);
    return values;
  }

  async function start(sigmas, sweep) {
    synth.disabled = true;
    sweepBtn.disabled = true;
    try {
      const body = { sigma_rel: sweep ? sigmas : sigmas[0], step: Number(stepSelect.value) };
      const profiles = profilesParam();
      if (profiles) body.profiles = profiles.split(',');
      const answer = await api(runPath(run, '/posthoc'), { method: 'POST', body, signal: ctx.signal });
      if (!ctx.active) return;
      const rows = sweep ? answer.snapshots : [answer];
      for (const r of rows) watching.add(r.id);
      derived = [...rows, ...derived.filter((d) => !rows.some((r) => r.id === d.id))];
      say(`Synthesising ${rows.length} post-hoc EMA${rows.length > 1 ? 's' : ''} at step ${fmtStep(body.step)}…`);
      progressBox.hidden = false;
      progressBar.value = 0;
      progressText.textContent = '';
      drawResults();
      followPending();
    } catch (err) {
      if (!isAbort(err) && ctx.active) say(`Could not synthesise: ${err.code ? `${err.code}: ` : ''}${err.message}`, 'bad');
    } finally {
      synth.disabled = false;
      sweepBtn.disabled = false;
    }
  }

  function downloads(row) {
    if (row.status !== 'complete') return h('span', { class: 'muted' }, '—');
    const href = (layout) => authUrl(withQuery(runPath(run, `/snapshots/${encodeURIComponent(row.id)}/download`), { profile: row.profiles[0], layout }));
    return h(
      'span',
      { class: 'links' },
      h('a', { href: href('full'), download: '', dataset: { layout: 'full' } }, 'full'),
      h('a', { href: href('sharded'), download: '', dataset: { layout: 'sharded' } }, 'sharded'),
    );
  }

  function drawResults() {
    if (!derived.length) {
      results.replaceChildren(emptyBox('No post-hoc or merged snapshots yet.'));
      return;
    }
    results.replaceChildren(
      tableWrap(
        h(
          'table',
          { class: 'table', dataset: { testid: 'derived' } },
          h('thead', {}, h('tr', {}, h('th', { class: 'num' }, 'Step'), h('th', {}, 'Kind'), h('th', { class: 'num' }, 'σ_rel'), h('th', { class: 'num' }, 'Residual'), h('th', {}, 'Status'), h('th', { class: 'num' }, 'Size'), h('th', {}, 'Created'), h('th', {}, 'Download'))),
          h(
            'tbody',
            {},
            derived.map((r) =>
              h(
                'tr',
                { dataset: { id: r.id, status: r.status, kind: r.kind } },
                h('td', { class: 'num' }, fmtStep(r.step)),
                h('td', {}, badge(r.kind, 'info'), h('div', { class: 'mono muted small' }, r.id)),
                h('td', { class: 'num', dataset: { field: 'sigma' } }, r.detail && r.detail.sigma_rel !== undefined ? fmtNum(r.detail.sigma_rel, 4) : '—'),
                h('td', { class: 'num' }, r.detail && r.detail.residual !== undefined ? fmtNum(r.detail.residual, 3) : '—'),
                h('td', { title: r.reason || '' }, snapshotBadge(r.status), r.status === 'failed' ? h('span', { class: 'small bad-text' }, ` ${r.reason || ''}`) : null),
                h('td', { class: 'num' }, r.status === 'complete' ? fmtBytes(r.bytes) : '—'),
                h('td', {}, fmtRelative(r.created_at_ms)),
                h('td', { dataset: { field: 'download' } }, downloads(r)),
              ),
            ),
          ),
        ),
      ),
    );
  }

  let listSeq = 0;
  async function loadDerived() {
    const seq = ++listSeq;
    try {
      const [ph, mg] = await Promise.all([
        api(withQuery(runPath(run, '/snapshots'), { kind: 'posthoc' }), { signal: ctx.signal }),
        api(withQuery(runPath(run, '/snapshots'), { kind: 'merge' }), { signal: ctx.signal }),
      ]);
      if (!ctx.active || seq !== listSeq) return;
      derived = [...ph.snapshots, ...mg.snapshots].sort((a, b) => b.created_at_ms - a.created_at_ms);
      drawResults();
      const mine = derived.filter((d) => watching.has(d.id));
      if (mine.length && mine.every((d) => d.status !== 'pending')) {
        const failed = mine.filter((d) => d.status === 'failed');
        progressBar.value = progressBar.max;
        say(failed.length ? `${failed.length} failed: ${failed[0].reason || ''}` : `Done: ${mine.length} derived snapshot${mine.length > 1 ? 's' : ''} ready to download.`, failed.length ? 'bad' : 'info');
        watching.clear();
      }
      followPending();
    } catch (err) {
      if (isAbort(err) || !ctx.active) return;
      results.replaceChildren(errorBox(err, loadDerived));
    }
  }

  function followPending() {
    clearTimeout(pendingTimer);
    if (derived.some((r) => r.status === 'pending')) pendingTimer = setTimeout(loadDerived, PENDING_REFRESH_MS);
  }

  async function init() {
    try {
      const view = await api(runPath(run), { signal: ctx.signal });
      if (!ctx.active) return;
      powerProfiles = view.config.profiles.filter((p) => p.kind === 'power' || p.kind === 'karras').map((p) => p.name);
      if (!powerProfiles.length) {
        say('This run has no power profile: post-hoc EMA needs snapshots of at least one (EDM2 keeps two, e.g. σ_rel 0.05 and 0.10).', 'warn');
      }
      profileBox.replaceChildren(
        h('span', { class: 'muted small' }, 'from'),
        ...powerProfiles.map((p) => h('label', { class: 'check' }, h('input', { type: 'checkbox', value: p, checked: true, onchange: schedulePlan }), ` ${p}`)),
      );
      const wanted = Number(query.get('sigma_rel'));
      setSigma(Number.isFinite(wanted) && wanted > 0 ? wanted : 0.1, null);
    } catch (err) {
      if (!isAbort(err) && ctx.active) say(`${err.code ? `${err.code}: ` : ''}${err.message}`, 'bad');
    }
  }

  slider.addEventListener('input', () => setSigma(sliderToSigma(Number(slider.value)), 'slider'));
  sigmaInput.addEventListener('input', () => {
    const s = sigma();
    if (s !== null) setSigma(s, 'input');
  });
  stepSelect.addEventListener('change', schedulePlan);
  synth.addEventListener('click', () => {
    const s = sigma();
    if (s !== null) start([s], false);
  });
  sweepBtn.addEventListener('click', () => {
    try {
      start(parseSweep(), true);
    } catch (err) {
      say(err.message, 'bad');
    }
  });

  init();
  loadDerived();
  sigmaUi.start();
  // Progress of a job (transient events) and snapshot changes.
  let eventTimer = null;
  const stream = openEvents(run, {
    kinds: ['snapshot', 'eval'],
    since: null,
    onEvent: (ev) => {
      if (ev.kind === 'eval') {
        sigmaUi.onEvent();
        return;
      }
      const d = ev.detail || {};
      if (d.status === 'running' && Array.isArray(d.ids) && d.ids.some((id) => watching.has(id))) {
        progressBox.hidden = false;
        progressBar.max = Math.max(1, d.total);
        progressBar.value = d.done;
        progressText.textContent = `${fmtBytes(d.done)} of ${fmtBytes(d.total)} read`;
        return;
      }
      if (d.status === 'complete' || d.status === 'failed' || d.status === 'deleted') {
        // A new source snapshot changes the usable steps and the weights.
        schedulePlan();
      }
      clearTimeout(eventTimer);
      eventTimer = setTimeout(loadDerived, 200);
    },
    onStatus: (s) => ctx.active && setConnection(s),
  });
  ctx.onCleanup(() => {
    stream.close();
    clearTimeout(eventTimer);
    clearTimeout(pendingTimer);
    clearTimeout(planTimer);
    if (chart) chart.destroy();
    setConnection(null);
  });
}
