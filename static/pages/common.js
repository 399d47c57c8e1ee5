// Pieces shared by the run pages: the run's title bar with its tabs, and
// the live-connection indicator in the top bar.

import { h } from '../dom.js';

const TABS = [
  ['overview', 'Overview', ''],
  ['snapshots', 'Snapshots', '/snapshots'],
  ['compare', 'Compare', '/compare'],
  ['posthoc', 'Post-hoc EMA', '/posthoc'],
];

export function runHref(run, rest = '') {
  return `#/runs/${encodeURIComponent(run)}${rest}`;
}

/** The run's name, a slot for its badges, and the tabs. Returns `{el, badges}`. */
export function runHeader(run, active) {
  const badges = h('span', { class: 'title-badges' });
  const el = h(
    'div',
    { class: 'page-head' },
    h('div', { class: 'title-row' }, h('h1', { class: 'run-title' }, run), badges),
    h(
      'nav',
      { class: 'tabs', 'aria-label': 'run pages' },
      TABS.map(([key, label, rest]) =>
        h('a', { href: runHref(run, rest), class: key === active ? 'tab active' : 'tab', 'aria-current': key === active ? 'page' : null }, label),
      ),
    ),
  );
  return { el, badges };
}

const CONN_TEXT = { connecting: 'connecting…', live: 'live', reconnecting: 'reconnecting…' };

/** Shows the state of the page's event stream in the top bar. */
export function setConnection(status) {
  const el = document.getElementById('conn');
  if (!el) return;
  el.hidden = !status;
  el.dataset.state = status || '';
  el.textContent = CONN_TEXT[status] || '';
  el.title = status === 'live' ? 'Receiving live events from the server' : 'Waiting for the event stream';
}
