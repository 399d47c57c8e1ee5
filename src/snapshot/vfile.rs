//! A file that exists only as a recipe: a list of pieces (literal bytes,
//! byte ranges of files on disk, ranges converted to another dtype, tensors
//! assembled from chunks), each with a known length. Downloads are served
//! from it piece by piece, so the server never holds a whole checkpoint; any
//! byte range can be produced without producing what comes before it
//! (HTTP `Range`).
//!
//! [`VirtualFile::stream_verified`] holds what it streams to the parts'
//! records: the sizes are checked before the first byte, and every part a
//! range touches is hashed while the bytes go out (the bytes themselves
//! when the file is one whole part, else a second read of each part beside
//! the stream). The last chunk waits for the verdict: a part that does not
//! match ends the stream with an error instead of a clean end.

use std::collections::HashMap;
use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::Stream;
use sha2::{Digest, Sha256};

use super::source::{PartLoc, PartMismatch, PartReader};
use crate::wire::DType;

/// Bytes produced at a time from stored bytes (mapped: page cache, not
/// the server's memory).
const CHUNK: u64 = 4 << 20;
/// Bytes produced at a time where they are computed (casts, gathers'
/// slices): these live in the server's memory until the socket takes them.
const CAST_CHUNK: u64 = 1 << 20;
/// Chunks queued between the producing thread and the socket.
const QUEUED: usize = 2;

/// One chunk of a tensor stored in a file.
#[derive(Debug, Clone)]
pub struct ChunkSource {
    pub path: Arc<PartLoc>,
    /// Byte offset of the chunk's data in the file.
    pub offset: u64,
    pub shape: Vec<i64>,
    pub offsets: Vec<i64>,
}

/// A whole tensor built from chunks that are not row blocks.
#[derive(Debug, Clone)]
pub struct GatherSpec {
    pub dtype: DType,
    pub to: DType,
    pub global_shape: Vec<i64>,
    pub chunks: Vec<ChunkSource>,
}

#[derive(Debug, Clone)]
pub enum Piece {
    Bytes(Bytes),
    File {
        path: Arc<PartLoc>,
        offset: u64,
        len: u64,
    },
    /// `count` elements of `from` at `offset`, written as `to`.
    Cast {
        path: Arc<PartLoc>,
        offset: u64,
        count: u64,
        from: DType,
        to: DType,
    },
    Gather(Arc<GatherSpec>),
}

