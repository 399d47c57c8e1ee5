//! Where a stored part's bytes are read from: a file (the store is a
//! directory: `pread` and `mmap` on the file itself) or an object of an
//! S3-compatible store (ranged GETs). Readers run on blocking threads, as
//! file reads always have; an object read blocks that thread on the
//! runtime until its bytes arrive. A store that cannot be reached reads
//! as `io::ErrorKind::NotConnected` (answered 503 `store_unavailable`).
//!
//! A part the catalog recorded carries its size, sha256 and block
//! checksums ([`PartLoc::recorded_with`], `services::snapshots::stored_part`), and
//! [`PartReader`] is the one reader every consumer goes through: it
//! fetches the blocks a read needs once (block-aligned ranged reads, a few
//! blocks per request, the last ones kept for the next read), checks each
//! against its CRC-32 and only then hands its bytes on. A part recorded
//! before block checksums existed has its whole sha256 checked before its
//! first byte is handed on. A part that does not match reads as an
//! `io::ErrorKind::InvalidData` error holding a [`PartMismatch`]
//! (answered 500 `snapshot_corrupt`); the blocks before a bad one still
//! read.

use std::collections::VecDeque;
use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use sha2::{Digest, Sha256};

use crate::objstore::{BlockSums, ObjectStore, StoreError};

/// A stored part: its key in the store, how to reach it, and what the
/// catalog recorded of it when it was written.
#[derive(Clone)]
pub struct PartLoc {
    key: String,
    at: At,
    recorded: Option<Recorded>,
    shared: Arc<Shared>,
}

/// What the readers of one `PartLoc` learn and pass on to the next one.
#[derive(Default)]
struct Shared {
    /// The first block, read and checked by an earlier reader (a tensor
    /// table read before the download streams): the next reader starts
    /// with it instead of fetching it again.
    warm: Mutex<Option<Bytes>>,
    /// A part without block checksums whose whole sha256 matched.
    whole_checked: AtomicBool,
}

/// The size, sha256 and block checksums a part had when it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub bytes: u64,
    pub sha256: String,
    /// `None` for a part written before block checksums were recorded.
    pub blocks: Option<BlockSums>,
}

/// A stored part whose bytes are not the ones recorded when it was written
/// (a flipped bit, a cut, a replaced object).
#[derive(Debug, Clone, thiserror::Error)]
#[error("stored part `{key}` does not match its record: {what}")]
pub struct PartMismatch {
    pub key: String,
    pub what: String,
}

impl PartMismatch {
    fn error(key: &str, what: String) -> io::Error {
        io::Error::new(
            io::ErrorKind::InvalidData,
            PartMismatch {
                key: key.to_string(),
                what,
            },
        )
    }

    /// The mismatch `e` carries, if it is one.
    pub fn of(e: &io::Error) -> Option<&PartMismatch> {
        e.get_ref()?.downcast_ref::<PartMismatch>()
    }

    /// `(run, snapshot)` from the key (`runs/<run>/snapshots/<id>/<file>`).
    pub fn snapshot(&self) -> Option<(&str, &str)> {
        let mut parts = self.key.split('/');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some("runs"), Some(run), Some("snapshots"), Some(id)) => Some((run, id)),
            _ => None,
        }
    }
}

/// Bytes hashed per read while checking a whole part without block
/// checksums: a file's come from the page cache (a small buffer, since one
/// is held per download being checked); an object's are one ranged GET
/// each.
const VERIFY_FILE_READ: usize = 1 << 20;
const VERIFY_OBJECT_READ: usize = 4 << 20;
/// At most this many bytes of blocks are fetched by one request (one GET,
/// one mapping).
const FETCH: u64 = 4 << 20;
/// Checked blocks a reader keeps for the reads that follow (a read that
/// ends inside a block is followed by one that starts in it).
const KEEP_BLOCKS: usize = 8;
/// Bytes handed on at a time where nothing is checked (unrecorded parts,
/// parts checked whole): one mapping or GET each.
const RAW_CHUNK: u64 = 4 << 20;
/// A read of a file at least this long is mapped rather than copied.
const MAP_MIN: u64 = 256 << 10;

