//! A file that exists only as a recipe: a list of pieces (literal bytes,
//! byte ranges of files on disk, ranges converted to another dtype, tensors
//! gathered from chunks a block of rows at a time), each with a known
//! length. Downloads are served from it piece by piece, so the server never
//! holds a whole checkpoint, nor a whole tensor; any byte range can be
//! produced without producing what comes before it (HTTP `Range`).
//!
//! [`VirtualFile::stream_verified`] holds what it streams to the parts'
//! records: every stored byte comes through the parts' [`PartReader`]s,
//! which fetch each block once and check it before handing it on. A block
//! that does not match ends the stream with an error before any of its
//! bytes, never a clean end; nothing rereads a part beside the stream.

use std::collections::HashMap;
use std::io;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::Stream;

use super::source::{PartLoc, PartMismatch, PartReader};
use crate::wire::DType;

/// Bytes produced at a time where they are computed (casts, gathers'
/// slices): these live in the server's memory until the socket takes them.
/// (Stored bytes go out as the readers hand them on: a block at a time,
/// mapped from the page cache or as the GET brought them.)
const CAST_CHUNK: u64 = 1 << 20;
/// Chunks queued between the producing thread and the socket.
const QUEUED: usize = 8;

/// One chunk of a tensor stored in a file.
#[derive(Debug, Clone)]
pub struct ChunkSource {
    pub path: Arc<PartLoc>,
    /// Byte offset of the chunk's data in the file.
    pub offset: u64,
    pub shape: Vec<i64>,
    pub offsets: Vec<i64>,
}

