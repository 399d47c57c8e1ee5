//! Durable files: written under a temporary name, fsynced, renamed, the
//! directory fsynced; only then does the catalog call them complete.
//! At start, anything the catalog does not list as complete is removed.

use std::cell::Cell;
use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::format::PartFile;

/// Suffix of files being written.
pub const TMP_SUFFIX: &str = ".tmp";

/// A file as recorded in the catalog.
#[derive(Debug, Clone)]
pub struct WrittenFile {
    /// Relative to the data dir.
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
    /// Its block checksums, computed in the same pass as the sha256.
    pub blocks: crate::objstore::BlockSums,
}

/// `runs/<run>`: everything a run keeps on disk (relative to the data dir).
pub fn run_rel_dir(run: &str) -> PathBuf {
    Path::new("runs").join(run)
}

/// `runs/<run>/snapshots/<id>` (relative to the data dir).
pub fn snapshot_rel_dir(run: &str, id: &str) -> PathBuf {
    run_rel_dir(run).join("snapshots").join(id)
}

/// File name of one rank's part.
pub fn part_file_name(rank: u32, part: &str) -> String {
    format!("rank-{rank:05}.{part}.safetensors")
}

struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    blocks: crate::objstore::BlockHasher,
    bytes: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.blocks.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes of at least this many bytes are hashed beside the write (see
/// [`PartWriter::write_all`]); smaller ones, where starting a thread would
/// cost more than it saves, on the writing thread.
const PARALLEL_HASH_BYTES: usize = 1 << 20;

thread_local! {
    /// CPU time the hashing threads started by this thread took.
    static HASHING_CPU: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// CPU time (user and system) of the calling thread.
pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// A clock of the CPU a thread spends writing: its own CPU time and that
/// of the hashing threads its [`PartWriter::write_all`] calls started.
/// Read before and after a write, it says what the write cost the
/// machine, which exceeds the write's duration when the hash runs beside it.
pub fn write_cpu() -> Duration {
    thread_cpu() + HASHING_CPU.with(Cell::get)
}

/// A part file being written under its temporary name: bytes go through a
/// sha256 and block checksums on their way; [`PartWriter::finish`] fsyncs
/// and renames it.
pub struct PartWriter {
    path: PathBuf,
    rel: PathBuf,
    tmp: PathBuf,
    w: HashingWriter<io::BufWriter<File>>,
}

impl PartWriter {
    pub fn create(data_dir: &Path, rel: &Path) -> io::Result<Self> {
        Self::with_buffer(data_dir, rel, 4 << 20)
    }

    /// With a write buffer of `capacity` bytes (writers that hold many
    /// files open at once take a small one).
    pub fn with_buffer(data_dir: &Path, rel: &Path, capacity: usize) -> io::Result<Self> {
        let path = data_dir.join(rel);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        let tmp = tmp_path(&path);
        let file = File::create(&tmp)?;
        Ok(PartWriter {
            path,
            rel: rel.to_path_buf(),
            tmp,
            w: HashingWriter {
                inner: io::BufWriter::with_capacity(capacity, file),
                hasher: Sha256::new(),
                blocks: Default::default(),
                bytes: 0,
            },
        })
    }

    /// Writes `buf`. A large one is hashed (sha256 and the block
    /// checksums) on a second thread while this one writes it: the
    /// identity hash then costs a capture no time where a core is free
    /// (`benches/verify.rs` measures it), where hashing on the writing
    /// thread took as long as the write itself.
    pub fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        if buf.len() < PARALLEL_HASH_BYTES {
            return self.w.write_all(buf);
        }
        let HashingWriter {
            inner,
            hasher,
            blocks,
            bytes,
        } = &mut self.w;
        std::thread::scope(|s| {
            let hashing = s.spawn(|| {
                hasher.update(buf);
                blocks.update(buf);
                thread_cpu()
            });
            let written = inner.write_all(buf);
            let cpu = hashing
                .join()
                .map_err(|_| io::Error::other("the hashing thread panicked"))?;
            HASHING_CPU.with(|c| c.set(c.get() + cpu));
            written
        })?;
        *bytes += buf.len() as u64;
        Ok(())
    }

    /// Flushes, fsyncs and renames the file into place (the directory is
    /// synced by [`sync_dir`] once all of its files are in place).
    pub fn finish(mut self) -> io::Result<WrittenFile> {
        self.w.flush()?;
        let HashingWriter {
            inner,
            hasher,
            blocks,
            bytes,
        } = self.w;
        let file = inner.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        drop(file);
        fs::rename(&self.tmp, &self.path)?;
        Ok(WrittenFile {
            path: self.rel.to_string_lossy().into_owned(),
            sha256: hex::encode(hasher.finalize()),
            bytes,
            blocks: blocks.finish(),
        })
    }
}

/// Writes `part` to `data_dir/rel` durably.
pub fn write_part(data_dir: &Path, rel: &Path, part: &PartFile) -> io::Result<WrittenFile> {
    let mut w = PartWriter::create(data_dir, rel)?;
    w.write_all(part.header.bytes())?;
    for block in &part.blocks {
        w.write_all(block)?;
    }
    w.finish()
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(TMP_SUFFIX);
    PathBuf::from(name)
}

/// fsync a directory, so the renames in it are durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// sha256 of a file, streamed.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    io::copy(&mut file, &mut hasher)?;
    Ok(hex::encode(hasher.finalize()))
}

