//! Where a stored part's bytes are read from: a file (the store is a
//! directory: `pread` and `mmap` on the file itself) or an object of an
//! S3-compatible store (ranged GETs). Readers run on blocking threads, as
//! file reads always have; an object read blocks that thread on the
//! runtime until its bytes arrive. A store that cannot be reached reads
//! as `io::ErrorKind::NotConnected` (answered 503 `store_unavailable`).

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;

use crate::objstore::{ObjectStore, StoreError};

/// A stored part: its key in the store, and how to reach it.
#[derive(Clone)]
pub struct PartLoc {
    key: String,
    at: At,
}

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
        })
    }

    /// A part that is a file outside any store (tests, local staging).
    pub fn file(path: PathBuf) -> Arc<Self> {
        Arc::new(PartLoc {
            key: path.to_string_lossy().into_owned(),
            at: At::File(path),
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
