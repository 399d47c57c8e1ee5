//! Weighted sums of stored parts, streamed: the engine of post-hoc EMA
//! (sources = power-profile parts) and of checkpoint merging (sources =
//! mirror parts).
//!
//! For one rank, every output is `sum_i w_i * source_i` over the averaged
//! tensors of the rank's layout, stored as a profile part (copied tensors
//! taken from one chosen source). All outputs are written in one pass over
//! the sources: the averaged range is cut into chunks of [`CHUNK`]
//! elements; each chunk of each source is read once (positioned reads, no
//! mapping), widened to float64 and added into every output's float64
//! accumulator, and each output's chunk is rounded to its dtype and
//! appended to its file. Memory is `outputs x CHUNK x 8` bytes plus one
//! chunk of input, whatever the size of the rank (EDM2's
//! `reconstruct_phema` batches its outputs the same way, but holds whole
//! networks).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::files::{PartWriter, WrittenFile};
use super::format::{self, BlockFill, StoredRange};
use super::source::{PartLoc, PartReader};
use crate::wire::layout::RankLayout;
use crate::wire::DType;

/// Elements per chunk: 1 MiB of float64 accumulator per output.
pub const CHUNK: usize = 1 << 17;

#[derive(Debug, thiserror::Error)]
pub enum CombineError {
    #[error("a source part is unreadable: {0}")]
    Format(#[from] format::FormatError),
    #[error("snapshot files: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Mismatch(String),
}

/// One output part of one rank.
pub struct OutputSpec {
    /// Where it goes, relative to the data dir.
    pub rel: PathBuf,
    /// The weight of each source, in source order.
    pub weights: Vec<f64>,
    /// Its `__metadata__`.
    pub meta: BTreeMap<String, String>,
}

struct Source {
    file: PartReader,
    table: HashMap<String, StoredRange>,
}

/// A run of averaged elements that is one contiguous byte range in every
/// source: read with one positioned read per source and chunk.
#[derive(Debug, PartialEq)]
struct Segment {
    numel: usize,
    /// Per source: dtype and absolute byte offset.
    at: Vec<(DType, u64)>,
}

/// Writes one profile part per output for this rank; `sources` are the
/// rank's part files, `base` the index of the one whose copied tensors
/// the outputs carry, `out_dtype` the dtype of their averaged tensors
/// (float32 or float64), `round_to` a dtype every source value is rounded
/// to before it is weighted (F16 or BF16: sources read as checkpoints
/// stored in that dtype, as ema-pytorch's `PostHocEMA` stores them).
/// `progress` hears of every source byte read.
#[allow(clippy::too_many_arguments)]
pub fn combine_rank(
    data_dir: &Path,
    layout: &RankLayout,
    sources: &[Arc<PartLoc>],
    base: usize,
    out_dtype: DType,
    round_to: Option<DType>,
    outputs: Vec<OutputSpec>,
    progress: &mut dyn FnMut(u64),
) -> Result<Vec<WrittenFile>, CombineError> {
    if !matches!(out_dtype, DType::F32 | DType::F64) {
        return Err(CombineError::Mismatch(format!(
            "combined tensors are stored as F32 or F64, not {out_dtype}"
        )));
    }
    let mut opened = Vec::with_capacity(sources.len());
    for path in sources {
        let mut file = path.open()?;
        let table = format::read_tensor_table(&mut file)?;
        opened.push(Source { file, table });
    }
    if outputs.iter().any(|o| o.weights.len() != opened.len()) {
        return Err(CombineError::Mismatch(
            "one weight per source is needed".into(),
        ));
    }
    let segments = averaged_segments(layout, &opened)?;
    // Progress counts every byte of every source file: what is not read
    // (headers, the other sources' copied tensors) counts as done now, so
    // the total is the sum of the file sizes.
    for (s, src) in opened.iter_mut().enumerate() {
        let averaged: u64 = segments
            .iter()
            .map(|seg| (seg.numel * seg.at[s].0.size()) as u64)
            .sum();
        progress(src.file.size()?.saturating_sub(averaged));
    }
    let mut writers = Vec::with_capacity(outputs.len());
    let mut fills = Vec::new();
    for o in &outputs {
        let (header, order) = format::profile_header(layout, out_dtype, o.meta.clone());
        // Chunks arrive 0.5-1 MiB at a time: a small buffer per output.
        let mut w = PartWriter::with_buffer(data_dir, &o.rel, 256 << 10)?;
        w.write_all(header.bytes())?;
        writers.push(w);
        fills = order;
    }
    let weights: Vec<&[f64]> = outputs.iter().map(|o| o.weights.as_slice()).collect();
    let mut sums = WeightedSums::new(&weights, out_dtype, layout.ema_numel);
    sums.round_to = round_to;
    for fill in fills {
        match fill {
            BlockFill::Averaged => {
                for seg in &segments {
                    sums.write_segment(seg, &opened, &mut writers, progress)?;
                }
            }
            BlockFill::Copied(group) => {
                copy_group(layout, group, &opened[base], &mut writers)?;
            }
        }
    }
    let mut written = Vec::with_capacity(writers.len());
    for w in writers {
        written.push(w.finish()?);
    }
    Ok(written)
}

/// The float64 accumulators of every output and the buffers a chunk goes
/// through, reused for every chunk.
struct WeightedSums<'a> {
    /// Per output: the weight of each source.
    weights: &'a [&'a [f64]],
    out_dtype: DType,
    round_to: Option<DType>,
    acc: Vec<Vec<f64>>,
    widened: Vec<f64>,
    bytes: Vec<u8>,
}