/// Removes every snapshot directory under `data_dir/runs/*/snapshots/` that
/// is not in `keep` (as `(run, id)`), and stray temporary files inside the
/// kept ones. Returns what was removed.
pub fn remove_unlisted(
    data_dir: &Path,
    keep: &HashSet<(String, String)>,
) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let runs = data_dir.join("runs");
    let Ok(run_dirs) = fs::read_dir(&runs) else {
        return Ok(removed);
    };
    for run_dir in run_dirs.flatten() {
        let run = run_dir.file_name().to_string_lossy().into_owned();
        let Ok(snaps) = fs::read_dir(run_dir.path().join("snapshots")) else {
            continue;
        };
        for snap in snaps.flatten() {
            let id = snap.file_name().to_string_lossy().into_owned();
            if keep.contains(&(run.clone(), id)) {
                for f in fs::read_dir(snap.path())?.flatten() {
                    let name = f.file_name().to_string_lossy().into_owned();
                    if name.ends_with(TMP_SUFFIX) || name.contains(crate::objstore::TMP_MARK) {
                        fs::remove_file(f.path())?;
                        removed.push(f.path());
                    }
                }
            } else {
                fs::remove_dir_all(snap.path())?;
                removed.push(snap.path());
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{DType, HeaderEntry, SafetensorsHeader};
    use std::collections::BTreeMap;

    #[test]
    fn writes_hash_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let part = PartFile {
            header: SafetensorsHeader::new(
                vec![HeaderEntry {
                    name: "w".into(),
                    dtype: DType::F32,
                    shape: vec![2],
                    nbytes: 8,
                }],
                BTreeMap::new(),
            ),
            blocks: vec![bytes::Bytes::from(vec![0u8; 8])],
        };
        let rel = snapshot_rel_dir("r", "s1").join(part_file_name(0, "ema"));
        let written = write_part(dir.path(), &rel, &part).unwrap();
        let path = dir.path().join(&rel);
        assert_eq!(written.bytes, std::fs::metadata(&path).unwrap().len());
        assert_eq!(written.sha256, sha256_file(&path).unwrap());
        assert!(!tmp_path(&path).exists());
        // A half-written file and an unlisted snapshot are removed.
        std::fs::write(tmp_path(&path), b"partial").unwrap();
        let orphan = dir.path().join(snapshot_rel_dir("r", "s2"));
        std::fs::create_dir_all(&orphan).unwrap();
        let keep = HashSet::from([("r".to_string(), "s1".to_string())]);
        let removed = remove_unlisted(dir.path(), &keep).unwrap();
        assert_eq!(removed.len(), 2);
        assert!(path.exists() && !orphan.exists() && !tmp_path(&path).exists());
    }

    #[test]
    fn write_cpu_counts_the_hashing_threads() {
        // A block past `PARALLEL_HASH_BYTES` is hashed on a second thread,
        // whose CPU time goes on the clock of the thread that wrote it.
        let dir = tempfile::tempdir().unwrap();
        let n = 16 * PARALLEL_HASH_BYTES;
        let part = PartFile {
            header: SafetensorsHeader::new(
                vec![HeaderEntry {
                    name: "w".into(),
                    dtype: DType::F32,
                    shape: vec![n as i64 / 4],
                    nbytes: n,
                }],
                BTreeMap::new(),
            ),
            blocks: vec![bytes::Bytes::from(vec![1u8; n])],
        };
        let hashed = || HASHING_CPU.with(Cell::get);
        let (before, clock) = (hashed(), write_cpu());
        write_part(dir.path(), Path::new("w.safetensors"), &part).unwrap();
        assert!(
            hashed() > before,
            "the hashing thread's CPU time was not counted"
        );
        assert!(write_cpu() - clock >= hashed() - before);
    }
}
