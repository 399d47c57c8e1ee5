//! The stored form of a rank's snapshot metadata: what the catalog keeps
//! with every part file (`snapshot_files.state`) so that a restore, a
//! download or a post-hoc job can read the part back.
//!
//! The types here are the format, written out field by field; the engine's
//! [`RankLayout`] and [`RankMeta`] are converted to and from them, so that a
//! change to the engine's structs cannot change what is on disk. Every
//! document carries its format number (`{"format": 1, ...}`):
//!
//! - format 0 (legacy): the unversioned JSON every version before format 1
//!   wrote (the engine structs serialised as they were), still read;
//! - format 1: [`StoredRankMeta`].
//!
//! The rule: a reader accepts every earlier format and refuses a newer one
//! with [`MetaError::Newer`], never guessing. [`decode_rank_meta`] is the
//! one reader and [`encode_rank_meta`] the one writer; the layout a reader
//! returns has its name index built and its offsets checked against its
//! groups, so no caller fixes it up after loading.
//!
//! The part files themselves (safetensors) carry the same number under
//! [`FORMAT_KEY`] in their `__metadata__` ([`check_part_format`]).

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::engine::capture::RankMeta;
use crate::wire::layout::{Group, LayoutTensor, RankLayout, Slot};
use crate::wire::{Chunk, DType};

/// The format this version writes.
pub const FORMAT_VERSION: u32 = 1;

/// The `__metadata__` key of a part file holding its format number (absent
/// in files written before format 1).
pub const FORMAT_KEY: &str = "polyak.format";

/// Why stored metadata cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MetaError {
    /// Written by a newer version: this server does not know its format.
    #[error(
        "written in snapshot format {found}; this server reads formats up to {FORMAT_VERSION} \
         (a newer polyak wrote it)"
    )]
    Newer { found: u32 },
    /// Not a document of any known format, or one that does not hold
    /// together (an offset outside its buffer, an unknown dtype).
    #[error("unreadable snapshot metadata: {0}")]
    Malformed(String),
}

fn malformed(what: impl std::fmt::Display) -> MetaError {
    MetaError::Malformed(what.to_string())
}

/// A rank's step bookkeeping and layout, format 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredRankMeta {
    /// Always [`FORMAT_VERSION`] when written.
    pub format: u32,
    pub layout: StoredLayout,
    /// The last step the rank applied.
    pub last_step: Option<u64>,
    /// The digest of the body applied at `last_step` (`BodyDigest`'s stored
    /// form), for duplicate detection after a restore.
    pub last_digest: Option<String>,
    /// Per profile name: pushes averaged (SWA).
    pub swa_n: BTreeMap<String, u64>,
    /// Whether the mirror holds a keyframe (deltas apply to it).
    pub has_keyframe: bool,
    /// The rank's lineage, raised by each `resume` (absent: 0, as every
    /// part written before it existed).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The tensors of a rank and the flat buffers they live in, format 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredLayout {
    /// In registration order.
    pub tensors: Vec<StoredTensor>,
    /// Elements of each profile's flat buffer of averaged tensors.
    pub ema_numel: i64,
    /// The copied tensors' flat buffers, one per dtype.
    pub copied_groups: Vec<StoredGroup>,
    /// The mirror's flat buffers, one per pushed dtype (empty without one).
    pub mirror_groups: Vec<StoredGroup>,
    /// Tied names: alias -> registered name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub aliases: BTreeMap<String, String>,
}

/// One tensor of a stored layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredTensor {
    pub name: String,
    /// The pushed dtype, as safetensors names it (`F32`, `BF16`, `I64`, ...).
    pub dtype: String,
    /// The pushed (local) shape.
    pub shape: Vec<i64>,
    pub numel: i64,
    /// Where a chunk of a sharded tensor sits in the whole tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<StoredChunk>,
    /// Averaged (in the profiles' buffers) or copied, and where.
    pub place: StoredPlace,
    /// Where it lives in the mirror (absent without a mirror).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<StoredOffset>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredChunk {
    pub global_shape: Vec<i64>,
    pub offsets: Vec<i64>,
}

/// Where a tensor's elements lie in the rank's flat buffers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum StoredPlace {
    /// Element offset in each profile's buffer of averaged tensors.
    Averaged { offset: i64 },
    /// Element offset in copied group `group`.
    Copied { group: usize, offset: i64 },
}