impl<'a> WeightedSums<'a> {
    fn new(weights: &'a [&'a [f64]], out_dtype: DType, numel: i64) -> Self {
        let chunk = CHUNK.min(numel.max(0) as usize);
        WeightedSums {
            weights,
            out_dtype,
            round_to: None,
            acc: vec![vec![0f64; chunk]; weights.len()],
            widened: Vec::new(),
            bytes: Vec::new(),
        }
    }

    /// Every output's weighted sum of one segment, chunk by chunk: each
    /// source chunk is read once and added into every accumulator.
    fn write_segment(
        &mut self,
        seg: &Segment,
        sources: &[Source],
        writers: &mut [PartWriter],
        progress: &mut dyn FnMut(u64),
    ) -> Result<(), CombineError> {
        let mut done = 0usize;
        while done < seg.numel {
            let n = CHUNK.min(seg.numel - done);
            for a in self.acc.iter_mut() {
                a[..n].fill(0.0);
            }
            for (s, src) in sources.iter().enumerate() {
                let (dtype, offset) = seg.at[s];
                let size = dtype.size();
                self.bytes.resize(n * size, 0);
                src.file
                    .read_exact_at(&mut self.bytes, offset + (done * size) as u64)?;
                progress(self.bytes.len() as u64);
                widen(dtype, &self.bytes, &mut self.widened);
                if let Some(to) = self.round_to {
                    round_through(to, &mut self.widened);
                }
                for (a, w) in self.acc.iter_mut().zip(self.weights) {
                    let w = w[s];
                    for (x, v) in a[..n].iter_mut().zip(&self.widened) {
                        *x += w * v;
                    }
                }
            }
            for (a, w) in self.acc.iter().zip(writers.iter_mut()) {
                narrow(self.out_dtype, &a[..n], &mut self.bytes);
                w.write_all(&self.bytes)?;
            }
            done += n;
        }
        Ok(())
    }
}

/// Copies the members of a copied group from `base` into every output.
fn copy_group(
    layout: &RankLayout,
    group: usize,
    base: &Source,
    writers: &mut [PartWriter],
) -> Result<(), CombineError> {
    let want = layout.copied_groups[group].dtype;
    let mut bytes = Vec::new();
    for i in format::copied_members(layout, group) {
        let t = &layout.tensors[i];
        let range = base.table.get(&t.name).ok_or_else(|| {
            CombineError::Mismatch(format!("`{}` is missing from a source", t.name))
        })?;
        if range.dtype != want || range.numel != t.numel {
            return Err(CombineError::Mismatch(format!(
                "`{}` is stored as {} x {}, the layout says {want} x {}",
                t.name, range.dtype, range.numel, t.numel
            )));
        }
        let total = t.numel as u64 * want.size() as u64;
        let mut at = 0u64;
        while at < total {
            let n = (total - at).min((CHUNK * 8) as u64) as usize;
            bytes.resize(n, 0);
            base.file.read_exact_at(&mut bytes, range.offset + at)?;
            for w in writers.iter_mut() {
                w.write_all(&bytes)?;
            }
            at += n as u64;
        }
    }
    Ok(())
}

