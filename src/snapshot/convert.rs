//! Tensors to stored parts and back: a rank's host tensors written as the
//! parts of [`super::format`], a rank rebuilt from its parts' bytes, and a
//! live export viewed as the named tensor bytes a comparison reads. The
//! format itself knows no tensors; this is where torch meets it.

use std::collections::BTreeMap;

use bytes::Bytes;
use tch::{Kind, Tensor};

use super::compare::RankTensors;
use super::format::{assemble, averaged_members, copied_members, FormatError, PartFile};
use super::meta::check_part_format;
use crate::engine::capture::{RankMeta, RestoredRank};
use crate::engine::host_bytes;
use crate::wire::layout::{RankLayout, Slot};
use crate::wire::DType;

impl From<tch::TchError> for FormatError {
    fn from(e: tch::TchError) -> Self {
        FormatError::Torch(e.to_string())
    }
}

/// A profile part from host tensors: the flat EMA and the copied groups.
pub fn profile_part(
    layout: &RankLayout,
    ema: Tensor,
    copied: Vec<Tensor>,
    meta: BTreeMap<String, String>,
) -> PartFile {
    let ema_dtype = DType::from_kind(ema.kind()).unwrap_or(DType::F32);
    let mut blocks = vec![(ema_dtype, averaged_members(layout), host_bytes(ema))];
    for (g, tensor) in copied.into_iter().enumerate() {
        blocks.push((
            layout.copied_groups[g].dtype,
            copied_members(layout, g),
            host_bytes(tensor),
        ));
    }
    let (header, blocks) = assemble(layout, blocks, meta);
    PartFile { header, blocks }
}

/// The mirror part: one block per pushed dtype.
pub fn mirror_part(
    layout: &RankLayout,
    mirror: Vec<Tensor>,
    meta: BTreeMap<String, String>,
) -> PartFile {
    let blocks = mirror
        .into_iter()
        .enumerate()
        .map(|(g, tensor)| {
            let members = (0..layout.tensors.len())
                .filter(|&i| layout.tensors[i].mirror.0 == g)
                .collect();
            (layout.mirror_groups[g].dtype, members, host_bytes(tensor))
        })
        .collect();
    let (header, blocks) = assemble(layout, blocks, meta);
    PartFile { header, blocks }
}

/// Every tensor of a rank as its bytes, sliced out of the rank's flat host
/// buffers: the averaged tensors from `ema` (in its dtype), the copied ones
/// from their groups. What a live export is compared as.
pub fn flat_tensors(layout: &RankLayout, ema: Tensor, copied: Vec<Tensor>) -> RankTensors {
    let ema_dtype = DType::from_kind(ema.kind()).unwrap_or(DType::F32);
    let ema = host_bytes(ema);
    let copied: Vec<Bytes> = copied.into_iter().map(host_bytes).collect();
    layout
        .tensors
        .iter()
        .map(|t| {
            let (dtype, buf, offset) = match t.slot {
                Slot::Averaged { offset } => (ema_dtype, &ema, offset),
                Slot::Copied { group, offset } => (t.dtype, &copied[group], offset),
            };
            let start = offset as usize * dtype.size();
            let end = start + t.numel as usize * dtype.size();
            (t.name.clone(), (dtype, buf.slice(start..end)))
        })
        .collect()
}