#[derive(Clone)]
enum At {
    /// A file, and the store's `polyak_store_read_bytes_total` when it is
    /// one of a store's.
    File(PathBuf, Option<prometheus::IntCounter>),
    Object(ObjectStore),
}

impl PartLoc {
    /// The part stored under `key`.
    pub fn new(store: &ObjectStore, key: &str) -> Arc<Self> {
        let at = match store.local_path(key) {
            Some(path) => At::File(path, Some(store.metrics().read_bytes.clone())),
            None => At::Object(store.clone()),
        };
        Arc::new(PartLoc {
            key: key.to_string(),
            at,
            recorded: None,
            shared: Arc::default(),
        })
    }

    /// The part stored under `key`, recorded as `bytes` long with `sha256`
    /// (and no block checksums: its whole sha256 is checked).
    pub fn recorded(store: &ObjectStore, key: &str, bytes: u64, sha256: &str) -> Arc<Self> {
        Self::recorded_with(store, key, bytes, sha256, None)
    }

    /// The part stored under `key` as the catalog recorded it.
    pub fn recorded_with(
        store: &ObjectStore,
        key: &str,
        bytes: u64,
        sha256: &str,
        blocks: Option<BlockSums>,
    ) -> Arc<Self> {
        let mut loc = Arc::unwrap_or_clone(Self::new(store, key));
        loc.recorded = Some(Recorded {
            bytes,
            sha256: sha256.to_string(),
            blocks,
        });
        Arc::new(loc)
    }

    /// What the catalog recorded of the part, when known.
    pub fn record(&self) -> Option<&Recorded> {
        self.recorded.as_ref()
    }

    /// Fails with a [`PartMismatch`] when the stored size is not the
    /// recorded one (a stat or HEAD: cheap enough before a first byte).
    pub fn check_size(&self) -> io::Result<()> {
        let Some(rec) = &self.recorded else {
            return Ok(());
        };
        let size = self.open()?.size()?;
        if size != rec.bytes {
            return Err(PartMismatch::error(
                &self.key,
                format!("{size} bytes stored, {} recorded", rec.bytes),
            ));
        }
        Ok(())
    }

