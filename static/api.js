// Talking to the polyak server: JSON calls with a timeout, the bearer token
// (asked for once, kept for the browser session), and Server-Sent Events.

import { h } from './dom.js';

const TOKEN_KEY = 'polyak.token';
const DEFAULT_TIMEOUT_MS = 30_000;

/** An answer that was not 2xx, in the API's `{error: {code, message}}` shape. */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.code = code;
  }
}

export function isAbort(err) {
  return err && err.name === 'AbortError';
}

export function getToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || '';
  } catch {
    return '';
  }
}

export function setToken(token) {
  try {
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    else sessionStorage.removeItem(TOKEN_KEY);
  } catch {
    // Storage disabled: the token lives until the page closes.
  }
  const button = document.getElementById('token-button');
  if (button) button.hidden = !token;
}

let pendingPrompt = null;

/**
 * Shows the token dialog; resolves with the token entered, or null when
 * cancelled. Concurrent 401s share one dialog.
 */
export function askToken(reason = 'This server needs a token to read runs.') {
  if (pendingPrompt) return pendingPrompt;
  pendingPrompt = new Promise((resolve) => {
    const input = h('input', {
      type: 'password',
      name: 'token',
      autocomplete: 'off',
      placeholder: 'admin or run read token',
      required: true,
      'aria-label': 'token',
    });
    const dialog = h(
      'dialog',
      { class: 'modal', id: 'token-dialog', 'aria-label': 'Token' },
      h(
        'form',
        { method: 'dialog' },
        h('h3', {}, 'Sign in to polyak'),
        h('p', { class: 'muted' }, reason, ' It is kept for this browser tab only (session storage).'),
        input,
        h(
          'div',
          { class: 'modal-actions' },
          h('button', { class: 'btn', value: 'cancel', type: 'submit', formnovalidate: true }, 'Cancel'),
          h('button', { class: 'btn primary', value: 'ok', type: 'submit' }, 'Use token'),
        ),
      ),
    );
    dialog.addEventListener('close', () => {
      const token = dialog.returnValue === 'ok' ? input.value.trim() : '';
      dialog.remove();
      pendingPrompt = null;
      if (token) setToken(token);
      resolve(token || null);
    });
    document.body.append(dialog);
    dialog.showModal();
    input.focus();
  });
  return pendingPrompt;
}

/** `/v1/runs/NAME` + rest, with the name escaped. */
export function runPath(run, rest = '') {
  return `/v1/runs/${encodeURIComponent(run)}${rest}`;
}

/** Adds the query parameters, skipping null/undefined/''. */
export function withQuery(path, params = {}) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== null && v !== undefined && v !== '') q.set(k, String(v));
  }
  const s = q.toString();
  return s ? `${path}${path.includes('?') ? '&' : '?'}${s}` : path;
}

/** A URL a browser opens by itself (downloads, EventSource): token as a query parameter. */
export function authUrl(path) {
  const token = getToken();
  return token ? withQuery(path, { access_token: token }) : path;
}

/**
 * @typedef {object} ApiOptions
 * @property {string} [method] `GET` unless said.
 * @property {unknown} [body] Sent as JSON.
 * @property {AbortSignal | null} [signal] Aborts the call (the page's, when it is left).
 * @property {number} [timeoutMs]
 * @property {Record<string, string>} [headers]
 */

/**
 * A JSON call. Rejects with ApiError (status 0 for network failures and
 * timeouts) or an AbortError when `signal` aborts. A 401 asks for a token
 * once and retries.
 * @param {string} path
 * @param {ApiOptions} [options]
 * @returns {Promise<any>}
 */
