//! Where a stored part's bytes are read from: a file (the store is a
//! directory: `pread` and `mmap` on the file itself) or an object of an
//! S3-compatible store (ranged GETs). Readers run on blocking threads, as
//! file reads always have; an object read blocks that thread on the
//! runtime until its bytes arrive. A store that cannot be reached reads
//! as `io::ErrorKind::NotConnected` (answered 503 `store_unavailable`).
//!
//! A part the catalog recorded carries its size and sha256
//! ([`PartLoc::recorded`]): [`PartLoc::check_size`], [`PartLoc::verify`]
//! and [`PartLoc::read_verified`] hold the bytes to that record, and a part
//! that does not match reads as an `io::ErrorKind::InvalidData` error
//! holding a [`PartMismatch`] (answered 500 `snapshot_corrupt`).

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::objstore::{ObjectStore, StoreError};

/// A stored part: its key in the store, how to reach it, and what the
/// catalog recorded of it when it was written.
#[derive(Clone)]
pub struct PartLoc {
    key: String,
    at: At,
    recorded: Option<Recorded>,
}

/// The size and sha256 a part had when it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub bytes: u64,
    pub sha256: String,
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

/// Bytes hashed per read while verifying a whole part: a file's come from
/// the page cache (a small buffer, since one is held per download being
/// verified); an object's are one ranged GET each.
const VERIFY_FILE_READ: usize = 1 << 20;
const VERIFY_OBJECT_READ: usize = 4 << 20;

#[derive(Clone)]
enum At {
    File(PathBuf),
    Object(ObjectStore),
}

impl PartLoc {
    /// The part stored under `key`.
    pub fn new(store: &ObjectStore, key: &str) -> Arc<Self> {
        let at = match store.local_path(key) {
            Some(path) => At::File(path),
            None => At::Object(store.clone()),
        };
        Arc::new(PartLoc {
            key: key.to_string(),
            at,
            recorded: None,
        })
    }

    /// The part stored under `key`, recorded as `bytes` long with `sha256`.
    pub fn recorded(store: &ObjectStore, key: &str, bytes: u64, sha256: &str) -> Arc<Self> {
        let mut loc = Arc::unwrap_or_clone(Self::new(store, key));
        loc.recorded = Some(Recorded {
            bytes,
            sha256: sha256.to_string(),
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

    /// Rereads the whole part, hashing it on the way, and fails with a
    /// [`PartMismatch`] when its size or sha256 is not the recorded one;
    /// `cancel` turning true stops it early (answered `Ok`).
    pub fn verify(&self, cancel: &AtomicBool) -> io::Result<()> {
        if self.recorded.is_none() {
            return Ok(());
        }
        self.check_size()?;
        let mut reader = self.open()?;
        let mut hasher = Sha256::new();
        let mut buf = vec![
            0u8;
            match self.at {
                At::File(_) => VERIFY_FILE_READ,
                At::Object(_) => VERIFY_OBJECT_READ,
            }
        ];
        let mut seen = 0u64;
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
        self.compare(seen, hasher)
    }

    /// The whole part, once its size and sha256 are checked.
    pub fn read_verified(&self) -> io::Result<Vec<u8>> {
        self.check_size()?;
        let bytes = self.open()?.read_all()?;
        if self.recorded.is_some() {
            let mut hasher = Sha256::new();
            hasher.update(&bytes);
            self.compare(bytes.len() as u64, hasher)?;
        }
        Ok(bytes)
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
            at: At::File(path),
            recorded: None,
        })
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// Opens the part for reading (an object is not contacted until read).
    pub fn open(&self) -> io::Result<PartReader> {
        Ok(match &self.at {
            At::File(path) => PartReader::File(File::open(path)?),
            At::Object(store) => PartReader::Object {
                store: store.clone(),
                key: self.key.clone(),
                pos: 0,
                len: None,
            },
        })
    }
}

impl fmt::Debug for PartLoc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.at {
            At::File(path) => write!(f, "file {}", path.display()),
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
pub enum PartReader {
    File(File),
    Object {
        store: ObjectStore,
        key: String,
        pos: u64,
        len: Option<u64>,
    },
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

impl PartReader {
    /// The part's size in bytes.
    pub fn size(&mut self) -> io::Result<u64> {
        match self {
            PartReader::File(file) => Ok(file.metadata()?.len()),
            PartReader::Object {
                store, key, len, ..
            } => {
                if let Some(n) = len {
                    return Ok(*n);
                }
                let n = block_on(store.size(key))?;
                *len = Some(n);
                Ok(n)
            }
        }
    }

    /// The file, when the part is one (for `mmap`).
    pub fn as_file(&self) -> Option<&File> {
        match self {
            PartReader::File(file) => Some(file),
            PartReader::Object { .. } => None,
        }
    }

    /// Fills `buf` from `offset`.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match self {
            PartReader::File(file) => file.read_exact_at(buf, offset),
            PartReader::Object { .. } => {
                let bytes = self.read_bytes_at(offset, buf.len() as u64)?;
                buf.copy_from_slice(&bytes);
                Ok(())
            }
        }
    }

    /// `len` bytes from `offset` (an object's come without a copy).
    pub fn read_bytes_at(&self, offset: u64, len: u64) -> io::Result<Bytes> {
        match self {
            PartReader::File(file) => {
                let mut buf = vec![0u8; len as usize];
                file.read_exact_at(&mut buf, offset)?;
                Ok(Bytes::from(buf))
            }
            PartReader::Object { store, key, .. } => {
                let bytes = block_on(store.read_range(key, offset..offset + len))?;
                if bytes.len() as u64 != len {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("object `{key}` is shorter than expected"),
                    ));
                }
                Ok(bytes)
            }
        }
    }

    /// The whole part.
    pub fn read_all(&mut self) -> io::Result<Vec<u8>> {
        match self {
            PartReader::File(file) => {
                let mut out = Vec::new();
                file.read_to_end(&mut out)?;
                Ok(out)
            }
            PartReader::Object { .. } => {
                let n = self.size()?;
                Ok(self.read_bytes_at(0, n)?.to_vec())
            }
        }
    }
}

impl Read for PartReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            PartReader::File(file) => file.read(buf),
            PartReader::Object { .. } => {
                let total = self.size()?;
                let PartReader::Object { pos, .. } = self else {
                    unreachable!()
                };
                let at = *pos;
                let n = (buf.len() as u64).min(total.saturating_sub(at));
                if n == 0 {
                    return Ok(0);
                }
                let bytes = self.read_bytes_at(at, n)?;
                buf[..n as usize].copy_from_slice(&bytes);
                if let PartReader::Object { pos, .. } = self {
                    *pos += n;
                }
                Ok(n as usize)
            }
        }
    }
}
