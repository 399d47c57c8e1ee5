//! What holding a download to its parts' recorded sha256 costs: a `full`
//! download of four ranks' parts (the parts reread and hashed beside the
//! stream) and a `layout=rank` download of one part (hashed as it is sent),
//! each streamed verified and unverified from the same file store in the
//! same process, as an HTTP body reads them, and written to a loopback TCP
//! socket whose other end a thread drains (a download goes to a socket; a
//! file store's cached pages reach the stream without a copy, so without
//! the socket the unverified side would cost nothing at all). Prints the
//! time ratios (verified / unverified) and sha256's own rate on the same
//! bytes; asserts nothing. `cargo bench --bench verify`
//! streams 1 GiB (4 x 256 MiB), best of three; `cargo test --benches` runs
//! it once with 64 MiB.

use std::sync::Arc;
use std::time::Instant;

use std::io::Read;

use futures::StreamExt;
use polyak::objstore::ObjectStore;
use polyak::snapshot::source::PartLoc;
use polyak::snapshot::vfile::{Piece, VirtualFile};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (size, reps) = if full {
        (1usize << 30, 3)
    } else {
        (64 << 20, 1)
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let store =
        ObjectStore::open(&format!("file://{}", dir.path().display()), None).expect("store");
    let part = size / 4;
    let mut parts = Vec::new();
    for r in 0..4 {
        let key = format!("parts/rank-{r:05}.safetensors");
        let data: Vec<u8> = (0..part).map(|i| ((i * 31 + r) % 251) as u8).collect();
        let path = dir.path().join(&key);
        std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        std::fs::write(&path, &data).expect("write");
        let sha = hex::encode(Sha256::digest(&data));
        parts.push(PartLoc::recorded(&store, &key, part as u64, &sha));
    }
    let file = |which: &[Arc<PartLoc>]| {
        Arc::new(VirtualFile::new(
            which
                .iter()
                .map(|p| Piece::File {
                    path: p.clone(),
                    offset: 0,
                    len: part as u64,
                })
                .collect(),
        ))
    };
    let (all, one) = (file(&parts), file(&parts[..1]));
    // The client's end: a thread that reads and drops everything.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 20];
                while matches!(conn.read(&mut buf), Ok(n) if n > 0) {}
            });
        }
    });
    let drain = |f: Arc<VirtualFile>, verified: bool| {
        rt.block_on(async move {
            let mut socket = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let started = Instant::now();
            let len = f.len();
            let mut got = 0u64;
            let mut body: std::pin::Pin<
                Box<dyn futures::Stream<Item = std::io::Result<bytes::Bytes>> + Send>,
            > = if verified {
                Box::pin(f.stream_verified(0..len, |m| panic!("{m}")))
            } else {
                Box::pin(f.stream(0..len))
            };
            while let Some(chunk) = body.next().await {
                let chunk = chunk.expect("chunk");
                got += chunk.len() as u64;
                socket.write_all(&chunk).await.expect("send");
            }
            assert_eq!(got, len);
            started.elapsed().as_secs_f64()
        })
    };
    // Warm the page cache: both paths then read the same cached pages.
    drain(all.clone(), false);
    let mut rows = Vec::new();
    for (name, f) in [("full, 4 parts", &all), ("rank, 1 part", &one)] {
        let (mut plain, mut checked) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..reps {
            plain = plain.min(drain(f.clone(), false));
            checked = checked.min(drain(f.clone(), true));
        }
        let mib = f.len() as f64 / (1 << 20) as f64;
        rows.push(format!(
            "| {name}, {mib:.0} MiB from files: verified / unverified (time) | {:.2} | {:.0} / {:.0} MiB/s |",
            checked / plain,
            mib / checked,
            mib / plain,
        ));
    }
    // sha256 alone over the same bytes (one thread): the floor of the cost.
    let data: Vec<u8> = (0..part).map(|i| (i % 251) as u8).collect();
    let mut hashed = f64::INFINITY;
    for _ in 0..reps {
        let started = Instant::now();
        std::hint::black_box(Sha256::digest(&data));
        hashed = hashed.min(started.elapsed().as_secs_f64());
    }
    rows.push(format!(
        "| sha256 of {:.0} MiB in memory, one thread | | {:.0} MiB/s |",
        part as f64 / (1 << 20) as f64,
        part as f64 / (1 << 20) as f64 / hashed,
    ));
    println!("| download | ratio | rates (verified / unverified) |");
    println!("| --- | --- | --- |");
    for row in rows {
        println!("{row}");
    }
}
