//! Parsing and validating a push body, in place.
//!
//! The body is one safetensors file. The `safetensors` crate checks the
//! header (its length against the body, its JSON, every tensor's offsets:
//! contiguous, non-overlapping, matching shape times dtype, and covering the
//! data exactly); this module adds polyak's own checks on top: the header
//! limit, the dtypes polyak keeps, `polyak.shards` chunk metadata,
//! `polyak.kind`, and the NaN/Inf scan. Nothing is copied: the result holds
//! byte ranges into the body it was given.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::check::{scan_and_digest, Span};
use super::quant::{fp8_is_nan, scale_at, Quant, QuantFormat, QUANT_KEY, SCALE_SUFFIX};
use super::DType;
use crate::run::NonfinitePolicy;

/// Metadata key holding chunk placement of sharded tensors.
pub const SHARDS_KEY: &str = "polyak.shards";
/// Metadata key selecting `full` or `delta`.
pub const KIND_KEY: &str = "polyak.kind";
/// `__metadata__` key: JSON `{alias: name}` for names that share one
/// tensor's storage (tied weights), pushed once under `name`.
pub const ALIASES_KEY: &str = "polyak.aliases";
/// `__metadata__` key of a keyframe (full push): CRC-32 (hex) of what the
/// client holds as the server's mirror right before this push.
pub const MIRROR_CRC_KEY: &str = "polyak.mirror_crc32";

/// Where a tensor chunk sits in its whole (unsharded) tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    pub global_shape: Vec<i64>,
    pub offsets: Vec<i64>,
}

/// `full`: the tensors are the weights. `delta`: floating point tensors are
/// added to the server's mirror first (integer and bool tensors still carry
/// their values). `xor`: floating point tensors are the bits of the weights
/// XOR the bits of the server's mirror (lossless, and mostly zero bytes for
/// the codec).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PushKind {
    Full,
    Delta,
    Xor,
}

impl PushKind {
    /// Whether the push needs a mirror and a keyframe to apply to.
    pub fn is_relative(self) -> bool {
        !matches!(self, PushKind::Full)
    }
}

/// A quantised delta tensor: its format and where its scales are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorQuant {
    pub format: QuantFormat,
    pub block: usize,
    /// Byte range of its float32 scales in the body (empty for bf16).
    pub scales: Range<usize>,
}

/// One tensor of a push: where its bytes are in the body.
#[derive(Debug, Clone)]
pub struct WireTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<i64>,
    /// Byte range in the body (absolute, header included).
    pub range: Range<usize>,
    pub chunk: Option<Chunk>,
    /// Holds NaN or Inf (only scanned when the policy is not `allow`).
    pub nonfinite: bool,
    /// Set on the tensors of a quantised delta (`dtype` is then the
    /// storage: `U8` for fp8 e4m3, `I8`, `BF16`).
    pub quant: Option<TensorQuant>,
}

impl WireTensor {
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

/// A validated push body.
#[derive(Debug, Clone)]
pub struct ParsedPush {
    pub body: Bytes,
    /// Tensors in the order of their data in the body.
    pub tensors: Vec<WireTensor>,
    pub kind: PushKind,
    /// The body's digest (see [`super::check`]): a repeated push is
    /// recognised by it.
    pub digest: u128,
    /// Tied names: alias -> the pushed name whose tensor it shares.
    pub aliases: BTreeMap<String, String>,
    /// A keyframe's claim of the mirror's CRC-32 before it.
    pub mirror_crc32: Option<u32>,
}

impl ParsedPush {
    pub fn bytes_of(&self, tensor: &WireTensor) -> &[u8] {
        &self.body[tensor.range.clone()]
    }
}

/// Why a push body was refused. Each variant has one HTTP status and code
/// (see `http::error`).
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("invalid safetensors body: {0}")]
    Invalid(String),
    #[error("safetensors header of {len} bytes is over the limit of {limit} bytes")]
    HeaderTooLarge { len: u64, limit: u64 },
    #[error("tensor `{tensor}` has dtype {dtype}, which polyak does not keep (float: F64 F32 F16 BF16; copied: I64 I32 I16 I8 U8 BOOL)")]
    UnsupportedDtype { tensor: String, dtype: String },
    #[error("invalid {SHARDS_KEY} metadata: {0}")]
    InvalidShards(String),
    #[error("invalid metadata: {0}")]
    InvalidMetadata(String),
    #[error("tensor `{tensor}` holds NaN or Inf (the run's nonfinite policy is `reject`)")]
    Nonfinite { tensor: String },
    #[error("the push holds no tensors")]
    Empty,
}

