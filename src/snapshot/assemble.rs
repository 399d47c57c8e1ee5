//! Downloads of a snapshot, built as [`VirtualFile`]s over the stored rank
//! files:
//!
//! - `full`: one safetensors file of whole tensors. Chunks of a tensor must
//!   tile its global shape exactly; row blocks (FSDP `Shard(0)`) are
//!   streamed straight from the rank files, other tilings (`Shard(1)`,
//!   tensor parallel) are gathered a block of rows at a time as they
//!   stream (each rank's slice of those rows, interleaved), never a whole
//!   tensor at once.
//! - `hf`: the same tensors as HF-style shards (`model-0000k-of-0000n`
//!   plus `model.safetensors.index.json`) in a tar.
//! - `sharded`: a tar of one safetensors file per rank whose
//!   `DCP_SHARDING_INFO` lets `torch.distributed.checkpoint` reshard it.
//! - `rank`: one stored file as it is on disk (its sha256 is recorded).

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::sync::Arc;

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::source::PartLoc;
use super::vfile::{ChunkSource, GatherSpec, Piece, VirtualFile};
use crate::engine::capture::RankMeta;
use crate::wire::{DType, HeaderEntry, SafetensorsHeader};

/// One stored part of one rank.
#[derive(Debug, Clone)]
pub struct StoredPart {
    pub rank: u32,
    pub path: Arc<PartLoc>,
    pub sha256: String,
    pub meta: Arc<RankMeta>,
}

/// What the client asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    Full,
    Sharded,
    Hf { max_shard_size: u64 },
    Rank(u32),
}

/// A download ready to stream.
pub struct Download {
    pub file: VirtualFile,
    pub etag: String,
    pub content_type: &'static str,
    pub file_name: String,
}

#[derive(Debug, thiserror::Error)]
pub enum AssembleError {
    #[error("{0}")]
    DoesNotTile(String),
    #[error("{0}")]
    Missing(String),
    #[error("reading a snapshot file: {0}")]
    Io(#[from] std::io::Error),
    #[error("a snapshot file is malformed: {0}")]
    Malformed(String),
    /// A part file of a newer format (or a format key that does not parse).
    #[error(transparent)]
    Format(#[from] super::meta::MetaError),
}

/// A tensor as stored in one rank file.
#[derive(Debug, Clone)]
struct StoredTensor {
    rank: u32,
    path: Arc<PartLoc>,
    dtype: DType,
    shape: Vec<i64>,
    /// Absolute byte offset of the data in the file.
    offset: u64,
    /// Chunk placement; `None` for a whole tensor.
    chunk_offsets: Option<Vec<i64>>,
    global_shape: Vec<i64>,
}

impl StoredTensor {
    fn numel(&self) -> i64 {
        self.shape.iter().product()
    }

    fn offsets(&self) -> Vec<i64> {
        self.chunk_offsets
            .clone()
            .unwrap_or_else(|| vec![0; self.shape.len()])
    }
}

/// Reads the tensor table of a stored file.
fn read_table(part: &StoredPart) -> Result<Vec<(String, StoredTensor)>, AssembleError> {
    let mut file = part.path.open()?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)?;
    let n = u64::from_le_bytes(len);
    if n > 256 << 20 {
        return Err(AssembleError::Malformed("header too large".into()));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)?;
    let value: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| AssembleError::Malformed(e.to_string()))?;
    let object = value
        .as_object()
        .ok_or_else(|| AssembleError::Malformed("header is not an object".into()))?;
    super::format::check_header_format(object)?;
    let chunks: HashMap<&str, &crate::wire::Chunk> = part
        .meta
        .layout
        .tensors
        .iter()
        .filter_map(|t| t.chunk.as_ref().map(|c| (t.name.as_str(), c)))
        .collect();
    let data_start = 8 + n;
    let mut out = Vec::new();
    for (name, info) in object {
        if name == "__metadata__" {
            continue;
        }
        let dtype_name = info["dtype"].as_str().unwrap_or_default();
        let dtype = DType::from_name(dtype_name)
            .ok_or_else(|| AssembleError::Malformed(format!("dtype {dtype_name}")))?;
        let shape: Vec<i64> = info["shape"]
            .as_array()
            .map(|a| a.iter().filter_map(|d| d.as_i64()).collect())
            .unwrap_or_default();
        let start = info["data_offsets"][0]
            .as_u64()
            .ok_or_else(|| AssembleError::Malformed(format!("offsets of {name}")))?;
        let chunk = chunks.get(name.as_str());
        out.push((
            name.clone(),
            StoredTensor {
                rank: part.rank,
                path: part.path.clone(),
                dtype,
                global_shape: chunk
                    .map(|c| c.global_shape.clone())
                    .unwrap_or_else(|| shape.clone()),
                chunk_offsets: chunk.map(|c| c.offsets.clone()),
                shape,
                offset: data_start + start,
            },
        ));
    }
    out.sort_by_key(|(_, t)| t.offset);
    Ok(out)
}

