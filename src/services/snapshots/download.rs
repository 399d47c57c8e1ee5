//! A download of a complete snapshot: which part and layout were asked
//! for, the recipe that assembles it from the stored parts (a
//! [`VirtualFile`] with its ETag and name), the byte range, and the
//! verified stream of that range. The HTTP handler parses the query and
//! the conditional headers and renders; the domain work is here.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::{Stream, StreamExt};

use super::{verify, Snaps, SnapshotError, SnapshotStatus};
use crate::contract::DownloadLayout;
use crate::registry::RunHandle;
use crate::services::ServiceError;
use crate::snapshot::assemble::{self, Layout};
use crate::snapshot::digests::{missing_ranges, Tap};
use crate::snapshot::format::MIRROR_PART;
use crate::snapshot::meta;
use crate::snapshot::source::PartMismatch;
use crate::snapshot::vfile::VirtualFile;
use crate::store::snapshots::{FileRow, SnapshotRow};
use crate::wire::DType;

/// HF-style shards' default size, in bytes (5 GB, as `transformers` has it).
const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

/// What a download asks for, as the query spells it.
#[derive(Debug, Default)]
pub struct Asked<'a> {
    /// A profile, `online` (the mirror), or the snapshot's first.
    pub profile: Option<&'a str>,
    /// `full` (default), `sharded`, `hf` or `rank`.
    pub layout: Option<&'a str>,
    /// `fp32`, `bf16`, `fp16` or `fp64`: floating tensors cast on the way.
    pub dtype: Option<&'a str>,
    /// With `layout=rank`.
    pub rank: Option<u32>,
    /// HF shards of at most this many bytes (`hf`, or `full` with it set).
    pub max_shard_size: Option<u64>,
}

/// A download ready to be served: the assembled file and how to name it.
#[derive(Clone)]
pub struct Prepared {
    pub file: Arc<VirtualFile>,
    pub etag: String,
    pub content_type: &'static str,
    pub file_name: String,
}

/// The layout a query names.
pub fn layout_of(asked: &Asked<'_>) -> Result<Layout, ServiceError> {
    let named = match asked.layout {
        None => DownloadLayout::Full,
        Some(text) => text
            .parse::<DownloadLayout>()
            .map_err(|e| ServiceError::bad_request("invalid_layout", format!("layout {e}")))?,
    };
    Ok(match (named, asked.max_shard_size) {
        (DownloadLayout::Full, None) => Layout::Full,
        (DownloadLayout::Full | DownloadLayout::Hf, Some(max)) => Layout::Hf {
            max_shard_size: max.max(1),
        },
        (DownloadLayout::Hf, None) => Layout::Hf {
            max_shard_size: DEFAULT_SHARD_BYTES,
        },
        (DownloadLayout::Sharded, _) => Layout::Sharded,
        (DownloadLayout::Rank, _) => Layout::Rank(asked.rank.ok_or_else(|| {
            ServiceError::bad_request("invalid_layout", "layout=rank needs rank=N")
        })?),
    })
}

/// The cast a query names.
pub fn cast_of(dtype: Option<&str>) -> Result<Option<DType>, ServiceError> {
    dtype
        .map(|d| {
            DType::parse_float(d).ok_or_else(|| {
                ServiceError::bad_request(
                    "invalid_dtype",
                    format!("dtype `{d}`: expected fp32, bf16, fp16 or fp64"),
                )
            })
        })
        .transpose()
}

/// The stored part name a download of `profile` reads.
pub fn part_name(row: &SnapshotRow, profile: Option<&str>) -> Result<String, ServiceError> {
    match profile {
        None => Ok(row.profiles.first().cloned().unwrap_or_default()),
        Some("online") | Some(MIRROR_PART) => Ok(MIRROR_PART.to_string()),
        Some(p) if row.profiles.iter().any(|q| q == p) => Ok(p.to_string()),
        Some(p) => Err(ServiceError::not_found(
            "profile_not_found",
            format!(
                "snapshot `{}` holds no profile `{p}` (it has {:?})",
                row.id, row.profiles
            ),
        )),
    }
}

/// A snapshot of the run, or `404 snapshot_not_found`.
pub async fn row(snaps: &Snaps, run: &str, id: &str) -> Result<SnapshotRow, ServiceError> {
    snaps.store.snapshot(run, id).await?.ok_or_else(|| {
        ServiceError::not_found(
            "snapshot_not_found",
            format!("no snapshot `{id}` in run `{run}`"),
        )
    })
}

/// A run's snapshots, oldest first.
pub async fn list(snaps: &Snaps, run: &str) -> Result<Vec<SnapshotRow>, ServiceError> {
    Ok(snaps.store.snapshots(run).await?)
}