    /// Rereads the whole part once, checking each block and hashing it on
    /// the way, and fails with a [`PartMismatch`] when its size, a block
    /// or its sha256 is not the recorded one; `cancel` turning true stops
    /// it early (answered `Ok`). `polyak verify` is this, part by part.
    pub fn verify(&self, cancel: &AtomicBool) -> io::Result<()> {
        let Some(rec) = &self.recorded else {
            return Ok(());
        };
        self.check_size()?;
        let mut hasher = Sha256::new();
        let mut seen = 0u64;
        if rec.blocks.is_some() {
            let reader = self.open()?;
            while seen < rec.bytes {
                if cancel.load(Ordering::Relaxed) {
                    return Ok(());
                }
                let b = reader.slice(seen, rec.bytes, rec.bytes)?;
                hasher.update(&b);
                seen += b.len() as u64;
            }
            return self.compare(seen, hasher);
        }
        let mut reader = self.open_unchecked()?;
        let mut buf = vec![
            0u8;
            match self.at {
                At::File(..) => VERIFY_FILE_READ,
                At::Object(_) => VERIFY_OBJECT_READ,
            }
        ];
        loop {
            if cancel.load(Ordering::Relaxed) {
                return Ok(());
            }
            let n = reader.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            seen += n as u64;
        }
        self.compare(seen, hasher)?;
        self.shared.whole_checked.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// The whole part, once its size and its blocks (or, without block
    /// checksums, its sha256) are checked: one read of it.
    pub fn read_verified(&self) -> io::Result<Vec<u8>> {
        self.check_size()?;
        match self.recorded.as_ref().map(|r| r.blocks.is_some()) {
            Some(true) => self.open()?.read_all(),
            Some(false) => {
                let bytes = self.open_unchecked()?.read_all()?;
                let mut hasher = Sha256::new();
                hasher.update(&bytes);
                self.compare(bytes.len() as u64, hasher)?;
                Ok(bytes)
            }
            None => self.open()?.read_all(),
        }
    }

    /// Checks `seen` bytes hashed into `hasher` against the record.
    pub fn compare(&self, seen: u64, hasher: Sha256) -> io::Result<()> {
        let Some(rec) = &self.recorded else {
            return Ok(());
        };
        if seen != rec.bytes {
            return Err(PartMismatch::error(
                &self.key,
                format!("{seen} bytes read, {} recorded", rec.bytes),
            ));
        }
        let sha = hex::encode(hasher.finalize());
        if !sha.eq_ignore_ascii_case(&rec.sha256) {
            return Err(PartMismatch::error(
                &self.key,
                format!("sha256 {sha}, {} recorded", rec.sha256),
            ));
        }
        Ok(())
    }

    /// A part that is a file outside any store (tests, local staging).
    pub fn file(path: PathBuf) -> Arc<Self> {
        Arc::new(PartLoc {
            key: path.to_string_lossy().into_owned(),
            at: At::File(path, None),
            recorded: None,
            shared: Arc::default(),
        })
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// Opens the part for reading, held to its record (an object is not
    /// contacted until read).
    pub fn open(&self) -> io::Result<PartReader> {
        self.open_as(true)
    }

    /// The same part with nothing learnt by earlier readers (no warm first
    /// block, a whole-hash check still to do): what a new request reads
    /// through, so a recipe kept between requests never serves a block
    /// another request checked.
    pub fn renewed(&self) -> PartLoc {
        PartLoc {
            key: self.key.clone(),
            at: self.at.clone(),
            recorded: self.recorded.clone(),
            shared: Arc::default(),
        }
    }

    /// Opens the part with nothing checked: for a part's own whole-hash
    /// check, and to measure what the checks cost.
    pub fn open_unchecked(&self) -> io::Result<PartReader> {
        self.open_as(false)
    }

    fn open_as(&self, checked: bool) -> io::Result<PartReader> {
        let raw = match &self.at {
            At::File(path, counted) => Raw::File(File::open(path)?, counted.clone()),
            At::Object(store) => Raw::Object(store.clone()),
        };
        let mut cache = VecDeque::new();
        if checked {
            let warm = self
                .shared
                .warm
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(first) = warm {
                cache.push_back((0, first));
            }
        }
        Ok(PartReader {
            loc: PartLoc {
                key: self.key.clone(),
                at: self.at.clone(),
                recorded: if checked { self.recorded.clone() } else { None },
                shared: self.shared.clone(),
            },
            raw,
            state: Mutex::new(State {
                cache,
                bad: None,
                len: None,
            }),
            pos: 0,
        })
    }
}

impl fmt::Debug for PartLoc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.at {
            At::File(path, _) => write!(f, "file {}", path.display()),
            At::Object(store) => write!(f, "{} object {}", store.kind(), self.key),
        }
    }
}

impl PartialEq for PartLoc {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl Eq for PartLoc {}

impl std::hash::Hash for PartLoc {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key.hash(state)
    }
}

/// An open part: positioned reads, and sequential reads through [`Read`].
/// Every byte it hands on of a recorded part has been checked: against its
/// block's CRC-32, or (a part without block checksums) after the whole
/// part's sha256 matched.
pub struct PartReader {
    /// The part, with its record when the reads are checked.
    loc: PartLoc,
    raw: Raw,
    state: Mutex<State>,
    /// Where sequential reads are.
    pos: u64,
}

enum Raw {
    File(File, Option<prometheus::IntCounter>),
    Object(ObjectStore),
}

struct State {
    /// Checked blocks, `(index, bytes)`, oldest first.
    cache: VecDeque<(u64, Bytes)>,
    /// The last block found not to match (never handed on; a stream ends
    /// there, a positioned read may still read the good blocks after it).
    bad: Option<(u64, String)>,
    len: Option<u64>,
}

