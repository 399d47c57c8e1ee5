"""End-to-end benchmark of polyak against its anchors and the machine's limits.

Run with ``./scripts/bench`` (builds the release server, then runs this).
Every figure is a ratio against a baseline measured in the same run on the
same machine; the table says PASS or MISS against the target. Writes
``benches/results.json``, a plot ``benches/e2e.png`` and the table into
``benches/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "clients" / "python"))

from polyak import Client  # noqa: E402
from polyak.testing import PolyakServer  # noqa: E402

MB = 1 << 20


# -- helpers ---------------------------------------------------------------


def safetensors_body(numel: int, dtype=torch.float32, tensors: int = 64, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    per = numel // tensors
    sd = {f"layer{i:03d}.weight": torch.randn(per, generator=g).to(dtype) for i in range(tensors)}
    return safetensors.torch.save(sd)


def rss_peak(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class Http:
    """One keep-alive connection; PUT bodies, parse JSON answers."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=600)

    def put(self, path: str, body: bytes) -> tuple[int, dict]:
        self.conn.request(
            "PUT", path, body=body, headers={"Content-Type": "application/octet-stream"}
        )
        r = self.conn.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else {}

    def close(self):
        self.conn.close()


def create_run(url: str, name: str, world: int = 1, profiles: int = 1, **extra) -> None:
    c = Client(url)
    profs = [
        {"name": f"p{i}", "kind": "constant", "beta": 0.99 + 0.001 * i} for i in range(profiles)
    ]
    c.create_run(
        name, world_size=world, profiles=profs, persist_every_secs=0, drift_every=0, **extra
    )
    c.close()


def _sink(port_q, n_bytes):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port_q.put(s.getsockname()[1])
    conn, _ = s.accept()
    buf = bytearray(8 * MB)
    view = memoryview(buf)
    got = 0
    while got < n_bytes:
        n = conn.recv_into(view)
        if not n:
            break
        got += n
    conn.sendall(b"k")
    conn.close()


def raw_tcp_rate(payload: bytes, count: int) -> float:
    """Loopback TCP into a plain socket sink in another process."""
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_sink, args=(q, len(payload) * count))
    p.start()
    port = q.get(timeout=30)
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    for _ in range(count):
        s.sendall(payload)
    s.recv(1)
    dt = time.perf_counter() - t0
    s.close()
    p.join(30)
    return len(payload) * count / dt


# -- measurements ------------------------------------------------------------


def ingest(url: str, run: str, bodies: list[bytes], start: int = 0) -> dict:
    """Pushes the bodies as consecutive steps on one connection."""
    h = Http(url)
    applies, lat = [], []
    total = 0
    t0 = time.perf_counter()
    for i, b in enumerate(bodies):
        t = time.perf_counter()
        status, out = h.put(f"/v1/runs/{run}/ranks/0/steps/{start + i}", b)
        lat.append(time.perf_counter() - t)
        assert status == 200 and out.get("applied"), out
        applies.append(out["apply_seconds"])
        total += len(b)
    dt = time.perf_counter() - t0
    h.close()
    return {"bytes_per_s": total / dt, "apply": applies, "latency": lat}


def apply_seconds(url: str, name: str, numel: int, profiles: int, dtype, pushes: int) -> float:
    create_run(url, name, profiles=profiles)
    bodies = [safetensors_body(numel, dtype, seed=s) for s in range(2)]
    res = ingest(url, name, [bodies[i % 2] if i else bodies[0] for i in range(pushes)])
    Client(url).delete_run(name)
    return statistics.median(res["apply"][1:])  # the first push copies


def torch_lerp_seconds(numel: int, reps: int = 5) -> float:
    ema = torch.zeros(numel)
    w = torch.randn(numel)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        ema.lerp_(w, 0.001)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Mlp(nn.Module):
    def __init__(self, params: int, width: int = 2048):
        super().__init__()
        n = max(1, params // (width * width))
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))


