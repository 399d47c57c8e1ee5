// The run page's settings kept in the browser (`polyak.KEY` in
// localStorage, JSON): the trainer charts' smoothing, the log's kinds.

export function loadSetting(key, fallback) {
  try {
    const v = localStorage.getItem(`polyak.${key}`);
    return v === null ? fallback : JSON.parse(v);
  } catch {
    return fallback;
  }
}

export function saveSetting(key, value) {
  try {
    localStorage.setItem(`polyak.${key}`, JSON.stringify(value));
  } catch {
    // Not persisted; the page still works.
  }
}