fn io_error(e: StoreError) -> io::Error {
    match e {
        StoreError::NotFound(key) => {
            io::Error::new(io::ErrorKind::NotFound, format!("object `{key}` not found"))
        }
        other if other.is_unavailable() => io::Error::new(io::ErrorKind::NotConnected, other),
        StoreError::Io(e) => e,
        other => io::Error::other(other),
    }
}

/// Runs a store request from a blocking thread.
fn block_on<T>(fut: impl std::future::Future<Output = Result<T, StoreError>>) -> io::Result<T> {
    let handle = tokio::runtime::Handle::try_current()
        .map_err(|_| io::Error::other("object reads need the server's runtime"))?;
    handle.block_on(fut).map_err(io_error)
}

/// A range of a stored file, mapped read-only: the socket write copies it
/// straight from the page cache, with no read into a buffer first.
struct Mapped(memmap2::Mmap);

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for PartReader {
    fn drop(&mut self) {
        // The first block, checked, is what the next reader of this part
        // (the download after its tensor table was read) starts with.
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some((_, first)) = state.cache.iter().find(|(i, _)| *i == 0) {
            if self.loc.recorded.is_some() {
                let mut warm = self
                    .loc
                    .shared
                    .warm
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                if warm.is_none() {
                    *warm = Some(first.clone());
                }
            }
        }
    }
}

impl PartReader {
    /// The part's size in bytes (as stored).
    pub fn size(&mut self) -> io::Result<u64> {
        self.stored_len()
    }

