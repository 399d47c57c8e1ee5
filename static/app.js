// The dashboard's router: `#/runs`, `#/runs/NAME`, `#/runs/NAME/snapshots`,
// `#/runs/NAME/compare?a=..&b=..`, `#/runs/NAME/posthoc?sigma_rel=..`,
// `#/runs/NAME/insight`, `#/compare?runs=a,b&metric=..` (runs side by side), `#/nodes`. Each page renders into #app with a
// context whose signal aborts its requests and whose cleanups stop its
// timers and streams when the page is left.

import { getToken, setToken } from './api.js';
import { errorBox, h } from './dom.js';
import * as comparePage from './pages/compare.js';
import * as insightPage from './pages/insight.js';
import * as nodesPage from './pages/nodes.js';
import * as posthocPage from './pages/posthoc.js';
import * as runPage from './pages/run.js';
import * as runsPage from './pages/runs.js';
import * as runsComparePage from './pages/runscompare.js';
import * as snapshotsPage from './pages/snapshots.js';

window.polyak = window.polyak || {};
window.polyak.charts = window.polyak.charts || {};

/**
 * What a page gets: its `signal` aborts its requests when it is left, and
 * what `onCleanup` and `every` register stops then.
 * @typedef {ReturnType<typeof makeContext>} PageContext
 * @typedef {{render: (root: HTMLElement, route: {run: string | null, query: URLSearchParams}, ctx: PageContext) => void}} Page
 */

/** @type {Array<[RegExp, Page]>} */
const ROUTES = [
  [/^\/runs$/, runsPage],
  [/^\/runs\/([^/]+)$/, runPage],
  [/^\/runs\/([^/]+)\/snapshots$/, snapshotsPage],
  [/^\/runs\/([^/]+)\/compare$/, comparePage],
  [/^\/runs\/([^/]+)\/posthoc$/, posthocPage],
  [/^\/runs\/([^/]+)\/insight$/, insightPage],
  [/^\/compare$/, runsComparePage],
  [/^\/nodes$/, nodesPage],
];

let current = null;

function makeContext() {
  const controller = new AbortController();
  const cleanups = [];
  return {
    signal: controller.signal,
    get active() {
      return !controller.signal.aborted;
    },
    onCleanup(fn) {
      cleanups.push(fn);
    },
    /**
     * Calls `fn` every `ms` while the page is shown: never two at once,
     * skipped while the tab is hidden.
     */
    every(ms, fn) {
      let timer = null;
      const tick = async () => {
        if (controller.signal.aborted) return;
        if (!document.hidden) {
          try {
            await fn();
          } catch {
            // Each caller shows its own errors; a failed poll retries next tick.
          }
        }
        if (!controller.signal.aborted) timer = setTimeout(tick, ms);
      };
      timer = setTimeout(tick, ms);
      cleanups.push(() => clearTimeout(timer));
    },
    dispose() {
      controller.abort();
      for (const fn of cleanups.splice(0)) {
        try {
          fn();
        } catch {
          // A cleanup that fails must not stop the others.
        }
      }
    },
  };
}

/** The query string of the current hash (`#/path?a=1`). */
export function hashQuery() {
  const raw = location.hash.replace(/^#/, '');
  const i = raw.indexOf('?');
  return new URLSearchParams(i >= 0 ? raw.slice(i + 1) : '');
}

function route() {
  const raw = location.hash.replace(/^#/, '');
  if (!raw || raw === '/') {
    location.replace('#/runs');
    return;
  }
  const path = raw.split('?')[0].replace(/\/+$/, '') || '/runs';
  if (current) current.dispose();
  window.polyak.charts = {};
  const ctx = makeContext();
  current = ctx;
  /** @type {HTMLElement} */ (document.getElementById('conn')).hidden = true;
  const root = /** @type {HTMLElement} */ (document.getElementById('app'));
  root.replaceChildren();
  window.scrollTo(0, 0);
  for (const [pattern, page] of ROUTES) {
    const m = path.match(pattern);
    if (!m) continue;
    let run = null;
    if (m[1] !== undefined) {
      try {
        run = decodeURIComponent(m[1]);
      } catch {
        run = m[1];
      }
    }
    try {
      page.render(root, { run, query: hashQuery() }, ctx);
    } catch (err) {
      root.append(errorBox(err));
    }
    return;
  }
  root.append(
    h('div', { class: 'page' }, errorBox({ code: 'not_found', message: `No page at #${path}.` }), h('p', {}, h('a', { href: '#/runs' }, 'All runs'))),
  );
}

/** @type {HTMLElement} */ (document.getElementById('token-button')).addEventListener('click', () => {
  setToken('');
  route();
});
setToken(getToken());
window.addEventListener('hashchange', route);
route();
