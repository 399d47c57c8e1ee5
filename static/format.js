// Numbers, sizes and times as people read them.

const BYTE_UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

export function fmtBytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return '—';
  let v = Math.abs(n);
  let i = 0;
  while (v >= 1024 && i < BYTE_UNITS.length - 1) {
    v /= 1024;
    i += 1;
  }
  const digits = i === 0 ? 0 : v < 10 ? 2 : v < 100 ? 1 : 0;
  return `${n < 0 ? '-' : ''}${v.toFixed(digits)} ${BYTE_UNITS[i]}`;
}

export function fmtRate(bytesPerSecond) {
  if (bytesPerSecond === null || bytesPerSecond === undefined) return '—';
  return `${fmtBytes(bytesPerSecond)}/s`;
}

/** A duration in seconds: `850 µs`, `12 ms`, `3.4 s`, `5 min`, `2.5 h`. */
export function fmtSeconds(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return '—';
  const a = Math.abs(s);
  if (a === 0) return '0 s';
  if (a < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
  if (a < 1) return `${(s * 1e3).toFixed(a < 0.01 ? 1 : 0)} ms`;
  if (a < 60) return `${s.toFixed(a < 10 ? 1 : 0)} s`;
  if (a < 3600) return `${(s / 60).toFixed(a < 600 ? 1 : 0)} min`;
  if (a < 86400) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

/** Time since something happened, from an age in seconds. */
export function fmtAge(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return '—';
  if (seconds < 1) return 'just now';
  return `${fmtSeconds(Math.floor(seconds))} ago`;
}

const intFormat = new Intl.NumberFormat('en-US', { maximumFractionDigits: 0 });

export function fmtInt(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return '—';
  return intFormat.format(n);
}

export const fmtStep = fmtInt;

/** A measured value: four significant digits, scientific when tiny or huge. */
export function fmtNum(x, digits = 4) {
  if (x === null || x === undefined) return '—';
  if (!Number.isFinite(x)) return String(x);
  if (x === 0) return '0';
  const a = Math.abs(x);
  if (a < 1e-3 || a >= 1e6) return x.toExponential(digits - 1).replace('e+', 'e');
  return Number(x.toPrecision(digits)).toString();
}

function pad(n, w = 2) {
  return String(n).padStart(w, '0');
}

/** `2026-12-02 12:45:40` in the browser's time zone. */
export function fmtTime(ms) {
  if (ms === null || ms === undefined) return '—';
  const d = new Date(ms);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

/** `12:45:40.123`, for event logs. */
export function fmtClock(ms) {
  const d = new Date(ms);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
}

/** `3 min ago`, from a timestamp (the browser's clock). */
export function fmtRelative(ms) {
  if (ms === null || ms === undefined) return '—';
  return fmtAge((Date.now() - ms) / 1000);
}

export function fmtShape(shape) {
  return Array.isArray(shape) ? `[${shape.join(', ')}]` : '—';
}
