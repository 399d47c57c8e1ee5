// A chart series as the run page keeps it: `{xs, ys}` sorted by x.

/** Inserts (or replaces) `[x, y]` in a series kept sorted by x. */
export function upsert(series, x, y) {
  const xs = series.xs;
  if (!xs.length || x > xs[xs.length - 1]) {
    xs.push(x);
    series.ys.push(y);
    return;
  }
  let lo = 0;
  let hi = xs.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  if (xs[lo] === x) series.ys[lo] = y;
  else {
    xs.splice(lo, 0, x);
    series.ys.splice(lo, 0, y);
  }
}
