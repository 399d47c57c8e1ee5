// The run's ranks as tiles (squares for large worlds) with their status,
// step, lag, throughput, wire figures and failover, and a summary line.

import { h, rankStatusText, rankTone } from '../../dom.js';
import { fmtAge, fmtInt, fmtRate, fmtSeconds, fmtStep } from '../../format.js';

const COMPACT_RANKS = 32; // above this many ranks, tiles become squares

/** A rank's failover in a few words: where from, and what was lost. */
function failoverText(f) {
  const lost = f.lost_steps === null || f.lost_steps === undefined ? 'loss known at next push' : `${fmtInt(f.lost_steps)} step${f.lost_steps === 1 ? '' : 's'} lost`;
  const at = f.restored_step === null ? 'empty' : fmtStep(f.restored_step);
  return f.restart ? `restarted @ ${at} · ${lost}` : `from ${f.from_node || '?'} @ ${at} · ${lost}`;
}

function failoverTitle(f) {
  return [
    f.restart ? `restored after its node restarted (epoch ${f.epoch})` : `taken over from ${f.from_node || 'a lost node'} (epoch ${f.epoch})`,
    f.snapshot ? `restored from snapshot ${f.snapshot} at step ${f.restored_step}` : 'no snapshot held the rank: its EMA restarted',
    f.last_seen_step !== null ? `last step the catalog saw: ${f.last_seen_step}` : null,
    f.resumed_step !== null ? `next push at step ${f.resumed_step}` : null,
  ]
    .filter(Boolean)
    .join('\n');
}

/** The ranks' card: `{el, update(ranks)}`, one tile per rank of `worldSize`. */
export function ranksPanel(worldSize) {
  const compact = worldSize > COMPACT_RANKS;
  const summary = h('span', { class: 'muted small' });
  const grid = h('div', { class: compact ? 'rank-grid compact' : 'rank-grid', dataset: { testid: 'ranks' } });
  const el = h('section', { class: 'card' }, h('div', { class: 'card-head' }, h('h2', {}, 'Ranks'), summary), grid);
  const tiles = [];

  function tile(rank) {
    if (compact) {
      const node = h('div', { class: 'rank-square', dataset: { rank } }, String(rank));
      return { node, fields: {} };
    }
    const fields = {};
    const field = (key, label) => {
      fields[key] = h('dd', { dataset: { field: key } }, '—');
      return [h('dt', {}, label), fields[key]];
    };
    fields.status = h('span', { class: 'badge muted rank-status' }, '…');
    fields.step = h('div', { class: 'rank-step', dataset: { field: 'last_step' } }, '—');
    const node = h(
      'div',
      { class: 'rank-tile', dataset: { rank } },
      h('div', { class: 'rank-head' }, h('span', { class: 'rank-id' }, `rank ${rank}`), fields.status),
      h('div', { class: 'rank-step-label muted small' }, 'last step'),
      fields.step,
      h(
        'dl',
        { class: 'rank-facts' },
        field('lag', 'lag'),
        field('age', 'last push'),
        field('throughput', 'throughput'),
        field('push', 'push latency'),
        field('pushes', 'pushes'),
        field('rejections', 'rejections'),
        field('wire', 'wire ratio'),
        field('codec', 'encode / decode'),
        field('engine', 'engine'),
        field('node', 'node'),
        field('failover', 'failover'),
      ),
    );
    return { node, fields };
  }

  return {
    el,
    /** `ranks`: RankView[] with `age` (seconds, browser-corrected) filled in. */
    update(ranks) {
      while (tiles.length < ranks.length) {
        const t = tile(tiles.length);
        tiles.push(t);
        grid.append(t.node);
      }
      const counts = { live: 0, stale: 0, never_seen: 0, not_restored: 0 };
      let behind = 0;
      ranks.forEach((r, i) => {
        const t = tiles[i];
        const status = r.shownStatus;
        counts[status] = (counts[status] || 0) + 1;
        t.node.dataset.status = status;
        if (r.lag > 0) behind += 1;
        if (compact) {
          t.node.className = `rank-square ${rankTone(status)}${r.lag > 0 ? ' behind' : ''}`;
          t.node.title = `rank ${r.rank}: ${rankStatusText(status)} · step ${fmtStep(r.last_step)} · lag ${fmtInt(r.lag)} · ${fmtAge(r.age)}${r.engine ? ` · ${r.engine}` : ''}${r.node ? ` on ${r.node}` : ''}${r.failover ? ` · ${failoverText(r.failover)}` : ''}`;
          return;
        }
        const f = t.fields;
        f.status.className = `badge ${rankTone(status)} rank-status`;
        f.status.textContent = rankStatusText(status);
        f.step.textContent = fmtStep(r.last_step);
        f.lag.textContent = r.lag === null || r.lag === undefined ? '—' : `${fmtInt(r.lag)} step${r.lag === 1 ? '' : 's'}`;
        f.lag.classList.toggle('warn-text', r.lag > 0);
        f.age.textContent = fmtAge(r.age);
        f.throughput.textContent = fmtRate(r.bytes_per_second);
        f.push.textContent = fmtSeconds(r.push_seconds);
        f.pushes.textContent = fmtInt(r.pushes);
        f.rejections.textContent = fmtInt(r.rejections);
        f.rejections.classList.toggle('bad-text', r.rejections > 0);
        const w = r.wire || {};
        const form = [w.last_kind, w.last_quant, w.last_encoding === 'identity' ? null : w.last_encoding]
          .filter(Boolean)
          .join(' · ');
        f.wire.textContent = w.ratio ? `${w.ratio.toFixed(2)}×${form ? ` (${form})` : ''}` : '—';
        f.wire.title = w.wire_bytes ? `${fmtInt(w.wire_bytes)} wire bytes for ${fmtInt(w.logical_bytes)} logical bytes` : '';
        const pushes = Math.max(1, r.pushes || 0);
        f.codec.textContent = w.wire_bytes
          ? `${fmtSeconds((w.encode_seconds || 0) / pushes)} / ${fmtSeconds((w.decode_seconds || 0) / pushes)}`
          : '—';
        f.codec.classList.toggle('bad-text', (w.mirror_mismatches || 0) > 0);
        f.engine.textContent = r.engine || '—';
        f.node.textContent = r.node || '—';
        f.failover.textContent = r.failover ? failoverText(r.failover) : '—';
        f.failover.classList.toggle('warn-text', Boolean(r.failover && r.failover.lost_steps));
        f.failover.title = r.failover ? failoverTitle(r.failover) : '';
      });
      const failedOver = ranks.filter((r) => r.failover);
      const lost = failedOver.reduce((n, r) => n + (r.failover.lost_steps || 0), 0);
      summary.textContent = [
        counts.finished ? `${counts.finished} finished` : `${counts.live} live`,
        counts.stale ? `${counts.stale} stale` : null,
        counts.never_seen ? `${counts.never_seen} never seen` : null,
        counts.not_restored ? `${counts.not_restored} not restored` : null,
        behind ? `${behind} behind the furthest rank` : null,
        failedOver.length
          ? `${[
              failedOver.some((r) => !r.failover.restart) ? `${failedOver.filter((r) => !r.failover.restart).length} taken over` : null,
              failedOver.some((r) => r.failover.restart) ? `${failedOver.filter((r) => r.failover.restart).length} restored after a restart` : null,
            ]
              .filter(Boolean)
              .join(' · ')} · ${fmtInt(lost)} step${lost === 1 ? '' : 's'} lost`
          : null,
      ]
        .filter(Boolean)
        .join(' · ');
    },
  };
}
