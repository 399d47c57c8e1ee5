//! What the wire carried for a rank: bytes sent against the bytes they
//! stand for, and the time spent encoding and decoding them.

use serde::Serialize;

/// One rank's wire figures since the server started.
#[derive(Debug, Clone, Default, Serialize, utoipa::ToSchema)]
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
