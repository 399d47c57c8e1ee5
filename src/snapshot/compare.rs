//! Per-tensor statistics between two EMA states of one run (two snapshots,
//! a snapshot and the live EMA, two profiles), over whole tensors.
//!
//! Rank chunks are combined exactly: sums of squares, dot products and
//! maxima are accumulated per chunk (in f64) and the norms taken at the end,
//! never averaged from per-chunk norms. Replicated tensors (whole on every
//! rank, or the same chunk on replicas) count once. One rank is read at a
//! time.

use std::collections::{BTreeMap, HashMap, HashSet};

use bytes::Bytes;
use serde::Serialize;
use utoipa::ToSchema;

use crate::wire::layout::RankLayout;
use crate::wire::DType;

/// One rank's tensors: name -> (dtype, little-endian bytes).
pub type RankTensors = HashMap<String, (DType, Bytes)>;

/// Statistics of one whole tensor.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TensorStats {
    pub name: String,
    pub shape: Vec<i64>,
    pub norm_a: f64,
    pub norm_b: f64,
    pub norm_diff: f64,
    /// `norm_diff / norm_a` (`norm_diff` itself when `norm_a` is 0).
    pub rel_diff: f64,
    /// `<a, b> / (norm_a norm_b)`; `null` when either norm is 0.
    pub cosine: Option<f64>,
    pub max_abs_diff: f64,
}

/// All tensors together, plus the tensor that moved most.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompareSummary {
    pub tensors: usize,
    pub numel: u64,
    pub norm_a: f64,
    pub norm_b: f64,
    pub norm_diff: f64,
    pub rel_diff: f64,
    pub cosine: Option<f64>,
    pub max_abs_diff: f64,
    pub max_rel_diff_tensor: Option<String>,
    /// Names present on one side only (not compared).
    pub only_in_a: Vec<String>,
    pub only_in_b: Vec<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompareResult {
    pub tensors: Vec<TensorStats>,
    pub summary: CompareSummary,
}

#[derive(Default, Clone, Copy)]
struct Acc {
    aa: f64,
    bb: f64,
    dd: f64,
    ab: f64,
    max_abs: f64,
    numel: u64,
}

fn values(dtype: DType, bytes: &[u8]) -> Box<dyn Iterator<Item = f64> + '_> {
    match dtype {
        DType::F32 => Box::new(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4")) as f64),
        ),
        DType::F64 => Box::new(
            bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8"))),
        ),
        DType::BF16 => Box::new(
            bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes(c.try_into().expect("2")).to_f64()),
        ),
        DType::F16 => Box::new(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes(c.try_into().expect("2")).to_f64()),
        ),
        DType::I64 => Box::new(
            bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as f64),
        ),
        DType::I32 => Box::new(
            bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().expect("4")) as f64),
        ),
        DType::I16 => Box::new(
            bytes
                .chunks_exact(2)
                .map(|c| i16::from_le_bytes(c.try_into().expect("2")) as f64),
        ),
        DType::I8 => Box::new(bytes.iter().map(|&b| b as i8 as f64)),
        DType::U8 | DType::BOOL => Box::new(bytes.iter().map(|&b| b as f64)),
    }
}

impl Acc {
    fn add(&mut self, a: (DType, &[u8]), b: (DType, &[u8])) {
        for (x, y) in values(a.0, a.1).zip(values(b.0, b.1)) {
            let d = x - y;
            self.aa += x * x;
            self.bb += y * y;
            self.dd += d * d;
            self.ab += x * y;
            self.max_abs = self.max_abs.max(d.abs());
            self.numel += 1;
        }
    }
}

/// Which (rank, tensor) pairs contribute to the whole tensors: the lowest
/// rank of a replicated tensor or chunk, and no empty chunk.
pub fn contributions(layouts: &BTreeMap<u32, RankLayout>) -> BTreeMap<u32, Vec<String>> {
    let mut seen: HashSet<(String, Vec<i64>, Vec<i64>)> = HashSet::new();
    let mut out: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for (&rank, layout) in layouts {
        for t in &layout.tensors {
            if t.numel == 0 {
                continue;
            }
            let offsets = t
                .chunk
                .as_ref()
                .map(|c| c.offsets.clone())
                .unwrap_or_else(|| vec![0; t.shape.len()]);
            if seen.insert((t.name.clone(), offsets, t.shape.clone())) {
                out.entry(rank).or_default().push(t.name.clone());
            }
        }
    }
    out
}