impl Piece {
    pub fn len(&self) -> u64 {
        match self {
            Piece::Bytes(b) => b.len() as u64,
            Piece::File { len, .. } => *len,
            Piece::Cast { count, to, .. } => count * to.size() as u64,
            Piece::Gather(g) => g.global_shape.iter().product::<i64>() as u64 * g.to.size() as u64,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Byte range of `from` in the file, when this piece is stored bytes
    /// (used to merge adjacent pieces).
    fn file_range(&self) -> Option<(&Arc<PartLoc>, u64, u64)> {
        match self {
            Piece::File { path, offset, len } => Some((path, *offset, *len)),
            Piece::Cast {
                path,
                offset,
                count,
                from,
                to,
            } if from == to => Some((path, *offset, count * from.size() as u64)),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct VirtualFile {
    pieces: Vec<Piece>,
    starts: Vec<u64>,
    len: u64,
}

impl VirtualFile {
    /// Builds the file; adjacent ranges of the same file are merged.
    pub fn new(pieces: Vec<Piece>) -> Self {
        let mut merged: Vec<Piece> = Vec::with_capacity(pieces.len());
        for piece in pieces {
            if piece.is_empty() {
                continue;
            }
            if let (Some(last), Some((path, offset, len))) = (merged.last_mut(), piece.file_range())
            {
                if let Some((lpath, loffset, llen)) = last.file_range() {
                    if (Arc::ptr_eq(lpath, path) || lpath == path) && loffset + llen == offset {
                        *last = Piece::File {
                            path: lpath.clone(),
                            offset: loffset,
                            len: llen + len,
                        };
                        continue;
                    }
                }
            }
            merged.push(match piece {
                Piece::Cast {
                    path,
                    offset,
                    count,
                    from,
                    to,
                } if from == to => Piece::File {
                    path,
                    offset,
                    len: count * from.size() as u64,
                },
                other => other,
            });
        }
        let mut starts = Vec::with_capacity(merged.len());
        let mut len = 0;
        for p in &merged {
            starts.push(len);
            len += p.len();
        }
        VirtualFile {
            pieces: merged,
            starts,
            len,
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Produces the bytes of `range` in order, at most [`CHUNK`] at a time;
    /// stops early when `sink` returns false.
    pub fn produce(
        &self,
        range: Range<u64>,
        mut sink: impl FnMut(Bytes) -> bool,
    ) -> io::Result<()> {
        let mut files: HashMap<String, PartReader> = HashMap::new();
        let end = range.end.min(self.len);
        let first = self
            .starts
            .partition_point(|&s| s <= range.start)
            .saturating_sub(1);
        for (i, piece) in self.pieces.iter().enumerate().skip(first) {
            let start = self.starts[i];
            if start >= end {
                break;
            }
            let local = range.start.saturating_sub(start)..(end - start).min(piece.len());
            if local.start >= local.end {
                continue;
            }
            if !produce_piece(piece, local, &mut files, &mut sink)? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Streams `range` from a blocking thread, with back-pressure.
    pub fn stream(self: Arc<Self>, range: Range<u64>) -> impl Stream<Item = io::Result<Bytes>> {
        let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(QUEUED);
        tokio::task::spawn_blocking(move || {
            let result = self.produce(range, |b| tx.blocking_send(Ok(b)).is_ok());
            if let Err(e) = result {
                let _ = tx.blocking_send(Err(e));
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }

    /// The stored parts whose bytes `range` reads (each once).
    pub fn parts_in(&self, range: Range<u64>) -> Vec<Arc<PartLoc>> {
        let mut out: Vec<Arc<PartLoc>> = Vec::new();
        let mut add = |p: &Arc<PartLoc>| {
            if !out.iter().any(|q| q.key() == p.key()) {
                out.push(p.clone());
            }
        };
        for (i, piece) in self.pieces.iter().enumerate() {
            let start = self.starts[i];
            if start >= range.end || start + piece.len() <= range.start {
                continue;
            }
            match piece {
                Piece::Bytes(_) => {}
                Piece::File { path, .. } | Piece::Cast { path, .. } => add(path),
                Piece::Gather(g) => g.chunks.iter().for_each(|c| add(&c.path)),
            }
        }
        out
    }

    /// The one recorded part this file is, byte for byte, if it is one.
    fn whole_part(&self) -> Option<&Arc<PartLoc>> {
        match self.pieces.as_slice() {
            [Piece::File {
                path,
                offset: 0,
                len,
            }] if path.record().is_some_and(|r| r.bytes == *len) => Some(path),
            _ => None,
        }
    }

    /// Checks the recorded size of every part `range` reads (before the
    /// first byte is sent).
    pub fn check_sizes(&self, range: Range<u64>) -> io::Result<()> {
        for part in self.parts_in(range) {
            part.check_size()?;
        }
        Ok(())
    }

    /// Streams `range` as [`VirtualFile::stream`] does, holding it to the
    /// parts' recorded sha256: a part that does not match ends the stream
    /// with an error before its last byte (the client sees a cut body,
    /// never a clean end), after `on_mismatch` heard of it.
    pub fn stream_verified(
        self: Arc<Self>,
        range: Range<u64>,
        on_mismatch: impl Fn(&PartMismatch) + Send + 'static,
    ) -> impl Stream<Item = io::Result<Bytes>> {
        let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(QUEUED);
        let handle = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let out = self.produce_verified(range, &handle, |b| tx.blocking_send(Ok(b)).is_ok());
            if let Err(e) = out {
                if let Some(m) = PartMismatch::of(&e) {
                    tracing::error!(part = %m.key, "{m}; the download was cut");
                    on_mismatch(m);
                }
                let _ = tx.blocking_send(Err(e));
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }

    /// Rereads and hashes the parts under `range` on a blocking thread
    /// beside the stream, until `cancel`; the first mismatch is left in
    /// `verdict`.
    fn spawn_side_check(
        &self,
        range: Range<u64>,
        handle: &tokio::runtime::Handle,
        cancel: &Arc<AtomicBool>,
        verdict: &Arc<Mutex<Option<io::Error>>>,
    ) -> tokio::task::JoinHandle<()> {
        let parts = self.parts_in(range);
        let (cancel, verdict) = (cancel.clone(), verdict.clone());
        handle.spawn_blocking(move || {
            for part in parts {
                if let Err(e) = part.verify(&cancel) {
                    *verdict.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    return;
                }
            }
        })
    }

    fn produce_verified(
        &self,
        range: Range<u64>,
        handle: &tokio::runtime::Handle,
        mut send: impl FnMut(Bytes) -> bool,
    ) -> io::Result<()> {
        // A whole part sent as is is hashed as it goes out; anything else
        // has its parts reread and hashed beside the stream.
        let inline = self
            .whole_part()
            .filter(|_| range == (0..self.len))
            .cloned();
        let cancel = Arc::new(AtomicBool::new(false));
        let verdict: Arc<Mutex<Option<io::Error>>> = Arc::new(Mutex::new(None));
        let side = match &inline {
            Some(_) => None,
            None => Some(self.spawn_side_check(range.clone(), handle, &cancel, &verdict)),
        };
        // Stops the side reader whatever way this returns.
        let _cancel = CancelOnDrop(cancel);
        let failed = |verdict: &Mutex<Option<io::Error>>| {
            verdict.lock().unwrap_or_else(|e| e.into_inner()).take()
        };
        let mut hasher = inline.as_ref().map(|_| Sha256::new());
        let mut seen = 0u64;
        let mut held: Option<Bytes> = None;
        let mut early: Option<io::Error> = None;
        let mut gone = false;
        self.produce(range, |b| {
            if let Some(h) = &mut hasher {
                h.update(&b);
                seen += b.len() as u64;
            }
            if let Some(e) = failed(&verdict) {
                early = Some(e);
                return false;
            }
            match held.replace(b) {
                Some(prev) => {
                    gone = !send(prev);
                    !gone
                }
                None => true,
            }
        })?;
        if let Some(e) = early {
            return Err(e);
        }
        if gone {
            return Ok(());
        }
        if let (Some(part), Some(h)) = (&inline, hasher) {
            part.compare(seen, h)?;
        }
        if let Some(side) = side {
            handle
                .block_on(side)
                .map_err(|e| io::Error::other(format!("verifying a part: {e}")))?;
            if let Some(e) = failed(&verdict) {
                return Err(e);
            }
        }
        if let Some(last) = held {
            send(last);
        }
        Ok(())
    }
}

/// Sets its flag when dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn open<'a>(
    files: &'a mut HashMap<String, PartReader>,
    path: &PartLoc,
) -> io::Result<&'a mut PartReader> {
    if !files.contains_key(path.key()) {
        files.insert(path.key().to_string(), path.open()?);
    }
    Ok(files.get_mut(path.key()).expect("just opened"))
}

fn read_at(
    files: &mut HashMap<String, PartReader>,
    path: &PartLoc,
    offset: u64,
    len: u64,
) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len as usize];
    open(files, path)?.read_exact_at(&mut buf, offset)?;
    Ok(buf)
}

/// A range of a stored file, mapped read-only: the socket write copies it
/// straight from the page cache, with no read into a buffer first.
struct Mapped(memmap2::Mmap);

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

fn map_at(
    files: &mut HashMap<String, PartReader>,
    path: &PartLoc,
    offset: u64,
    len: u64,
) -> io::Result<Bytes> {
    if len == 0 {
        return Ok(Bytes::new());
    }
    let reader = open(files, path)?;
    if offset + len > reader.size()? {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("{path:?} is shorter than its recipe"),
        ));
    }
    let Some(file) = reader.as_file() else {
        // An object: its bytes arrive in a buffer of their own.
        return reader.read_bytes_at(offset, len);
    };
    // SAFETY: the files a download reads are stored snapshot parts: written
    // under a temporary name, fsynced and renamed into place before they are
    // listed, and never written again (retention and delete unlink them,
    // which leaves mapped pages valid). The length was checked just above.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .offset(offset)
            .len(len as usize)
            .populate()
            .map(file)?
    };
    Ok(Bytes::from_owner(Mapped(map)))
}

fn produce_piece(
    piece: &Piece,
    local: Range<u64>,
    files: &mut HashMap<String, PartReader>,
    sink: &mut impl FnMut(Bytes) -> bool,
) -> io::Result<bool> {
    match piece {
        Piece::Bytes(b) => Ok(sink(b.slice(local.start as usize..local.end as usize))),
        Piece::File { path, offset, .. } => {
            let mut pos = local.start;
            while pos < local.end {
                let n = CHUNK.min(local.end - pos);
                if !sink(map_at(files, path, offset + pos, n)?) {
                    return Ok(false);
                }
                pos += n;
            }
            Ok(true)
        }
        Piece::Cast {
            path,
            offset,
            from,
            to,
            ..
        } => {
            let (fs, ts) = (from.size() as u64, to.size() as u64);
            let mut pos = local.start;
            while pos < local.end {
                // Whole elements covering [pos, pos + CHUNK).
                let want_end = (pos + CAST_CHUNK).min(local.end);
                let first_el = pos / ts;
                let last_el = want_end.div_ceil(ts);
                let raw = read_at(
                    files,
                    path,
                    offset + first_el * fs,
                    (last_el - first_el) * fs,
                )?;
                let converted = convert(&raw, *from, *to);
                let skip = (pos - first_el * ts) as usize;
                let take = (want_end - pos) as usize;
                if !sink(Bytes::from(converted).slice(skip..skip + take)) {
                    return Ok(false);
                }
                pos = want_end;
            }
            Ok(true)
        }
        Piece::Gather(spec) => {
            let whole = gather(spec, files)?;
            let out = Bytes::from(convert(&whole, spec.dtype, spec.to));
            Ok(sink(out.slice(local.start as usize..local.end as usize)))
        }
    }
}

/// Builds a whole tensor in memory from its chunks (any N-d tiling).
fn gather(spec: &GatherSpec, files: &mut HashMap<String, PartReader>) -> io::Result<Vec<u8>> {
    let es = spec.dtype.size();
    let global = &spec.global_shape;
    let numel: i64 = global.iter().product();
    let mut out = vec![0u8; numel as usize * es];
    let ndim = global.len();
    // Row-major strides of the whole tensor, in elements.
    let mut strides = vec![1i64; ndim];
    for d in (0..ndim.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * global[d + 1];
    }
    for chunk in &spec.chunks {
        let cnumel: i64 = chunk.shape.iter().product();
        if cnumel == 0 {
            continue;
        }
        let data = read_at(files, &chunk.path, chunk.offset, cnumel as u64 * es as u64)?;
        if ndim == 0 {
            out.copy_from_slice(&data);
            continue;
        }
        // Copy the chunk one innermost row at a time.
        let row = chunk.shape[ndim - 1] as usize;
        let rows = (cnumel as usize) / row.max(1);
        let mut index = vec![0i64; ndim - 1];
        for r in 0..rows {
            let mut dst = chunk.offsets[ndim - 1];
            for d in 0..ndim - 1 {
                dst += (chunk.offsets[d] + index[d]) * strides[d];
            }
            let src = r * row * es;
            let dst = dst as usize * es;
            out[dst..dst + row * es].copy_from_slice(&data[src..src + row * es]);
            // Next row index, last dimension fastest.
            for d in (0..ndim - 1).rev() {
                index[d] += 1;
                if index[d] < chunk.shape[d] {
                    break;
                }
                index[d] = 0;
            }
        }
    }
    Ok(out)
}

/// Converts little-endian elements between float dtypes (round to nearest
/// even, as `tensor.to(dtype)` does). Same dtype: returned as is.
pub fn convert(raw: &[u8], from: DType, to: DType) -> Vec<u8> {
    if from == to {
        return raw.to_vec();
    }
    let mut out = Vec::with_capacity(raw.len() / from.size() * to.size());
    for el in raw.chunks_exact(from.size()) {
        let v: f64 = match from {
            DType::F32 => f32::from_le_bytes(el.try_into().expect("4 bytes")) as f64,
            DType::F64 => f64::from_le_bytes(el.try_into().expect("8 bytes")),
            DType::BF16 => half::bf16::from_le_bytes(el.try_into().expect("2 bytes")).to_f64(),
            DType::F16 => half::f16::from_le_bytes(el.try_into().expect("2 bytes")).to_f64(),
            _ => unreachable!("only float dtypes are cast"),
        };
        match to {
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
            // Round once, from the f32 value when the source is f32, so the
            // result equals torch's single rounding.
            DType::BF16 => out.extend_from_slice(&to_bf16(el, from, v).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&to_f16(el, from, v).to_le_bytes()),
            _ => unreachable!("only float dtypes are cast"),
        }
    }
    out
}

fn to_bf16(el: &[u8], from: DType, v: f64) -> half::bf16 {
    match from {
        DType::F32 => half::bf16::from_f32(f32::from_le_bytes(el.try_into().expect("4 bytes"))),
        _ => half::bf16::from_f64(v),
    }
}

fn to_f16(el: &[u8], from: DType, v: f64) -> half::f16 {
    match from {
        DType::F32 => half::f16::from_f32(f32::from_le_bytes(el.try_into().expect("4 bytes"))),
        _ => half::f16::from_f64(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(vf: &VirtualFile, range: Range<u64>) -> Vec<u8> {
        let mut out = Vec::new();
        vf.produce(range, |b| {
            out.extend_from_slice(&b);
            true
        })
        .unwrap();
        out
    }

    #[test]
    fn ranges_equal_slices_of_the_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = PartLoc::file(dir.path().join("f"));
        let fpath = dir.path().join("f");
        let floats: Vec<f32> = (0..1000).map(|i| i as f32 * 0.37 - 11.0).collect();
        let raw: Vec<u8> = floats.iter().flat_map(|f| f.to_le_bytes()).collect();
        std::fs::write(&fpath, &raw).unwrap();
        let vf = VirtualFile::new(vec![
            Piece::Bytes(Bytes::from_static(b"header!")),
            Piece::File {
                path: path.clone(),
                offset: 0,
                len: 400,
            },
            Piece::File {
                path: path.clone(),
                offset: 400,
                len: 400,
            },
            Piece::Cast {
                path: path.clone(),
                offset: 800,
                count: 100,
                from: DType::F32,
                to: DType::BF16,
            },
        ]);
        assert_eq!(vf.pieces.len(), 3, "adjacent file ranges merge");
        assert_eq!(vf.len(), 7 + 800 + 200);
        let whole = collect(&vf, 0..vf.len());
        assert_eq!(&whole[..7], b"header!");
        assert_eq!(&whole[7..807], &raw[..800]);
        let bf: Vec<u8> = floats[200..300]
            .iter()
            .flat_map(|f| half::bf16::from_f32(*f).to_le_bytes())
            .collect();
        assert_eq!(&whole[807..], &bf[..]);
        for (s, e) in [
            (0, 1),
            (3, 9),
            (100, 900),
            (806, 809),
            (808, 1007),
            (1006, 1007),
        ] {
            assert_eq!(
                collect(&vf, s..e),
                whole[s as usize..e as usize],
                "{s}..{e}"
            );
        }
    }

    #[test]
    fn gather_places_column_chunks() {
        // A 3x4 tensor split into two column chunks (Shard(1)).
        let dir = tempfile::tempdir().unwrap();
        let a = PartLoc::file(dir.path().join("a"));
        let b = PartLoc::file(dir.path().join("b"));
        let whole: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let left: Vec<u8> = [0, 1, 4, 5, 8, 9]
            .iter()
            .flat_map(|&i| whole[i].to_le_bytes())
            .collect();
        let right: Vec<u8> = [2, 3, 6, 7, 10, 11]
            .iter()
            .flat_map(|&i| whole[i].to_le_bytes())
            .collect();
        std::fs::write(dir.path().join("a"), &left).unwrap();
        std::fs::write(dir.path().join("b"), &right).unwrap();
        let spec = GatherSpec {
            dtype: DType::F32,
            to: DType::F32,
            global_shape: vec![3, 4],
            chunks: vec![
                ChunkSource {
                    path: a,
                    offset: 0,
                    shape: vec![3, 2],
                    offsets: vec![0, 0],
                },
                ChunkSource {
                    path: b,
                    offset: 0,
                    shape: vec![3, 2],
                    offsets: vec![0, 2],
                },
            ],
        };
        let vf = VirtualFile::new(vec![Piece::Gather(Arc::new(spec))]);
        let got = collect(&vf, 0..vf.len());
        let want: Vec<u8> = whole.iter().flat_map(|f| f.to_le_bytes()).collect();
        assert_eq!(got, want);
        assert_eq!(collect(&vf, 10..30), want[10..30]);
    }
}
