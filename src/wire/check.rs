//! The body's digest and its NaN/Inf scan, in one pass over memory.
//!
//! Both read every byte of the body. Run one after the other (or side by
//! side on two threads), a 64 MB body is streamed from memory twice. Here
//! the body is cut into blocks small enough to stay in the core's L2 cache:
//! each block is hashed (xxh3-64), then the float tensors' elements that
//! start in it are scanned from cache. The blocks of a large body are split
//! between two threads, each streaming its own half once.
//!
//! The digest is xxh3-128 over the blocks' hashes and the body's length (a
//! hash tree of one level), so the halves can be hashed independently; it
//! identifies a body for the duplicate-push check and is not a published
//! format.

use std::ops::Range;

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use super::nonfinite::has_nonfinite;
use super::DType;

/// The digest of the body applied last, as a rank keeps it for the
/// duplicate-push check and as its stored state holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyDigest {
    /// [`scan_and_digest`]'s digest.
    Blocks(u128),
    /// xxh3-128 of the whole body, as states stored by earlier versions of
    /// the server hold it. A push retried across an upgrade is checked
    /// against it by hashing the retried body the old way.
    Whole(u128),
}

/// How stored state marks a [`BodyDigest::Blocks`] digest (a bare hex
/// digest is a [`BodyDigest::Whole`] one).
const BLOCKS_TAG: &str = "xxh3-blocks:";

impl BodyDigest {
    /// Whether `body`, whose [`scan_and_digest`] digest is `digest`, is the
    /// body this digest was taken of.
    pub fn matches(self, digest: u128, body: &[u8]) -> bool {
        match self {
            BodyDigest::Blocks(d) => d == digest,
            BodyDigest::Whole(d) => xxh3_128(body) == d,
        }
    }

    /// The form kept in stored state.
    pub fn to_stored(self) -> String {
        match self {
            BodyDigest::Blocks(d) => format!("{BLOCKS_TAG}{d:032x}"),
            BodyDigest::Whole(d) => format!("{d:032x}"),
        }
    }

    /// Reads [`Self::to_stored`]'s form; `None` if it is neither.
    pub fn from_stored(s: &str) -> Option<Self> {
        match s.strip_prefix(BLOCKS_TAG) {
            Some(hex) => u128::from_str_radix(hex, 16).ok().map(BodyDigest::Blocks),
            None => u128::from_str_radix(s, 16).ok().map(BodyDigest::Whole),
        }
    }
}

/// Bytes hashed and scanned at a time: the block is still in L2 when the
/// scan reads it after the hash.
pub const DIGEST_BLOCK: usize = 256 << 10;
/// Bodies at least this large are split between two threads.
pub const PARALLEL_MIN: usize = 4 << 20;

/// One tensor's bytes in the body, by dtype, in body order.
#[derive(Debug, Clone)]
pub struct Span {
    pub dtype: DType,
    pub range: Range<usize>,
}

/// The digest of `body`, and for each span (when `scan`) whether it holds
/// NaN or Inf. Spans must be sorted and must not overlap.
pub fn scan_and_digest(body: &[u8], spans: &[Span], scan: bool) -> (u128, Vec<bool>) {
    let blocks = body.len().div_ceil(DIGEST_BLOCK).max(1);
    let mut hashes = vec![0u64; blocks];
    let mut flags = vec![false; spans.len()];
    if body.len() >= PARALLEL_MIN {
        let mid = blocks / 2;
        let (first, second) = hashes.split_at_mut(mid);
        let mut flags2 = vec![false; spans.len()];
        std::thread::scope(|s| {
            s.spawn(|| pass(body, spans, scan, mid, second, &mut flags2));
            pass(body, spans, scan, 0, first, &mut flags);
        });
        for (f, g) in flags.iter_mut().zip(flags2) {
            *f |= g;
        }
    } else {
        pass(body, spans, scan, 0, &mut hashes, &mut flags);
    }
    (combine(&hashes, body.len()), flags)
}

/// The digest from the blocks' hashes.
fn combine(hashes: &[u64], len: usize) -> u128 {
    let mut tail = Vec::with_capacity(hashes.len() * 8 + 8);
    for h in hashes {
        tail.extend_from_slice(&h.to_le_bytes());
    }
    tail.extend_from_slice(&(len as u64).to_le_bytes());
    xxh3_128(&tail)
}

