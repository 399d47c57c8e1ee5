//! What the wire carried for a rank: bytes sent against the bytes they
//! stand for, and the time spent encoding and decoding them.

use serde::{Deserialize, Serialize};

/// One rank's wire figures over the run (kept in the catalog's rank row,
/// so a restart keeps them).
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct WireStats {
    /// Body bytes received for applied pushes.
    pub wire_bytes: u64,
    /// The bytes those pushes stand for: each tensor at its registered
    /// dtype, uncompressed and unquantised.
    pub logical_bytes: u64,
    /// `logical_bytes / wire_bytes` (1 for plain pushes; higher is better).
    pub ratio: Option<f64>,
    /// Encoding seconds the client reported (`Polyak-Encode-Seconds`).
    pub encode_seconds: f64,
    /// Seconds the server spent decoding (`polyak-bgz`, `zstd`).
    pub decode_seconds: f64,
    /// The last applied push: its kind (`full`, `delta`, `xor`), encoding
    /// and quantisation.
    pub last_kind: Option<String>,
    pub last_encoding: Option<String>,
    pub last_quant: Option<String>,
    /// Keyframes that found the mirror other than the client held it.
    pub mirror_mismatches: u64,
}

impl WireStats {
    /// Adds one applied push.
    pub fn note(&mut self, wire: u64, logical: u64, encode: f64, decode: f64) {
        self.wire_bytes += wire;
        self.logical_bytes += logical;
        self.encode_seconds += encode;
        self.decode_seconds += decode;
        self.ratio =
            (self.wire_bytes > 0).then(|| self.logical_bytes as f64 / self.wire_bytes as f64);
    }
}

/// A run's wire figures: its ranks' [`WireStats`] summed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct WireTotals {
    /// Body bytes received for applied pushes, over the ranks.
    pub wire_bytes: u64,
    /// The bytes those pushes stand for, over the ranks.
    pub logical_bytes: u64,
    /// `logical_bytes / wire_bytes` of the sums (null before any push).
    pub ratio: Option<f64>,
    /// Encoding seconds the clients reported, over the ranks.
    pub encode_seconds: f64,
    /// Seconds the server spent decoding, over the ranks.
    pub decode_seconds: f64,
    /// Keyframes that found a mirror diverged, over the ranks.
    pub mirror_mismatches: u64,
}

impl WireTotals {
    /// The sum of `ranks`.
    pub fn of<'a>(ranks: impl IntoIterator<Item = &'a WireStats>) -> Self {
        let mut t = WireTotals::default();
        for r in ranks {
            t.wire_bytes += r.wire_bytes;
            t.logical_bytes += r.logical_bytes;
            t.encode_seconds += r.encode_seconds;
            t.decode_seconds += r.decode_seconds;
            t.mirror_mismatches += r.mirror_mismatches;
        }
        t.ratio = (t.wire_bytes > 0).then(|| t.logical_bytes as f64 / t.wire_bytes as f64);
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_sum_the_ranks() {
        let mut a = WireStats::default();
        a.note(100, 400, 0.5, 0.25);
        a.mirror_mismatches = 1;
        let mut b = WireStats::default();
        b.note(300, 400, 0.25, 0.5);
        let t = WireTotals::of([&a, &b]);
        assert_eq!(
            (t.wire_bytes, t.logical_bytes, t.mirror_mismatches),
            (400, 800, 1)
        );
        assert_eq!(
            (t.encode_seconds, t.decode_seconds, t.ratio),
            (0.75, 0.75, Some(2.0))
        );
        assert_eq!(WireTotals::of([]).ratio, None);
    }
}
