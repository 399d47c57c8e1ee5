// Panels of the run page that researchers add to a run: its tags and note
// (edited in place, PATCH /v1/runs/NAME) and its alerts (badge in the
// title, list with acknowledgement), refreshed every 2 s and on `alert` events.

import { api, isAbort, runPath } from '../api.js';
import { badge, emptyBox, h } from '../dom.js';
import { fmtRelative, fmtStep } from '../format.js';

const ALERTS_REFRESH_MS = 2000;

function annotationsCard(run, view) {
  const tags = h('input', { type: 'text', value: (view.tags || []).join(', '), placeholder: 'tags, comma separated', 'aria-label': 'tags', dataset: { testid: 'tags-input' } });
  const note = h('textarea', { placeholder: 'a note on this run', 'aria-label': 'note', dataset: { testid: 'note-input' } });
  note.value = view.note || '';
  const status = h('span', { class: 'muted small', 'aria-live': 'polite' });
  const save = h('button', { type: 'submit', class: 'btn small primary', dataset: { testid: 'save-annotations' } }, 'Save');
  const form = h(
    'form',
    { class: 'annotations' },
    h('label', {}, h('span', { class: 'muted small' }, 'Tags'), tags),
    h('label', {}, h('span', { class: 'muted small' }, 'Note'), note),
    h('div', {}, save, ' ', status),
  );
  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    save.disabled = true;
    status.textContent = 'saving…';
    try {
      const list = tags.value
        .split(',')
        .map((t) => t.trim())
        .filter(Boolean);
      const meta = await api(runPath(run), { method: 'PATCH', body: { tags: list, note: note.value } });
      tags.value = meta.tags.join(', ');
      status.textContent = `saved ${new Date().toLocaleTimeString()}`;
      status.dataset.saved = 'true';
    } catch (err) {
      status.textContent = `not saved: ${err.message}`;
    } finally {
      save.disabled = false;
    }
  });
  return h('section', { class: 'card', dataset: { testid: 'annotations' } }, h('div', { class: 'card-head' }, h('h2', {}, 'Tags and note')), form);
}

function alertItem(run, a, refresh, nodes) {
  const tone = a.state === 'firing' ? (a.acknowledged ? 'warn' : 'bad') : 'ok';
  const when = a.state === 'firing' ? `since ${fmtRelative(a.fired_at_ms)}` : `resolved ${fmtRelative(a.resolved_at_ms)}`;
  const steps = a.state === 'firing' ? (a.fired_step !== null ? `step ${fmtStep(a.fired_step)}` : '') : a.resolved_step !== null ? `step ${fmtStep(a.resolved_step)}` : '';
  return h(
    'li',
    { dataset: { alertKey: a.key, state: a.state, acknowledged: String(a.acknowledged) } },
    badge(a.state, tone),
    h('span', { class: 'mono small' }, a.kind),
    h('span', { class: 'alert-message' }, a.message),
    h('span', { class: 'muted small' }, [when, steps, nodes > 1 ? `on ${a.node}` : ''].filter(Boolean).join(' · ')),
    a.acknowledged
      ? badge('acknowledged', 'muted')
      : h(
          'button',
          {
            type: 'button',
            class: 'btn small',
            dataset: { ack: String(a.id) },
            onclick: async () => {
              await api(runPath(run, `/alerts/${a.id}/ack`), { method: 'POST' }).catch(() => {});
              refresh();
            },
          },
          'Acknowledge',
        ),
  );
}

/** The run page's extras: `{el, badge, refresh()}`. */
export function runExtras(ctx, run, view) {
  const alertBadge = h('span', { dataset: { testid: 'alerts-badge' } });
  const list = h('ul', { class: 'alert-list', dataset: { testid: 'alerts' } });
  const alertsCard = h('section', { class: 'card', id: 'alerts' }, h('div', { class: 'card-head' }, h('h2', {}, 'Alerts'), h('span', { class: 'muted small' }, 'rules evaluated on the server')), list);
  let busy = false;
  async function refresh() {
    if (busy || !ctx.active) return;
    busy = true;
    try {
      const data = await api(runPath(run, '/alerts'), { signal: ctx.signal });
      if (!ctx.active) return;
      alertBadge.dataset.firing = String(data.firing);
      alertBadge.replaceChildren(data.firing ? h('a', { href: '#alerts', onclick: (e) => { e.preventDefault(); alertsCard.scrollIntoView(); } }, badge(`${data.firing} alert${data.firing === 1 ? '' : 's'}`, 'bad')) : '');
      // A service of several nodes lists every node's alerts; a node that
      // did not answer is named, since its alerts are missing.
      const items = data.alerts.length ? data.alerts.slice(0, 50).map((a) => alertItem(run, a, refresh, data.nodes + data.unreachable.length)) : [h('li', {}, emptyBox('No alerts.'))];
      if (data.unreachable.length) items.unshift(h('li', { class: 'muted small', dataset: { testid: 'alerts-unreachable' } }, `not listed: the alerts of ${data.unreachable.join(', ')} (did not answer)`));
      list.replaceChildren(...items);
    } catch (err) {
      if (!isAbort(err) && ctx.active) list.replaceChildren(h('li', { class: 'muted' }, `alerts unavailable: ${err.message}`));
    } finally {
      busy = false;
    }
  }
  refresh();
  ctx.every(ALERTS_REFRESH_MS, refresh);
  const el = h('div', { class: 'split' }, alertsCard, annotationsCard(run, view));
  return { el, badge: alertBadge, refresh };
}