/// Blocks `first..first + hashes.len()`: hash each, then scan the elements
/// of float spans that start in it.
fn pass(
    body: &[u8],
    spans: &[Span],
    scan: bool,
    first: usize,
    hashes: &mut [u64],
    flags: &mut [bool],
) {
    for (i, hash) in hashes.iter_mut().enumerate() {
        let lo = (first + i) * DIGEST_BLOCK;
        let hi = (lo + DIGEST_BLOCK).min(body.len());
        *hash = xxh3_64(&body[lo.min(hi)..hi]);
        if !scan {
            continue;
        }
        let mut k = spans.partition_point(|s| s.range.end <= lo);
        while let Some(span) = spans.get(k).filter(|s| s.range.start < hi) {
            if !flags[k] && span.dtype.is_float() {
                // Whole elements only: one that straddles the block's end
                // belongs to this block, and is read a few bytes past it.
                let size = span.dtype.size();
                let start = span.range.start;
                let align = |at: usize| start + (at - start).div_ceil(size) * size;
                let from = align(lo.max(start));
                let to = align(hi.min(span.range.end)).min(span.range.end);
                if from < to && has_nonfinite(span.dtype, &body[from..to]) {
                    flags[k] = true;
                }
            }
            k += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, written out plainly.
    fn reference_digest(body: &[u8]) -> u128 {
        let hashes: Vec<u64> = if body.is_empty() {
            vec![xxh3_64(&[])]
        } else {
            body.chunks(DIGEST_BLOCK).map(xxh3_64).collect()
        };
        combine(&hashes, body.len())
    }

    fn span(dtype: DType, range: Range<usize>) -> Span {
        Span { dtype, range }
    }

    fn f32_body(prefix: usize, values: &[f32]) -> Vec<u8> {
        let mut b = vec![7u8; prefix];
        b.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        b
    }

    #[test]
    fn digest_matches_its_definition_on_both_paths() {
        for len in [
            0,
            1,
            DIGEST_BLOCK - 1,
            DIGEST_BLOCK,
            3 * DIGEST_BLOCK + 5,
            PARALLEL_MIN + 3,
        ] {
            let body: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let (digest, _) = scan_and_digest(&body, &[], true);
            assert_eq!(digest, reference_digest(&body), "len {len}");
        }
        let mut body = vec![1u8; PARALLEL_MIN + 10];
        let (a, _) = scan_and_digest(&body, &[], false);
        *body.last_mut().unwrap() = 2;
        let (b, _) = scan_and_digest(&body, &[], false);
        assert_ne!(
            a, b,
            "a change in the second thread's half changes the digest"
        );
    }

    /// A NaN anywhere (first element, last element, straddling a block
    /// boundary at an unaligned start) is found on both paths, and flagged
    /// on its own tensor only.
    #[test]
    fn finds_nonfinite_across_blocks() {
        // 13 bytes of other data first: elements are not block-aligned.
        let n = (PARALLEL_MIN + 3 * DIGEST_BLOCK) / 4;
        let positions = [
            0,
            1,
            DIGEST_BLOCK / 4 - 4,
            DIGEST_BLOCK / 4 - 3,
            n / 2,
            n - 1,
        ];
        for small in [false, true] {
            let n = if small { 3 * DIGEST_BLOCK / 4 } else { n };
            for &pos in positions.iter().filter(|&&p| p < n) {
                let mut v = vec![0.25f32; n];
                v[pos] = f32::NAN;
                let body = f32_body(13, &v);
                let spans = [span(DType::I32, 0..12), span(DType::F32, 13..body.len())];
                let (_, flags) = scan_and_digest(&body, &spans, true);
                assert_eq!(flags, [false, true], "NaN at {pos}, small {small}");
                let (_, off) = scan_and_digest(&body, &spans, false);
                assert_eq!(off, [false, false]);
            }
        }
    }

    /// Stored digests round-trip; one stored by an earlier version (xxh3-128
    /// of the whole body, bare hex) still recognises a retried body.
    #[test]
    fn stored_digests_old_and_new() {
        let body: Vec<u8> = (0..PARALLEL_MIN + 99).map(|i| (i % 253) as u8).collect();
        let (digest, _) = scan_and_digest(&body, &[], false);
        let mut other = body.clone();
        other[5] ^= 1;
        let (other_digest, _) = scan_and_digest(&other, &[], false);
        let new = BodyDigest::Blocks(digest);
        assert_eq!(BodyDigest::from_stored(&new.to_stored()), Some(new));
        assert!(new.matches(digest, &body) && !new.matches(other_digest, &other));
        let legacy = format!("{:032x}", xxh3_128(&body));
        let old = BodyDigest::from_stored(&legacy).unwrap();
        assert_eq!(old, BodyDigest::Whole(xxh3_128(&body)));
        assert_eq!(old.to_stored(), legacy);
        assert!(old.matches(digest, &body) && !old.matches(other_digest, &other));
        assert_eq!(BodyDigest::from_stored("xxh3-blocks:zz"), None);
    }

    #[test]
    fn clean_bodies_and_integers_are_not_flagged() {
        let n = PARALLEL_MIN / 4 + 17;
        let body = f32_body(3, &vec![f32::MAX; n]);
        let spans = [span(DType::U8, 0..3), span(DType::F32, 3..body.len())];
        let (_, flags) = scan_and_digest(&body, &spans, true);
        assert_eq!(flags, [false, false]);
        // All exponent bits set, but an integer tensor: never non-finite.
        let ints = vec![0xffu8; 64];
        let spans = [span(DType::I32, 0..64)];
        assert_eq!(scan_and_digest(&ints, &spans, true).1, [false]);
    }
}
