//! The file format of one rank's part: a safetensors file holding the
//! rank's tensors under the names, shapes and chunk metadata it pushed.
//!
//! A profile part holds the profile's averaged tensors (in the EMA dtype)
//! and the copied tensors; the `__mirror__` part holds the mirror, every
//! tensor in its pushed dtype; a `bema` profile's hidden buffers are
//! profile parts named by [`bema_part`]. Blocks are laid out in decreasing element
//! size, so every tensor stays aligned; inside a block, tensors follow the
//! layout order, so each flat buffer is one contiguous byte range of the
//! file. The same layout answers `GET .../ranks/{rank}/ema`.
//!
//! Encoding only: no tensors here. Parts are built from host tensors, and
//! ranks restored from parts, in [`super::convert`].

use std::collections::BTreeMap;

use bytes::Bytes;

use super::meta::{check_part_format, MetaError, FORMAT_KEY, FORMAT_VERSION};
use crate::wire::layout::{RankLayout, Slot};
use crate::wire::push::{ALIASES_KEY, SHARDS_KEY};
use crate::wire::{DType, HeaderEntry, SafetensorsHeader};

/// The part name of the mirror.
pub const MIRROR_PART: &str = "__mirror__";

/// The part names of a `bema` profile's hidden buffers (the contract's:
/// the engine names its captures by them).
pub use crate::contract::{bema_part, BemaBuffer};

/// A file's header and its data blocks, in order.
pub struct PartFile {
    pub header: SafetensorsHeader,
    pub blocks: Vec<Bytes>,
}

impl PartFile {
    pub fn len(&self) -> u64 {
        self.header.file_len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The `__metadata__` every stored part carries: the format number
/// ([`FORMAT_KEY`]), then what the part is.
pub fn part_metadata(
    run: &str,
    snapshot: &str,
    rank: u32,
    step: u64,
    part: &str,
) -> BTreeMap<String, String> {
    BTreeMap::from([
        (FORMAT_KEY.to_string(), FORMAT_VERSION.to_string()),
        ("polyak.run".to_string(), run.to_string()),
        ("polyak.snapshot".to_string(), snapshot.to_string()),
        ("polyak.rank".to_string(), rank.to_string()),
        ("polyak.step".to_string(), step.to_string()),
        ("polyak.profile".to_string(), part.to_string()),
    ])
}

fn shards_metadata(layout: &RankLayout, meta: &mut BTreeMap<String, String>) {
    let mut shards = serde_json::Map::new();
    for t in &layout.tensors {
        if let Some(chunk) = &t.chunk {
            shards.insert(t.name.clone(), serde_json::json!(chunk));
        }
    }
    if !shards.is_empty() {
        meta.insert(
            SHARDS_KEY.to_string(),
            serde_json::Value::Object(shards).to_string(),
        );
    }
}

/// Lays out `blocks` (dtype, member tensor indices, payload) as one file:
/// the header, and the payloads in file order.
pub(super) fn assemble<T>(
    layout: &RankLayout,
    mut blocks: Vec<(DType, Vec<usize>, T)>,
    mut meta: BTreeMap<String, String>,
) -> (SafetensorsHeader, Vec<T>) {
    blocks.sort_by_key(|(d, _, _)| std::cmp::Reverse(d.size()));
    let mut entries = Vec::new();
    for (dtype, members, _) in &blocks {
        for &i in members {
            let t = &layout.tensors[i];
            entries.push(HeaderEntry {
                name: t.name.clone(),
                dtype: *dtype,
                shape: t.shape.clone(),
                nbytes: t.numel as usize * dtype.size(),
            });
        }
    }
    shards_metadata(layout, &mut meta);
    if !layout.aliases.is_empty() {
        meta.insert(
            ALIASES_KEY.to_string(),
            serde_json::json!(layout.aliases).to_string(),
        );
    }
    let header = SafetensorsHeader::new(entries, meta);
    (header, blocks.into_iter().map(|(_, _, b)| b).collect())
}

/// What fills one data block of a profile part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFill {
    /// The averaged tensors, end to end in layout order.
    Averaged,
    /// The members of this copied group, in layout order.
    Copied(usize),
}

/// The header of a profile part whose averaged tensors are stored as
/// `ema_dtype`, and what fills each of its blocks in file order: the same
/// file [`profile_part`] writes, for writers that stream the data.
pub fn profile_header(
    layout: &RankLayout,
    ema_dtype: DType,
    meta: BTreeMap<String, String>,
) -> (SafetensorsHeader, Vec<BlockFill>) {
    let mut blocks = vec![(ema_dtype, averaged_members(layout), BlockFill::Averaged)];
    for (g, group) in layout.copied_groups.iter().enumerate() {
        blocks.push((group.dtype, copied_members(layout, g), BlockFill::Copied(g)));
    }
    assemble(layout, blocks, meta)
}

/// The averaged tensors, in the order of their EMA offsets.
pub fn averaged_members(layout: &RankLayout) -> Vec<usize> {
    (0..layout.tensors.len())
        .filter(|&i| matches!(layout.tensors[i].slot, Slot::Averaged { .. }))
        .collect()
}

/// The members of a copied group, in the order of their offsets.
pub fn copied_members(layout: &RankLayout, group: usize) -> Vec<usize> {
    (0..layout.tensors.len())
        .filter(|&i| matches!(layout.tensors[i].slot, Slot::Copied { group: g, .. } if g == group))
        .collect()
}

/// Where one tensor's data lies in a stored file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredRange {
    pub dtype: DType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    pub numel: i64,
}

