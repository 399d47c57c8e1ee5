//! The lossless push codec: byte-grouped floats compressed with zstd
//! (`Content-Encoding: polyak-bgz`).
//!
//! The bytes of a float are far from equally random: in trained weights the
//! sign-and-exponent byte takes a handful of values, the high mantissa byte
//! a few more, and the low mantissa bytes are close to noise. Interleaved,
//! zstd sees noise everywhere; grouped by significance (every element's
//! byte 0, then every element's byte 1, ...), the predictable bytes form
//! long runs it compresses well. XOR deltas against the mirror
//! (`polyak.kind: xor`) make even the high bytes mostly zero.
//!
//! The decoded body is exactly the safetensors file the client would have
//! sent uncompressed, so everything after decoding (validation, digest,
//! duplicate check) is unchanged. The encoded body:
//!
//! ```text
//! "PBG1"                      4 bytes, magic and version
//! N: u64 LE                   the safetensors header length
//! header: N bytes             the safetensors header, unchanged
//! C: u32 LE                   number of frames
//! C x u32 LE                  each frame's compressed length
//! C zstd frames               each with its content checksum
//! ```
//!
//! The frames follow from the header alone: the tensors in data order,
//! consecutive tensors of one element size joined into runs, each run cut
//! into chunks of at most [`CHUNK_BYTES`] (whole elements). Each chunk is
//! byte-grouped with its element size as the stride and compressed as one
//! zstd frame. Empty tensors take no frame. Frames decode independently,
//! on several threads, each into a cache-sized scratch buffer and from
//! there ungrouped straight into the body buffer: the body is written once.

use std::ops::Range;

use bytes::Bytes;

use super::bodies::BodyPool;

/// The `Content-Encoding` token of this codec.
pub const ENCODING: &str = "polyak-bgz";
/// First bytes of an encoded body.
pub const MAGIC: &[u8; 4] = b"PBG1";
/// Logical bytes per frame (rounded down to whole elements).
pub const CHUNK_BYTES: usize = 1 << 20;

/// Why an encoded body was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CodecError {
    #[error("polyak-bgz body: {0}")]
    Corrupt(String),
    #[error("decoded body of {len} bytes is over the limit of {limit} bytes")]
    TooLarge { len: u64, limit: u64 },
}

/// One frame: a range of the data section and the stride of its elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Byte range in the data section.
    pub range: Range<usize>,
    /// Element size: the byte-grouping stride.
    pub stride: usize,
}

/// Element size of a safetensors dtype name (1 for names polyak does not
/// know: validation refuses those later, with its own error).
fn element_size(dtype: &str) -> usize {
    match dtype {
        "F64" | "I64" | "U64" | "C64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        _ => 1,
    }
}

/// The frames of a body whose safetensors header is `header`, and the
/// data section's length, which may not pass `limit` (checked before any
/// frame is listed: a header of a few bytes may name exabytes).
pub fn frames_of(header: &[u8], limit: u64) -> Result<(Vec<Frame>, usize), CodecError> {
    let value: serde_json::Value = serde_json::from_slice(header)
        .map_err(|e| CodecError::Corrupt(format!("header is not JSON: {e}")))?;
    let entries = value
        .as_object()
        .ok_or_else(|| CodecError::Corrupt("header is not a JSON object".into()))?;
    let mut spans: Vec<(usize, usize, usize)> = Vec::with_capacity(entries.len());
    for (name, info) in entries {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info.get("dtype").and_then(|d| d.as_str()).unwrap_or("");
        let offsets = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .filter(|o| o.len() == 2)
            .and_then(|o| Some((o[0].as_u64()? as usize, o[1].as_u64()? as usize)))
            .ok_or_else(|| CodecError::Corrupt(format!("`{name}` has no data_offsets")))?;
        if offsets.1 < offsets.0 {
            return Err(CodecError::Corrupt(format!(
                "`{name}` has data_offsets that run backwards"
            )));
        }
        spans.push((offsets.0, offsets.1, element_size(dtype)));
    }
    spans.sort_unstable();
    let mut end = 0usize;
    for &(start, stop, _) in &spans {
        if start != end {
            return Err(CodecError::Corrupt(format!(
                "tensor data leaves a gap or overlaps at byte {start}"
            )));
        }
        end = stop;
    }
    if end as u64 > limit {
        return Err(CodecError::TooLarge {
            len: end as u64,
            limit,
        });
    }
    let mut frames: Vec<Frame> = Vec::new();
    let mut run: Option<(usize, usize, usize)> = None;
    for (start, stop, size) in spans {
        if start == stop {
            continue;
        }
        run = match run {
            Some((a, b, s)) if s == size && b == start => Some((a, stop, s)),
            Some(done) => {
                push_chunks(&mut frames, done);
                Some((start, stop, size))
            }
            None => Some((start, stop, size)),
        };
    }
    if let Some(done) = run {
        push_chunks(&mut frames, done);
    }
    Ok((frames, end))
}