/// Limits applied while parsing.
#[derive(Debug, Clone, Copy)]
pub struct WireLimits {
    pub header_limit: u64,
}

/// Parses and validates a push body. `policy` decides whether tensors are
/// scanned for NaN/Inf and what a hit means.
pub fn parse_push(
    body: Bytes,
    limits: WireLimits,
    policy: NonfinitePolicy,
) -> Result<ParsedPush, WireError> {
    let (data_start, metadata) = read_header(&body, limits)?;
    let extra = metadata.metadata().clone().unwrap_or_default();
    let PushMeta {
        kind,
        quant,
        mirror_crc32,
        mut chunks,
        aliases,
    } = PushMeta::parse(&extra)?;
    let names = metadata.offset_keys();
    if names.is_empty() {
        return Err(WireError::Empty);
    }
    check_aliases(&metadata, &aliases)?;
    let mut tensors = Vec::with_capacity(names.len());
    let mut scales: HashMap<String, Range<usize>> = HashMap::new();
    for name in names {
        let info = metadata.info(&name).ok_or_else(|| {
            WireError::Invalid(format!("tensor `{name}` vanished from the header"))
        })?;
        let (start, end) = info.data_offsets;
        let range = data_start + start..data_start + end;
        if let (Some(q), Some(of)) = (quant, name.strip_suffix(SCALE_SUFFIX)) {
            if q.format.scaled() {
                if info.dtype != safetensors::Dtype::F32 || info.shape.len() != 1 {
                    return Err(WireError::InvalidMetadata(format!(
                        "scales `{name}` must be a 1-d F32 tensor"
                    )));
                }
                scales.insert(of.to_string(), range);
                continue;
            }
        }
        let chunk = chunks.remove(&name);
        tensors.push(wire_tensor(name, info, range, chunk, quant)?);
    }
    attach_scales(&mut tensors, scales)?;
    if let Some(name) = chunks.keys().next() {
        return Err(WireError::InvalidShards(format!(
            "chunk metadata for `{name}`, which is not in the push"
        )));
    }
    let digest = scan_nonfinite(&body, &mut tensors, kind, policy)?;
    Ok(ParsedPush {
        body,
        tensors,
        kind,
        digest,
        aliases,
        mirror_crc32,
    })
}

/// The safetensors header of a push body, within `limits`: where the data
/// starts, and the parsed header.
fn read_header(
    body: &Bytes,
    limits: WireLimits,
) -> Result<(usize, safetensors::tensor::Metadata), WireError> {
    let prefix: [u8; 8] = body
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| {
            WireError::Invalid(format!(
                "body of {} bytes is shorter than the 8-byte header length",
                body.len()
            ))
        })?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > limits.header_limit {
        return Err(WireError::HeaderTooLarge {
            len: header_len,
            limit: limits.header_limit,
        });
    }
    if header_len > body.len() as u64 - 8 {
        return Err(WireError::Invalid(format!(
            "header length {header_len} runs past the end of the {}-byte body",
            body.len()
        )));
    }
    let (n, metadata) = safetensors::SafeTensors::read_metadata(body)
        .map_err(|e| classify_safetensors_error(e, &body[8..8 + header_len as usize]))?;
    Ok((8 + n, metadata))
}

/// What a push's `__metadata__` says about it.
struct PushMeta {
    kind: PushKind,
    quant: Option<Quant>,
    mirror_crc32: Option<u32>,
    chunks: HashMap<String, Chunk>,
    aliases: BTreeMap<String, String>,
}

