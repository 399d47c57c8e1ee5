//! The digests a download states for the file it serves: the CRC-32 of
//! each [`DIGEST_BLOCK`] of the served bytes, whatever the layout (a
//! stored part as it is, or a file assembled from several, cast or
//! gathered). A client checks what it wrote against them, block by block,
//! so a byte that changed on the way, in its own writes or between two
//! halves of a resumed download is found and fetched again.
//!
//! The digests are of bytes the one verified reader produced, so they are
//! as trusted as the stored block checksums behind them. They are
//! computed as responses stream (a [`Tap`] on each one: every digest block
//! a response carries whole is hashed as it passes) and kept per ETag in a
//! bounded [`DigestCache`]; a block no response carried yet is produced
//! again (through the verified reader, only that block) when the digests
//! are asked for. A client that fetched its ranges on digest-block
//! boundaries from this node costs the store nothing more.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Bytes per stated digest (a multiple of the stored blocks' 1 MiB): a
/// 100 GiB file states 12,800 of them.
pub const DIGEST_BLOCK: u64 = 8 << 20;

/// Served files whose digests a node keeps (the oldest is dropped).
const KEPT_FILES: usize = 256;

/// The digests known of one served file.
#[derive(Debug, Clone)]
struct Known {
    len: u64,
    crc: Vec<Option<u32>>,
}

/// Digests of served files by ETag, as far as responses have carried them.
#[derive(Debug, Default)]
pub struct DigestCache {
    inner: Mutex<Files>,
    /// Per ETag being computed: its turn, so the digests of one file are
    /// produced by one computation at a time (see [`Self::turn`]).
    turns: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

#[derive(Debug, Default)]
struct Files {
    by_etag: HashMap<String, Known>,
    order: VecDeque<String>,
}

/// How many digest blocks a `len`-byte file has.
pub fn blocks_of(len: u64) -> usize {
    len.div_ceil(DIGEST_BLOCK) as usize
}

/// The bytes of digest block `i` of a `len`-byte file.
pub fn block_range(i: usize, len: u64) -> Range<u64> {
    let start = i as u64 * DIGEST_BLOCK;
    start..(start + DIGEST_BLOCK).min(len)
}

impl DigestCache {
    /// Records the CRC-32 of block `i` of the `len`-byte file `etag`.
    pub fn record(&self, etag: &str, len: u64, i: usize, crc: u32) {
        let mut files = self.inner.lock().expect("digest cache lock");
        if !files.by_etag.contains_key(etag) {
            if files.order.len() >= KEPT_FILES {
                if let Some(old) = files.order.pop_front() {
                    files.by_etag.remove(&old);
                }
            }
            files.order.push_back(etag.to_string());
            files.by_etag.insert(
                etag.to_string(),
                Known {
                    len,
                    crc: vec![None; blocks_of(len)],
                },
            );
        }
        let known = files.by_etag.get_mut(etag).expect("just inserted");
        if known.len == len && i < known.crc.len() {
            known.crc[i] = Some(crc);
        }
    }

    /// The turn to compute the missing digests of `etag`: held until the
    /// computation ends (even when the request that started it is gone:
    /// the caller moves it to the blocking thread), so requests for the
    /// same file one after the other, or a client's retry, wait for it and
    /// then find what it recorded instead of reading the file again beside
    /// it.
    pub async fn turn(&self, etag: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut turns = self.turns.lock().expect("digest turns lock");
            if turns.len() >= KEPT_FILES {
                // Those nobody holds or waits for (the map owns them alone).
                turns.retain(|_, t| Arc::strong_count(t) > 1);
            }
            turns.entry(etag.to_string()).or_default().clone()
        };
        lock.lock_owned().await
    }

    /// What is known of `etag` (a `len`-byte file): each block's CRC-32,
    /// `None` where no response carried it whole yet.
    pub fn known(&self, etag: &str, len: u64) -> Vec<Option<u32>> {
        let files = self.inner.lock().expect("digest cache lock");
        match files.by_etag.get(etag) {
            Some(k) if k.len == len => k.crc.clone(),
            _ => vec![None; blocks_of(len)],
        }
    }
}

/// Hashes a response's bytes as they are produced, from `start` on: each
/// digest block it carries whole is recorded in the cache once its last
/// byte has passed (a response cut short records nothing of its last
/// block; one that starts inside a block records from the next).
pub struct Tap {
    cache: Arc<DigestCache>,
    etag: Arc<str>,
    len: u64,
    pos: u64,
    hasher: Option<crc32fast::Hasher>,
}