/// Concatenates the named tensors' bytes into one flat host tensor.
fn gather(file: &[u8], names: &[&str], dtype: DType, numel: i64) -> Result<Tensor, FormatError> {
    let st = safetensors::SafeTensors::deserialize(file)
        .map_err(|e| FormatError::Parse(e.to_string()))?;
    let bytes = numel as usize * dtype.size();
    // Straight into the flat buffer the engine will keep (advised for huge
    // pages before it is written, as a freshly registered rank's is).
    let t = crate::hugepages::empty(numel, dtype.kind())?;
    let mut at = 0usize;
    for name in names {
        let view = st
            .tensor(name)
            .map_err(|e| FormatError::Parse(format!("`{name}`: {e}")))?;
        if DType::from_safetensors(view.dtype()) != Some(dtype) {
            return Err(FormatError::Parse(format!(
                "`{name}` has dtype {:?}, expected {dtype}",
                view.dtype()
            )));
        }
        let data = view.data();
        if at + data.len() > bytes {
            return Err(FormatError::Parse(format!(
                "expected {numel} elements of {dtype}, found more at `{name}`"
            )));
        }
        if !data.is_empty() {
            // SAFETY: `t` is a fresh contiguous CPU tensor of `bytes` bytes
            // that nothing else references yet, and `at + data.len()` is
            // within it (checked above).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr(),
                    (t.data_ptr() as *mut u8).add(at),
                    data.len(),
                );
            }
        }
        at += data.len();
    }
    if at != bytes {
        return Err(FormatError::Parse(format!(
            "expected {numel} elements of {dtype}, found {at} bytes"
        )));
    }
    Ok(t)
}

/// Rebuilds a rank from its part files: `profiles` in the run's profile
/// order, each with its file's bytes; `mirror` when the run keeps one.
pub fn restore_rank(
    meta: RankMeta,
    profiles: &[Vec<u8>],
    mirror: Option<&[u8]>,
    ema_kind: Kind,
) -> Result<RestoredRank, FormatError> {
    for file in profiles.iter().map(Vec::as_slice).chain(mirror) {
        let (_, header) = safetensors::SafeTensors::read_metadata(file)
            .map_err(|e| FormatError::Parse(e.to_string()))?;
        check_part_format(header.metadata().as_ref())?;
    }
    let layout = &meta.layout;
    let ema_dtype = DType::from_kind(ema_kind).unwrap_or(DType::F32);
    let averaged: Vec<&str> = averaged_members(layout)
        .into_iter()
        .map(|i| layout.tensors[i].name.as_str())
        .collect();
    let ema = profiles
        .iter()
        .map(|file| gather(file, &averaged, ema_dtype, layout.ema_numel))
        .collect::<Result<Vec<_>, _>>()?;
    let first = profiles
        .first()
        .ok_or_else(|| FormatError::Parse("no profile part to restore from".into()))?;
    let copied = layout
        .copied_groups
        .iter()
        .enumerate()
        .map(|(g, group)| {
            let names: Vec<&str> = copied_members(layout, g)
                .into_iter()
                .map(|i| layout.tensors[i].name.as_str())
                .collect();
            gather(first, &names, group.dtype, group.numel)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mirror = match mirror {
        None => None,
        Some(file) => Some(
            layout
                .mirror_groups
                .iter()
                .enumerate()
                .map(|(g, group)| {
                    let names: Vec<&str> = layout
                        .tensors
                        .iter()
                        .filter(|t| t.mirror.0 == g)
                        .map(|t| t.name.as_str())
                        .collect();
                    gather(file, &names, group.dtype, group.numel)
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    Ok(RestoredRank {
        meta,
        ema,
        copied,
        mirror,
        bema: Vec::new(),
    })
}

/// A `bema` profile's hidden buffers from their parts' bytes (`w0`, then
/// the plain EMA): the averaged tensors of each, as one flat host tensor of
/// the EMA dtype.
pub fn restore_bema(
    layout: &RankLayout,
    start: &[u8],
    ema: &[u8],
    ema_kind: Kind,
) -> Result<(Tensor, Tensor), FormatError> {
    let ema_dtype = DType::from_kind(ema_kind).unwrap_or(DType::F32);
    let averaged: Vec<&str> = averaged_members(layout)
        .into_iter()
        .map(|i| layout.tensors[i].name.as_str())
        .collect();
    let mut flat = [start, ema].into_iter().map(|file| {
        let (_, header) = safetensors::SafeTensors::read_metadata(file)
            .map_err(|e| FormatError::Parse(e.to_string()))?;
        check_part_format(header.metadata().as_ref())?;
        gather(file, &averaged, ema_dtype, layout.ema_numel)
    });
    let start = flat.next().expect("two parts")?;
    let ema = flat.next().expect("two parts")?;
    Ok((start, ema))
}