    fn stored_len(&self) -> io::Result<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = state.len {
            return Ok(n);
        }
        let n = match &self.raw {
            Raw::File(file, _) => file.metadata()?.len(),
            Raw::Object(store) => block_on(store.size(&self.loc.key))?,
        };
        state.len = Some(n);
        Ok(n)
    }

    /// The part's length for reading: the recorded one when recorded (a
    /// stored size that differs reads as a mismatch), else the stored one.
    fn len(&self) -> io::Result<u64> {
        match &self.loc.recorded {
            Some(rec) => Ok(rec.bytes),
            None => self.stored_len(),
        }
    }

    /// The file, when the part is one.
    pub fn as_file(&self) -> Option<&File> {
        match &self.raw {
            Raw::File(file, _) => Some(file),
            Raw::Object(_) => None,
        }
    }

    /// `len` bytes at `offset`, as stored, nothing checked: a file's mapped
    /// (long reads) or copied, an object's one ranged GET.
    fn raw_read(&self, offset: u64, len: u64) -> io::Result<Bytes> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        let short = || {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{:?} is shorter than expected", self.loc),
            )
        };
        match &self.raw {
            Raw::File(file, counted) => {
                if offset + len > file.metadata()?.len() {
                    return Err(short());
                }
                if let Some(c) = counted {
                    c.inc_by(len);
                }
                if len < MAP_MIN {
                    let mut buf = vec![0u8; len as usize];
                    file.read_exact_at(&mut buf, offset)?;
                    return Ok(Bytes::from(buf));
                }
                // SAFETY: the files read are stored snapshot parts: written
                // under a temporary name, fsynced and renamed into place
                // before they are listed, and never written again (retention
                // and delete unlink them, which leaves mapped pages valid).
                // The length was checked just above.
                let map = unsafe {
                    memmap2::MmapOptions::new()
                        .offset(offset)
                        .len(len as usize)
                        .populate()
                        .map(file)?
                };
                Ok(Bytes::from_owner(Mapped(map)))
            }
            Raw::Object(store) => {
                let bytes = block_on(store.read_range(&self.loc.key, offset..offset + len))?;
                if bytes.len() as u64 != len {
                    return Err(short());
                }
                Ok(bytes)
            }
        }
    }

    /// Bytes from `pos`, at most to `end` (and at most to the end of the
    /// block `pos` is in, or [`RAW_CHUNK`] where nothing is checked), all
    /// of them checked. `ahead` says how far the caller reads on from here
    /// (the end of its range in this part): blocks up to it are fetched
    /// together, never past it, so a `Range` reads only the blocks it
    /// touches.
    pub fn slice(&self, pos: u64, end: u64, ahead: u64) -> io::Result<Bytes> {
        let len = self.len()?;
        let end = end.min(len);
        if pos >= end {
            return Ok(Bytes::new());
        }
        let Some(rec) = &self.loc.recorded else {
            return self.raw_read(pos, (end - pos).min(RAW_CHUNK));
        };
        let Some(sums) = &rec.blocks else {
            if !self.loc.shared.whole_checked.load(Ordering::Relaxed) {
                self.loc.verify(&AtomicBool::new(false))?;
            }
            return self.raw_read(pos, (end - pos).min(RAW_CHUNK));
        };
        let size = sums.block;
        let index = pos / size;
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !state.cache.iter().any(|(i, _)| *i == index) {
            self.fetch(&mut state, sums, len, index, ahead.max(end))?;
        }
        let (_, block) = state
            .cache
            .iter()
            .find(|(i, _)| *i == index)
            .expect("fetched");
        let from = (pos - index * size) as usize;
        let to = ((end - index * size) as usize).min(block.len());
        Ok(block.slice(from..to))
    }

    /// Fetches blocks from `first` on (up to the one `ahead` falls in, at
    /// most [`FETCH`] bytes) in one read, checks them in order and keeps
    /// those that match; fails when `first` does not.
    fn fetch(
        &self,
        state: &mut State,
        sums: &BlockSums,
        len: u64,
        first: u64,
        ahead: u64,
    ) -> io::Result<()> {
        let key = &self.loc.key;
        let size = sums.block;
        let count = sums.blocks_for(len);
        if sums.crcs.len() as u64 != count {
            return Err(PartMismatch::error(
                key,
                format!(
                    "{} block checksums recorded for {len} bytes",
                    sums.crcs.len()
                ),
            ));
        }
        if let Some((bad, what)) = &state.bad {
            if *bad == first {
                return Err(PartMismatch::error(key, what.clone()));
            }
        }
        let last = ahead
            .min(len)
            .div_ceil(size)
            .max(first + 1)
            .min(first + (FETCH / size).max(1))
            .min(count);
        let start = first * size;
        let stop = (last * size).min(len);
        let data = self.raw_read(start, stop - start).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                PartMismatch::error(key, format!("shorter than the {len} bytes recorded"))
            } else {
                e
            }
        })?;
        for index in first..last {
            let at = ((index - first) * size) as usize;
            let block = data.slice(at..(at + size as usize).min(data.len()));
            if let Err(bad) = sums.check(index, &block) {
                let what = format!(
                    "block {index} (bytes {}..{}) has crc32 {:08x}, {:08x} recorded",
                    index * size,
                    index * size + block.len() as u64,
                    bad.found,
                    bad.recorded
                );
                state.bad = Some((index, what.clone()));
                if index == first {
                    return Err(PartMismatch::error(key, what));
                }
                break;
            }
            if state.cache.len() >= KEEP_BLOCKS {
                state.cache.pop_front();
            }
            state.cache.push_back((index, block));
        }
        Ok(())
    }

    /// `len` checked bytes from `offset` (a copy only when they span
    /// blocks); `ahead` as for [`PartReader::slice`].
    pub fn read_bytes_ahead(&self, offset: u64, len: u64, ahead: u64) -> io::Result<Bytes> {
        let end = offset + len;
        let first = self.slice(offset, end, ahead)?;
        if first.len() as u64 == len {
            return Ok(first);
        }
        let mut out = BytesMut::with_capacity(len as usize);
        out.extend_from_slice(&first);
        let mut pos = offset + first.len() as u64;
        while pos < end {
            let b = self.slice(pos, end, ahead)?;
            if b.is_empty() {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("{:?} is shorter than expected", self.loc),
                ));
            }
            pos += b.len() as u64;
            out.extend_from_slice(&b);
        }
        Ok(out.freeze())
    }

    /// Fills `buf` from `offset`.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = buf.len() as u64;
        let bytes = self.read_bytes_ahead(offset, len, offset + len)?;
        buf.copy_from_slice(&bytes);
        Ok(())
    }

    /// `len` checked bytes from `offset`.
    pub fn read_bytes_at(&self, offset: u64, len: u64) -> io::Result<Bytes> {
        self.read_bytes_ahead(offset, len, offset + len)
    }

    /// The whole part.
    pub fn read_all(&mut self) -> io::Result<Vec<u8>> {
        let n = self.len()?;
        let mut out = Vec::with_capacity(n as usize);
        let mut pos = 0;
        while pos < n {
            let b = self.slice(pos, n, n)?;
            if b.is_empty() {
                break;
            }
            pos += b.len() as u64;
            out.extend_from_slice(&b);
        }
        Ok(out)
    }
}