impl Tap {
    pub fn new(cache: Arc<DigestCache>, etag: Arc<str>, len: u64, start: u64) -> Self {
        Tap {
            cache,
            etag,
            len,
            pos: start,
            hasher: (start % DIGEST_BLOCK == 0).then(crc32fast::Hasher::new),
        }
    }

    /// The next bytes of the response, in order.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() && self.pos < self.len {
            let i = (self.pos / DIGEST_BLOCK) as usize;
            let end = block_range(i, self.len).end;
            let n = (bytes.len() as u64).min(end - self.pos) as usize;
            if let Some(h) = &mut self.hasher {
                h.update(&bytes[..n]);
            }
            self.pos += n as u64;
            bytes = &bytes[n..];
            if self.pos == end {
                if let Some(h) = self.hasher.take() {
                    self.cache.record(&self.etag, self.len, i, h.finalize());
                }
                self.hasher = Some(crc32fast::Hasher::new());
            }
        }
    }
}

/// The runs of consecutive blocks `known` lacks, as byte ranges of a
/// `len`-byte file (what must be produced again to state every digest).
pub fn missing_ranges(known: &[Option<u32>], len: u64) -> Vec<Range<u64>> {
    let mut out: Vec<Range<u64>> = Vec::new();
    for (i, crc) in known.iter().enumerate() {
        if crc.is_some() {
            continue;
        }
        let r = block_range(i, len);
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crc(b: &[u8]) -> u32 {
        crc32fast::hash(b)
    }

    #[test]
    fn a_whole_response_states_every_block_and_a_range_only_those_it_carries_whole() {
        let len = 2 * DIGEST_BLOCK + 5;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let cache = Arc::new(DigestCache::default());
        let tag: Arc<str> = Arc::from("e");
        // A range from inside block 0 to inside block 2: only block 1 whole.
        let r = 10..(2 * DIGEST_BLOCK + 1);
        let mut tap = Tap::new(cache.clone(), tag.clone(), len, r.start);
        for piece in data[r.start as usize..r.end as usize].chunks(3 << 20) {
            tap.feed(piece);
        }
        let b1 = block_range(1, len);
        assert_eq!(
            cache.known("e", len),
            vec![
                None,
                Some(crc(&data[b1.start as usize..b1.end as usize])),
                None
            ]
        );
        assert_eq!(
            missing_ranges(&cache.known("e", len), len),
            vec![0..DIGEST_BLOCK, 2 * DIGEST_BLOCK..len]
        );
        // The whole file, in odd pieces: every block, the short last one too.
        let mut tap = Tap::new(cache.clone(), tag, len, 0);
        for piece in data.chunks(1_000_003) {
            tap.feed(piece);
        }
        let want: Vec<Option<u32>> = (0..3)
            .map(|i| {
                let r = block_range(i, len);
                Some(crc(&data[r.start as usize..r.end as usize]))
            })
            .collect();
        assert_eq!(cache.known("e", len), want);
        assert!(missing_ranges(&want, len).is_empty());
        // Another length under the same tag is another file: nothing known.
        assert_eq!(cache.known("e", len + 1), vec![None; 3]);
    }

    /// One computation per file at a time: a second turn at the same ETag
    /// waits for the first to end, one at another file does not.
    #[tokio::test]
    async fn a_files_digests_are_computed_by_one_at_a_time() {
        let cache = DigestCache::default();
        let first = cache.turn("a").await;
        let other = tokio::time::timeout(std::time::Duration::from_secs(1), cache.turn("b")).await;
        assert!(other.is_ok(), "another file's turn does not wait");
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(50), cache.turn("a"));
        assert!(waiting.await.is_err(), "the same file's turn waits");
        drop(first);
        let again = tokio::time::timeout(std::time::Duration::from_secs(1), cache.turn("a")).await;
        assert!(again.is_ok(), "and gets it once the first ended");
    }

    #[test]
    fn the_cache_keeps_a_bounded_number_of_files() {
        let cache = DigestCache::default();
        for i in 0..(KEPT_FILES + 3) {
            cache.record(&format!("f{i}"), 1, 0, i as u32);
        }
        assert_eq!(cache.known("f0", 1), vec![None]);
        assert_eq!(
            cache.known(&format!("f{}", KEPT_FILES + 2), 1),
            vec![Some(KEPT_FILES as u32 + 2)]
        );
    }
}
