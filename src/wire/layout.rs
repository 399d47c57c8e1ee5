//! The layout a rank registers with its first push: each tensor's name,
//! dtype, shape and chunk, and where it lives in the rank's flat buffers
//! (averaged or copied, and its mirror slot). Later pushes are checked
//! against it; the engine allocates from it, and stored parts are laid out
//! and described by it.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::{Chunk, DType, ParsedPush};
use crate::run::RunConfig;

/// Whether a tensor is averaged or copied, and where it lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Slot {
    /// Element offset in each profile's flat EMA buffer.
    Averaged { offset: i64 },
    /// Copied-buffer group and element offset in it.
    Copied { group: usize, offset: i64 },
}

/// One tensor of a rank's registered layout.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayoutTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub numel: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<Chunk>,
    #[serde(flatten)]
    pub slot: Slot,
    /// Mirror group and element offset.
    #[serde(rename = "mirror_slot")]
    pub mirror: (usize, i64),
}

/// A flat buffer's dtype and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Group {
    pub dtype: DType,
    pub numel: i64,
}

/// The tensors a rank registered with its first push.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankLayout {
    pub tensors: Vec<LayoutTensor>,
    /// Name -> position in `tensors` (rebuilt after deserialising).
    #[serde(skip)]
    pub index: HashMap<String, usize>,
    /// Elements in each profile's flat EMA buffer.
    pub ema_numel: i64,
    pub copied_groups: Vec<Group>,
    pub mirror_groups: Vec<Group>,
    /// Tied names (alias -> registered name): held once, and written under
    /// both names wherever the rank's tensors are served or downloaded.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub aliases: BTreeMap<String, String>,
}

impl RankLayout {
    /// Registers the layout of a first push.
    pub fn register(push: &ParsedPush, config: &RunConfig, copy: &globset::GlobSet) -> Self {
        let mut tensors = Vec::with_capacity(push.tensors.len());
        let mut ema_numel = 0i64;
        let mut copied_groups: Vec<Group> = Vec::new();
        let mut mirror_groups: Vec<Group> = Vec::new();
        fn place(groups: &mut Vec<Group>, dtype: DType, numel: i64) -> (usize, i64) {
            let g = match groups.iter().position(|g| g.dtype == dtype) {
                Some(g) => g,
                None => {
                    groups.push(Group { dtype, numel: 0 });
                    groups.len() - 1
                }
            };
            let offset = groups[g].numel;
            groups[g].numel += numel;
            (g, offset)
        }
        for t in &push.tensors {
            let numel = t.numel();
            let averaged = t.dtype.is_float() && !copy.is_match(&t.name);
            let slot = if averaged {
                let offset = ema_numel;
                ema_numel += numel;
                Slot::Averaged { offset }
            } else {
                let (group, offset) = place(&mut copied_groups, t.dtype, numel);
                Slot::Copied { group, offset }
            };
            let mirror = if config.mirror {
                place(&mut mirror_groups, t.dtype, numel)
            } else {
                (0, 0)
            };
            tensors.push(LayoutTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                numel,
                chunk: t.chunk.clone(),
                slot,
                mirror,
            });
        }
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        RankLayout {
            tensors,
            index,
            ema_numel,
            copied_groups,
            mirror_groups,
            aliases: push.aliases.clone(),
        }
    }

    /// Rebuilds the name index (it is not serialised).
    pub fn rebuild_index(&mut self) {
        self.index = self
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
    }

    /// For each pushed tensor, the index of its layout tensor; or why the
    /// push does not match the registered layout.
    pub fn match_push(&self, push: &ParsedPush) -> Result<Vec<usize>, String> {
        if push.aliases != self.aliases {
            return Err(format!(
                "the push ties names {:?}, the registered layout {:?}",
                push.aliases, self.aliases
            ));
        }
        if push.tensors.len() != self.tensors.len() {
            let missing = self
                .tensors
                .iter()
                .find(|t| !push.tensors.iter().any(|p| p.name == t.name));
            return Err(match missing {
                Some(t) => format!(
                    "the push has {} tensors, the registered layout {}; `{}` is missing",
                    push.tensors.len(),
                    self.tensors.len(),
                    t.name
                ),
                None => format!(
                    "the push has {} tensors, the registered layout {}",
                    push.tensors.len(),
                    self.tensors.len()
                ),
            });
        }
        push.tensors
            .iter()
            .map(|p| {
                let &i = self
                    .index
                    .get(&p.name)
                    .ok_or_else(|| format!("`{}` is not in the registered layout", p.name))?;
                let t = &self.tensors[i];
                if p.quant.is_some() {
                    // A quantised delta: stored other than registered.
                    if !t.dtype.is_float() {
                        return Err(format!(
                            "`{}` was registered as {}, which is not averaged, and is now a quantised delta",
                            p.name, t.dtype
                        ));
                    }
                } else if t.dtype != p.dtype {
                    return Err(format!(
                        "`{}` was registered as {} and is now {}",
                        p.name, t.dtype, p.dtype
                    ));
                }
                if t.shape != p.shape {
                    return Err(format!(
                        "`{}` was registered with shape {:?} and now has {:?}",
                        p.name, t.shape, p.shape
                    ));
                }
                if t.chunk != p.chunk {
                    return Err(format!(
                        "`{}` was registered with chunk {:?} and now has {:?}",
                        p.name, t.chunk, p.chunk
                    ));
                }
                Ok(i)
            })
            .collect()
    }

    /// Bytes of one profile's EMA buffer.
    pub fn ema_bytes(&self, ema_dtype_size: usize) -> u64 {
        self.ema_numel as u64 * ema_dtype_size as u64
    }

    pub fn copied_bytes(&self) -> u64 {
        self.copied_groups
            .iter()
            .map(|g| g.numel as u64 * g.dtype.size() as u64)
            .sum()
    }

    pub fn mirror_bytes(&self) -> u64 {
        self.mirror_groups
            .iter()
            .map(|g| g.numel as u64 * g.dtype.size() as u64)
            .sum()
    }
}
