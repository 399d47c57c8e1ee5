// The run's figures in a strip above the panels, updated with the ranks.

import { h, stat } from '../../dom.js';
import { fmtBytes, fmtInt, fmtRate, fmtRelative, fmtSeconds, fmtStep, fmtTime } from '../../format.js';

/** The strip: `{el, update(view, ranks)}`. */
export function statsStrip() {
  const values = {};
  const cell = (key, label) => {
    values[key] = h('span', { dataset: { testid: key } }, '—');
    return stat(label, values[key]);
  };
  const el = h(
    'div',
    { class: 'stats' },
    cell('last-step', 'Last step'),
    cell('min-step', 'Slowest rank at'),
    cell('ranks-seen', 'Ranks seen'),
    cell('throughput', 'Ingest'),
    cell('resident', 'EMA resident'),
    cell('wire', 'Wire ratio'),
    cell('codec', 'Encode / decode'),
    cell('device', 'Device'),
    cell('created', 'Created'),
  );
  return {
    el,
    update(view, ranks) {
      values['last-step'].textContent = fmtStep(view.last_step);
      values['min-step'].textContent = fmtStep(view.min_step);
      values['ranks-seen'].textContent = `${view.ranks_seen} / ${view.config.world_size}`;
      const rate = ranks.reduce((sum, r) => sum + (r.status === 'live' && r.bytes_per_second ? r.bytes_per_second : 0), 0);
      values.throughput.textContent = fmtRate(rate);
      values.resident.textContent = fmtBytes(view.resident_bytes);
      // The ranks' wire figures summed (the run view's `wire`).
      const w = view.wire || {};
      values.wire.textContent = w.ratio ? `${w.ratio.toFixed(2)}×` : '—';
      values.wire.title = w.wire_bytes ? `${fmtInt(w.wire_bytes)} wire bytes for ${fmtInt(w.logical_bytes)} logical bytes` : '';
      values.codec.textContent = w.wire_bytes ? `${fmtSeconds(w.encode_seconds || 0)} / ${fmtSeconds(w.decode_seconds || 0)}` : '—';
      values.codec.title = 'encode (client-reported) / decode (server) seconds, all pushes of all ranks';
      values.codec.classList.toggle('bad-text', (w.mirror_mismatches || 0) > 0);
      values.device.textContent = view.config.device;
      values.device.title = `EMA kept as ${view.config.ema_dtype} on ${view.config.device}`;
      values.created.textContent = fmtRelative(view.created_at_ms);
      values.created.title = fmtTime(view.created_at_ms);
    },
  };
}