/// The files of snapshot `id` (sha256, bytes, step per rank).
pub async fn files(snaps: &Snaps, id: &str) -> Result<Vec<FileRow>, ServiceError> {
    Ok(snaps.store.snapshot_files(id).await?)
}

/// The stored files of `part` of a complete snapshot, by rank, each held
/// to everything its row recorded (its block checksums included).
async fn stored_parts(
    snaps: &Snaps,
    row: &SnapshotRow,
    part: &str,
) -> Result<Vec<assemble::StoredPart>, SnapshotError> {
    let mut out = Vec::new();
    for f in snaps.store.snapshot_files(&row.id).await? {
        if f.part != part {
            continue;
        }
        out.push(assemble::StoredPart {
            rank: f.rank,
            path: crate::services::snapshots::stored_part(&snaps.objects, &f),
            meta: Arc::new(meta::decode_rank_meta(&f.state)?),
            sha256: f.sha256,
        });
    }
    Ok(out)
}

/// Assembles the download of snapshot `id` that `asked` names: the
/// snapshot must be complete; its parts' metadata is read, the recipe
/// built off the runtime (a part whose stored size already disagrees is
/// reported as corrupt).
pub async fn prepare(
    snaps: &Snaps,
    run: &RunHandle,
    id: &str,
    asked: &Asked<'_>,
) -> Result<Prepared, ServiceError> {
    let name = &run.config.name;
    let row = row(snaps, name, id).await?;
    if row.status != SnapshotStatus::Complete {
        return Err(ServiceError::conflict(
            "snapshot_not_complete",
            format!(
                "snapshot `{id}` is {}{}",
                row.status,
                row.reason
                    .as_deref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            ),
        ));
    }
    let part = part_name(&row, asked.profile)?;
    let cast = cast_of(asked.dtype)?;
    let layout = layout_of(asked)?;
    let parts = stored_parts(snaps, &row, &part).await?;
    if parts.is_empty() {
        return Err(ServiceError::not_found(
            "not_in_snapshot",
            format!("snapshot `{id}` holds no `{part}` files"),
        ));
    }
    let mut meta = BTreeMap::from([
        ("polyak.run".to_string(), name.clone()),
        ("polyak.snapshot".to_string(), id.to_string()),
        ("polyak.step".to_string(), row.step.to_string()),
        ("polyak.profile".to_string(), part.clone()),
    ]);
    let model_config = run.meta.lock().expect("meta lock").model_config.clone();
    if let Some(config) = model_config.and_then(|c| serde_json::to_string_pretty(&c).ok()) {
        meta.insert(assemble::HF_CONFIG_META.to_string(), config);
    }
    let sid = id.to_string();
    let mtime = (row.completed_at_ms.unwrap_or(row.created_at_ms).max(0) / 1000) as u64;
    let etag = assemble::etag(&sid, &meta, &parts, layout, cast);
    let records = Records::of(&parts);
    if let Some(kept) = snaps.recipes.get(&etag, &records) {
        return Ok(Prepared {
            file: Arc::new(kept.file.renewed()),
            ..kept
        });
    }
    let dl = tokio::task::spawn_blocking(move || {
        assemble::build(&sid, meta, &parts, layout, cast, mtime)
    })
    .await?
    .inspect_err(|e| {
        if let assemble::AssembleError::Io(e) = e {
            report(snaps, e);
        }
    })?;
    let ready = Prepared {
        file: Arc::new(dl.file),
        etag: dl.etag,
        content_type: dl.content_type,
        file_name: dl.file_name,
    };
    // Kept without what this request's readers learnt (the checked first
    // blocks of the tables just read): each request checks its own.
    snaps.recipes.put(
        records,
        Prepared {
            file: Arc::new(ready.file.renewed()),
            ..ready.clone()
        },
    );
    Ok(ready)
}

/// Files served lately, by ETag: the ranged requests of one download ask
/// for the same file many times, and its recipe (each part's tensor table,
/// read from the part's first block) is built once. Bounded; a snapshot
/// deleted meanwhile is refused before the cache is looked at.
#[derive(Default)]
pub struct Recipes {
    kept: std::sync::Mutex<std::collections::VecDeque<(Records, Prepared)>>,
}

/// Recipes a node keeps.
const KEPT_RECIPES: usize = 32;

/// Everything the catalog holds of the parts a recipe reads (what each
/// read is held to): a kept recipe serves only while it is unchanged.
#[derive(PartialEq, Eq)]
struct Records(Vec<(String, Option<crate::snapshot::source::Recorded>)>);

impl Records {
    fn of(parts: &[assemble::StoredPart]) -> Records {
        Records(
            parts
                .iter()
                .map(|p| (p.path.key().to_string(), p.path.record().cloned()))
                .collect(),
        )
    }
}