impl PushMeta {
    fn parse(extra: &HashMap<String, String>) -> Result<Self, WireError> {
        let kind = match extra.get(KIND_KEY).map(String::as_str) {
            None | Some("full") => PushKind::Full,
            Some("delta") => PushKind::Delta,
            Some("xor") => PushKind::Xor,
            Some(other) => {
                return Err(WireError::InvalidMetadata(format!(
                    "{KIND_KEY} must be `full`, `delta` or `xor`, got `{other}`"
                )))
            }
        };
        let quant = match extra.get(QUANT_KEY) {
            None => None,
            Some(_) if kind != PushKind::Delta => {
                return Err(WireError::InvalidMetadata(format!(
                    "{QUANT_KEY} needs {KIND_KEY} `delta`"
                )))
            }
            Some(json) => Some(Quant::parse(json).map_err(WireError::InvalidMetadata)?),
        };
        let mirror_crc32 = match extra.get(MIRROR_CRC_KEY) {
            None => None,
            Some(hex) => Some(u32::from_str_radix(hex, 16).map_err(|_| {
                WireError::InvalidMetadata(format!(
                    "{MIRROR_CRC_KEY} must be a CRC-32 in hex, got `{hex}`"
                ))
            })?),
        };
        let chunks = match extra.get(SHARDS_KEY) {
            None => HashMap::new(),
            Some(json) => serde_json::from_str(json).map_err(|e| {
                WireError::InvalidShards(format!("not a JSON object of chunks: {e}"))
            })?,
        };
        let aliases = match extra.get(ALIASES_KEY) {
            None => BTreeMap::new(),
            Some(json) => serde_json::from_str(json).map_err(|e| {
                WireError::InvalidMetadata(format!(
                    "{ALIASES_KEY} is not a JSON object of names: {e}"
                ))
            })?,
        };
        Ok(PushMeta {
            kind,
            quant,
            mirror_crc32,
            chunks,
            aliases,
        })
    }
}

/// Every alias names a pushed tensor and is not one itself.
fn check_aliases(
    metadata: &safetensors::tensor::Metadata,
    aliases: &BTreeMap<String, String>,
) -> Result<(), WireError> {
    for (alias, target) in aliases {
        if metadata.info(alias).is_some() {
            return Err(WireError::InvalidMetadata(format!(
                "{ALIASES_KEY}: `{alias}` is pushed as a tensor and named as an alias"
            )));
        }
        if metadata.info(target).is_none() {
            return Err(WireError::InvalidMetadata(format!(
                "{ALIASES_KEY}: `{alias}` aliases `{target}`, which is not in the push"
            )));
        }
    }
    Ok(())
}

/// One pushed tensor (not a scales tensor): its dtype as stored (fp8 as
/// bytes), its chunk checked against its shape, its quantisation.
fn wire_tensor(
    name: String,
    info: &safetensors::tensor::TensorInfo,
    range: Range<usize>,
    chunk: Option<Chunk>,
    quant: Option<Quant>,
) -> Result<WireTensor, WireError> {
    let fp8 = info.dtype == safetensors::Dtype::F8_E4M3
        && quant.is_some_and(|q| q.format == QuantFormat::Fp8E4m3);
    let dtype = if fp8 {
        DType::U8
    } else {
        DType::from_safetensors(info.dtype).ok_or_else(|| WireError::UnsupportedDtype {
            tensor: name.clone(),
            dtype: format!("{:?}", info.dtype),
        })?
    };
    let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
    if let Some(chunk) = &chunk {
        check_chunk(&name, &shape, chunk)?;
    }
    let quant = quant.and_then(|q| {
        let quantised = match q.format {
            QuantFormat::Bf16 => dtype == DType::BF16,
            QuantFormat::Fp8E4m3 => fp8,
            QuantFormat::Int8 => dtype == DType::I8,
        };
        quantised.then_some(TensorQuant {
            format: q.format,
            block: q.block,
            scales: 0..0,
        })
    });
    Ok(WireTensor {
        name,
        dtype,
        shape,
        range,
        chunk,
        nonfinite: false,
        quant,
    })
}