fn push_chunks(frames: &mut Vec<Frame>, (start, end, stride): (usize, usize, usize)) {
    let step = (CHUNK_BYTES / stride) * stride;
    let mut at = start;
    while at < end {
        let to = (at + step).min(end);
        frames.push(Frame {
            range: at..to,
            stride,
        });
        at = to;
    }
}

/// `src` byte-grouped with `stride`: every element's byte 0, then byte 1...
pub fn group(src: &[u8], stride: usize, out: &mut Vec<u8>) {
    out.clear();
    if stride == 1 || src.len() % stride != 0 {
        out.extend_from_slice(src);
        return;
    }
    let n = src.len() / stride;
    out.resize(src.len(), 0);
    for k in 0..stride {
        let plane = &mut out[k * n..(k + 1) * n];
        for (o, e) in plane.iter_mut().zip(src.chunks_exact(stride)) {
            *o = e[k];
        }
    }
}

/// The inverse of [`group`], into `out` (the same length as `grouped`).
pub fn ungroup(grouped: &[u8], stride: usize, out: &mut [u8]) {
    if stride == 1 || grouped.len() % stride != 0 {
        out.copy_from_slice(grouped);
        return;
    }
    let n = grouped.len() / stride;
    match stride {
        2 => {
            let (a, b) = grouped.split_at(n);
            for ((o, &x), &y) in out.chunks_exact_mut(2).zip(a).zip(b) {
                o[0] = x;
                o[1] = y;
            }
        }
        4 => {
            let (a, rest) = grouped.split_at(n);
            let (b, rest) = rest.split_at(n);
            let (c, d) = rest.split_at(n);
            for (i, o) in out.chunks_exact_mut(4).enumerate() {
                o[0] = a[i];
                o[1] = b[i];
                o[2] = c[i];
                o[3] = d[i];
            }
        }
        _ => {
            for (i, o) in out.chunks_exact_mut(stride).enumerate() {
                for (k, byte) in o.iter_mut().enumerate() {
                    *byte = grouped[k * n + i];
                }
            }
        }
    }
}

/// Encodes a safetensors body (used by tests, benchmarks and the fuzz
/// corpus; the Python client has its own encoder of the same format).
pub fn encode(body: &[u8], level: i32) -> Result<Vec<u8>, CodecError> {
    let n = body
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        .ok_or_else(|| CodecError::Corrupt("body shorter than 8 bytes".into()))?;
    let header = body
        .get(8..8 + n)
        .ok_or_else(|| CodecError::Corrupt("header runs past the body".into()))?;
    let (frames, data_len) = frames_of(header, body.len() as u64)?;
    let data = &body[8 + n..];
    if data.len() != data_len {
        return Err(CodecError::Corrupt("data does not match the header".into()));
    }
    let mut out = Vec::with_capacity(body.len() / 2);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(n as u64).to_le_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(&(frames.len() as u32).to_le_bytes());
    let mut compressed = Vec::with_capacity(frames.len());
    let mut grouped = Vec::new();
    let mut cx = zstd::bulk::Compressor::new(level)
        .map_err(|e| CodecError::Corrupt(format!("zstd: {e}")))?;
    cx.include_checksum(true)
        .map_err(|e| CodecError::Corrupt(format!("zstd: {e}")))?;
    for f in &frames {
        group(&data[f.range.clone()], f.stride, &mut grouped);
        let c = cx
            .compress(&grouped)
            .map_err(|e| CodecError::Corrupt(format!("zstd: {e}")))?;
        out.extend_from_slice(&(c.len() as u32).to_le_bytes());
        compressed.push(c);
    }
    for c in compressed {
        out.extend_from_slice(&c);
    }
    Ok(out)
}

