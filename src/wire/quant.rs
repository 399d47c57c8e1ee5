//! Quantised delta payloads: `polyak.kind: delta` with
//! `polyak.quant: {"format": "bf16" | "fp8_e4m3" | "int8", "block": 128 | 256}`.
//!
//! The client keeps a copy of exactly what the server's mirror holds and
//! sends `q(w - mirror)`; both sides add `dequant(q)` to their mirror, so
//! the quantisation error of one push is carried into the next delta
//! (error feedback) instead of accumulating. For that the two sides must
//! compute the same mirror bit for bit: dequantisation is
//! `float32(q) * scale` rounded to float32, then added to the mirror in
//! float32 (and rounded to the mirror's dtype when it is bf16 or fp16), with
//! no fused multiply-add; torch's `q.float() * scale` and `mirror + deq`
//! round the same way.
//!
//! On the wire, a quantised tensor keeps its name and registered shape; its
//! dtype is `F8_E4M3`, `I8` or `BF16`. For fp8 and int8 its scales follow as
//! the `F32` tensor `<name>:scale` of `ceil(numel / block)` values, one per
//! block of `block` consecutive elements (the last block may be short).
//! `bf16` deltas have no scales.

use serde::Deserialize;

/// Metadata key declaring a quantised delta.
pub const QUANT_KEY: &str = "polyak.quant";
/// Suffix of the scales tensor of a quantised tensor.
pub const SCALE_SUFFIX: &str = ":scale";

/// How the delta values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantFormat {
    Bf16,
    Fp8E4m3,
    Int8,
}

impl QuantFormat {
    /// Whether the values come with one scale per block.
    pub fn scaled(self) -> bool {
        !matches!(self, QuantFormat::Bf16)
    }
}

/// A push's `polyak.quant` declaration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quant {
    pub format: QuantFormat,
    #[serde(default = "default_block")]
    pub block: usize,
}

fn default_block() -> usize {
    128
}

impl Quant {
    /// Reads and checks the metadata value.
    pub fn parse(json: &str) -> Result<Self, String> {
        let q: Quant = serde_json::from_str(json).map_err(|e| {
            format!(
                "{QUANT_KEY} must be {{\"format\": \"bf16\"|\"fp8_e4m3\"|\"int8\", \"block\": 128|256}}: {e}"
            )
        })?;
        if q.format.scaled() && !matches!(q.block, 128 | 256) {
            return Err(format!(
                "{QUANT_KEY}: block must be 128 or 256, got {}",
                q.block
            ));
        }
        Ok(q)
    }

    /// Scales of a tensor of `numel` elements.
    pub fn blocks(&self, numel: usize) -> usize {
        if self.format.scaled() {
            numel.div_ceil(self.block)
        } else {
            0
        }
    }
}

/// float8 e4m3fn (no infinities; 0x7f and 0xff are NaN) to float32, exactly.
pub const fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        // Subnormal: man/8 * 2^-6.
        man * (1.0 / 512.0)
    } else {
        let mut scale = 1.0f32;
        let mut e = exp - 7;
        while e > 0 {
            scale *= 2.0;
            e -= 1;
        }
        while e < 0 {
            scale *= 0.5;
            e += 1;
        }
        (1.0 + man / 8.0) * scale
    };
    sign * mag
}

/// Every fp8 value as float32.
pub static FP8_E4M3: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = fp8_e4m3_to_f32(i as u8);
        i += 1;
    }
    t
};

/// Whether an fp8 e4m3fn byte is NaN (the format has no infinities).
pub fn fp8_is_nan(b: u8) -> bool {
    b & 0x7f == 0x7f
}

/// The `i`-th little-endian float32 of `bytes` (scales need no alignment).
#[inline]
pub fn scale_at(bytes: &[u8], i: usize) -> f32 {
    f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_table_matches_torch() {
        let bytes: Vec<u8> = (0..=255u8).collect();
        let t = tch::Tensor::from_slice(&bytes)
            .view_dtype(tch::Kind::Float8e4m3fn)
            .to_kind(tch::Kind::Float);
        let want: Vec<f32> = Vec::try_from(&t).unwrap();
        for (i, (&a, &b)) in FP8_E4M3.iter().zip(&want).enumerate() {
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "byte {i:#04x}: {a} vs torch {b}"
            );
            assert_eq!(a.is_nan(), fp8_is_nan(i as u8));
        }
        assert_eq!(FP8_E4M3[0x7e], 448.0);
        assert_eq!(FP8_E4M3[0x01], 2f32.powi(-9));
    }

    #[test]
    fn parses_declarations() {
        let q = Quant::parse(r#"{"format":"fp8_e4m3","block":256}"#).unwrap();
        assert_eq!(
            (q.format, q.block, q.blocks(513)),
            (QuantFormat::Fp8E4m3, 256, 3)
        );
        let q = Quant::parse(r#"{"format":"bf16"}"#).unwrap();
        assert_eq!(q.blocks(1000), 0);
        for bad in [
            r#"{"format":"int4","block":128}"#,
            r#"{"format":"int8","block":100}"#,
            r#"{"format":"int8","block":128,"x":1}"#,
            "[]",
        ] {
            assert!(Quant::parse(bad).is_err(), "{bad}");
        }
    }
}