/// The digest and the NaN/Inf scan, in one pass over the body; marks the
/// tensors holding NaN/Inf, or refuses the push under `reject`. The floats
/// of an XOR push are bit patterns, not values: the engine scans them once
/// they are undone against the mirror.
fn scan_nonfinite(
    body: &Bytes,
    tensors: &mut [WireTensor],
    kind: PushKind,
    policy: NonfinitePolicy,
) -> Result<u128, WireError> {
    let scan = policy != NonfinitePolicy::Allow;
    let spans: Vec<Span> = tensors
        .iter()
        .map(|t| Span {
            dtype: if kind == PushKind::Xor {
                DType::U8
            } else {
                t.dtype
            },
            range: t.range.clone(),
        })
        .collect();
    let (digest, flags) = scan_and_digest(body, &spans, scan);
    for (t, nonfinite) in tensors.iter_mut().zip(flags) {
        t.nonfinite = nonfinite || (scan && quant_nonfinite(body, t));
        if t.nonfinite && policy == NonfinitePolicy::Reject {
            return Err(WireError::Nonfinite {
                tensor: t.name.clone(),
            });
        }
    }
    Ok(digest)
}

/// Gives each fp8/int8 tensor its scales; every scales tensor must belong
/// to one and hold one value per block.
fn attach_scales(
    tensors: &mut [WireTensor],
    mut scales: HashMap<String, Range<usize>>,
) -> Result<(), WireError> {
    for t in tensors.iter_mut() {
        let numel = t.numel();
        let Some(q) = &mut t.quant else { continue };
        if !q.format.scaled() {
            continue;
        }
        let range = scales.remove(&t.name).ok_or_else(|| {
            WireError::InvalidMetadata(format!(
                "quantised `{}` has no `{}{SCALE_SUFFIX}` tensor",
                t.name, t.name
            ))
        })?;
        let want = (numel as usize).div_ceil(q.block);
        if range.len() != 4 * want {
            return Err(WireError::InvalidMetadata(format!(
                "`{}{SCALE_SUFFIX}` holds {} scales; {numel} values in blocks of {} need {want}",
                t.name,
                range.len() / 4,
                q.block
            )));
        }
        q.scales = range;
    }
    if let Some(name) = scales.keys().next() {
        return Err(WireError::InvalidMetadata(format!(
            "`{name}{SCALE_SUFFIX}` scales a tensor that is not quantised in the push"
        )));
    }
    Ok(())
}

/// A quantised tensor holds NaN/Inf when one of its scales does, or (fp8)
/// one of its values is NaN.
fn quant_nonfinite(body: &[u8], t: &WireTensor) -> bool {
    let Some(q) = &t.quant else { return false };
    let scales = &body[q.scales.clone()];
    if (0..scales.len() / 4).any(|i| !scale_at(scales, i).is_finite()) {
        return true;
    }
    q.format == QuantFormat::Fp8E4m3 && body[t.range.clone()].iter().any(|&b| fp8_is_nan(b))
}

/// A chunk must have one offset per dimension and lie inside its global
/// shape.
fn check_chunk(name: &str, shape: &[i64], chunk: &Chunk) -> Result<(), WireError> {
    if chunk.global_shape.len() != shape.len() || chunk.offsets.len() != shape.len() {
        return Err(WireError::InvalidShards(format!(
            "`{name}` has {} dimensions but its chunk gives global_shape of {} and offsets of {}",
            shape.len(),
            chunk.global_shape.len(),
            chunk.offsets.len()
        )));
    }
    for (d, ((&size, &offset), &global)) in shape
        .iter()
        .zip(&chunk.offsets)
        .zip(&chunk.global_shape)
        .enumerate()
    {
        if offset < 0 || global < 0 || offset.checked_add(size).is_none_or(|end| end > global) {
            return Err(WireError::InvalidShards(format!(
                "chunk of `{name}` lies outside its global shape {:?} in dimension {d} (offset {offset}, size {size})",
                chunk.global_shape
            )));
        }
    }
    Ok(())
}