/// A whole tensor built from chunks that are not row blocks, produced a
/// window of rows at a time (see `produce_gather`).
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

    /// The same recipe over renewed parts ([`PartLoc::renewed`]; one per
    /// part, shared by its pieces): each request to a kept recipe reads
    /// and checks its own blocks.
    pub fn renewed(&self) -> VirtualFile {
        let mut fresh: HashMap<String, Arc<PartLoc>> = HashMap::new();
        let mut renew = |p: &Arc<PartLoc>| {
            fresh
                .entry(p.key().to_string())
                .or_insert_with(|| Arc::new(p.renewed()))
                .clone()
        };
        let pieces = self
            .pieces
            .iter()
            .map(|piece| {
                let mut piece = piece.clone();
                match &mut piece {
                    Piece::Bytes(_) => {}
                    Piece::File { path, .. } | Piece::Cast { path, .. } => *path = renew(path),
                    Piece::Gather(g) => {
                        let mut spec = (**g).clone();
                        for c in &mut spec.chunks {
                            c.path = renew(&c.path);
                        }
                        *g = Arc::new(spec);
                    }
                }
                piece
            })
            .collect();
        VirtualFile {
            pieces,
            starts: self.starts.clone(),
            len: self.len,
        }
    }

    /// Reads and checks the first block of every part the file reads, so
    /// that a part whose first block does not match refuses the response
    /// before its first byte (as when the recipe was just built from the
    /// parts' tables); the readers hand the blocks on to the stream.
    pub fn check_first_blocks(&self) -> io::Result<()> {
        for part in self.parts_in(0..self.len) {
            let reader = part.open()?;
            reader.read_bytes_ahead(0, 1, 0)?;
        }
        Ok(())
    }

    /// Produces the bytes of `range` in order, a block (or a computed
    /// chunk) at a time, every stored byte checked against its part's
    /// record; stops early when `sink` returns false.
    pub fn produce(&self, range: Range<u64>, sink: impl FnMut(Bytes) -> bool) -> io::Result<()> {
        self.produce_as(range, true, sink)
    }

    /// [`VirtualFile::produce`] with the stored bytes checked or not.
    fn produce_as(
        &self,
        range: Range<u64>,
        checked: bool,
        mut sink: impl FnMut(Bytes) -> bool,
    ) -> io::Result<()> {
        let mut files = Readers {
            open: HashMap::new(),
            checked,
        };
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

    /// Streams `range` from a blocking thread, with back-pressure, with
    /// nothing checked (what the checks cost is measured against this).
    pub fn stream(self: Arc<Self>, range: Range<u64>) -> impl Stream<Item = io::Result<Bytes>> {
        let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(QUEUED);
        tokio::task::spawn_blocking(move || {
            let result = self.produce_as(range, false, |b| tx.blocking_send(Ok(b)).is_ok());
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

    /// Checks the recorded size of every part `range` reads (before the
    /// first byte is sent).
    pub fn check_sizes(&self, range: Range<u64>) -> io::Result<()> {
        for part in self.parts_in(range) {
            part.check_size()?;
        }
        Ok(())
    }

    /// Streams `range` as [`VirtualFile::stream`] does, every stored byte
    /// checked before it is sent: a block that does not match ends the
    /// stream with an error before any byte of it (the client sees a cut
    /// body, never a clean end), after `on_mismatch` heard of it.
    pub fn stream_verified(
        self: Arc<Self>,
        range: Range<u64>,
        on_mismatch: impl Fn(&PartMismatch) + Send + 'static,
    ) -> impl Stream<Item = io::Result<Bytes>> {
        self.stream_verified_tapped(range, on_mismatch, |_| {})
    }

    /// [`VirtualFile::stream_verified`], each checked piece shown to `tap`
    /// (in order, on the producing thread) before it is sent.
    pub fn stream_verified_tapped(
        self: Arc<Self>,
        range: Range<u64>,
        on_mismatch: impl Fn(&PartMismatch) + Send + 'static,
        mut tap: impl FnMut(&[u8]) + Send + 'static,
    ) -> impl Stream<Item = io::Result<Bytes>> {
        let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(QUEUED);
        tokio::task::spawn_blocking(move || {
            let out = self.produce_as(range, true, |b| {
                tap(&b);
                tx.blocking_send(Ok(b)).is_ok()
            });
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
}

/// The readers a production has open, one per part.
struct Readers {
    open: HashMap<String, PartReader>,
    checked: bool,
}

impl Readers {
    fn get(&mut self, path: &PartLoc) -> io::Result<&PartReader> {
        if !self.open.contains_key(path.key()) {
            let reader = if self.checked {
                path.open()?
            } else {
                path.open_unchecked()?
            };
            self.open.insert(path.key().to_string(), reader);
        }
        Ok(self.open.get(path.key()).expect("just opened"))
    }
}

fn produce_piece(
    piece: &Piece,
    local: Range<u64>,
    files: &mut Readers,
    sink: &mut impl FnMut(Bytes) -> bool,
) -> io::Result<bool> {
    match piece {
        Piece::Bytes(b) => Ok(sink(b.slice(local.start as usize..local.end as usize))),
        Piece::File { path, offset, .. } => {
            let reader = files.get(path)?;
            let (mut pos, end) = (offset + local.start, offset + local.end);
            while pos < end {
                let b = reader.slice(pos, end, end)?;
                if b.is_empty() {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("{path:?} is shorter than its recipe"),
                    ));
                }
                pos += b.len() as u64;
                if !sink(b) {
                    return Ok(false);
                }
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
            // Where this piece's reads end in the part.
            let ahead = offset + local.end.div_ceil(ts) * fs;
            let reader = files.get(path)?;
            let mut pos = local.start;
            while pos < local.end {
                // Whole elements covering [pos, pos + CAST_CHUNK).
                let want_end = (pos + CAST_CHUNK).min(local.end);
                let first_el = pos / ts;
                let last_el = want_end.div_ceil(ts);
                let raw = reader.read_bytes_ahead(
                    offset + first_el * fs,
                    (last_el - first_el) * fs,
                    ahead,
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
        Piece::Gather(spec) => produce_gather(spec, local, files, CAST_CHUNK, sink),
    }
}

/// Where a chunk's innermost rows (its last dimension) land in the whole
/// tensor, row-major; a scalar is one row of one element.
struct ChunkRows<'a> {
    source: &'a ChunkSource,
    /// Elements per innermost row.
    row: u64,
    rows: u64,
    /// The chunk's shape and offsets, and the whole tensor's strides (in
    /// elements), without the last dimension.
    shape: &'a [i64],
    offsets: &'a [i64],
    strides: &'a [i64],
    /// Offset of the chunk in the last dimension.
    column: u64,
}

impl ChunkRows<'_> {
    /// The element of the whole tensor where row `r` of the chunk starts.
    fn start(&self, mut r: u64) -> u64 {
        let mut at = self.column;
        for d in (0..self.shape.len()).rev() {
            let n = self.shape[d] as u64;
            at += (self.offsets[d] as u64 + r % n) * self.strides[d] as u64;
            r /= n;
        }
        at
    }

    /// The rows that hold elements of `[from, to)` of the whole tensor
    /// (they increase with the row), and the elements of the chunk, in its
    /// stored order, from the first of them to the last: one contiguous
    /// range of the stored chunk.
    fn span(&self, from: u64, to: u64) -> Option<(Range<u64>, Range<u64>)> {
        let first = partition(self.rows, |r| self.start(r) + self.row <= from);
        let end = partition(self.rows, |r| self.start(r) < to);
        if first >= end {
            return None;
        }
        let a = first * self.row + from.saturating_sub(self.start(first));
        let last = end - 1;
        let b = last * self.row + (to - self.start(last)).min(self.row);
        Some((first..end, a..b))
    }
}

/// The first `r` in `0..n` for which `below(r)` is false (`below` holds on a
/// prefix).
fn partition(n: u64, below: impl Fn(u64) -> bool) -> u64 {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if below(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Bytes `local` of a tensor whose chunks are not row blocks (any N-d
/// tiling), a window of about `window` bytes of whole-tensor elements at a
/// time: for each window, each chunk's rows under it (one contiguous read
/// of the stored chunk, through its part's reader) are placed where they
/// belong, then the window is cast and handed on. Nothing holds more than
/// a window (and the reader's blocks), however large the tensor.
fn produce_gather(
    spec: &GatherSpec,
    local: Range<u64>,
    files: &mut Readers,
    window: u64,
    sink: &mut impl FnMut(Bytes) -> bool,
) -> io::Result<bool> {
    let (es, ts) = (spec.dtype.size() as u64, spec.to.size() as u64);
    let ndim = spec.global_shape.len();
    // Row-major strides of the whole tensor, in elements.
    let mut strides = vec![1i64; ndim];
    for d in (0..ndim.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * spec.global_shape[d + 1];
    }
    let outer = ndim.saturating_sub(1);
    let chunks: Vec<ChunkRows> = spec
        .chunks
        .iter()
        .filter(|c| c.shape.iter().all(|&n| n > 0))
        .map(|c| {
            let row = c.shape.last().copied().unwrap_or(1) as u64;
            let numel = c.shape.iter().product::<i64>() as u64;
            ChunkRows {
                source: c,
                row,
                rows: numel / row,
                shape: &c.shape[..outer],
                offsets: &c.offsets[..outer],
                strides: &strides[..outer],
                column: c.offsets.last().copied().unwrap_or(0) as u64,
            }
        })
        .collect();
    let (first_el, end_el) = (local.start / ts, local.end.div_ceil(ts));
    // Where each chunk's reads for the whole range end in its part.
    let ahead: Vec<u64> = chunks
        .iter()
        .map(|c| {
            let end = c.span(first_el, end_el).map_or(0, |(_, s)| s.end);
            c.source.offset + end * es
        })
        .collect();
    let step = (window / es.max(ts)).max(1);
    let mut from = first_el;
    while from < end_el {
        let to = (from + step).min(end_el);
        let mut buf = vec![0u8; ((to - from) * es) as usize];
        for (c, &ahead) in chunks.iter().zip(&ahead) {
            let Some((rows, stored)) = c.span(from, to) else {
                continue;
            };
            let data = files.get(&c.source.path)?.read_bytes_ahead(
                c.source.offset + stored.start * es,
                (stored.end - stored.start) * es,
                ahead,
            )?;
            for r in rows {
                // This row's elements under the window, in the whole
                // tensor and in the bytes just read.
                let (start, end) = (c.start(r), c.start(r) + c.row);
                let (lo, hi) = (start.max(from), end.min(to));
                let src = (r * c.row + (lo - start) - stored.start) * es;
                let dst = (lo - from) * es;
                let n = (hi - lo) * es;
                buf[dst as usize..(dst + n) as usize]
                    .copy_from_slice(&data[src as usize..(src + n) as usize]);
            }
        }
        let out = if spec.dtype == spec.to {
            Bytes::from(buf)
        } else {
            Bytes::from(convert(&buf, spec.dtype, spec.to))
        };
        // The window in output bytes is [from * ts, to * ts).
        let skip = local.start.saturating_sub(from * ts);
        let take = local.end.min(to * ts) - from * ts;
        if !sink(out.slice(skip as usize..take as usize)) {
            return Ok(false);
        }
        from = to;
    }
    Ok(true)
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
    use sha2::Digest;

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

    /// The whole tensor built in memory from its chunks, as gathers were
    /// produced before they streamed (the reference they must equal).
    fn gather_whole(spec: &GatherSpec) -> Vec<u8> {
        let es = spec.dtype.size();
        let global = &spec.global_shape;
        let numel: i64 = global.iter().product();
        let mut out = vec![0u8; numel as usize * es];
        let ndim = global.len();
        let mut strides = vec![1i64; ndim];
        for d in (0..ndim.saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * global[d + 1];
        }
        for chunk in &spec.chunks {
            let cnumel: i64 = chunk.shape.iter().product();
            if cnumel == 0 {
                continue;
            }
            let data = chunk
                .path
                .open()
                .unwrap()
                .read_bytes_at(chunk.offset, cnumel as u64 * es as u64)
                .unwrap();
            if ndim == 0 {
                out.copy_from_slice(&data);
                continue;
            }
            let row = chunk.shape[ndim - 1] as usize;
            let rows = (cnumel as usize) / row.max(1);
            let mut index = vec![0i64; ndim - 1];
            for r in 0..rows {
                let mut dst = chunk.offsets[ndim - 1];
                for d in 0..ndim - 1 {
                    dst += (chunk.offsets[d] + index[d]) * strides[d];
                }
                let (src, dst) = (r * row * es, dst as usize * es);
                out[dst..dst + row * es].copy_from_slice(&data[src..src + row * es]);
                for d in (0..ndim - 1).rev() {
                    index[d] += 1;
                    if index[d] < chunk.shape[d] {
                        break;
                    }
                    index[d] = 0;
                }
            }
        }
        convert(&out, spec.dtype, spec.to)
    }

    /// `global` (f32) cut into the boxes `tiles` (offsets, shape), stored
    /// in `files` part files after a 24-byte header, boxes dealt to the
    /// files in turn.
    fn tiled(
        dir: &std::path::Path,
        store: Option<&crate::objstore::ObjectStore>,
        global: &[i64],
        tiles: &[(Vec<i64>, Vec<i64>)],
        files: usize,
        to: DType,
    ) -> (GatherSpec, Vec<f32>) {
        let numel: i64 = global.iter().product();
        let whole: Vec<f32> = (0..numel).map(|i| (i as f32 * 0.731).sin() * 3.0).collect();
        let mut strides = vec![1i64; global.len()];
        for d in (0..global.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * global[d + 1];
        }
        let mut bytes: Vec<Vec<u8>> = vec![vec![7u8; 24]; files];
        let mut chunks = Vec::new();
        for (k, (offsets, shape)) in tiles.iter().enumerate() {
            let f = k % files;
            let offset = bytes[f].len() as u64;
            // The box's elements in row-major order of the box.
            let n: i64 = shape.iter().product();
            for mut i in 0..n {
                let mut at = 0;
                for d in (0..shape.len()).rev() {
                    at += (offsets[d] + i % shape[d]) * strides[d];
                    i /= shape[d];
                }
                bytes[f].extend_from_slice(&whole[at as usize].to_le_bytes());
            }
            chunks.push((f, offset, shape.clone(), offsets.clone()));
        }
        let mut locs = Vec::new();
        for (f, b) in bytes.iter().enumerate() {
            let name = format!("part{f}");
            std::fs::write(dir.join(&name), b).unwrap();
            locs.push(match store {
                Some(store) => {
                    let sha = hex::encode(sha2::Sha256::digest(b));
                    let sums = crate::objstore::BlockSums::of(b, crate::objstore::BLOCK_BYTES);
                    PartLoc::recorded_with(store, &name, b.len() as u64, &sha, Some(sums))
                }
                None => PartLoc::file(dir.join(&name)),
            });
        }
        let spec = GatherSpec {
            dtype: DType::F32,
            to,
            global_shape: global.to_vec(),
            chunks: chunks
                .into_iter()
                .map(|(f, offset, shape, offsets)| ChunkSource {
                    path: locs[f].clone(),
                    offset,
                    shape,
                    offsets,
                })
                .collect(),
        };
        (spec, whole)
    }

    /// Bytes `range` of a gathered piece, produced `window` bytes of
    /// elements at a time.
    fn gathered(spec: &GatherSpec, range: Range<u64>, window: u64) -> Vec<u8> {
        let mut files = Readers {
            open: HashMap::new(),
            checked: true,
        };
        let mut out = Vec::new();
        let done = produce_gather(spec, range, &mut files, window, &mut |b: Bytes| {
            assert!(b.len() as u64 <= window.max(8), "{} bytes at once", b.len());
            out.extend_from_slice(&b);
            true
        })
        .unwrap();
        assert!(done);
        out
    }

    #[test]
    fn a_gathered_range_equals_the_whole_tensors_bytes() {
        // A 5 x 6 x 7 tensor tiled unevenly along dims 1 and 2 (and one
        // empty chunk), two chunks per part file.
        let dir = tempfile::tempdir().unwrap();
        let tiles = vec![
            (vec![0, 0, 0], vec![5, 4, 3]),
            (vec![0, 0, 3], vec![5, 4, 4]),
            (vec![0, 4, 0], vec![5, 2, 7]),
            (vec![0, 6, 0], vec![5, 0, 7]),
        ];
        for to in [DType::F32, DType::BF16, DType::F64] {
            let (spec, _) = tiled(dir.path(), None, &[5, 6, 7], &tiles, 2, to);
            let whole = gather_whole(&spec);
            let len = whole.len() as u64;
            assert_eq!(len, 5 * 6 * 7 * to.size() as u64);
            for window in [1, 12, 40, 100, 1 << 20] {
                for (s, e) in [
                    (0, len),
                    (1, len),
                    (len / 2 + 1, len),
                    (33, 91),
                    (len - 3, len),
                ] {
                    assert_eq!(
                        gathered(&spec, s..e, window),
                        whole[s as usize..e as usize],
                        "{to:?} window {window}: {s}..{e}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_large_column_gather_streams_the_same_bytes_from_mid_tensor() {
        // 300 x 2048 f32 (2.3 MiB) in two column chunks, in recorded parts
        // of a store (read through the checked block reader), more than
        // one window long; ranges that start mid-tensor and mid-element.
        let dir = tempfile::tempdir().unwrap();
        let store =
            crate::objstore::ObjectStore::open(&format!("file://{}", dir.path().display()), None)
                .unwrap();
        let tiles = vec![
            (vec![0, 0], vec![300, 1024]),
            (vec![0, 1024], vec![300, 1024]),
        ];
        for to in [DType::F32, DType::BF16] {
            let (spec, values) = tiled(dir.path(), Some(&store), &[300, 2048], &tiles, 2, to);
            let whole = gather_whole(&spec);
            if to == DType::F32 {
                let want: Vec<u8> = values.iter().flat_map(|f| f.to_le_bytes()).collect();
                assert_eq!(whole, want, "the reference is the tensor");
            }
            let spec = Arc::new(spec);
            let vf = VirtualFile::new(vec![
                Piece::Bytes(Bytes::from_static(b"head")),
                Piece::Gather(spec.clone()),
            ]);
            let len = whole.len() as u64;
            assert_eq!(vf.len(), 4 + len);
            for (s, e) in [
                (0, len),
                (1_000_003, len),
                (len / 2 + 1, len / 2 + 5000),
                (CAST_CHUNK - 1, CAST_CHUNK + 3),
                (len - 1, len),
            ] {
                assert_eq!(
                    collect(&vf, 4 + s..4 + e),
                    whole[s as usize..e as usize],
                    "{to:?}: {s}..{e}"
                );
            }
            // At most a window at a time, however large the tensor.
            let mut most = 0;
            vf.produce(4 + 17..vf.len(), |b| {
                most = most.max(b.len());
                true
            })
            .unwrap();
            assert!(most as u64 <= CAST_CHUNK, "{most}");
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
