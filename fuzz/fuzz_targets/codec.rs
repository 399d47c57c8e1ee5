//! The `polyak-bgz` codec and the fp8 dequantisation, on any bytes:
//!
//! - as an encoded body, the decoder answers an error or a body that
//!   encodes and decodes back to itself; it never panics, overflows or
//!   writes out of bounds;
//! - as the data of a safetensors body (tensors of the sizes and dtypes the
//!   first bytes choose, empty ones included), encoding then decoding
//!   gives back exactly the body, and a corrupted copy of the encoding
//!   that keeps the header either decodes to exactly the body or fails;
//! - as fp8 e4m3 bytes, the dequantisation is NaN exactly where the format
//!   says and finite elsewhere, and the scales read back as written.

#![no_main]

use libfuzzer_sys::fuzz_target;
use polyak_fuzz::wire::bodies::BodyPool;
use polyak_fuzz::wire::codec::{decode, encode};
use polyak_fuzz::wire::quant::{fp8_e4m3_to_f32, fp8_is_nan, scale_at};

const LIMIT: u64 = 1 << 24;

/// Dtypes by element size: what the codec groups by.
const DTYPES: [&str; 9] = ["F32", "BF16", "F16", "F64", "I64", "I32", "I8", "U8", "BOOL"];

fn size_of(dtype: &str) -> usize {
    match dtype {
        "F64" | "I64" => 8,
        "F32" | "I32" => 4,
        "F16" | "BF16" => 2,
        _ => 1,
    }
}

/// A safetensors body whose tensors take `data` in order: `spec` bytes
/// choose each tensor's dtype and length (0 included).
fn body_of(spec: &[u8], data: &[u8]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for (i, pair) in spec.chunks(2).enumerate() {
        let dtype = DTYPES[pair[0] as usize % DTYPES.len()];
        let size = size_of(dtype);
        let want = pair.get(1).map_or(0, |&b| b as usize) * 37;
        let numel = want.min((data.len() - at) / size);
        header.insert(
            format!("t{i}"),
            serde_json::json!({"dtype": dtype, "shape": [numel], "data_offsets": [at, at + numel * size]}),
        );
        at += numel * size;
    }
    let mut head = serde_json::to_vec(&header).expect("json");
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut body = Vec::with_capacity(8 + head.len() + at);
    body.extend_from_slice(&(head.len() as u64).to_le_bytes());
    body.extend_from_slice(&head);
    body.extend_from_slice(&data[..at]);
    body
}

fuzz_target!(|data: &[u8]| {
    let pool = BodyPool::new(2);
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        0 => {
            // Any bytes as an encoded body.
            if let Ok(body) = decode(rest, LIMIT, &pool) {
                let again = encode(&body, 1).expect("a decoded body encodes");
                assert_eq!(&decode(&again, LIMIT, &pool).expect("decodes")[..], &body[..]);
            }
        }
        1 => {
            // Any data as tensors: decode(encode(x)) == x, and a flipped
            // byte in the encoding never yields another body.
            let tensors = (rest.first().copied().unwrap_or(0) % 8) as usize;
            let spec = rest.get(1..1 + 2 * tensors).unwrap_or(&[]);
            let payload = rest.get(1 + 2 * tensors..).unwrap_or(&[]);
            let body = body_of(spec, payload);
            let enc = encode(&body, 1).expect("a well-formed body encodes");
            let dec = decode(&enc, LIMIT, &pool).expect("its encoding decodes");
            assert_eq!(&dec[..], &body[..]);
            if let Some(&flip) = payload.first() {
                let mut bad = enc.clone();
                let i = (flip as usize * 7919) % bad.len();
                bad[i] ^= 0x5a;
                if let Ok(other) = decode(&bad, LIMIT, &pool) {
                    // The header is not checksummed (validation checks it
                    // afterwards); under the same header the frames never
                    // decode to other data.
                    let n = 8 + u64::from_le_bytes(body[..8].try_into().unwrap()) as usize;
                    if other.get(..n) == Some(&body[..n]) {
                        assert_eq!(&other[..], &body[..]);
                    }
                }
            }
        }
        _ => {
            // fp8 e4m3 dequantisation and block scales.
            for &b in rest {
                let v = fp8_e4m3_to_f32(b);
                assert_eq!(v.is_nan(), fp8_is_nan(b), "byte {b:#04x}");
                assert!(v.is_nan() || v.abs() <= 448.0, "byte {b:#04x}: {v}");
            }
            for (i, s) in rest.chunks_exact(4).enumerate() {
                let want = f32::from_le_bytes(s.try_into().unwrap());
                assert_eq!(scale_at(rest, i).to_bits(), want.to_bits());
            }
        }
    }
});
