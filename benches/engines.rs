//! Aggregate apply throughput of one run's 8 ranks on 2 CPU engines
//! against 1, without HTTP: every rank's validated push is handed to its
//! engine at once, round after round, as ingest does; the figure is the
//! applied bytes per second of 2 engines over 1 (target >= 1.6 on 2
//! cores). Beside it, the machine's ceiling for the same work: torch's
//! `lerp_` of the same EMAs on 2 intra-op threads over 1. Small shards
//! (under the fused kernel's 1M-value split, one thread per apply) and
//! large ones (split over the cores by one engine already). Prints, asserts
//! nothing. `cargo test --bench engines -- --bench` measures (best of 5);
//! `cargo test --benches` runs it once, small.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::future::join_all;
use polyak::registry::Registry;
use polyak::run::{NonfinitePolicy, RunConfig, RunSpec};
use polyak::wire::{parse_push, DType, HeaderEntry, SafetensorsHeader, WireLimits};
use tch::{Device, Kind, Tensor};

const RANKS: u32 = 8;
const PROFILES: usize = 4;

fn body(numel: usize, seed: u32) -> Bytes {
    let header = SafetensorsHeader::new(
        vec![HeaderEntry {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![numel as i64],
            nbytes: numel * 4,
        }],
        Default::default(),
    );
    let mut out = header.bytes().to_vec();
    let mut x = 0x9e37_79b9u32 ^ seed;
    for _ in 0..numel {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        out.extend_from_slice(&((x as f32 / u32::MAX as f32) - 0.5).to_le_bytes());
    }
    Bytes::from(out)
}

fn config(name: &str) -> RunConfig {
    let profiles: Vec<serde_json::Value> = (0..PROFILES)
        .map(|i| serde_json::json!({"name": format!("p{i}"), "kind": "constant", "beta": 0.9 + i as f64 * 0.01}))
        .collect();
    let spec: RunSpec = serde_json::from_value(serde_json::json!({
        "name": name, "world_size": RANKS, "profiles": profiles, "drift_every": 0,
        "persist_every_secs": 0
    }))
    .unwrap();
    spec.validate("cpu", |d| Ok(d.to_string())).unwrap()
}

/// Applied bytes per second: `rounds` pushes of every rank, each round's
/// pushes all in flight at once; best of `reps`.
async fn rate(engines: usize, numel: usize, rounds: u64, reps: usize) -> f64 {
    let (captures, _rx) = tokio::sync::mpsc::unbounded_channel();
    let gauge = prometheus::IntGauge::new("runs", "runs").unwrap();
    let me = ("bench".to_string(), "http://127.0.0.1:0".to_string());
    let registry = Registry::new(
        ("cpu".into(), vec![]),
        engines,
        64,
        1 << 30,
        captures,
        gauge,
        me,
    );
    let limits = WireLimits {
        header_limit: 1 << 20,
    };
    let bodies: Vec<Bytes> = (0..2).map(|i| body(numel, i)).collect();
    let mut best = 0f64;
    for rep in 0..reps {
        let name = format!("bench-{rep}");
        let run = registry
            .install_run(
                Arc::new(config(&name)),
                0,
                None,
                Vec::new(),
                vec![registry.me(1); RANKS as usize],
            )
            .await
            .unwrap();
        let mut seconds = 0f64;
        for step in 0..=rounds {
            let pushes: Vec<_> = (0..RANKS)
                .map(|rank| {
                    let b = bodies[(step % 2) as usize].clone();
                    (rank, parse_push(b, limits, NonfinitePolicy::Allow).unwrap())
                })
                .collect();
            let started = Instant::now();
            let applied = join_all(pushes.into_iter().map(|(rank, push)| {
                let n = name.clone();
                let engine = run.engines.of(rank).expect("every rank is held here");
                async move {
                    engine
                        .push(&n, rank, step, push, Box::new(()))
                        .await
                        .map(|r| r.map(|o| o.applied))
                }
            }))
            .await;
            assert!(applied.into_iter().all(|a| a.unwrap().unwrap()));
            // Step 0 registers the layouts and allocates the EMAs.
            if step > 0 {
                seconds += started.elapsed().as_secs_f64();
            }
        }
        run.engines.drop_run(&name).await;
        registry.remove_run(&name);
        best = best.max((RANKS as u64 * rounds * numel as u64 * 4) as f64 / seconds);
    }
    best
}

/// torch's `lerp_` of every profile of every rank on 2 threads over 1.
fn ceiling(numel: usize, reps: usize) -> f64 {
    let ws: Vec<Tensor> = (0..RANKS)
        .map(|_| Tensor::randn([numel as i64], (Kind::Float, Device::Cpu)))
        .collect();
    let mut emas: Vec<Tensor> = (0..RANKS as usize * PROFILES)
        .map(|_| Tensor::randn([numel as i64], (Kind::Float, Device::Cpu)))
        .collect();
    let before = tch::get_num_threads();
    let mut best = [f64::MAX; 2];
    for _ in 0..reps {
        for (i, threads) in [1, 2].into_iter().enumerate() {
            tch::set_num_threads(threads);
            let t0 = Instant::now();
            for (j, e) in emas.iter_mut().enumerate() {
                let _ = e.lerp_(&ws[j / PROFILES], 0.1);
            }
            best[i] = best[i].min(t0.elapsed().as_secs_f64());
        }
    }
    tch::set_num_threads(before);
    best[0] / best[1]
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (small, large, rounds, reps) = if full {
        (500_000, 4_000_000, 16, 5)
    } else {
        (50_000, 200_000, 2, 1)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let _no_grad = tch::no_grad_guard();
    println!(
        "{RANKS} ranks, {PROFILES} profiles, fp32; {} CPUs; best of {reps}",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("{:<78} {:>9}  target    result", "figure", "measured");
    for (label, numel, target) in [("small", small, true), ("large", large, false)] {
        let one = rt.block_on(rate(1, numel, rounds, reps));
        let two = rt.block_on(rate(2, numel, rounds, reps));
        let ratio = two / one;
        let mib = numel as f64 * 4.0 / (1 << 20) as f64;
        let figure =
            format!("aggregate apply rate, {label} shards ({mib:.1} MiB): --engines 2 / 1");
        if target {
            let verdict = if ratio >= 1.6 { "PASS" } else { "MISS" };
            println!("{figure:<78} {ratio:>9.2}  >= 1.6    {verdict}");
        } else {
            println!("{figure:<78} {ratio:>9.2}  reported  -");
        }
        println!(
            "{:<78} {:>9}  reported  -",
            format!("  GB/s applied on 1; on 2 engines ({label})"),
            format!("{:.2}; {:.2}", one / 1e9, two / 1e9)
        );
        let c = ceiling(numel, reps);
        println!(
            "{:<78} {c:>9.2}  reported  -",
            format!("  machine ceiling ({label}): torch lerp_ on 2 threads / 1 thread")
        );
    }
}