/// Compares side A and side B; `load_a(rank)` / `load_b(rank)` give one
/// rank's tensors at a time.
pub fn compare<E: From<String>>(
    layouts: &BTreeMap<u32, RankLayout>,
    mut load_a: impl FnMut(u32) -> Result<RankTensors, E>,
    mut load_b: impl FnMut(u32) -> Result<RankTensors, E>,
) -> Result<CompareResult, E> {
    let mut acc: BTreeMap<String, Acc> = BTreeMap::new();
    let mut shapes: HashMap<String, Vec<i64>> = HashMap::new();
    let mut only_a = Vec::new();
    let mut only_b = Vec::new();
    for (rank, names) in contributions(layouts) {
        let a = load_a(rank)?;
        let b = load_b(rank)?;
        for name in names {
            match (a.get(&name), b.get(&name)) {
                (Some(x), Some(y)) => {
                    if x.1.len() / x.0.size() != y.1.len() / y.0.size() {
                        return Err(E::from(format!(
                            "`{name}` has different sizes on the two sides (rank {rank})"
                        )));
                    }
                    acc.entry(name.clone())
                        .or_default()
                        .add((x.0, &x.1), (y.0, &y.1));
                }
                (Some(_), None) => only_a.push(name.clone()),
                (None, Some(_)) => only_b.push(name.clone()),
                (None, None) => {}
            }
        }
        for t in &layouts[&rank].tensors {
            shapes.entry(t.name.clone()).or_insert_with(|| {
                t.chunk
                    .as_ref()
                    .map(|c| c.global_shape.clone())
                    .unwrap_or_else(|| t.shape.clone())
            });
        }
    }
    let mut total = Acc::default();
    let tensors: Vec<TensorStats> = acc
        .into_iter()
        .map(|(name, a)| {
            total.aa += a.aa;
            total.bb += a.bb;
            total.dd += a.dd;
            total.ab += a.ab;
            total.max_abs = total.max_abs.max(a.max_abs);
            total.numel += a.numel;
            stats(name.clone(), shapes.remove(&name).unwrap_or_default(), a)
        })
        .collect();
    let whole = stats(String::new(), Vec::new(), total);
    let max_rel = tensors
        .iter()
        .max_by(|x, y| x.rel_diff.total_cmp(&y.rel_diff))
        .map(|t| t.name.clone());
    only_a.sort();
    only_a.dedup();
    only_b.sort();
    only_b.dedup();
    Ok(CompareResult {
        summary: CompareSummary {
            tensors: tensors.len(),
            numel: total.numel,
            norm_a: whole.norm_a,
            norm_b: whole.norm_b,
            norm_diff: whole.norm_diff,
            rel_diff: whole.rel_diff,
            cosine: whole.cosine,
            max_abs_diff: whole.max_abs_diff,
            max_rel_diff_tensor: max_rel,
            only_in_a: only_a,
            only_in_b: only_b,
        },
        tensors,
    })
}

fn stats(name: String, shape: Vec<i64>, a: Acc) -> TensorStats {
    let (na, nb, nd) = (a.aa.sqrt(), a.bb.sqrt(), a.dd.sqrt());
    TensorStats {
        name,
        shape,
        norm_a: na,
        norm_b: nb,
        norm_diff: nd,
        rel_diff: if na > 0.0 { nd / na } else { nd },
        cosine: (na > 0.0 && nb > 0.0).then(|| a.ab / (na * nb)),
        max_abs_diff: a.max_abs,
    }
}