/// The pieces of each tensor, per name, after the tiling check.
#[derive(Clone)]
struct Whole {
    name: String,
    dtype: DType,
    global_shape: Vec<i64>,
    /// Non-empty chunks, duplicates (replicas) removed, lowest rank first.
    chunks: Vec<StoredTensor>,
}

fn boxes_overlap(a: &StoredTensor, b: &StoredTensor) -> bool {
    let (ao, bo) = (a.offsets(), b.offsets());
    (0..a.shape.len()).all(|d| ao[d] < bo[d] + b.shape[d] && bo[d] < ao[d] + a.shape[d])
}

/// Groups the ranks' tensors by name and checks that each one's chunks tile
/// its global shape exactly.
fn wholes(parts: &[StoredPart]) -> Result<Vec<Whole>, AssembleError> {
    let mut by_name: BTreeMap<String, Vec<StoredTensor>> = BTreeMap::new();
    for part in parts {
        for (name, t) in read_table(part)? {
            by_name.entry(name).or_default().push(t);
        }
    }
    let mut out = Vec::with_capacity(by_name.len());
    for (name, mut all) in by_name {
        all.sort_by_key(|t| t.rank);
        let first = &all[0];
        let (dtype, global) = (first.dtype, first.global_shape.clone());
        if all
            .iter()
            .any(|t| t.dtype != dtype || t.global_shape != global)
        {
            return Err(AssembleError::DoesNotTile(format!(
                "`{name}` has different dtypes or global shapes on different ranks"
            )));
        }
        let chunks = distinct_chunks(&name, all)?;
        let covered: i64 = chunks.iter().map(StoredTensor::numel).sum();
        let total: i64 = global.iter().product();
        if covered != total {
            return Err(AssembleError::DoesNotTile(format!(
                "chunks of `{name}` cover {covered} of {total} elements of its global shape {global:?} (a rank is missing?)"
            )));
        }
        out.push(Whole {
            name,
            dtype,
            global_shape: global,
            chunks,
        });
    }
    add_tied(parts, &mut out);
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The pieces of tensor `name` (its copies on every rank, lowest rank
/// first): one copy of a replicated tensor, else its non-empty chunks with
/// replicas dropped, none overlapping another.
fn distinct_chunks(
    name: &str,
    mut all: Vec<StoredTensor>,
) -> Result<Vec<StoredTensor>, AssembleError> {
    let whole_count = all.iter().filter(|t| t.chunk_offsets.is_none()).count();
    if whole_count == all.len() {
        // Replicated (DDP, or a tensor FSDP did not shard): one copy.
        return Ok(vec![all.swap_remove(0)]);
    }
    if whole_count > 0 {
        return Err(AssembleError::DoesNotTile(format!(
            "`{name}` is whole on some ranks and a chunk on others"
        )));
    }
    let mut kept: Vec<StoredTensor> = Vec::new();
    for t in all.into_iter().filter(|t| t.numel() > 0) {
        // The same chunk on several ranks (replicas, e.g. HSDP).
        if kept
            .iter()
            .any(|k| k.offsets() == t.offsets() && k.shape == t.shape)
        {
            continue;
        }
        if let Some(k) = kept.iter().find(|k| boxes_overlap(k, &t)) {
            return Err(AssembleError::DoesNotTile(format!(
                "chunks of `{name}` from ranks {} and {} overlap",
                k.rank, t.rank
            )));
        }
        kept.push(t);
    }
    Ok(kept)
}

/// Tied names were pushed and stored once; every layout writes them under
/// each name so that strict `load_state_dict` finds them all.
fn add_tied(parts: &[StoredPart], out: &mut Vec<Whole>) {
    let aliases: BTreeMap<&str, &str> = parts
        .iter()
        .flat_map(|p| p.meta.layout.aliases.iter())
        .map(|(a, t)| (a.as_str(), t.as_str()))
        .collect();
    for (alias, target) in aliases {
        if out.iter().any(|w| w.name == alias) {
            continue;
        }
        if let Some(w) = out.iter().find(|w| w.name == target) {
            let tied = Whole {
                name: alias.to_string(),
                ..w.clone()
            };
            out.push(tied);
        }
    }
}

fn out_dtype(stored: DType, cast: Option<DType>) -> DType {
    match cast {
        Some(to) if stored.is_float() => to,
        _ => stored,
    }
}

fn data_piece(t: &StoredTensor, to: DType) -> Piece {
    Piece::Cast {
        path: t.path.clone(),
        offset: t.offset,
        count: t.numel() as u64,
        from: t.dtype,
        to,
    }
}

/// The data pieces of a whole tensor, in row-major order.
fn whole_pieces(w: &Whole, to: DType) -> Vec<Piece> {
    let row_blocks = w.chunks.iter().all(|c| {
        let o = c.offsets();
        (1..c.shape.len()).all(|d| o[d] == 0 && c.shape[d] == w.global_shape[d])
    });
    if row_blocks {
        let mut chunks: Vec<&StoredTensor> = w.chunks.iter().collect();
        chunks.sort_by_key(|c| c.offsets().first().copied().unwrap_or(0));
        chunks.into_iter().map(|c| data_piece(c, to)).collect()
    } else {
        vec![Piece::Gather(Arc::new(GatherSpec {
            dtype: w.dtype,
            to,
            global_shape: w.global_shape.clone(),
            chunks: w
                .chunks
                .iter()
                .map(|c| ChunkSource {
                    path: c.path.clone(),
                    offset: c.offset,
                    shape: c.shape.clone(),
                    offsets: c.offsets(),
                })
                .collect(),
        }))]
    }
}

/// A safetensors file of whole tensors (sorted by dtype size, then name,
/// as the reference writer does).
fn full_file(wholes: &[&Whole], cast: Option<DType>, meta: BTreeMap<String, String>) -> Vec<Piece> {
    let mut order: Vec<&&Whole> = wholes.iter().collect();
    order.sort_by(|a, b| {
        let (da, db) = (out_dtype(a.dtype, cast), out_dtype(b.dtype, cast));
        db.size().cmp(&da.size()).then(a.name.cmp(&b.name))
    });
    let header = SafetensorsHeader::new(
        order
            .iter()
            .map(|w| {
                let to = out_dtype(w.dtype, cast);
                HeaderEntry {
                    name: w.name.clone(),
                    dtype: to,
                    shape: w.global_shape.clone(),
                    nbytes: w.global_shape.iter().product::<i64>() as usize * to.size(),
                }
            })
            .collect(),
        meta,
    );
    let mut pieces = vec![Piece::Bytes(Bytes::from(header.into_bytes()))];
    for w in order {
        pieces.extend(whole_pieces(w, out_dtype(w.dtype, cast)));
    }
    pieces
}

fn tar_entry(name: &str, len: u64, mtime: u64) -> Piece {
    let mut header = tar::Header::new_ustar();
    // Names here are short and ASCII.
    let _ = header.set_path(name);
    header.set_size(len);
    header.set_mode(0o644);
    header.set_mtime(mtime);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();
    Piece::Bytes(Bytes::copy_from_slice(header.as_bytes()))
}

fn tar_padding(len: u64) -> Piece {
    let pad = (512 - len % 512) % 512;
    Piece::Bytes(Bytes::from(vec![0u8; pad as usize]))
}

fn tar_file(out: &mut Vec<Piece>, name: &str, pieces: Vec<Piece>, mtime: u64) {
    let len: u64 = pieces.iter().map(Piece::len).sum();
    out.push(tar_entry(name, len, mtime));
    out.extend(pieces);
    out.push(tar_padding(len));
}

/// The entry of `meta` (given to [`build`]) holding the model's
/// configuration as JSON: written as `config.json` into `hf` downloads,
/// never into a file's safetensors metadata.
pub const HF_CONFIG_META: &str = "polyak.hf_config";

/// Builds the download of `profile` of a snapshot in `layout`. Files in a
/// tar carry `mtime` (seconds since the epoch: when the snapshot was
/// taken), so unpacked files tell their age.
pub fn build(
    snapshot_id: &str,
    mut meta: BTreeMap<String, String>,
    parts: &[StoredPart],
    layout: Layout,
    cast: Option<DType>,
    mtime: u64,
) -> Result<Download, AssembleError> {
    if parts.is_empty() {
        return Err(AssembleError::Missing(
            "the snapshot holds no rank files".into(),
        ));
    }
    let etag = etag(snapshot_id, &meta, parts, layout, cast);
    let hf_config = meta.remove(HF_CONFIG_META);
    let suffix = cast
        .map(|c| format!("-{}", c.safetensors_name().to_lowercase()))
        .unwrap_or_default();
    let (pieces, content_type, file_name) = match layout {
        Layout::Rank(rank) => (
            rank_file(parts, rank)?,
            "application/octet-stream",
            format!("{snapshot_id}-rank{rank:05}.safetensors"),
        ),
        Layout::Full => {
            let all = wholes(parts)?;
            let refs: Vec<&Whole> = all.iter().collect();
            let mut meta = meta;
            meta.insert("format".into(), "pt".into());
            (
                full_file(&refs, cast, meta),
                "application/octet-stream",
                format!("{snapshot_id}{suffix}.safetensors"),
            )
        }
        Layout::Hf { max_shard_size } => (
            hf_tar(
                &wholes(parts)?,
                max_shard_size,
                cast,
                &meta,
                hf_config,
                mtime,
            ),
            "application/x-tar",
            format!("{snapshot_id}{suffix}-hf.tar"),
        ),
        Layout::Sharded => (
            sharded_tar(&wholes(parts)?, cast, &meta, mtime),
            "application/x-tar",
            format!("{snapshot_id}{suffix}-sharded.tar"),
        ),
    };
    Ok(Download {
        file: VirtualFile::new(pieces),
        etag,
        content_type,
        file_name,
    })
}

/// The ETag of the download [`build`] makes of the same arguments, known
/// without reading a part: what it is built from (the snapshot, the
/// profile and the metadata written into it, the layout and cast, the
/// model config of an `hf` tar, every part's sha256).
pub fn etag(
    snapshot_id: &str,
    meta: &BTreeMap<String, String>,
    parts: &[StoredPart],
    layout: Layout,
    cast: Option<DType>,
) -> String {
    let mut hasher = Sha256::new();
    hasher.update(snapshot_id.as_bytes());
    hasher.update(format!("{layout:?}{cast:?}").as_bytes());
    for (k, v) in meta {
        if k == HF_CONFIG_META && !matches!(layout, Layout::Hf { .. }) {
            continue;
        }
        hasher.update(format!("{}:{k}={}:{v};", k.len(), v.len()).as_bytes());
    }
    for p in parts {
        hasher.update(p.sha256.as_bytes());
    }
    format!("\"{}\"", &hex::encode(hasher.finalize())[..32])
}

/// One rank's stored file, as it is.
fn rank_file(parts: &[StoredPart], rank: u32) -> Result<Vec<Piece>, AssembleError> {
    let part = parts.iter().find(|p| p.rank == rank).ok_or_else(|| {
        AssembleError::Missing(format!("rank {rank} has no file in this snapshot"))
    })?;
    let len = part.path.open()?.size()?;
    Ok(vec![Piece::File {
        path: part.path.clone(),
        offset: 0,
        len,
    }])
}

/// Bytes of a whole tensor once cast.
fn whole_bytes(w: &Whole, cast: Option<DType>) -> u64 {
    w.global_shape.iter().product::<i64>() as u64 * out_dtype(w.dtype, cast).size() as u64
}

/// The tensors in name order, packed greedily into shards of at most
/// `max_shard_size` bytes; a tensor larger than the limit gets a shard of
/// its own.
fn pack_shards(all: &[Whole], max_shard_size: u64, cast: Option<DType>) -> Vec<Vec<&Whole>> {
    let mut sorted: Vec<&Whole> = all.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut shards: Vec<Vec<&Whole>> = Vec::new();
    let mut size = 0u64;
    for w in sorted {
        let bytes = whole_bytes(w, cast);
        if shards.is_empty() || (size + bytes > max_shard_size && size > 0) {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("a shard").push(w);
        size += bytes;
    }
    shards
}

/// The `hf` layout: a tar of `transformers` shards, their index and the
/// model's `config.json` when the run has one.
fn hf_tar(
    all: &[Whole],
    max_shard_size: u64,
    cast: Option<DType>,
    meta: &BTreeMap<String, String>,
    hf_config: Option<String>,
    mtime: u64,
) -> Vec<Piece> {
    let shards = pack_shards(all, max_shard_size, cast);
    let n = shards.len();
    let mut out = Vec::new();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (k, shard) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
        for w in shard {
            weight_map.insert(w.name.clone(), name.clone());
            total += whole_bytes(w, cast);
        }
        let mut meta = meta.clone();
        meta.insert("format".into(), "pt".into());
        tar_file(&mut out, &name, full_file(shard, cast, meta), mtime);
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let index = Bytes::from(serde_json::to_vec_pretty(&index).unwrap_or_default());
    tar_file(
        &mut out,
        "model.safetensors.index.json",
        vec![Piece::Bytes(index)],
        mtime,
    );
    // `from_pretrained` builds the model from it; without it a default
    // model is built and the weights do not fit.
    if let Some(config) = hf_config {
        tar_file(
            &mut out,
            "config.json",
            vec![Piece::Bytes(Bytes::from(config.into_bytes()))],
            mtime,
        );
    }
    out.push(Piece::Bytes(Bytes::from(vec![0u8; 1024])));
    out
}

/// The `sharded` layout: a tar of one DCP-style safetensors file per rank
/// holding the chunks it contributes (replicas and empty chunks dropped by
/// the tiling check).
fn sharded_tar(
    all: &[Whole],
    cast: Option<DType>,
    meta: &BTreeMap<String, String>,
    mtime: u64,
) -> Vec<Piece> {
    let mut per_rank: BTreeMap<u32, Vec<(&str, &StoredTensor)>> = BTreeMap::new();
    for w in all {
        for c in &w.chunks {
            per_rank
                .entry(c.rank)
                .or_default()
                .push((w.name.as_str(), c));
        }
    }
    let mut out = Vec::new();
    for (rank, tensors) in per_rank {
        tar_file(
            &mut out,
            &format!("rank-{rank:05}.safetensors"),
            rank_chunks_file(rank, tensors, cast, meta.clone()),
            mtime,
        );
    }
    out.push(Piece::Bytes(Bytes::from(vec![0u8; 1024])));
    out
}

/// One rank's chunks as a safetensors file, their offsets in the global
/// tensors in its `DCP_SHARDING_INFO` metadata (sorted by dtype size, then
/// name).
fn rank_chunks_file(
    rank: u32,
    mut tensors: Vec<(&str, &StoredTensor)>,
    cast: Option<DType>,
    mut meta: BTreeMap<String, String>,
) -> Vec<Piece> {
    tensors.sort_by(|(an, a), (bn, b)| {
        let (da, db) = (out_dtype(a.dtype, cast), out_dtype(b.dtype, cast));
        db.size().cmp(&da.size()).then(an.cmp(bn))
    });
    let mut info = serde_json::Map::new();
    for (name, t) in &tensors {
        info.insert(
            name.to_string(),
            serde_json::json!({"saved_offsets": t.offsets()}),
        );
    }
    meta.insert(
        "DCP_SHARDING_INFO".into(),
        serde_json::Value::Object(info).to_string(),
    );
    meta.insert("DCP_VERSION".into(), "1.0".into());
    meta.insert("polyak.rank".into(), rank.to_string());
    let header = SafetensorsHeader::new(
        tensors
            .iter()
            .map(|(name, t)| {
                let to = out_dtype(t.dtype, cast);
                HeaderEntry {
                    name: name.to_string(),
                    dtype: to,
                    shape: t.shape.clone(),
                    nbytes: t.numel() as usize * to.size(),
                }
            })
            .collect(),
        meta,
    );
    let mut pieces = vec![Piece::Bytes(Bytes::from(header.into_bytes()))];
    for (_, t) in &tensors {
        pieces.push(data_piece(t, out_dtype(t.dtype, cast)));
    }
    pieces
}