/// An element offset in one of a list of groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredOffset {
    pub group: usize,
    pub offset: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredGroup {
    /// As safetensors names it.
    pub dtype: String,
    pub numel: i64,
}

/// Writes a rank's metadata in the current format.
pub fn encode_rank_meta(meta: &RankMeta) -> String {
    let stored = StoredRankMeta::from_engine(meta);
    serde_json::to_string(&stored).expect("stored metadata serialises")
}

/// Reads a rank's metadata in any format up to [`FORMAT_VERSION`]: the
/// layout comes back checked and with its name index built.
pub fn decode_rank_meta(json: &str) -> Result<RankMeta, MetaError> {
    let value: serde_json::Value = serde_json::from_str(json).map_err(malformed)?;
    let object = value
        .as_object()
        .ok_or_else(|| malformed("not a JSON object"))?;
    let stored = match version_of(object)? {
        0 => legacy::LegacyRankMeta::deserialize(&value)
            .map_err(malformed)?
            .upgrade()?,
        _ => StoredRankMeta::deserialize(&value).map_err(malformed)?,
    };
    stored.into_engine()
}

/// The rank's lineage recorded in a part's metadata (`generation`), read
/// without decoding its layout: 0 when absent (every format before it) or
/// unreadable (the full decode reports that).
pub fn generation_of(json: &str) -> u64 {
    #[derive(Deserialize)]
    struct Lineage {
        #[serde(default)]
        generation: u64,
    }
    serde_json::from_str::<Lineage>(json)
        .map(|l| l.generation)
        .unwrap_or(0)
}

/// Writes a rank's layout alone in the current format, as the catalog's
/// rank rows keep it: `{"format": 1, "layout": {...}}`.
pub fn encode_layout(layout: &RankLayout) -> String {
    serde_json::json!({"format": FORMAT_VERSION, "layout": StoredLayout::from_engine(layout)})
        .to_string()
}

/// Reads a layout [`encode_layout`] wrote, or the legacy unversioned
/// layout of earlier versions.
pub fn decode_layout(value: &serde_json::Value) -> Result<RankLayout, MetaError> {
    let object = value
        .as_object()
        .ok_or_else(|| malformed("not a JSON object"))?;
    let stored = match version_of(object)? {
        0 => legacy::LegacyLayout::deserialize(value)
            .map_err(malformed)?
            .upgrade()?,
        _ => StoredLayout::deserialize(&value["layout"]).map_err(malformed)?,
    };
    stored.into_engine()
}

/// The format of a document: 0 without a `format` field; an error for one
/// newer than [`FORMAT_VERSION`] or not a number.
fn version_of(object: &serde_json::Map<String, serde_json::Value>) -> Result<u32, MetaError> {
    match object.get("format") {
        None => Ok(0),
        Some(v) => match v.as_u64() {
            Some(n) if n > FORMAT_VERSION as u64 => Err(MetaError::Newer {
                found: u32::try_from(n).unwrap_or(u32::MAX),
            }),
            Some(n) if n >= 1 => Ok(n as u32),
            _ => Err(malformed(format!("unknown format {v}"))),
        },
    }
}

/// Checks a part file's `__metadata__`: a file without [`FORMAT_KEY`] was
/// written before format 1 and is read as it is; a newer format is refused.
pub fn check_part_format(metadata: Option<&HashMap<String, String>>) -> Result<(), MetaError> {
    match metadata.and_then(|m| m.get(FORMAT_KEY)) {
        None => Ok(()),
        Some(v) => match v.parse::<u32>() {
            Ok(n) if n <= FORMAT_VERSION => Ok(()),
            Ok(n) => Err(MetaError::Newer { found: n }),
            Err(_) => Err(malformed(format!("{FORMAT_KEY} is `{v}`"))),
        },
    }
}

fn dtype_of(name: &str) -> Result<DType, MetaError> {
    DType::from_name(name).ok_or_else(|| malformed(format!("unknown dtype `{name}`")))
}

impl StoredRankMeta {
    pub fn from_engine(meta: &RankMeta) -> Self {
        StoredRankMeta {
            format: FORMAT_VERSION,
            layout: StoredLayout::from_engine(&meta.layout),
            last_step: meta.last_step,
            last_digest: meta.last_digest.clone(),
            swa_n: meta.swa_n.clone(),
            has_keyframe: meta.has_keyframe,
            generation: meta.generation,
        }
    }

