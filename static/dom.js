// Building DOM nodes, and the states every panel shares: loading, error, empty.

/**
 * `h('a', {href: '#', class: 'x', onclick: fn}, 'text', child)`: attributes
 * `on*` with a function become listeners, `dataset` an object of data-*,
 * `null`/`false` attributes and children are skipped, arrays are flattened.
 */
export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith('on') && typeof value === 'function') {
      node.addEventListener(key.slice(2), value);
    } else if (key === 'dataset') {
      Object.assign(node.dataset, value);
    } else if (key === 'value' && 'value' in node) {
      node.value = value;
    } else if (key === 'checked' || key === 'disabled' || key === 'selected') {
      node[key] = Boolean(value);
    } else {
      node.setAttribute(key, value === true ? '' : String(value));
    }
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(node, child);
    else node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function loadingBox(text = 'Loading…') {
  return h('div', { class: 'state loading', role: 'status' }, h('span', { class: 'spinner' }), text);
}

/** An error panel with the API's code and message, and a retry button. */
export function errorBox(err, onRetry) {
  const code = err && err.code ? err.code : 'error';
  const message = err && err.message ? err.message : String(err);
  return h(
    'div',
    { class: 'state error', role: 'alert' },
    h('div', {}, h('strong', {}, err && err.status ? `${err.status} ${code}` : code), ' ', message),
    onRetry ? h('button', { class: 'btn small', onclick: onRetry }, 'Retry') : null,
  );
}

export function emptyBox(...children) {
  return h('div', { class: 'state empty' }, ...children);
}

/** A coloured pill; `tone` is one of ok, warn, bad, info, muted. */
export function badge(text, tone = 'muted', attrs = {}) {
  return h('span', { class: `badge ${tone}`, ...attrs }, text);
}

const HEALTH_TONE = { healthy: 'ok', degraded: 'warn', waiting: 'info', idle: 'muted', finished: 'info' };
const RANK_TONE = { live: 'ok', stale: 'warn', never_seen: 'muted', not_restored: 'bad', finished: 'info' };
const SNAPSHOT_TONE = { complete: 'ok', pending: 'info', failed: 'bad', deleted: 'muted' };

export function healthBadge(health) {
  return badge(health, HEALTH_TONE[health] || 'muted', { dataset: { health } });
}

export function rankTone(status) {
  return RANK_TONE[status] || 'muted';
}

export function rankStatusText(status) {
  return status === 'never_seen' ? 'never seen' : status === 'not_restored' ? 'not restored' : status;
}

export function snapshotBadge(status) {
  return badge(status, SNAPSHOT_TONE[status] || 'muted', { dataset: { status } });
}

/** The breadcrumbs in the top bar: `[{text, href?}]`. */
export function setCrumbs(items) {
  const nav = document.getElementById('crumbs');
  if (!nav) return;
  nav.replaceChildren(
    ...items.flatMap((item, i) => [
      ...(i ? [h('span', { class: 'sep' }, '/')] : []),
      // A long run name is cut at the top bar's edge: the tooltip has it whole.
      item.href ? h('a', { href: item.href, title: item.text }, item.text) : h('span', { title: item.text }, item.text),
    ]),
  );
  document.title = ['polyak', ...items.map((i) => i.text)].slice(-2).reverse().join(' · ');
}

/** A labelled figure for the stat strips. */
export function stat(label, value, attrs = {}) {
  return h('div', { class: 'stat', ...attrs }, h('div', { class: 'stat-label' }, label), h('div', { class: 'stat-value' }, value));
}

/** Wraps a table so it scrolls sideways on narrow screens. */
export function tableWrap(table) {
  return h('div', { class: 'table-wrap' }, table);
}

/**
 * A modal confirmation. Resolves true when confirmed. Built on <dialog>,
 * not window.confirm, so it does not block the page's timers and streams.
 */
export function confirmDialog({ title, message, confirmText = 'Confirm', danger = false }) {
  return new Promise((resolve) => {
    const dialog = h(
      'dialog',
      { class: 'modal', 'aria-label': title },
      h(
        'form',
        { method: 'dialog' },
        h('h3', {}, title),
        h('p', {}, message),
        h(
          'div',
          { class: 'modal-actions' },
          h('button', { class: 'btn', value: 'cancel', type: 'submit' }, 'Cancel'),
          h('button', { class: `btn ${danger ? 'danger' : 'primary'}`, value: 'ok', type: 'submit', dataset: { confirm: '' } }, confirmText),
        ),
      ),
    );
    dialog.addEventListener('close', () => {
      resolve(dialog.returnValue === 'ok');
      dialog.remove();
    });
    document.body.append(dialog);
    dialog.showModal();
  });
}