impl Recipes {
    fn get(&self, etag: &str, records: &Records) -> Option<Prepared> {
        let kept = self.kept.lock().expect("recipes lock");
        kept.iter()
            .find(|(r, p)| p.etag == etag && r == records)
            .map(|(_, p)| p.clone())
    }

    fn put(&self, records: Records, ready: Prepared) {
        let mut kept = self.kept.lock().expect("recipes lock");
        kept.retain(|(_, p)| p.etag != ready.etag);
        if kept.len() >= KEPT_RECIPES {
            kept.pop_front();
        }
        kept.push_back((records, ready));
    }
}

/// A `Range` no byte of the file satisfies (answered 416).
#[derive(Debug, PartialEq, Eq)]
pub struct Unsatisfiable;

/// `bytes=a-b`, `bytes=a-`, `bytes=-n` of a `len`-byte file, read as RFC
/// 9110 §14.1 says: one range (several are answered whole, which §14.2
/// allows); a field that does not parse as a range of bytes (another unit,
/// `bytes=abc`, a last byte before the first) is ignored, so the whole file
/// is sent; a last byte past the end, however large (past u64 too), is
/// clamped to it, as is a suffix longer than the file. Only a first byte at
/// or past the end, or an empty suffix, is unsatisfiable.
pub fn byte_range(spec: &str, len: u64) -> Result<Option<Range<u64>>, Unsatisfiable> {
    let spec = spec.trim();
    let Some((unit, ranges)) = spec.split_once('=') else {
        return Ok(None);
    };
    if !unit.trim().eq_ignore_ascii_case("bytes") || ranges.contains(',') {
        return Ok(None);
    }
    let Some((a, b)) = ranges.trim().split_once('-') else {
        return Ok(None);
    };
    let (a, b) = (a.trim(), b.trim());
    if !digits(b) && !b.is_empty() {
        return Ok(None);
    }
    if a.is_empty() {
        // suffix-range: the last `b` bytes.
        if b.is_empty() {
            return Ok(None);
        }
        let n = decimal(b);
        if n == 0 {
            return Err(Unsatisfiable);
        }
        return Ok(Some(len.saturating_sub(n)..len));
    }
    if !digits(a) {
        return Ok(None);
    }
    let (start, last) = (decimal(a), (!b.is_empty()).then(|| decimal(b)));
    if last.is_some_and(|last| last < start) {
        return Ok(None);
    }
    if start >= len {
        return Err(Unsatisfiable);
    }
    let end = last.map_or(len, |last| last.saturating_add(1).min(len));
    Ok(Some(start..end))
}

/// Whether `s` is one or more ASCII digits (RFC 9110's `1*DIGIT`).
fn digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit())
}

/// The value of a string of digits, `u64::MAX` when it is larger: every
/// such position is past the end of any file.
fn decimal(s: &str) -> u64 {
    s.parse().unwrap_or(u64::MAX)
}

/// The bytes `span` of a prepared download, held to the parts' records:
/// their sizes before the first byte, each block checked before any byte
/// of it is sent. A mismatch in the first chunk refuses the response
/// (`500 snapshot_corrupt`, nothing sent); a later one cuts the stream
/// before the bad block. Either is reported. Each digest block the span
/// carries whole is hashed as it passes, for [`digests`].
pub async fn open(
    snaps: &Snaps,
    file: Arc<VirtualFile>,
    etag: &str,
    span: Range<u64>,
) -> Result<impl Stream<Item = std::io::Result<Bytes>>, ServiceError> {
    let (sized, checked) = (file.clone(), span.clone());
    tokio::task::spawn_blocking(move || {
        sized.check_sizes(checked.clone())?;
        if checked.start == 0 && !sized.is_empty() {
            // As a recipe just built from the parts' tables would: a bad
            // first block of any part refuses the whole file's response.
            sized.check_first_blocks()?;
        }
        Ok::<_, std::io::Error>(())
    })
    .await?
    .map_err(|e| {
        report(snaps, &e);
        ServiceError::from(SnapshotError::Io(e))
    })?;
    let (events, metrics) = (snaps.events.clone(), snaps.metrics.clone());
    let mut tap = Tap::new(
        snaps.digests.clone(),
        Arc::from(etag),
        file.len(),
        span.start,
    );
    let mut body = Box::pin(file.stream_verified_tapped(
        span,
        move |m| verify::report_mismatch(&events, &metrics, m, "download"),
        move |b| tap.feed(b),
    ));
    // The first chunk before the answer: a part whose first block read
    // does not match is refused rather than sent as a cut body.
    let first = loop {
        match futures::StreamExt::next(&mut body).await {
            Some(Err(e)) => return Err(ServiceError::from(SnapshotError::Io(e))),
            // An empty piece is no first byte: the check goes on.
            Some(Ok(b)) if b.is_empty() => continue,
            first => break first,
        }
    };
    Ok(futures::stream::iter(first).chain(body))
}

