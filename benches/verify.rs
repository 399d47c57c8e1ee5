//! What holding a download to its parts' records costs, and what recording
//! the block checksums costs a capture's write.
//!
//! Reads: a `full` download of four ranks' parts and a `layout=rank`
//! download of one part, each streamed checked (every block's CRC-32
//! checked before its bytes go on) and unchecked from the same file store
//! in the same process, as an HTTP body reads them, and written to a
//! loopback TCP socket whose other end a thread drains (a download goes to
//! a socket; a file store's cached pages reach the stream without a copy,
//! so without the socket the unchecked side would cost nothing at all).
//!
//! Writes: a part written to the data dir as a capture writes it
//! (`snapshot::files::PartWriter`: sha256 and block checksums on the way,
//! fsync, rename) against the same write with the sha256 alone and with
//! no hash at all (the store's own rate).
//!
//! Prints the time ratios and CRC-32's and sha256's own rates on the same
//! bytes; asserts nothing. `cargo test --bench verify -- --bench` streams
//! 1 GiB (4 x 256 MiB) and writes 256 MiB, best of three; `cargo test
//! --benches` runs it once with 64 MiB and 16 MiB.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use polyak::objstore::{BlockSums, ObjectStore, BLOCK_BYTES};
use polyak::snapshot::files::PartWriter;
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
        let blocks = BlockSums::of(&data, BLOCK_BYTES);
        parts.push(PartLoc::recorded_with(
            &store,
            &key,
            part as u64,
            &sha,
            Some(blocks),
        ));
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
            "| {name}, {mib:.0} MiB from files into a socket: verified / unverified (time) | {:.2} | {:.0} / {:.0} MiB/s |",
            checked / plain,
            mib / checked,
            mib / plain,
        ));
    }

    // The write side: one part as a capture writes it into the data dir.
    let wsize = if full { 256usize << 20 } else { 16 << 20 };
    let data: Vec<u8> = (0..wsize).map(|i| (i % 251) as u8).collect();
    let wdir = tempfile::tempdir().expect("tempdir");
    let write = |how: u8, n: usize| -> f64 {
        let rel = std::path::PathBuf::from(format!("w/part-{how}-{n}.safetensors"));
        let started = Instant::now();
        match how {
            // Sha256 and block checksums on the way (what captures do).
            0 => {
                let mut w = PartWriter::create(wdir.path(), &rel).expect("create");
                for piece in data.chunks(4 << 20) {
                    w.write_all(piece).expect("write");
                }
                std::hint::black_box(w.finish().expect("finish"));
            }
            // The sha256 alone, or no hash: the same buffered write, fsync.
            _ => {
                let path = wdir.path().join(&rel);
                std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
                let file = std::fs::File::create(&path).expect("create");
                let mut out = std::io::BufWriter::with_capacity(4 << 20, file);
                let mut hasher = Sha256::new();
                for piece in data.chunks(4 << 20) {
                    out.write_all(piece).expect("write");
                    if how == 1 {
                        hasher.update(piece);
                    }
                }
                let file = out.into_inner().expect("flush");
                file.sync_all().expect("fsync");
                std::hint::black_box(hasher.finalize());
            }
        }
        started.elapsed().as_secs_f64()
    };
    let (mut both, mut sha_only, mut bare) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for n in 0..reps.max(2) {
        bare = bare.min(write(2, n));
        sha_only = sha_only.min(write(1, n));
        both = both.min(write(0, n));
    }
    let wmib = wsize as f64 / (1 << 20) as f64;
    rows.push(format!(
        "| capture write of {wmib:.0} MiB to files: sha256 + block CRC-32 / sha256 alone (time) | {:.2} | {:.0} / {:.0} MiB/s |",
        both / sha_only,
        wmib / both,
        wmib / sha_only,
    ));
    rows.push(format!(
        "| capture write of {wmib:.0} MiB to files: sha256 + block CRC-32 / no hash (time) | {:.2} | {:.0} / {:.0} MiB/s |",
        both / bare,
        wmib / both,
        wmib / bare,
    ));

    // The hashes alone over the same bytes (one thread).
    let (mut crc, mut sha) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..reps {
        let started = Instant::now();
        std::hint::black_box(BlockSums::of(&data, BLOCK_BYTES));
        crc = crc.min(started.elapsed().as_secs_f64());
        let started = Instant::now();
        std::hint::black_box(Sha256::digest(&data));
        sha = sha.min(started.elapsed().as_secs_f64());
    }
    rows.push(format!(
        "| block CRC-32 / sha256 of {wmib:.0} MiB in memory, one thread | | {:.0} / {:.0} MiB/s |",
        wmib / crc,
        wmib / sha,
    ));
    println!("| figure | ratio | rates |");
    println!("| --- | --- | --- |");
    for row in rows {
        println!("{row}");
    }
}