/// Tells an unknown dtype (422) from a malformed header (400): the crate
/// reports both as a JSON error.
fn classify_safetensors_error(err: safetensors::SafeTensorError, header: &[u8]) -> WireError {
    use safetensors::SafeTensorError as E;
    match err {
        E::InvalidHeaderDeserialization(_) => {
            if let Some((tensor, dtype)) = unknown_dtype(header) {
                return WireError::UnsupportedDtype { tensor, dtype };
            }
            WireError::Invalid(err.to_string())
        }
        E::MetadataIncompleteBuffer => WireError::Invalid(
            "the tensors' data does not match the body length (truncated or padded body)".into(),
        ),
        E::InvalidOffset(name) => WireError::Invalid(format!(
            "tensor `{name}` has data offsets that overlap, leave a gap, or run backwards"
        )),
        E::TensorInvalidInfo => {
            WireError::Invalid("a tensor's byte range does not match its shape and dtype".into())
        }
        other => WireError::Invalid(other.to_string()),
    }
}

fn unknown_dtype(header: &[u8]) -> Option<(String, String)> {
    const KNOWN: &[&str] = &[
        "BOOL",
        "F4",
        "F6_E2M3",
        "F6_E3M2",
        "U8",
        "I8",
        "F8_E5M2",
        "F8_E4M3",
        "F8_E8M0",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
        "I16",
        "U16",
        "F16",
        "BF16",
        "I32",
        "U32",
        "F32",
        "C64",
        "F64",
        "I64",
        "U64",
    ];
    let value: serde_json::Value = serde_json::from_slice(header).ok()?;
    value.as_object()?.iter().find_map(|(name, info)| {
        let dtype = info.get("dtype")?;
        match dtype.as_str() {
            Some(s) if KNOWN.contains(&s) => None,
            _ => Some((name.clone(), dtype.to_string())),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::writer::{HeaderEntry, SafetensorsHeader};

    const LIMITS: WireLimits = WireLimits {
        header_limit: 1 << 20,
    };

    fn body(entries: &[(&str, DType, Vec<i64>, Vec<u8>)], meta: &[(&str, &str)]) -> Bytes {
        let header = SafetensorsHeader::new(
            entries
                .iter()
                .map(|(n, d, s, b)| HeaderEntry {
                    name: n.to_string(),
                    dtype: *d,
                    shape: s.clone(),
                    nbytes: b.len(),
                })
                .collect(),
            meta.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        let mut out = header.bytes().to_vec();
        for (_, _, _, b) in entries {
            out.extend_from_slice(b);
        }
        Bytes::from(out)
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn parses_tensors_in_place() {
        let b = body(
            &[
                (
                    "a.weight",
                    DType::F32,
                    vec![2, 2],
                    f32s(&[1.0, 2.0, 3.0, 4.0]),
                ),
                ("a.bias", DType::F32, vec![2], f32s(&[5.0, 6.0])),
                ("n", DType::I64, vec![], 7i64.to_le_bytes().to_vec()),
            ],
            &[],
        );
        let push = parse_push(b.clone(), LIMITS, NonfinitePolicy::Reject).unwrap();
        assert_eq!(push.tensors.len(), 3);
        assert_eq!(push.kind, PushKind::Full);
        let w = push.tensors.iter().find(|t| t.name == "a.weight").unwrap();
        assert_eq!(push.bytes_of(w), &f32s(&[1.0, 2.0, 3.0, 4.0])[..]);
        // The digest is the one computed with the scan.
        assert_eq!(push.digest, scan_and_digest(&b, &[], false).0);
        // Same bytes, same digest; other bytes, other digest.
        let again = parse_push(b, LIMITS, NonfinitePolicy::Reject).unwrap();
        assert_eq!(push.digest, again.digest);
        let other = body(&[("a.bias", DType::F32, vec![2], f32s(&[5.0, 6.5]))], &[]);
        assert_ne!(
            push.digest,
            parse_push(other, LIMITS, NonfinitePolicy::Reject)
                .unwrap()
                .digest
        );
    }

    #[test]
    fn refuses_malformed_bodies() {
        let good = body(&[("a", DType::F32, vec![4], f32s(&[1.0; 4]))], &[]);
        // Truncated data.
        let cut = good.slice(..good.len() - 3);
        assert!(matches!(
            parse_push(cut, LIMITS, NonfinitePolicy::Reject),
            Err(WireError::Invalid(_))
        ));
        // Shorter than the length prefix.
        assert!(matches!(
            parse_push(Bytes::from_static(b"abc"), LIMITS, NonfinitePolicy::Reject),
            Err(WireError::Invalid(_))
        ));
        // Header length past the body.
        let mut past = good.to_vec();
        past[..8].copy_from_slice(&(good.len() as u64 + 10).to_le_bytes());
        assert!(matches!(
            parse_push(Bytes::from(past), LIMITS, NonfinitePolicy::Reject),
            Err(WireError::Invalid(m)) if m.contains("past the end")
        ));
        // Header over the limit.
        let small = WireLimits { header_limit: 16 };
        assert!(matches!(
            parse_push(good.clone(), small, NonfinitePolicy::Reject),
            Err(WireError::HeaderTooLarge { .. })
        ));
    }

    #[test]
    fn refuses_overlapping_offsets_and_unknown_dtypes() {
        let header = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        let mut raw = (header.len() as u64).to_le_bytes().to_vec();
        raw.extend_from_slice(header);
        raw.extend_from_slice(&[0u8; 12]);
        assert!(matches!(
            parse_push(Bytes::from(raw), LIMITS, NonfinitePolicy::Reject),
            Err(WireError::Invalid(m)) if m.contains("overlap")
        ));
        let header = br#"{"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}}"#;
        let mut raw = (header.len() as u64).to_le_bytes().to_vec();
        raw.extend_from_slice(header);
        raw.extend_from_slice(&[0u8; 8]);
        assert!(matches!(
            parse_push(Bytes::from(raw), LIMITS, NonfinitePolicy::Reject),
            Err(WireError::UnsupportedDtype { tensor, .. }) if tensor == "a"
        ));
        let header = br#"{"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}}"#;
        let mut raw = (header.len() as u64).to_le_bytes().to_vec();
        raw.extend_from_slice(header);
        raw.extend_from_slice(&[0u8; 2]);
        assert!(matches!(
            parse_push(Bytes::from(raw), LIMITS, NonfinitePolicy::Reject),
            Err(WireError::UnsupportedDtype { .. })
        ));
    }

    #[test]
    fn checks_chunks_and_kind() {
        let entries = [("w", DType::F32, vec![2, 3], f32s(&[0.0; 6]))];
        let ok = body(
            &entries,
            &[(
                SHARDS_KEY,
                r#"{"w":{"global_shape":[5,3],"offsets":[3,0]}}"#,
            )],
        );
        let push = parse_push(ok, LIMITS, NonfinitePolicy::Reject).unwrap();
        assert_eq!(
            push.tensors[0].chunk,
            Some(Chunk {
                global_shape: vec![5, 3],
                offsets: vec![3, 0]
            })
        );
        for shards in [
            r#"{"w":{"global_shape":[4,3],"offsets":[3,0]}}"#,
            r#"{"w":{"global_shape":[5,3],"offsets":[-1,0]}}"#,
            r#"{"w":{"global_shape":[5],"offsets":[0]}}"#,
            r#"{"v":{"global_shape":[5,3],"offsets":[0,0]}}"#,
            r#"[1,2]"#,
        ] {
            let b = body(&entries, &[(SHARDS_KEY, shards)]);
            assert!(
                matches!(
                    parse_push(b, LIMITS, NonfinitePolicy::Reject),
                    Err(WireError::InvalidShards(_))
                ),
                "{shards}"
            );
        }
        let delta = body(&entries, &[(KIND_KEY, "delta")]);
        assert_eq!(
            parse_push(delta, LIMITS, NonfinitePolicy::Reject)
                .unwrap()
                .kind,
            PushKind::Delta
        );
        let xor = body(&entries, &[(KIND_KEY, "xor")]);
        assert_eq!(
            parse_push(xor, LIMITS, NonfinitePolicy::Reject)
                .unwrap()
                .kind,
            PushKind::Xor
        );
        let bad = body(&entries, &[(KIND_KEY, "sparse")]);
        assert!(matches!(
            parse_push(bad, LIMITS, NonfinitePolicy::Reject),
            Err(WireError::InvalidMetadata(_))
        ));
    }

    #[test]
    fn nonfinite_policies() {
        let b = body(
            &[
                ("bad", DType::F32, vec![2], f32s(&[1.0, f32::NAN])),
                ("good", DType::F32, vec![2], f32s(&[1.0, 2.0])),
            ],
            &[],
        );
        assert!(matches!(
            parse_push(b.clone(), LIMITS, NonfinitePolicy::Reject),
            Err(WireError::Nonfinite { tensor }) if tensor == "bad"
        ));
        let skip = parse_push(b.clone(), LIMITS, NonfinitePolicy::SkipTensor).unwrap();
        let flags: Vec<_> = skip
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.nonfinite))
            .collect();
        assert!(flags.contains(&("bad", true)) && flags.contains(&("good", false)));
        let allow = parse_push(b, LIMITS, NonfinitePolicy::Allow).unwrap();
        assert!(allow.tensors.iter().all(|t| !t.nonfinite));
    }

    /// A body whose header is written by hand (dtypes polyak's writer
    /// does not produce, such as F8_E4M3).
    fn raw_body(entries: &[(&str, &str, Vec<usize>, Vec<u8>)], meta: &[(&str, &str)]) -> Bytes {
        let mut header = serde_json::Map::new();
        if !meta.is_empty() {
            let m: serde_json::Map<String, serde_json::Value> = meta
                .iter()
                .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
                .collect();
            header.insert("__metadata__".into(), m.into());
        }
        let mut offset = 0;
        for (name, dtype, shape, bytes) in entries {
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes.len()]}),
            );
            offset += bytes.len();
        }
        let text = serde_json::to_vec(&header).unwrap();
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&text);
        for (_, _, _, b) in entries {
            out.extend_from_slice(b);
        }
        Bytes::from(out)
    }

    #[test]
    fn quantised_deltas_carry_their_scales() {
        let fp8 = r#"{"format":"fp8_e4m3","block":128}"#;
        let meta = [(KIND_KEY, "delta"), (QUANT_KEY, fp8)];
        let q = vec![0x38u8; 300]; // 1.0 in e4m3
        let scales = f32s(&[0.5, 0.25, 2.0]);
        let ok = raw_body(
            &[
                ("w", "F8_E4M3", vec![300], q.clone()),
                ("w:scale", "F32", vec![3], scales.clone()),
                ("n", "I64", vec![], 7i64.to_le_bytes().to_vec()),
            ],
            &meta,
        );
        let push = parse_push(ok, LIMITS, NonfinitePolicy::Reject).unwrap();
        assert_eq!(
            push.tensors.len(),
            2,
            "the scales are not a tensor of the layout"
        );
        let w = push.tensors.iter().find(|t| t.name == "w").unwrap();
        let tq = w.quant.as_ref().unwrap();
        assert_eq!(
            (w.dtype, tq.format, tq.block),
            (DType::U8, QuantFormat::Fp8E4m3, 128)
        );
        assert_eq!(&push.body[tq.scales.clone()], &scales[..]);
        assert!(push
            .tensors
            .iter()
            .find(|t| t.name == "n")
            .unwrap()
            .quant
            .is_none());
        // fp8 without a quant declaration is a dtype polyak does not keep.
        let bare = raw_body(
            &[("w", "F8_E4M3", vec![300], q.clone())],
            &[(KIND_KEY, "delta")],
        );
        assert!(matches!(
            parse_push(bare, LIMITS, NonfinitePolicy::Reject),
            Err(WireError::UnsupportedDtype { .. })
        ));
        // Too few scales, none, or scales of nothing.
        for entries in [
            vec![
                ("w", "F8_E4M3", vec![300], q.clone()),
                ("w:scale", "F32", vec![2], f32s(&[1.0, 1.0])),
            ],
            vec![("w", "F8_E4M3", vec![300], q.clone())],
            vec![
                ("w", "F8_E4M3", vec![300], q.clone()),
                ("w:scale", "F32", vec![3], scales.clone()),
                ("v:scale", "F32", vec![1], f32s(&[1.0])),
            ],
        ] {
            assert!(matches!(
                parse_push(raw_body(&entries, &meta), LIMITS, NonfinitePolicy::Reject),
                Err(WireError::InvalidMetadata(_))
            ));
        }
        // An Inf scale or an fp8 NaN: the tensor holds NaN/Inf.
        for (values, s) in [
            (q.clone(), f32s(&[0.5, f32::INFINITY, 2.0])),
            (
                {
                    let mut v = q.clone();
                    v[299] = 0x7f;
                    v
                },
                scales.clone(),
            ),
        ] {
            let b = raw_body(
                &[
                    ("w", "F8_E4M3", vec![300], values),
                    ("w:scale", "F32", vec![3], s),
                ],
                &meta,
            );
            assert!(matches!(
                parse_push(b.clone(), LIMITS, NonfinitePolicy::Reject),
                Err(WireError::Nonfinite { tensor }) if tensor == "w"
            ));
            let skip = parse_push(b, LIMITS, NonfinitePolicy::SkipTensor).unwrap();
            assert!(skip.tensors[0].nonfinite);
        }
        // An XOR push is not scanned as floats (its NaN bits are not NaN).
        let xor = body(
            &[("w", DType::F32, vec![1], f32s(&[f32::NAN]))],
            &[(KIND_KEY, "xor")],
        );
        assert!(
            !parse_push(xor, LIMITS, NonfinitePolicy::Reject)
                .unwrap()
                .tensors[0]
                .nonfinite
        );
        // A keyframe's mirror checksum.
        let kf = body(
            &[("w", DType::F32, vec![1], f32s(&[1.0]))],
            &[(MIRROR_CRC_KEY, "00c0ffee")],
        );
        assert_eq!(
            parse_push(kf, LIMITS, NonfinitePolicy::Reject)
                .unwrap()
                .mirror_crc32,
            Some(0xc0ffee)
        );
    }

    /// Large bodies are split between two threads: the same digest, flags
    /// and errors as the one-thread path.
    #[test]
    fn large_bodies_scan_and_digest_in_parallel() {
        let n = crate::wire::check::PARALLEL_MIN / 4 + 1;
        let mut tail = vec![0.5f32; n];
        tail[n - 1] = f32::INFINITY;
        let b = body(
            &[
                ("a", DType::F32, vec![n as i64], f32s(&vec![1.0; n])),
                ("b", DType::F32, vec![n as i64], f32s(&tail)),
            ],
            &[],
        );
        assert!(b.len() >= crate::wire::check::PARALLEL_MIN);
        assert!(matches!(
            parse_push(b.clone(), LIMITS, NonfinitePolicy::Reject),
            Err(WireError::Nonfinite { tensor }) if tensor == "b"
        ));
        let skip = parse_push(b.clone(), LIMITS, NonfinitePolicy::SkipTensor).unwrap();
        assert_eq!(skip.digest, scan_and_digest(&b, &[], false).0);
        let flags: Vec<_> = skip.tensors.iter().map(|t| t.nonfinite).collect();
        assert_eq!(flags, [false, true]);
        let allow = parse_push(b.clone(), LIMITS, NonfinitePolicy::Allow).unwrap();
        assert_eq!(allow.digest, skip.digest);
    }
}