/// The largest header a stored part may have.
const MAX_STORED_HEADER: u64 = 256 << 20;

/// Reads the tensor table of a stored safetensors file (its header only).
pub fn read_tensor_table(
    file: &mut impl std::io::Read,
) -> Result<std::collections::HashMap<String, StoredRange>, FormatError> {
    let mut len = [0u8; 8];
    file.read_exact(&mut len)?;
    let n = u64::from_le_bytes(len);
    if n > MAX_STORED_HEADER {
        return Err(FormatError::Parse(format!("header of {n} bytes")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)?;
    let value: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| FormatError::Parse(e.to_string()))?;
    let object = value
        .as_object()
        .ok_or_else(|| FormatError::Parse("the header is not an object".into()))?;
    check_header_format(object)?;
    let data_start = 8 + n;
    let mut out = std::collections::HashMap::with_capacity(object.len());
    for (name, info) in object {
        if name == "__metadata__" {
            continue;
        }
        let bad = || FormatError::Parse(format!("`{name}`: malformed entry"));
        let dtype = info["dtype"]
            .as_str()
            .and_then(DType::from_name)
            .ok_or_else(bad)?;
        let shape = info["shape"].as_array().ok_or_else(bad)?;
        let mut numel = 1i64;
        for d in shape {
            numel = numel
                .checked_mul(d.as_i64().ok_or_else(bad)?)
                .ok_or_else(bad)?;
        }
        let offsets = info["data_offsets"].as_array().ok_or_else(bad)?;
        let (start, end) = match offsets.as_slice() {
            [a, b] => (a.as_u64().ok_or_else(bad)?, b.as_u64().ok_or_else(bad)?),
            _ => return Err(bad()),
        };
        if end < start || end - start != numel as u64 * dtype.size() as u64 {
            return Err(bad());
        }
        out.insert(
            name.clone(),
            StoredRange {
                dtype,
                offset: data_start + start,
                numel,
            },
        );
    }
    Ok(out)
}

/// Checks the format number in a parsed safetensors header's
/// `__metadata__` (see [`check_part_format`]).
pub fn check_header_format(
    header: &serde_json::Map<String, serde_json::Value>,
) -> Result<(), MetaError> {
    let metadata: Option<std::collections::HashMap<String, String>> = header
        .get("__metadata__")
        .and_then(|m| m.as_object())
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        });
    check_part_format(metadata.as_ref())
}

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{0}")]
    Parse(String),
    /// A part (or its catalog metadata) of a format this server does not
    /// read, or metadata that does not hold together.
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// Building tensors from a part failed (see `super::convert`).
    #[error("torch: {0}")]
    Torch(String),
    #[error("reading a stored part: {0}")]
    Io(#[from] std::io::Error),
}