    pub fn into_engine(self) -> Result<RankMeta, MetaError> {
        Ok(RankMeta {
            layout: self.layout.into_engine()?,
            last_step: self.last_step,
            last_digest: self.last_digest,
            swa_n: self.swa_n,
            has_keyframe: self.has_keyframe,
            generation: self.generation,
        })
    }
}

impl StoredGroup {
    fn from_engine(g: &Group) -> Self {
        StoredGroup {
            dtype: g.dtype.safetensors_name().to_string(),
            numel: g.numel,
        }
    }
}

impl StoredLayout {
    pub fn from_engine(layout: &RankLayout) -> Self {
        let mirrored = !layout.mirror_groups.is_empty();
        StoredLayout {
            tensors: layout
                .tensors
                .iter()
                .map(|t| StoredTensor {
                    name: t.name.clone(),
                    dtype: t.dtype.safetensors_name().to_string(),
                    shape: t.shape.clone(),
                    numel: t.numel,
                    chunk: t.chunk.as_ref().map(|c| StoredChunk {
                        global_shape: c.global_shape.clone(),
                        offsets: c.offsets.clone(),
                    }),
                    place: match t.slot {
                        Slot::Averaged { offset } => StoredPlace::Averaged { offset },
                        Slot::Copied { group, offset } => StoredPlace::Copied { group, offset },
                    },
                    mirror: mirrored.then_some(StoredOffset {
                        group: t.mirror.0,
                        offset: t.mirror.1,
                    }),
                })
                .collect(),
            ema_numel: layout.ema_numel,
            copied_groups: layout
                .copied_groups
                .iter()
                .map(StoredGroup::from_engine)
                .collect(),
            mirror_groups: layout
                .mirror_groups
                .iter()
                .map(StoredGroup::from_engine)
                .collect(),
            aliases: layout.aliases.clone(),
        }
    }

    /// The engine's layout, checked: every tensor's elements inside its
    /// buffers, groups of known dtypes, names unique, aliases naming
    /// tensors; with its name index built.
    pub fn into_engine(self) -> Result<RankLayout, MetaError> {
        let copied_groups = groups_of(&self.copied_groups)?;
        let mirror_groups = groups_of(&self.mirror_groups)?;
        let tensors = self
            .tensors
            .into_iter()
            .map(|t| t.into_engine(self.ema_numel, &copied_groups, &mirror_groups))
            .collect::<Result<Vec<_>, _>>()?;
        let mut names = HashSet::new();
        if let Some(t) = tensors.iter().find(|t| !names.insert(t.name.as_str())) {
            return Err(malformed(format!("`{}` appears twice", t.name)));
        }
        if let Some((alias, target)) = self
            .aliases
            .iter()
            .find(|(a, t)| names.contains(a.as_str()) || !names.contains(t.as_str()))
        {
            return Err(malformed(format!(
                "alias `{alias}` -> `{target}` does not name one stored tensor"
            )));
        }
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(RankLayout {
            tensors,
            index,
            ema_numel: self.ema_numel,
            copied_groups,
            mirror_groups,
            aliases: self.aliases,
        })
    }
}

/// The engine's groups, of known dtypes and sizes.
fn groups_of(gs: &[StoredGroup]) -> Result<Vec<Group>, MetaError> {
    gs.iter()
        .map(|g| {
            if g.numel < 0 {
                return Err(malformed(format!("a group of {} elements", g.numel)));
            }
            Ok(Group {
                dtype: dtype_of(&g.dtype)?,
                numel: g.numel,
            })
        })
        .collect()
}

/// Whether `numel` elements at `offset` fit a buffer (`what`) of `len`.
fn within(name: &str, what: &str, offset: i64, numel: i64, len: i64) -> Result<(), MetaError> {
    if offset < 0 || offset.checked_add(numel).is_none_or(|end| end > len) {
        Err(malformed(format!(
            "`{name}`: {numel} elements at {offset} do not fit the {what} of {len}"
        )))
    } else {
        Ok(())
    }
}