/// Reads a stored part of one rank whole, for comparing, held to its
/// recorded size and sha256 (the outer error: the part could not be read
/// or does not match; the inner: its bytes do not parse).
pub fn read_part(
    part: &super::assemble::StoredPart,
) -> std::io::Result<Result<RankTensors, String>> {
    let bytes = part.path.read_verified()?;
    Ok(read_rank_file(Bytes::from(bytes)))
}

pub fn read_rank_file(bytes: Bytes) -> Result<RankTensors, String> {
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| e.to_string())?;
    super::meta::check_part_format(header.metadata().as_ref()).map_err(|e| e.to_string())?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let base = bytes.as_ptr() as usize;
    let mut out = HashMap::new();
    for (name, view) in st.iter() {
        let dtype =
            DType::from_safetensors(view.dtype()).ok_or_else(|| format!("dtype of {name}"))?;
        let start = view.data().as_ptr() as usize - base;
        out.insert(
            name.to_string(),
            (dtype, bytes.slice(start..start + view.data().len())),
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::layout::{LayoutTensor, Slot};
    use crate::wire::Chunk;

    fn layout(tensors: Vec<(&str, Vec<i64>, Option<Chunk>)>) -> RankLayout {
        let mut l = RankLayout {
            tensors: tensors
                .into_iter()
                .map(|(n, shape, chunk)| LayoutTensor {
                    name: n.into(),
                    dtype: DType::F32,
                    numel: shape.iter().product(),
                    shape,
                    chunk,
                    slot: Slot::Averaged { offset: 0 },
                    mirror: (0, 0),
                })
                .collect(),
            index: HashMap::new(),
            ema_numel: 0,
            copied_groups: vec![],
            mirror_groups: vec![],
            aliases: Default::default(),
        };
        l.rebuild_index();
        l
    }

    fn f32s(v: &[f32]) -> (DType, Bytes) {
        (
            DType::F32,
            Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()),
        )
    }

    #[test]
    fn chunks_combine_by_sums_of_squares_and_replicas_count_once() {
        let chunk = |o: i64| {
            Some(Chunk {
                global_shape: vec![4],
                offsets: vec![o],
            })
        };
        let layouts = BTreeMap::from([
            (
                0,
                layout(vec![("w", vec![2], chunk(0)), ("b", vec![2], None)]),
            ),
            (
                1,
                layout(vec![("w", vec![2], chunk(2)), ("b", vec![2], None)]),
            ),
        ]);
        let a = |r: u32| -> Result<RankTensors, String> {
            Ok(HashMap::from([
                (
                    "w".to_string(),
                    if r == 0 {
                        f32s(&[3.0, 0.0])
                    } else {
                        f32s(&[0.0, 4.0])
                    },
                ),
                ("b".to_string(), f32s(&[1.0, 1.0])),
            ]))
        };
        let b = |r: u32| -> Result<RankTensors, String> {
            Ok(HashMap::from([
                (
                    "w".to_string(),
                    if r == 0 {
                        f32s(&[3.0, 0.0])
                    } else {
                        f32s(&[0.0, 1.0])
                    },
                ),
                ("b".to_string(), f32s(&[1.0, 1.0])),
            ]))
        };
        let res = compare::<String>(&layouts, a, b).unwrap();
        let w = res.tensors.iter().find(|t| t.name == "w").unwrap();
        assert_eq!(w.shape, vec![4]);
        assert!((w.norm_a - 5.0).abs() < 1e-12);
        assert!((w.norm_b - 10f64.sqrt()).abs() < 1e-12);
        assert!((w.norm_diff - 3.0).abs() < 1e-12);
        assert!((w.rel_diff - 0.6).abs() < 1e-12);
        assert!((w.cosine.unwrap() - 13.0 / (5.0 * 10f64.sqrt())).abs() < 1e-12);
        assert_eq!(w.max_abs_diff, 3.0);
        let bias = res.tensors.iter().find(|t| t.name == "b").unwrap();
        assert!(
            (bias.norm_a - 2f64.sqrt()).abs() < 1e-12,
            "replicated bias counted once"
        );
        assert_eq!(res.summary.numel, 6);
        assert_eq!(res.summary.max_rel_diff_tensor.as_deref(), Some("w"));
    }
}