/// The averaged tensors of `layout`, located in every source by name and
/// merged into runs that are contiguous in all of them.
fn averaged_segments(
    layout: &RankLayout,
    sources: &[Source],
) -> Result<Vec<Segment>, CombineError> {
    let mut segments: Vec<Segment> = Vec::new();
    for i in format::averaged_members(layout) {
        let t = &layout.tensors[i];
        let mut at = Vec::with_capacity(sources.len());
        for src in sources {
            let range = src.table.get(&t.name).ok_or_else(|| {
                CombineError::Mismatch(format!("`{}` is missing from a source", t.name))
            })?;
            if !range.dtype.is_float() || range.numel != t.numel {
                return Err(CombineError::Mismatch(format!(
                    "`{}` is stored as {} x {}, the layout says a float x {}",
                    t.name, range.dtype, range.numel, t.numel
                )));
            }
            at.push((range.dtype, range.offset));
        }
        let numel = t.numel as usize;
        if numel == 0 {
            continue;
        }
        if let Some(last) = segments.last_mut() {
            let follows = last.at.iter().zip(&at).all(|(&(d0, o0), &(d1, o1))| {
                d0 == d1 && o0 + (last.numel * d0.size()) as u64 == o1
            });
            if follows {
                last.numel += numel;
                continue;
            }
        }
        segments.push(Segment { numel, at });
    }
    Ok(segments)
}

/// Little-endian `dtype` elements as float64.
fn widen(dtype: DType, bytes: &[u8], out: &mut Vec<f64>) {
    out.clear();
    match dtype {
        DType::F64 => out.extend(
            bytes
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes"))),
        ),
        DType::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")) as f64),
        ),
        DType::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64()),
        ),
        DType::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64()),
        ),
        // Segments hold float tensors only (checked when they are built).
        _ => unreachable!("averaged tensors are floating point"),
    }
}

/// Rounds every value to `dtype` (F16 or BF16, nearest even, as torch's
/// `.to(dtype)`), kept as float64; other dtypes leave the values as they are.
fn round_through(dtype: DType, values: &mut [f64]) {
    match dtype {
        DType::F16 => values
            .iter_mut()
            .for_each(|v| *v = half::f16::from_f64(*v).to_f64()),
        DType::BF16 => values
            .iter_mut()
            .for_each(|v| *v = half::bf16::from_f64(*v).to_f64()),
        _ => {}
    }
}