def training_thread(url: str, params: int, steps: int, step_seconds: float) -> dict:
    """Training-thread time per push against ema-pytorch on the same model."""
    from ema_pytorch import EMA
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = Mlp(params)
    n_params = sum(p.numel() for p in model.parameters())
    out: dict = {"params": n_params}
    for profiles in (1, 3):
        emas = [
            EMA(model, beta=0.999, update_every=1, update_after_step=0, use_foreach=True)
            for _ in range(profiles)
        ]
        times = []
        for _ in range(steps):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            t = time.perf_counter()
            for e in emas:
                e.update()
            times.append(time.perf_counter() - t)
        out[f"ema_pytorch_{profiles}"] = statistics.median(times[1:])
        del emas
        name = f"tt{profiles}"
        create_run(url, name, profiles=profiles)
        run = Client(url).run(name)
        pusher = run.pusher(0)
        times = []
        for step in range(steps):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            t = time.perf_counter()
            pusher.push(model, step)
            times.append(time.perf_counter() - t)
            time.sleep(step_seconds)  # the rest of the training step
        pusher.flush()
        pusher.close()
        out[f"polyak_push_{profiles}"] = statistics.median(times[1:])
        Client(url).delete_run(name)
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        avg.update_parameters(model)
        times.append(time.perf_counter() - t)
    out["averaged_model"] = statistics.median(times[1:])
    return out


def download(url: str, numel: int, tmp: Path) -> dict:
    create_run(url, "dl")
    body = safetensors_body(numel, seed=3)
    ingest(url, "dl", [body])
    run = Client(url).run("dl")
    snap = run.snapshot(wait=True)
    out_dir = tmp / "dl"
    t = time.perf_counter()
    run.download_to(snap, str(out_dir), profile="p0", layout="full", progress=False)
    dl_s = time.perf_counter() - t
    size = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    tensors = safetensors.torch.load(body)
    t = time.perf_counter()
    safetensors.torch.save_file(tensors, str(tmp / "baseline.safetensors"))
    save_s = time.perf_counter() - t
    Client(url).delete_run("dl")
    return {"bytes": size, "download_s": dl_s, "save_file_s": save_s}


def rank_worker(url: str, run: str, rank: int, body: bytes, seconds: float, out: list):
    h = Http(url)
    lat, errors, sent = [], 0, 0
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        t = time.perf_counter()
        try:
            status, _ = h.put(f"/v1/runs/{run}/ranks/{rank}/steps/{step}", body)
        except OSError:
            status = -1
            h.close()
            h = Http(url)
        lat.append(time.perf_counter() - t)
        if status == 200:
            sent += len(body)
            step += 1
        elif status == 429:
            time.sleep(0.05)
        else:
            errors += 1
    h.close()
    out.append({"lat": lat, "errors": errors, "bytes": sent})