export async function api(path, { method = 'GET', body, signal, timeoutMs = DEFAULT_TIMEOUT_MS, headers = {} } = {}) {
  for (let attempt = 0; attempt < 2; attempt += 1) {
    const token = getToken();
    /** @type {Record<string, string>} */
    const sent = { Accept: 'application/json', ...headers };
    if (token) sent.Authorization = `Bearer ${token}`;
    if (body !== undefined) sent['Content-Type'] = 'application/json';
    const controller = new AbortController();
    let timedOut = false;
    const timer = setTimeout(() => {
      timedOut = true;
      controller.abort();
    }, timeoutMs);
    const onAbort = () => controller.abort();
    if (signal) {
      if (signal.aborted) controller.abort();
      else signal.addEventListener('abort', onAbort, { once: true });
    }
    let response;
    try {
      response = await fetch(path, {
        method,
        headers: sent,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: controller.signal,
      });
    } catch (err) {
      if (timedOut) throw new ApiError(0, 'timeout', `${method} ${path}: no answer after ${timeoutMs / 1000} s`);
      if (isAbort(err)) throw err;
      throw new ApiError(0, 'unreachable', `${method} ${path}: the server did not answer (${err.message})`);
    } finally {
      clearTimeout(timer);
      if (signal) signal.removeEventListener('abort', onAbort);
    }
    if (response.status === 401 && attempt === 0) {
      const reason = token ? 'The token was not accepted.' : 'This server needs a token to read runs.';
      if (await askToken(reason)) continue;
    }
    if (!response.ok) {
      let code = 'http_error';
      let message = response.statusText;
      try {
        const data = await response.json();
        if (data && data.error) ({ code, message } = data.error);
      } catch {
        // Not the API's error shape: keep the status text.
      }
      throw new ApiError(response.status, code, message);
    }
    if (response.status === 204) return null;
    return response.json();
  }
  throw new ApiError(401, 'unauthenticated', 'no token given');
}

/**
 * Events in the stream's order: by their place in the catalog (`seq`), and
 * those not stored yet (no place) after them, by id.
 */
export function byStreamOrder(a, b) {
  const ka = a.seq ?? Number.MAX_SAFE_INTEGER;
  const kb = b.seq ?? Number.MAX_SAFE_INTEGER;
  return ka - kb || a.id - b.id;
}

export const EVENT_KINDS = ['run_created', 'rank_registered', 'push', 'rejection', 'snapshot', 'metrics', 'restored', 'resumed', 'alert', 'eval'];

/**
 * A run's event stream. `onEvent(event)` gets the parsed `{id, seq, kind,
 * rank, step, at_ms, detail}` once per id, in the stream's order (the order
 * the catalog stored them, over every node of a service); `onStatus('connecting' |
 * 'live' | 'reconnecting')` follows the connection and `onOpen(n)` is
 * called on each (re)connection. `since` is the id of the last event
 * already shown (`seen`: ids already shown, not passed on again). On an
 * error the stream is reopened after the last event it carried (`?since=`
 * its SSE id; transient events have none, and are never replayed), after a
 * pause that grows to 10 s. Returns `{close()}`.
 * @param {string} run
 * @param {object} options
 * @param {number | string | null} [options.since]
 * @param {Iterable<number>} [options.seen]
 * @param {string[] | null} [options.kinds]
 * @param {(event: any) => void} options.onEvent
 * @param {(status: 'connecting' | 'live' | 'reconnecting') => void} [options.onStatus]
 * @param {(opens: number) => void} [options.onOpen]
 */
export function openEvents(run, { since = null, seen = [], kinds = null, onEvent, onStatus = () => {}, onOpen = () => {} }) {
  let lastId = since;
  // Ids passed on lately: a replay that overlaps what was shown is dropped.
  const shown = new Set(seen);
  const remember = (id) => {
    shown.add(id);
    if (shown.size > 10_000) shown.delete(/** @type {number} */ (shown.values().next().value));
  };
  let source = null;
  let retryTimer = null;
  let closed = false;
  let opens = 0;
  let failures = 0;

  const connect = () => {
    if (closed) return;
    onStatus(opens ? 'reconnecting' : 'connecting');
    source = new EventSource(authUrl(withQuery(runPath(run, '/events'), { since: lastId, kinds: kinds && kinds.join(',') })));
    const handle = (message) => {
      let event;
      try {
        event = JSON.parse(message.data);
      } catch {
        return;
      }
      if (message.lastEventId) lastId = message.lastEventId;
      if (typeof event.id === 'number') {
        if (shown.has(event.id)) return;
        remember(event.id);
      }
      onEvent(event);
    };
    for (const kind of EVENT_KINDS) source.addEventListener(kind, handle);
    source.onmessage = handle;
    source.onopen = () => {
      opens += 1;
      failures = 0;
      onStatus('live');
      onOpen(opens);
    };
    source.onerror = () => {
      if (closed) return;
      source.close();
      failures += 1;
      onStatus('reconnecting');
      retryTimer = setTimeout(connect, Math.min(10_000, 1000 * 2 ** Math.min(failures - 1, 4)));
    };
  };
  connect();
  return {
    close() {
      closed = true;
      clearTimeout(retryTimer);
      if (source) source.close();
    },
  };
}