/// The digests a download states for the file `dl` serves: the CRC-32 of
/// each [`DIGEST_BLOCK`](crate::snapshot::digests::DIGEST_BLOCK), in order. Blocks no response of this node carried
/// whole yet are produced again through the verified reader (only those:
/// a download fetched on block boundaries costs nothing more), by one
/// computation per file at a time; a stored block that does not match is
/// reported and answered `snapshot_corrupt`.
pub async fn digests(snaps: &Snaps, dl: &Prepared) -> Result<Vec<u32>, ServiceError> {
    let len = dl.file.len();
    let missing = || missing_ranges(&snaps.digests.known(&dl.etag, len), len);
    if !missing().is_empty() {
        // One computation per file at a time: a request that waited for
        // another's finds what it recorded.
        let turn = snaps.digests.turn(&dl.etag).await;
        let missing = missing();
        let (file, cache, etag) = (dl.file.clone(), snaps.digests.clone(), dl.etag.clone());
        let (events, metrics) = (snaps.events.clone(), snaps.metrics.clone());
        tokio::task::spawn_blocking(move || {
            // Held until the blocks are recorded, whether or not the
            // request is still there to read them.
            let _turn = turn;
            let etag: Arc<str> = Arc::from(etag);
            for range in missing {
                file.check_sizes(range.clone())?;
                let mut tap = Tap::new(cache.clone(), etag.clone(), len, range.start);
                file.produce(range, |b| {
                    tap.feed(&b);
                    true
                })
                .inspect_err(|e| {
                    if let Some(m) = PartMismatch::of(e) {
                        verify::report_mismatch(&events, &metrics, m, "download");
                    }
                })?;
            }
            Ok::<_, std::io::Error>(())
        })
        .await?
        .map_err(|e| ServiceError::from(SnapshotError::Io(e)))?;
    }
    snaps
        .digests
        .known(&dl.etag, len)
        .into_iter()
        .enumerate()
        .map(|(i, crc)| {
            crc.ok_or_else(|| {
                // Only when more files were served meanwhile than the cache
                // keeps: the client asks again.
                ServiceError::busy(
                    format!("the digest of block {i} was dropped while it was computed"),
                    1,
                )
            })
        })
        .collect()
}

/// Reports a part a download found other than recorded.
fn report(snaps: &Snaps, e: &std::io::Error) {
    if let Some(m) = PartMismatch::of(e) {
        verify::report_mismatch(&snaps.events, &snaps.metrics, m, "download");
    }
}

#[cfg(test)]
mod tests {
    use super::{byte_range, Unsatisfiable};

    #[test]
    fn byte_ranges_follow_rfc_9110() {
        assert_eq!(byte_range("bytes=0-9", 100), Ok(Some(0..10)));
        assert_eq!(byte_range("bytes=90-", 100), Ok(Some(90..100)));
        assert_eq!(byte_range("bytes=-10", 100), Ok(Some(90..100)));
        assert_eq!(byte_range("bytes=-200", 100), Ok(Some(0..100)));
        assert_eq!(byte_range("bytes=95-200", 100), Ok(Some(95..100)));
        assert_eq!(byte_range("bytes=0-1,5-6", 100), Ok(None));
        assert_eq!(byte_range("items=0-1", 100), Ok(None));
        assert_eq!(byte_range("Bytes=0-9", 100), Ok(Some(0..10)));
        assert_eq!(byte_range("bytes=100-", 100), Err(Unsatisfiable));
        assert_eq!(byte_range("bytes=-0", 100), Err(Unsatisfiable));
        assert_eq!(
            byte_range("bytes=18446744073709551616-", 100),
            Err(Unsatisfiable)
        );
    }

    #[test]
    fn ranges_that_do_not_parse_are_ignored() {
        for spec in [
            "bytes=abc",
            "bytes=x-",
            "bytes=1-x",
            "bytes=5-4",
            "bytes=--1",
            "bytes=1",
            "bytes=-",
            "bytes=+1-2",
            "bytes=1-+2",
            "bytes",
        ] {
            assert_eq!(byte_range(spec, 100), Ok(None), "{spec}");
        }
    }

    #[test]
    fn a_last_byte_past_the_end_is_clamped_however_large() {
        for spec in [
            "bytes=0-18446744073709551615",
            "bytes=0-18446744073709551616",
            "bytes=0-99999999999999999999999",
        ] {
            assert_eq!(byte_range(spec, 100), Ok(Some(0..100)), "{spec}");
        }
        assert_eq!(
            byte_range("bytes=-99999999999999999999999", 100),
            Ok(Some(0..100))
        );
    }
}