def concurrent(url: str, ranks: int, shard_bytes: int, seconds: float) -> dict:
    name = f"conc{ranks}"
    create_run(url, name, world=ranks)
    body = safetensors_body(shard_bytes // 4, seed=5, tensors=8)
    results: list = []
    threads = [
        threading.Thread(target=rank_worker, args=(url, name, r, body, seconds, results))
        for r in range(ranks)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    Client(url).delete_run(name)
    lat = sorted(x for r in results for x in r["lat"])
    return {
        "ranks": ranks,
        "bytes_per_s": sum(r["bytes"] for r in results) / dt,
        "errors": sum(r["errors"] for r in results),
        "p50": lat[len(lat) // 2] if lat else None,
        "p99": lat[int(len(lat) * 0.99)] if lat else None,
    }


# -- report ----------------------------------------------------------------


def verdict(value: float, target: float, higher_is_better: bool) -> str:
    ok = value >= target if higher_is_better else value <= target
    return "PASS" if ok else "MISS"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "polyak"))
    ap.add_argument("--params", type=float, default=100e6, help="model size for the main figures")
    ap.add_argument(
        "--sizes", default="10e6,30e6,100e6,300e6", help="parameter counts for the growth figure"
    )
    ap.add_argument("--concurrent-seconds", type=float, default=60)
    ap.add_argument(
        "--quick", action="store_true", help="small sizes, short runs (checks the script)"
    )
    args = ap.parse_args()
    if args.quick:
        args.params, args.sizes, args.concurrent_seconds = 4e6, "1e6,2e6,4e6", 3
    params = int(args.params)
    results: dict = {
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.processor() or platform.machine()}"
    }
    tmp = Path(tempfile.mkdtemp(prefix="polyak-bench-"))
    table = []

    def row(figure, value, target, higher, fmt="{:.2f}"):
        table.append(
            (figure, fmt.format(value), target, verdict(value, float(target.split()[-1]), higher))
        )

    with PolyakServer(tmp / "data", binary=args.bin) as srv:
        url = srv.url
        # 1. ingest vs raw loopback TCP, 64 MB fp32 bodies
        numel64 = 16 * MB if not args.quick else MB  # 64 MB of fp32
        bodies = [safetensors_body(numel64, seed=s) for s in range(2)]
        count = 12 if not args.quick else 4
        raw = raw_tcp_rate(bodies[0], count)
        create_run(url, "ingest")
        ingest(url, "ingest", bodies[:1])  # registers the layout (a copy)
        ing = ingest(url, "ingest", [bodies[i % 2] for i in range(count)], start=1)
        Client(url).delete_run("ingest")
        results["ingest"] = {
            "raw_tcp_bytes_per_s": raw,
            **{k: v for k, v in ing.items() if k == "bytes_per_s"},
        }
        row(
            "ingest, 1 client, 64 MB fp32 bodies: server / raw loopback TCP",
            ing["bytes_per_s"] / raw,
            ">= 0.7",
            True,
        )

        # 2./3. apply cost by profiles and dtype at the main size
        pushes = 5 if not args.quick else 3
        a1 = apply_seconds(url, "a1", params, 1, torch.float32, pushes)
        a4 = apply_seconds(url, "a4", params, 4, torch.float32, pushes)
        b1 = apply_seconds(url, "b1", params, 1, torch.bfloat16, pushes)
        lerp = torch_lerp_seconds(params)
        results["apply"] = {"fp32_1": a1, "fp32_4": a4, "bf16_1": b1, "torch_lerp": lerp}
        row("server apply time, 4 profiles / 1 profile", a4 / a1, "<= 1.5", False)
        row("bf16 body into fp32 EMA: apply rate / fp32 apply rate", a1 / b1, ">= 0.8", True)
        per_profile = {}
        for k in (1, 2, 8):
            per_profile[k] = (
                a1
                if k == 1
                else apply_seconds(url, f"pp{k}", params // 4, k, torch.float32, pushes)
            )
        results["profiles_curve"] = per_profile

        # 4./5. training-thread time per push vs ema-pytorch
        tt = training_thread(
            url,
            params,
            steps=6 if not args.quick else 3,
            step_seconds=1.0 if not args.quick else 0.1,
        )
        results["training_thread"] = tt
        row(
            "training-thread time per push / ema_pytorch.EMA(use_foreach).update(), 1 profile",
            tt["polyak_push_1"] / tt["ema_pytorch_1"],
            "<= 0.5",
            False,
        )
        row(
            "same, 3 profiles / three ema-pytorch EMAs",
            tt["polyak_push_3"] / tt["ema_pytorch_3"],
            "<= 0.2",
            False,
        )

        # 6. full download to disk vs safetensors.torch.save_file
        dl = download(url, params, tmp)
        results["download"] = dl
        row(
            "full download written to disk / save_file of the same tensors (rate)",
            dl["save_file_s"] / dl["download_s"],
            ">= 1.0",
            True,
        )

        # 8. concurrency
        shard = 8 * MB if not args.quick else MB
        one = concurrent(url, 1, shard, min(10, args.concurrent_seconds))
        curve = {1: one}
        for r in (8,):
            curve[r] = concurrent(url, r, shard, min(10, args.concurrent_seconds))
        many = concurrent(url, 32, shard, args.concurrent_seconds)
        curve[32] = many
        results["concurrent"] = curve
        table.append(
            (
                f"32 ranks, 8 MB shards, {args.concurrent_seconds:.0f} s: errors",
                str(many["errors"]),
                "== 0",
                "PASS" if many["errors"] == 0 else "MISS",
            )
        )
        row(
            "32 ranks: aggregate throughput / one rank's",
            many["bytes_per_s"] / one["bytes_per_s"],
            ">= 0.8",
            True,
        )
        table.append(
            (
                "32 ranks: push latency p50 / p99 (s)",
                f"{many['p50']:.3f} / {many['p99']:.3f}",
                "reported",
                "-",
            )
        )

    # 7. peak RSS, on a fresh server: EMA + mirror + 2 x the largest body
    with PolyakServer(tmp / "rss", binary=args.bin) as srv:
        create_run(srv.url, "rss", mirror=True)
        bodies = [safetensors_body(params, seed=s) for s in range(2)]
        ingest(srv.url, "rss", [bodies[i % 2] for i in range(4)])
        peak = rss_peak(srv.pid)
        model_bytes = params // 64 * 64 * 4
        budget = model_bytes + model_bytes + 2 * len(bodies[0])
        results["rss"] = {"peak": peak, "ema_mirror_2body": budget}
        row("server peak RSS / (EMA + mirror + 2 x largest body)", peak / budget, "<= 1.2", False)
        del bodies

    # 9. growth of the apply cost with model size
    with PolyakServer(tmp / "grow", binary=args.bin) as srv:
        growth = {}
        for s in [int(float(x)) for x in args.sizes.split(",")]:
            growth[s] = {
                "polyak": apply_seconds(srv.url, f"g{s}", s, 1, torch.float32, 4),
                "torch_lerp": torch_lerp_seconds(s),
            }
        per_param = [v["polyak"] / s for s, v in growth.items()]
        results["growth"] = growth
        spread = max(per_param) / min(per_param)
        sizes = list(growth)
        row(
            f"apply cost per parameter, {sizes[0]:.0e} to {sizes[-1]:.0e}: max / min",
            spread,
            "<= 1.1",
            False,
        )

    results["table"] = table
    (HERE / "results.json").write_text(json.dumps(results, indent=2, default=str))
    width = max(len(r[0]) for r in table)
    print(f"\npolyak end-to-end benchmark — {results['machine']}, {params / 1e6:.0f}M parameters\n")
    print(f"{'figure':<{width}}  {'measured':>12}  {'target':>9}  result")
    for figure, value, target, v in table:
        print(f"{figure:<{width}}  {value:>12}  {target:>9}  {v}")
    plot(results, HERE / "e2e.png")
    write_readme(results, params, args)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    g = results["growth"]
    sizes = [int(s) for s in g]
    axes[0].plot(sizes, [g[s]["polyak"] for s in g], "o-", label="polyak apply (server)")
    axes[0].plot(sizes, [g[s]["torch_lerp"] for s in g], "s--", label="torch lerp_ (in process)")
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="parameters",
        ylabel="seconds per update",
        title="Cost against model size",
    )
    axes[0].legend()
    c = results["concurrent"]
    ranks = sorted(int(r) for r in c)
    axes[1].plot(ranks, [c[r]["bytes_per_s"] / 1e9 for r in ranks], "o-")
    axes[1].set(
        xlabel="concurrent ranks",
        ylabel="GB/s aggregate",
        title="Ingest against ranks",
        xscale="log",
    )
    p = results["profiles_curve"]
    ks = sorted(int(k) for k in p)
    axes[2].plot(ks, [p[k] / p[1] if k != 1 else 1.0 for k in ks], "o-")
    axes[2].set(xlabel="profiles", ylabel="apply time / 1 profile", title="Cost against profiles")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_readme(results: dict, params: int, args) -> None:
    lines = [
        "# Benchmarks",
        "",
        "`./scripts/bench` builds the release server and runs `benches/e2e.py`, which starts",
        "the real server and measures every figure as a ratio against a baseline taken in",
        "the same run on the same machine (`--quick` checks the script in seconds).",
        "`cargo bench --bench engine` runs the criterion micro-benchmarks (parse and",
        "validate, apply for 1/2/4/8 profiles with fp32 and bf16 bodies, assembling a",
        "`full` download), each beside its baseline; CI runs them once (`cargo test --benches`).",
        "",
        f"Latest run: {results['machine']}, {params / 1e6:.0f}M float32 parameters"
        + (" (quick mode)" if args.quick else "")
        + ".",
        "",
        "| figure | measured | target | result |",
        "| --- | --- | --- | --- |",
    ]
    for figure, value, target, v in results["table"]:
        lines.append(f"| {figure} | {value} | {target} | {v} |")
    lines += ["", "![cost against model size, ranks and profiles](e2e.png)", ""]
    (HERE / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