/// float64 values rounded to `dtype` (F32 or F64), little-endian.
fn narrow(dtype: DType, values: &[f64], out: &mut Vec<u8>) {
    out.clear();
    match dtype {
        DType::F64 => {
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        _ => {
            for v in values {
                out.extend_from_slice(&(*v as f32).to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{HeaderEntry, SafetensorsHeader};

    /// A stored file of f32 tensors `(name, values)` in the given order.
    fn stored(dir: &Path, name: &str, tensors: &[(&str, Vec<f32>)]) -> PathBuf {
        let entries = tensors
            .iter()
            .map(|(n, v)| HeaderEntry {
                name: n.to_string(),
                dtype: DType::F32,
                shape: vec![v.len() as i64],
                nbytes: v.len() * 4,
            })
            .collect();
        let mut bytes = SafetensorsHeader::new(entries, BTreeMap::new()).into_bytes();
        for (_, v) in tensors {
            for x in v {
                bytes.extend_from_slice(&x.to_le_bytes());
            }
        }
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn f32_layout(tensors: &[(&str, i64)]) -> RankLayout {
        use crate::wire::layout::{LayoutTensor, Slot};
        let mut offset = 0;
        let tensors = tensors
            .iter()
            .map(|&(name, numel)| {
                let t = LayoutTensor {
                    name: name.to_string(),
                    dtype: DType::F32,
                    shape: vec![numel],
                    numel,
                    chunk: None,
                    slot: Slot::Averaged { offset },
                    mirror: (0, 0),
                };
                offset += numel;
                t
            })
            .collect();
        let mut layout = RankLayout {
            tensors,
            index: HashMap::new(),
            ema_numel: offset,
            copied_groups: Vec::new(),
            mirror_groups: Vec::new(),
            aliases: Default::default(),
        };
        layout.rebuild_index();
        layout
    }

    #[test]
    fn weighted_sums_over_chunks_and_split_tensors() {
        let dir = tempfile::tempdir().unwrap();
        // Two tensors, one longer than a chunk; stored in a different order
        // in the second source, so the segments cannot merge there.
        let n = CHUNK + 5;
        let a0: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let b0 = vec![1.5f32, -2.0, 3.25];
        let a1: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        let b1 = vec![0.5f32, 4.0, -1.0];
        let s0 = stored(dir.path(), "s0", &[("a", a0.clone()), ("b", b0.clone())]);
        let s1 = stored(dir.path(), "s1", &[("b", b1.clone()), ("a", a1.clone())]);
        let layout = f32_layout(&[("a", n as i64), ("b", 3)]);
        let outputs = vec![
            OutputSpec {
                rel: "o/x.safetensors".into(),
                weights: vec![0.25, 0.75],
                meta: BTreeMap::new(),
            },
            OutputSpec {
                rel: "o/y.safetensors".into(),
                weights: vec![2.0, -1.0],
                meta: BTreeMap::new(),
            },
        ];
        let mut read = 0u64;
        let written = combine_rank(
            dir.path(),
            &layout,
            &[PartLoc::file(s0.clone()), PartLoc::file(s1.clone())],
            0,
            DType::F32,
            None,
            outputs,
            &mut |b| read += b,
        )
        .unwrap();
        let files: u64 = [&s0, &s1]
            .iter()
            .map(|p| std::fs::metadata(p).unwrap().len())
            .sum();
        assert_eq!(read, files);
        let want = |w0: f64, w1: f64| -> (Vec<f32>, Vec<f32>) {
            let a = a0
                .iter()
                .zip(&a1)
                .map(|(x, y)| (w0 * *x as f64 + w1 * *y as f64) as f32)
                .collect();
            let b = b0
                .iter()
                .zip(&b1)
                .map(|(x, y)| (w0 * *x as f64 + w1 * *y as f64) as f32)
                .collect();
            (a, b)
        };
        for (file, (w0, w1)) in written.iter().zip([(0.25, 0.75), (2.0, -1.0)]) {
            let bytes = std::fs::read(dir.path().join(&file.path)).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let get = |name: &str| -> Vec<f32> {
                st.tensor(name)
                    .unwrap()
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect()
            };
            let (a, b) = want(w0, w1);
            assert_eq!(get("a"), a);
            assert_eq!(get("b"), b);
            assert_eq!(
                file.sha256,
                super::super::files::sha256_file(&dir.path().join(&file.path)).unwrap()
            );
        }
    }

    #[test]
    fn sources_rounded_to_half_before_weighting() {
        let dir = tempfile::tempdir().unwrap();
        // 1 + 2^-12 is between two float16 values (1 and 1 + 2^-10) and
        // rounds to 1; 0.1 rounds to 0.0999755859375.
        let v = vec![1.0f32 + 2f32.powi(-12), 0.1, 65504.0, -3.0];
        let s0 = stored(dir.path(), "s0", &[("a", v.clone())]);
        let layout = f32_layout(&[("a", 4)]);
        for (round_to, want) in [
            (Some(DType::F16), vec![1.0f32, 0.099_975_586, 65504.0, -3.0]),
            (
                Some(DType::BF16),
                vec![1.0f32, 0.100_097_656, 65536.0, -3.0],
            ),
            (None, v.clone()),
        ] {
            let outputs = vec![OutputSpec {
                rel: "o/r.safetensors".into(),
                weights: vec![1.0],
                meta: BTreeMap::new(),
            }];
            let written = combine_rank(
                dir.path(),
                &layout,
                &[PartLoc::file(s0.clone())],
                0,
                DType::F32,
                round_to,
                outputs,
                &mut |_| {},
            )
            .unwrap();
            let bytes = std::fs::read(dir.path().join(&written[0].path)).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let got: Vec<f32> = st
                .tensor("a")
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(got, want, "{round_to:?}");
        }
    }
}