impl StoredTensor {
    /// The engine's tensor, checked: its shape holds its elements, which
    /// fit the averaged buffer or its copied group, and its mirror group.
    fn into_engine(
        self,
        ema_numel: i64,
        copied_groups: &[Group],
        mirror_groups: &[Group],
    ) -> Result<LayoutTensor, MetaError> {
        let dtype = dtype_of(&self.dtype)?;
        let numel = self
            .shape
            .iter()
            .try_fold(1i64, |n, &d| if d < 0 { None } else { n.checked_mul(d) });
        if numel != Some(self.numel) {
            return Err(malformed(format!(
                "`{}`: shape {:?} does not hold {} elements",
                self.name, self.shape, self.numel
            )));
        }
        let slot = match self.place {
            StoredPlace::Averaged { offset } => {
                within(&self.name, "averaged buffer", offset, self.numel, ema_numel)?;
                Slot::Averaged { offset }
            }
            StoredPlace::Copied { group, offset } => {
                let g = copied_groups.get(group).ok_or_else(|| {
                    malformed(format!("`{}`: no copied group {group}", self.name))
                })?;
                if g.dtype != dtype {
                    return Err(malformed(format!(
                        "`{}` is {dtype}, its copied group {}",
                        self.name, g.dtype
                    )));
                }
                within(&self.name, "copied group", offset, self.numel, g.numel)?;
                Slot::Copied { group, offset }
            }
        };
        let mirror = match self.mirror {
            None if mirror_groups.is_empty() => (0, 0),
            None => return Err(malformed(format!("`{}` has no mirror place", self.name))),
            Some(StoredOffset { group, offset }) => {
                let g = mirror_groups.get(group).ok_or_else(|| {
                    malformed(format!("`{}`: no mirror group {group}", self.name))
                })?;
                within(&self.name, "mirror group", offset, self.numel, g.numel)?;
                (group, offset)
            }
        };
        Ok(LayoutTensor {
            name: self.name,
            dtype,
            shape: self.shape,
            numel: self.numel,
            chunk: self.chunk.map(|c| Chunk {
                global_shape: c.global_shape,
                offsets: c.offsets,
            }),
            slot,
            mirror,
        })
    }
}

/// Format 0: the unversioned JSON of every version before format 1, spelled
/// out here as it was written (the engine structs' serde form at the time),
/// so that the engine's structs may change without losing these files.
mod legacy {
    use super::*;

    #[derive(Deserialize)]
    pub struct LegacyRankMeta {
        layout: LegacyLayout,
        last_step: Option<u64>,
        last_digest: Option<String>,
        swa_n: BTreeMap<String, u64>,
        has_keyframe: bool,
    }

    #[derive(Deserialize)]
    pub struct LegacyLayout {
        tensors: Vec<LegacyTensor>,
        ema_numel: i64,
        copied_groups: Vec<LegacyGroup>,
        mirror_groups: Vec<LegacyGroup>,
        #[serde(default)]
        aliases: BTreeMap<String, String>,
    }

    #[derive(Deserialize)]
    struct LegacyTensor {
        name: String,
        dtype: String,
        shape: Vec<i64>,
        numel: i64,
        #[serde(default)]
        chunk: Option<StoredChunk>,
        #[serde(flatten)]
        place: StoredPlace,
        /// `[group, offset]`; `[0, 0]` without a mirror.
        mirror_slot: (usize, i64),
    }

    #[derive(Deserialize)]
    struct LegacyGroup {
        dtype: String,
        numel: i64,
    }

    impl LegacyRankMeta {
        /// The same document in format 1.
        pub fn upgrade(self) -> Result<StoredRankMeta, MetaError> {
            Ok(StoredRankMeta {
                format: 0,
                layout: self.layout.upgrade()?,
                last_step: self.last_step,
                last_digest: self.last_digest,
                swa_n: self.swa_n,
                has_keyframe: self.has_keyframe,
                generation: 0,
            })
        }
    }

