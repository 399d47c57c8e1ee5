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
use super::DType;
use crate::run::NonfinitePolicy;

/// Metadata key holding chunk placement of sharded tensors.
pub const SHARDS_KEY: &str = "polyak.shards";
/// Metadata key selecting `full` or `delta`.
pub const KIND_KEY: &str = "polyak.kind";
/// `__metadata__` key: JSON `{alias: name}` for names that share one
/// tensor's storage (tied weights), pushed once under `name`.
pub const ALIASES_KEY: &str = "polyak.aliases";

/// Where a tensor chunk sits in its whole (unsharded) tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    pub global_shape: Vec<i64>,
    pub offsets: Vec<i64>,
}

/// `full`: the tensors are the weights. `delta`: floating point tensors are
/// added to the server's mirror first (integer and bool tensors still carry
/// their values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PushKind {
    Full,
    Delta,
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
    let (n, metadata) = safetensors::SafeTensors::read_metadata(&body)
        .map_err(|e| classify_safetensors_error(e, &body[8..8 + header_len as usize]))?;
    let data_start = 8 + n;

    let extra = metadata.metadata().clone().unwrap_or_default();
    let kind = match extra.get(KIND_KEY).map(String::as_str) {
        None | Some("full") => PushKind::Full,
        Some("delta") => PushKind::Delta,
        Some(other) => {
            return Err(WireError::InvalidMetadata(format!(
                "{KIND_KEY} must be `full` or `delta`, got `{other}`"
            )))
        }
    };
    let mut chunks: HashMap<String, Chunk> = match extra.get(SHARDS_KEY) {
        None => HashMap::new(),
        Some(json) => serde_json::from_str(json)
            .map_err(|e| WireError::InvalidShards(format!("not a JSON object of chunks: {e}")))?,
    };

    let aliases: BTreeMap<String, String> = match extra.get(ALIASES_KEY) {
        None => BTreeMap::new(),
        Some(json) => serde_json::from_str(json).map_err(|e| {
            WireError::InvalidMetadata(format!("{ALIASES_KEY} is not a JSON object of names: {e}"))
        })?,
    };

    let names = metadata.offset_keys();
    if names.is_empty() {
        return Err(WireError::Empty);
    }
    for (alias, target) in &aliases {
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
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let info = metadata.info(&name).ok_or_else(|| {
            WireError::Invalid(format!("tensor `{name}` vanished from the header"))
        })?;
        let dtype =
            DType::from_safetensors(info.dtype).ok_or_else(|| WireError::UnsupportedDtype {
                tensor: name.clone(),
                dtype: format!("{:?}", info.dtype),
            })?;
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        let (start, end) = info.data_offsets;
        let range = data_start + start..data_start + end;
        let chunk = chunks.remove(&name);
        if let Some(chunk) = &chunk {
            check_chunk(&name, &shape, chunk)?;
        }
        tensors.push(WireTensor {
            name,
            dtype,
            shape,
            range,
            chunk,
            nonfinite: false,
        });
    }
    if let Some(name) = chunks.keys().next() {
        return Err(WireError::InvalidShards(format!(
            "chunk metadata for `{name}`, which is not in the push"
        )));
    }
    // The digest and the NaN/Inf scan, in one pass over the body.
    let scan = policy != NonfinitePolicy::Allow;
    let spans: Vec<Span> = tensors
        .iter()
        .map(|t| Span {
            dtype: t.dtype,
            range: t.range.clone(),
        })
        .collect();
    let (digest, flags) = scan_and_digest(&body, &spans, scan);
    for (t, nonfinite) in tensors.iter_mut().zip(flags) {
        t.nonfinite = nonfinite;
        if nonfinite && policy == NonfinitePolicy::Reject {
            return Err(WireError::Nonfinite {
                tensor: t.name.clone(),
            });
        }
    }
    Ok(ParsedPush {
        body,
        tensors,
        kind,
        digest,
        aliases,
    })
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
