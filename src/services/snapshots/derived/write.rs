//! The pass over the sources: every output written rank by rank through
//! [`combine`](crate::snapshot::combine), progress reported as bytes are read.

use std::time::Instant;

use super::progress::REPORT_EVERY;
use super::Job;
use crate::services::snapshots::SnapshotError;
use crate::snapshot::combine::{self, OutputSpec};
use crate::snapshot::source::PartLoc;
use crate::snapshot::{files, format, meta};
use crate::store::snapshots::FileRow;

/// Writes every output, rank by rank, under `data_dir`; returns each
/// output's file rows (keys in the store).
pub(super) fn write_outputs(
    data_dir: &std::path::Path,
    objects: &crate::objstore::ObjectStore,
    job: &Job,
    report: &mut dyn FnMut(u64),
) -> Result<Vec<Vec<FileRow>>, SnapshotError> {
    let ranks: Vec<u32> = {
        let mut r: Vec<u32> = job.files[job.base].iter().map(|f| f.rank).collect();
        r.sort_unstable();
        r
    };
    let mut out: Vec<Vec<FileRow>> = vec![Vec::new(); job.outputs.len()];
    let mut done = 0u64;
    let mut last_report = Instant::now();
    for rank in ranks {
        let paths = rank_sources(objects, job, rank)?;
        let base_file = job.files[job.base]
            .iter()
            .find(|f| f.rank == rank)
            .expect("ranks come from the base");
        let meta = meta::decode_rank_meta(&base_file.state)?;
        let specs = rank_outputs(job, rank);
        let written = combine::combine_rank(
            data_dir,
            &meta.layout,
            &paths,
            job.base,
            job.out_dtype,
            job.round_to,
            specs,
            &mut |bytes| {
                done += bytes;
                if last_report.elapsed() >= REPORT_EVERY {
                    last_report = Instant::now();
                    report(done);
                }
            },
        )
        .map_err(combine_error)?;
        let state_json = meta::encode_rank_meta(&meta);
        for ((o, w), rows) in job.outputs.iter().zip(written).zip(out.iter_mut()) {
            rows.push(FileRow {
                rank,
                part: o.profile.clone(),
                path: w.path,
                sha256: w.sha256,
                bytes: w.bytes,
                step: job.step,
                state: state_json.clone(),
                // Weights no rank ever held: nothing to fence.
                fence: None,
                blocks: Some(w.blocks),
            });
        }
    }
    for o in &job.outputs {
        let dir = data_dir.join(files::snapshot_rel_dir(&job.run, &o.id));
        if dir.exists() {
            files::sync_dir(&dir)?;
        }
    }
    report(done);
    Ok(out)
}

/// Every source's part of `rank`, to be read and held to its recorded
/// size and sha256.
fn rank_sources(
    objects: &crate::objstore::ObjectStore,
    job: &Job,
    rank: u32,
) -> Result<Vec<std::sync::Arc<PartLoc>>, SnapshotError> {
    let mut paths = Vec::with_capacity(job.files.len());
    for files in &job.files {
        let f = files.iter().find(|f| f.rank == rank).ok_or_else(|| {
            SnapshotError::Internal(format!("rank {rank} is missing from a source snapshot"))
        })?;
        paths.push(crate::services::snapshots::stored_part(objects, f));
    }
    Ok(paths)
}

/// Where and how each output's part of `rank` is written.
fn rank_outputs(job: &Job, rank: u32) -> Vec<OutputSpec> {
    job.outputs
        .iter()
        .map(|o| OutputSpec {
            rel: files::snapshot_rel_dir(&job.run, &o.id)
                .join(files::part_file_name(rank, &o.profile)),
            weights: o.weights.clone(),
            meta: format::part_metadata(&job.run, &o.id, rank, job.step, &o.profile),
        })
        .collect()
}

fn combine_error(e: combine::CombineError) -> SnapshotError {
    match e {
        combine::CombineError::Io(e) => SnapshotError::Io(e),
        combine::CombineError::Format(format::FormatError::Meta(m)) => SnapshotError::Meta(m),
        other => SnapshotError::Internal(other.to_string()),
    }
}