    impl LegacyLayout {
        /// The same layout in format 1.
        pub fn upgrade(self) -> Result<StoredLayout, MetaError> {
            let group = |g: LegacyGroup| -> Result<StoredGroup, MetaError> {
                Ok(StoredGroup {
                    dtype: dtype_of(&g.dtype)?.safetensors_name().to_string(),
                    numel: g.numel,
                })
            };
            let l = self;
            let mirrored = !l.mirror_groups.is_empty();
            Ok(StoredLayout {
                tensors: l
                    .tensors
                    .into_iter()
                    .map(|t| StoredTensor {
                        name: t.name,
                        dtype: t.dtype,
                        shape: t.shape,
                        numel: t.numel,
                        chunk: t.chunk,
                        place: t.place,
                        mirror: mirrored.then_some(StoredOffset {
                            group: t.mirror_slot.0,
                            offset: t.mirror_slot.1,
                        }),
                    })
                    .collect(),
                ema_numel: l.ema_numel,
                copied_groups: l
                    .copied_groups
                    .into_iter()
                    .map(group)
                    .collect::<Result<_, _>>()?,
                mirror_groups: l
                    .mirror_groups
                    .into_iter()
                    .map(group)
                    .collect::<Result<_, _>>()?,
                aliases: l.aliases,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    //! Files written before format 1 (`tests/data/format-v0/`, see its
    //! README) read back to the values their writer pushed; format 1 reads
    //! back to what it wrote; a newer format is refused.

    use std::path::PathBuf;

    use serde_json::Value;

    use super::*;
    use crate::snapshot::convert;
    use crate::snapshot::format::{self, FormatError};

    fn v0_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/format-v0")
    }

    fn v0_json(name: &str) -> Value {
        let text = std::fs::read_to_string(v0_dir().join(name)).expect("fixture");
        serde_json::from_str(&text).expect("fixture JSON")
    }

    /// `(kind, rank, part, state)` of every catalog row of the fixtures.
    fn v0_rows() -> Vec<(String, u32, String, String)> {
        let rows = v0_json("rows.json");
        let rows = rows.as_array().expect("rows");
        assert_eq!(
            rows.len(),
            16,
            "2 snapshots x 2 ranks x (3 profiles + mirror)"
        );
        rows.iter()
            .map(|r| {
                (
                    r["kind"].as_str().unwrap().to_string(),
                    r["rank"].as_u64().unwrap() as u32,
                    r["part"].as_str().unwrap().to_string(),
                    r["state"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    fn floats(v: &Value) -> Vec<f64> {
        match v {
            Value::Array(items) => items.iter().flat_map(floats).collect(),
            other => vec![other.as_f64().expect("a number")],
        }
    }

    fn values(dtype: DType, bytes: &[u8]) -> Vec<f64> {
        let w = dtype.size();
        bytes
            .chunks_exact(w)
            .map(|b| match dtype {
                DType::F32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
                DType::F16 => half::f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
                DType::I64 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
                other => panic!("no {other} in the fixtures"),
            })
            .collect()
    }

    /// The layout and bookkeeping of every row: the names, dtypes, shapes,
    /// chunks, tied name, places and steps the fixture's writer pushed.
    #[test]
    fn legacy_rows_read_back_to_what_was_pushed() {
        for (kind, rank, part, state) in v0_rows() {
            let at = format!("{kind} rank {rank} part {part}");
            assert!(!state.contains("\"format\""), "{at}: a format-0 row");
            let meta = decode_rank_meta(&state).unwrap_or_else(|e| panic!("{at}: {e}"));
            assert_eq!(meta.last_step, Some(2), "{at}");
            assert!(meta.has_keyframe, "{at}");
            assert!(meta
                .last_digest
                .as_deref()
                .is_some_and(|d| d.starts_with("xxh3-blocks:")));
            assert_eq!(
                meta.swa_n,
                BTreeMap::from([("avg".into(), 3), ("fast".into(), 0), ("slow".into(), 0)]),
                "{at}: three pushes averaged by the SWA profile"
            );
            let l = &meta.layout;
            assert_eq!(l.aliases, BTreeMap::from([("head".into(), "w".into())]));
            let by_name: BTreeMap<&str, &LayoutTensor> =
                l.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
            assert_eq!(
                by_name.keys().copied().collect::<Vec<_>>(),
                ["b", "count", "h", "w"]
            );
            for (i, t) in l.tensors.iter().enumerate() {
                assert_eq!(l.index[&t.name], i, "{at}: the index is built");
            }
            let expect = [
                ("w", DType::F32, vec![2, 3], true),
                ("b", DType::F32, vec![3], true),
                ("h", DType::F16, vec![4], true),
                ("count", DType::I64, vec![2], false),
            ];
            for (name, dtype, shape, averaged) in expect {
                let t = by_name[name];
                assert_eq!((t.dtype, &t.shape), (dtype, &shape), "{at}: `{name}`");
                assert_eq!(t.numel, shape.iter().product::<i64>());
                assert_eq!(
                    matches!(t.slot, Slot::Averaged { .. }),
                    averaged,
                    "{at}: `{name}`"
                );
                let group = l.mirror_groups[t.mirror.0];
                assert_eq!(group.dtype, dtype, "{at}: `{name}` mirrored in its dtype");
            }
            let chunk = by_name["w"].chunk.as_ref().expect("`w` is a chunk");
            assert_eq!(chunk.global_shape, [4, 3]);
            assert_eq!(chunk.offsets, [2 * rank as i64, 0]);
            assert!(by_name["b"].chunk.is_none());
            assert_eq!(l.ema_numel, 3 + 6 + 4);
            assert_eq!(
                l.copied_groups,
                [Group {
                    dtype: DType::I64,
                    numel: 2
                }]
            );
            assert_eq!(l.mirror_groups.iter().map(|g| g.numel).sum::<i64>(), 15);
        }
    }

    /// The part files restore, through the catalog row's metadata, to the
    /// averages torch computed and the weights pushed last.
    #[test]
    fn legacy_part_files_restore_to_torchs_values() {
        let expected = v0_json("expected.json");
        let (_, _, _, state) = v0_rows()
            .into_iter()
            .find(|(kind, rank, part, _)| kind == "manual" && *rank == 0 && part == "fast")
            .expect("the manual snapshot's rank 0");
        let meta = decode_rank_meta(&state).unwrap();
        let fast = std::fs::read(v0_dir().join("manual.rank-00000.fast.safetensors")).unwrap();
        let mirror =
            std::fs::read(v0_dir().join("manual.rank-00000.__mirror__.safetensors")).unwrap();
        // Written before format 1: no format key, read all the same.
        let mut file =
            std::fs::File::open(v0_dir().join("manual.rank-00000.fast.safetensors")).unwrap();
        assert_eq!(format::read_tensor_table(&mut file).unwrap().len(), 4);
        let (_, header) = safetensors::SafeTensors::read_metadata(&fast).unwrap();
        let keys = header.metadata().clone().unwrap();
        assert!(!keys.contains_key(FORMAT_KEY));
        assert_eq!(keys["polyak.profile"], "fast");
        assert_eq!(keys["polyak.aliases"], r#"{"head":"w"}"#);

        let restored =
            convert::restore_rank(meta, &[fast], Some(&mirror), tch::Kind::Float).unwrap();
        let layout = restored.meta.layout.clone();
        let mut ema = restored.ema;
        assert_eq!(ema.len(), 1);
        let tensors = convert::flat_tensors(&layout, ema.remove(0), restored.copied);
        let want = &expected["ema"]["0"]["fast"];
        let pushed = &expected["pushed"]["0"];
        let mut checked = 0;
        for (name, (dtype, bytes)) in &tensors {
            let want = want.get(name).unwrap_or(&pushed[name]);
            assert_eq!(values(*dtype, bytes), floats(want), "`{name}`");
            checked += 1;
        }
        assert_eq!(checked, 4);
        // The mirror: every tensor as pushed last, in its pushed dtype.
        let mirror = restored.mirror.expect("a mirror");
        for t in &layout.tensors {
            let (g, offset) = t.mirror;
            let buf = crate::engine::host_bytes(mirror[g].shallow_clone());
            let size = t.dtype.size();
            let start = offset as usize * size;
            let got = values(t.dtype, &buf[start..start + t.numel as usize * size]);
            assert_eq!(got, floats(&pushed[&t.name]), "mirror `{}`", t.name);
        }
    }

    /// Format 1 writes its number and reads back to the same metadata, and
    /// the legacy rows come back the same through it.
    #[test]
    fn format_1_round_trips() {
        for (_, _, _, state) in v0_rows() {
            let meta = decode_rank_meta(&state).unwrap();
            let json = encode_rank_meta(&meta);
            let value: Value = serde_json::from_str(&json).unwrap();
            assert_eq!(value["format"], FORMAT_VERSION);
            assert!(value["layout"]["tensors"][0]["place"]["role"].is_string());
            let again = decode_rank_meta(&json).unwrap();
            assert_eq!(
                StoredRankMeta::from_engine(&again),
                StoredRankMeta::from_engine(&meta)
            );
            assert_eq!(again.layout.index, meta.layout.index);
            let layout =
                decode_layout(&serde_json::from_str(&encode_layout(&meta.layout)).unwrap())
                    .unwrap();
            assert_eq!(
                StoredLayout::from_engine(&layout),
                StoredLayout::from_engine(&meta.layout)
            );
            let legacy: Value = serde_json::from_str(&state).unwrap();
            let layout = decode_layout(&legacy["layout"]).unwrap();
            assert_eq!(
                StoredLayout::from_engine(&layout),
                StoredLayout::from_engine(&meta.layout)
            );
        }
    }

    /// A newer format is refused, saying which; so is a part file of one.
    #[test]
    fn newer_formats_are_refused() {
        let (_, _, _, state) = v0_rows().remove(0);
        let meta = decode_rank_meta(&state).unwrap();
        let mut value: Value = serde_json::from_str(&encode_rank_meta(&meta)).unwrap();
        value["format"] = (FORMAT_VERSION + 1).into();
        let err = decode_rank_meta(&value.to_string()).unwrap_err();
        assert_eq!(
            err,
            MetaError::Newer {
                found: FORMAT_VERSION + 1
            }
        );
        assert!(err.to_string().contains("reads formats up to 1"), "{err}");
        let layout = serde_json::json!({"format": 7, "layout": {}});
        assert_eq!(
            decode_layout(&layout).unwrap_err(),
            MetaError::Newer { found: 7 }
        );
        for bad in [Value::from(0), Value::from("1"), Value::from(-1)] {
            value["format"] = bad;
            assert!(matches!(
                decode_rank_meta(&value.to_string()),
                Err(MetaError::Malformed(_))
            ));
        }

        let mut keys = HashMap::from([(FORMAT_KEY.to_string(), "1".to_string())]);
        assert_eq!(check_part_format(Some(&keys)), Ok(()));
        assert_eq!(check_part_format(None), Ok(()));
        keys.insert(FORMAT_KEY.into(), "2".into());
        assert_eq!(
            check_part_format(Some(&keys)),
            Err(MetaError::Newer { found: 2 })
        );

        // A part file claiming format 2 does not restore.
        let fast = std::fs::read(v0_dir().join("manual.rank-00000.fast.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&fast).unwrap();
        let mut metadata = st_metadata(&fast);
        metadata.insert(FORMAT_KEY.into(), "2".into());
        let newer = safetensors::serialize(st.tensors(), Some(metadata)).unwrap();
        match convert::restore_rank(meta, &[newer], None, tch::Kind::Float) {
            Err(FormatError::Meta(MetaError::Newer { found: 2 })) => {}
            Err(e) => panic!("refused for another reason: {e}"),
            Ok(_) => panic!("a format 2 part file was restored"),
        }
    }

    fn st_metadata(file: &[u8]) -> HashMap<String, String> {
        let (_, header) = safetensors::SafeTensors::read_metadata(file).unwrap();
        header.metadata().clone().unwrap_or_default()
    }

    /// Metadata that does not hold together is refused, not loaded into a
    /// layout that would index out of its buffers.
    #[test]
    fn inconsistent_metadata_is_refused() {
        let (_, _, _, state) = v0_rows().remove(0);
        let meta = decode_rank_meta(&state).unwrap();
        let good: Value = serde_json::from_str(&encode_rank_meta(&meta)).unwrap();
        type Break = fn(&mut Value);
        let cases: [(&str, Break); 6] = [
            ("offset past the buffer", |v| {
                v["layout"]["tensors"][1]["place"]["offset"] = 100.into()
            }),
            ("shape and numel disagree", |v| {
                v["layout"]["tensors"][1]["numel"] = 5.into()
            }),
            ("unknown dtype", |v| {
                v["layout"]["tensors"][1]["dtype"] = "F12".into()
            }),
            ("no such copied group", |v| {
                v["layout"]["copied_groups"] = serde_json::json!([])
            }),
            ("alias of nothing", |v| {
                v["layout"]["aliases"] = serde_json::json!({"x": "nope"})
            }),
            ("not an object", |v| *v = serde_json::json!([1])),
        ];
        for (what, break_it) in cases {
            let mut v = good.clone();
            break_it(&mut v);
            assert!(
                matches!(
                    decode_rank_meta(&v.to_string()),
                    Err(MetaError::Malformed(_))
                ),
                "{what}"
            );
        }
        assert!(matches!(
            decode_rank_meta("{"),
            Err(MetaError::Malformed(_))
        ));
    }
}