impl Read for PartReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let at = self.pos;
        let b = self.slice(at, at + buf.len() as u64, at + buf.len() as u64)?;
        buf[..b.len()].copy_from_slice(&b);
        self.pos += b.len() as u64;
        Ok(b.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objstore::BLOCK_BYTES;

    /// A part of three and a half blocks in a file store, recorded, with
    /// one bit of its third block flipped after it was recorded.
    #[test]
    fn blocks_before_a_bad_one_read_and_none_of_it_does() {
        let dir = tempfile::tempdir().unwrap();
        let store = ObjectStore::open(&format!("file://{}", dir.path().display()), None).unwrap();
        let len = (3 * BLOCK_BYTES + BLOCK_BYTES / 2) as usize;
        let data: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
        std::fs::write(dir.path().join("part"), &data).unwrap();
        let sha = hex::encode(Sha256::digest(&data));
        let sums = BlockSums::of(&data, BLOCK_BYTES);
        let loc = PartLoc::recorded_with(&store, "part", len as u64, &sha, Some(sums));
        assert_eq!(loc.read_verified().unwrap(), data);
        loc.verify(&AtomicBool::new(false)).unwrap();
        // A range across a block boundary: the same bytes.
        let reader = loc.open().unwrap();
        let (a, b) = (BLOCK_BYTES - 10, BLOCK_BYTES + 20);
        assert_eq!(
            reader.read_bytes_at(a, b - a).unwrap(),
            &data[a as usize..b as usize]
        );
        drop(reader);

        let mut bad = data.clone();
        let flip = 2 * BLOCK_BYTES as usize + 77;
        bad[flip] ^= 0x20;
        std::fs::write(dir.path().join("part"), &bad).unwrap();
        let reader = loc.open().unwrap();
        let end = len as u64;
        let mut got = Vec::new();
        let err = loop {
            match reader.slice(got.len() as u64, end, end) {
                Ok(b) => got.extend_from_slice(&b),
                Err(e) => break e,
            }
        };
        assert_eq!(
            got,
            &data[..2 * BLOCK_BYTES as usize],
            "up to the bad block"
        );
        let m = PartMismatch::of(&err).expect("a mismatch");
        assert!(m.what.starts_with("block 2 "), "{}", m.what);
        // The block after it is still good, read on its own.
        let tail = reader.read_bytes_at(3 * BLOCK_BYTES, 100).unwrap();
        assert_eq!(tail, &data[3 * BLOCK_BYTES as usize..][..100]);
        let m = loc.read_verified().unwrap_err();
        assert!(PartMismatch::of(&m).is_some());
        let v = loc.verify(&AtomicBool::new(false)).unwrap_err();
        assert!(PartMismatch::of(&v).unwrap().what.starts_with("block 2 "));

        // Without block checksums: the whole sha256, before the first byte.
        let old = PartLoc::recorded(&store, "part", len as u64, &sha);
        let e = old.open().unwrap().read_bytes_at(0, 10).unwrap_err();
        assert!(PartMismatch::of(&e).unwrap().what.starts_with("sha256"));
        std::fs::write(dir.path().join("part"), &data).unwrap();
        let old = PartLoc::recorded(&store, "part", len as u64, &sha);
        assert_eq!(
            old.open().unwrap().read_bytes_at(5, 10).unwrap(),
            &data[5..15]
        );
    }
}
