//! Criterion micro-benchmarks of the hot paths, each next to its baseline:
//!
//! - `parse`: validating a 64 MB push (header, offsets, NaN scan, digest)
//!   against a plain `memcpy` of the same bytes;
//! - `apply`: one push into 1/2/4/8 profiles, fp32 and bf16 bodies, against
//!   torch's flat `lerp_` of the same size in the same process;
//! - `assemble`: producing a `full` download of a two-rank snapshot against
//!   reading the same stored bytes.
//!
//! `cargo bench --bench engine` measures; `cargo test --benches` (CI) runs
//! each once so the benches never rot.

use std::sync::Arc;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use polyak::engine::rank::{RankLayout, RankState};
use polyak::run::{NonfinitePolicy, RunConfig, RunSpec};
use polyak::snapshot::assemble::{self, Layout, StoredPart};
use polyak::wire::{parse_push, DType, HeaderEntry, ParsedPush, SafetensorsHeader, WireLimits};
use tch::{Device, Kind, Tensor};

const LIMITS: WireLimits = WireLimits {
    header_limit: 1 << 24,
};

/// A body of `tensors` tensors holding `numel` elements in all.
fn body(numel: usize, tensors: usize, dtype: DType) -> Bytes {
    let per = numel / tensors;
    let entries: Vec<HeaderEntry> = (0..tensors)
        .map(|i| HeaderEntry {
            name: format!("layer{i:03}.weight"),
            dtype,
            shape: vec![per as i64],
            nbytes: per * dtype.size(),
        })
        .collect();
    let header = SafetensorsHeader::new(entries, Default::default());
    let mut out = header.bytes().to_vec();
    let mut x = 0x12345678u32;
    for _ in 0..per * tensors {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let v = (x as f32 / u32::MAX as f32) - 0.5;
        match dtype {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            _ => unreachable!(),
        }
    }
    Bytes::from(out)
}

fn config(profiles: usize) -> RunConfig {
    let profiles: Vec<serde_json::Value> = (0..profiles)
        .map(|i| serde_json::json!({"name": format!("p{i}"), "kind": "constant", "beta": 0.9 + i as f64 * 0.01}))
        .collect();
    let spec: RunSpec = serde_json::from_value(serde_json::json!({
        "name": "bench", "world_size": 1, "profiles": profiles, "drift_every": 0
    }))
    .unwrap();
    spec.validate("cpu", |d| Ok(d.to_string())).unwrap()
}

fn parse(c: &mut Criterion) {
    let numel = 16 << 20; // 64 MB of fp32
    let b = body(numel, 64, DType::F32);
    let mut g = c.benchmark_group("parse");
    g.throughput(Throughput::Bytes(b.len() as u64));
    g.sample_size(10);
    g.bench_function("memcpy_baseline", |bench| {
        let mut dst = vec![0u8; b.len()];
        bench.iter(|| dst.copy_from_slice(&b))
    });
    g.bench_function("validate_64MB", |bench| {
        bench.iter(|| parse_push(b.clone(), LIMITS, NonfinitePolicy::Reject).unwrap())
    });
    g.finish();
}

fn rank_for(push: &ParsedPush, cfg: &RunConfig) -> RankState {
    let layout = Arc::new(RankLayout::register(push, cfg, &globset::GlobSet::empty()));
    RankState::new(layout, cfg, Device::Cpu).unwrap()
}

fn apply(c: &mut Criterion) {
    let numel = 4 << 20;
    let mut g = c.benchmark_group("apply");
    g.throughput(Throughput::Elements(numel as u64));
    g.sample_size(10);
    g.bench_function("torch_lerp_baseline", |bench| {
        let _guard = tch::no_grad_guard();
        let mut ema = Tensor::zeros([numel as i64], (Kind::Float, Device::Cpu));
        let w = Tensor::ones([numel as i64], (Kind::Float, Device::Cpu));
        bench.iter(|| {
            let _ = ema.lerp_(&w, 0.001);
        })
    });
    for dtype in [DType::F32, DType::BF16] {
        let b = body(numel, 32, dtype);
        let push = parse_push(b, LIMITS, NonfinitePolicy::Reject).unwrap();
        let order: Vec<usize> = (0..push.tensors.len()).collect();
        for profiles in [1usize, 2, 4, 8] {
            let cfg = config(profiles);
            let mut rank = rank_for(&push, &cfg);
            let mut step = 0u64;
            rank.apply_push(&cfg, &push, &order, step, Device::Cpu)
                .unwrap();
            g.bench_with_input(
                BenchmarkId::new(
                    format!("{}", dtype).to_lowercase(),
                    format!("{profiles}_profiles"),
                ),
                &profiles,
                |bench, _| {
                    bench.iter(|| {
                        step += 1;
                        rank.apply_push(&cfg, &push, &order, step, Device::Cpu)
                            .unwrap()
                    })
                },
            );
        }
    }
    g.finish();
}

fn assemble_full(c: &mut Criterion) {
    use polyak::snapshot::{convert, files};
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(1);
    let numel = 4 << 20;
    let mut parts = Vec::new();
    for rank in 0..2u32 {
        let b = body(numel, 16, DType::F32);
        let push = parse_push(b, LIMITS, NonfinitePolicy::Reject).unwrap();
        let order: Vec<usize> = (0..push.tensors.len()).collect();
        let mut state = rank_for(&push, &cfg);
        state
            .apply_push(&cfg, &push, &order, 0, Device::Cpu)
            .unwrap();
        let meta = polyak::engine::capture::meta_of(&cfg, &state);
        let part = convert::profile_part(
            &state.layout,
            polyak::engine::deep_copy(&state.ema[0]).unwrap(),
            Vec::new(),
            Default::default(),
        );
        let rel = files::snapshot_rel_dir("bench", "s").join(files::part_file_name(rank, "p0"));
        let written = files::write_part(dir.path(), &rel, &part).unwrap();
        parts.push(StoredPart {
            rank,
            path: polyak::snapshot::source::PartLoc::file(dir.path().join(&rel)),
            sha256: written.sha256,
            meta: Arc::new(meta),
        });
    }
    let total: u64 = parts
        .iter()
        .map(|p| p.path.open().unwrap().size().unwrap())
        .sum();
    let mut g = c.benchmark_group("assemble");
    g.throughput(Throughput::Bytes(total));
    g.sample_size(10);
    g.bench_function("read_files_baseline", |bench| {
        bench.iter(|| {
            parts
                .iter()
                .map(|p| p.path.open().unwrap().read_all().unwrap().len())
                .sum::<usize>()
        })
    });
    g.bench_function("full_download", |bench| {
        bench.iter(|| {
            let dl =
                assemble::build("s", Default::default(), &parts, Layout::Full, None, 0).unwrap();
            let mut n = 0usize;
            dl.file
                .produce(0..dl.file.len(), |b| {
                    n += b.len();
                    true
                })
                .unwrap();
            n
        })
    });
    g.finish();
}

criterion_group!(benches, parse, apply, assemble_full);
criterion_main!(benches);