/// Threads that decode the frames of one large body.
const DECODE_THREADS: usize = 4;

/// Decodes an encoded body into a buffer of `pool`, refusing a decoded
/// size over `limit`. Every frame must decode to exactly its chunk's length
/// and carry a zstd content checksum (verified while decoding), so a
/// corrupted or truncated body is refused, not half-applied.
pub fn decode(
    raw: &[u8],
    limit: u64,
    pool: &std::sync::Arc<BodyPool>,
) -> Result<Bytes, CodecError> {
    let corrupt = |m: &str| CodecError::Corrupt(m.to_string());
    if raw.get(..4) != Some(&MAGIC[..]) {
        return Err(corrupt("does not start with PBG1"));
    }
    let n = raw
        .get(4..12)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or_else(|| corrupt("truncated before the header length"))?;
    if n > limit || n > raw.len() as u64 {
        return Err(corrupt("header length runs past the body"));
    }
    let n = n as usize;
    let header = raw
        .get(12..12 + n)
        .ok_or_else(|| corrupt("truncated inside the header"))?;
    let (frames, data_len) = frames_of(header, limit)?;
    let total = 8 + n as u64 + data_len as u64;
    if total > limit {
        return Err(CodecError::TooLarge { len: total, limit });
    }
    let mut at = 12 + n;
    let count = raw
        .get(at..at + 4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
        .ok_or_else(|| corrupt("truncated before the frame count"))?;
    at += 4;
    if count != frames.len() {
        return Err(CodecError::Corrupt(format!(
            "{count} frames where the header asks for {}",
            frames.len()
        )));
    }
    let table = raw
        .get(at..at + 4 * count)
        .ok_or_else(|| corrupt("truncated inside the frame table"))?;
    at += 4 * count;
    let mut sources: Vec<&[u8]> = Vec::with_capacity(count);
    for len in table.chunks_exact(4) {
        let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
        let frame = raw
            .get(at..at + len)
            .ok_or_else(|| corrupt("truncated inside the frames"))?;
        sources.push(frame);
        at += len;
    }
    if at != raw.len() {
        return Err(CodecError::Corrupt(format!(
            "{} bytes after the last frame",
            raw.len() - at
        )));
    }

    let mut buf = pool.take(total as usize);
    buf.resize(total as usize);
    let out = buf.bytes_mut();
    out[..8].copy_from_slice(&(n as u64).to_le_bytes());
    out[8..8 + n].copy_from_slice(header);
    let data = &mut out[8 + n..];
    decode_frames(&frames, &sources, data)?;
    Ok(buf.freeze())
}

/// One decoding thread's share: its frames, their compressed bytes, the
/// part of the data section they fill, and where that part starts.
type FrameRun<'a, 'b> = (&'a [Frame], &'a [&'b [u8]], &'a mut [u8], usize);

/// Decodes every frame into its range of `data`, on up to
/// [`DECODE_THREADS`] threads (each a contiguous run of frames).
fn decode_frames(frames: &[Frame], sources: &[&[u8]], data: &mut [u8]) -> Result<(), CodecError> {
    let threads = if data.len() >= 4 * CHUNK_BYTES {
        DECODE_THREADS.min(frames.len())
    } else {
        1
    };
    if threads <= 1 {
        return decode_run(frames, sources, data, 0);
    }
    let per = frames.len().div_ceil(threads);
    let mut parts: Vec<FrameRun<'_, '_>> = Vec::with_capacity(threads);
    let mut rest = data;
    let mut consumed = 0usize;
    for (fs, ss) in frames.chunks(per).zip(sources.chunks(per)) {
        let end = fs.last().map_or(consumed, |f| f.range.end);
        let (mine, tail) = rest.split_at_mut(end - consumed);
        parts.push((fs, ss, mine, consumed));
        rest = tail;
        consumed = end;
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = parts
            .into_iter()
            .map(|(fs, ss, out, base)| scope.spawn(move || decode_run(fs, ss, out, base)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("decode thread"))
            .collect::<Result<Vec<()>, CodecError>>()
    })?;
    Ok(())
}

/// Decodes consecutive frames into `out`, which starts at byte `base` of
/// the data section.
fn decode_run(
    frames: &[Frame],
    sources: &[&[u8]],
    out: &mut [u8],
    base: usize,
) -> Result<(), CodecError> {
    let mut dx =
        zstd::bulk::Decompressor::new().map_err(|e| CodecError::Corrupt(format!("zstd: {e}")))?;
    let mut scratch: Vec<u8> = Vec::with_capacity(CHUNK_BYTES);
    for (f, src) in frames.iter().zip(sources) {
        if !has_checksum(src) {
            return Err(CodecError::Corrupt(format!(
                "the frame of bytes {}..{} carries no content checksum",
                f.range.start, f.range.end
            )));
        }
        let want = f.range.len();
        scratch.clear();
        scratch.reserve(want);
        let got = dx.decompress_to_buffer(src, &mut scratch).map_err(|e| {
            CodecError::Corrupt(format!(
                "the frame of bytes {}..{} does not decode: {e}",
                f.range.start, f.range.end
            ))
        })?;
        if got != want {
            return Err(CodecError::Corrupt(format!(
                "the frame of bytes {}..{} decodes to {got} bytes",
                f.range.start, f.range.end
            )));
        }
        ungroup(
            &scratch,
            f.stride,
            &mut out[f.range.start - base..f.range.end - base],
        );
    }
    Ok(())
}

/// Whether a zstd frame's header sets the content checksum flag.
fn has_checksum(frame: &[u8]) -> bool {
    frame.len() > 4 && frame[..4] == [0x28, 0xb5, 0x2f, 0xfd] && frame[4] & 0x04 != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::writer::{HeaderEntry, SafetensorsHeader};
    use crate::wire::DType;

    fn body(entries: &[(&str, DType, Vec<u8>)]) -> Vec<u8> {
        let header = SafetensorsHeader::new(
            entries
                .iter()
                .map(|(n, d, b)| HeaderEntry {
                    name: n.to_string(),
                    dtype: *d,
                    shape: vec![(b.len() / d.size()) as i64],
                    nbytes: b.len(),
                })
                .collect(),
            Default::default(),
        );
        let mut out = header.bytes().to_vec();
        for (_, _, b) in entries {
            out.extend_from_slice(b);
        }
        out
    }

    fn floats(n: usize, seed: u32) -> Vec<u8> {
        (0..n)
            .flat_map(|i| {
                (((i as u32).wrapping_mul(2654435761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
                    .to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn group_and_ungroup_invert_each_other() {
        for stride in [1, 2, 4, 8] {
            for n in [0, 1, 7, 1000] {
                let src: Vec<u8> = (0..n * stride).map(|i| (i * 37 % 251) as u8).collect();
                let mut g = Vec::new();
                group(&src, stride, &mut g);
                if stride > 1 && n > 1 {
                    // Byte k of element i sits at k * n + i.
                    assert_eq!(g[n + 1], src[stride + 1]);
                }
                let mut back = vec![0u8; src.len()];
                ungroup(&g, stride, &mut back);
                assert_eq!(back, src, "stride {stride} n {n}");
            }
        }
    }

    #[test]
    fn round_trips_bit_exactly_with_odd_sizes_and_empty_tensors() {
        let pool = BodyPool::new(2);
        let big = CHUNK_BYTES / 4 * 5 + 3; // several frames, a partial last one
        let odd: Vec<u8> = (0..7u16)
            .flat_map(|i| half::bf16::from_f32(i as f32 * 0.3).to_le_bytes())
            .collect();
        let nan: Vec<u8> = [f32::NAN, f32::INFINITY, -0.0, 1.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        for entries in [
            vec![
                ("a", DType::F32, floats(big, 1)),
                ("b", DType::BF16, odd.clone()),
            ],
            vec![
                ("e", DType::F32, Vec::new()),
                ("z", DType::I64, 9i64.to_le_bytes().to_vec()),
            ],
            vec![("e", DType::F32, Vec::new())],
            vec![
                ("n", DType::F32, nan.clone()),
                ("x", DType::F64, 3f64.to_le_bytes().to_vec()),
            ],
        ] {
            let b = body(&entries);
            let enc = encode(&b, 3).unwrap();
            let dec = decode(&enc, 1 << 30, &pool).unwrap();
            assert_eq!(&dec[..], &b[..]);
        }
        // A several-frame body decoded on threads equals the encoded one.
        let large = body(&[("w", DType::F32, floats(5 * CHUNK_BYTES / 4 + 1, 7))]);
        let enc = encode(&large, 1).unwrap();
        assert_eq!(&decode(&enc, 1 << 30, &pool).unwrap()[..], &large[..]);
    }

    #[test]
    fn compresses_grouped_floats_better_than_plain_zstd() {
        // Smooth weights: exponents repeat, low mantissa bytes are noise.
        let w: Vec<u8> = (0..1 << 18)
            .flat_map(|i| half::bf16::from_f32(((i as f32) * 0.001).sin() * 0.05).to_le_bytes())
            .collect();
        let b = body(&[("w", DType::BF16, w)]);
        let grouped = encode(&b, 3).unwrap().len();
        let plain = zstd::bulk::compress(&b, 3).unwrap().len();
        assert!(grouped < plain, "grouped {grouped} plain {plain}");
    }

    #[test]
    fn refuses_corrupted_and_truncated_bodies() {
        let pool = BodyPool::new(2);
        let b = body(&[("w", DType::F32, floats(100_000, 3))]);
        let enc = encode(&b, 3).unwrap();
        for cut in [3, 11, 20, enc.len() / 2, enc.len() - 1] {
            assert!(
                matches!(
                    decode(&enc[..cut], 1 << 30, &pool),
                    Err(CodecError::Corrupt(_))
                ),
                "cut at {cut}"
            );
        }
        // A flipped byte in the compressed data: the checksum catches it
        // even when the frame still decodes.
        for at in [enc.len() - 10, enc.len() / 2 + 40] {
            let mut bad = enc.clone();
            bad[at] ^= 0x55;
            assert!(decode(&bad, 1 << 30, &pool).is_err(), "flip at {at}");
        }
        // Trailing garbage, and a frame without its checksum.
        let mut long = enc.clone();
        long.push(0);
        assert!(decode(&long, 1 << 30, &pool).is_err());
        assert!(matches!(
            decode(&enc, 100, &pool),
            Err(CodecError::TooLarge { .. } | CodecError::Corrupt(_))
        ));
    }

    #[test]
    fn a_header_naming_exabytes_is_refused_before_any_frame_is_listed() {
        // A body of a hundred bytes whose header claims 2^64 - 1 bytes of
        // data: listing its frames first took memory until the process died.
        let pool = BodyPool::new(2);
        let header = br#"{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,18446744073709551615]}}"#;
        let mut raw = MAGIC.to_vec();
        raw.extend_from_slice(&(header.len() as u64).to_le_bytes());
        raw.extend_from_slice(header);
        raw.extend_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            decode(&raw, 1 << 30, &pool),
            Err(CodecError::TooLarge { limit, .. }) if limit == 1 << 30
        ));
        assert!(matches!(
            frames_of(header, 1 << 30),
            Err(CodecError::TooLarge { .. })
        ));
    }
}
