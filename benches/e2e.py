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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "clients" / "python"))
sys.path.insert(0, str(ROOT / "clients" / "python-testing"))
sys.path.insert(0, str(HERE))

from polyak import Client  # noqa: E402
from polyak_testing import PolyakServer  # noqa: E402

MB = 1 << 20
#: Where the runs keep their EMA and where torch's baselines run (--device).
DEVICE = "cpu"


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
        name,
        world_size=world,
        profiles=profs,
        persist_every_secs=0,
        drift_every=0,
        device=DEVICE,
        **extra,
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
    # The spawned sink imports the calling script first (torch with it):
    # on a loaded machine that takes a while.
    port = q.get(timeout=300)
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    for _ in range(count):
        s.sendall(payload)
    s.recv(1)
    dt = time.perf_counter() - t0
    s.close()
    p.join(30)
    return len(payload) * count / dt


def machine() -> str:
    """CPU model, cores and memory (no host name)."""
    model = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB memory"
    gpu = ""
    if DEVICE.startswith("cuda"):
        gpu = f", {torch.cuda.get_device_name(torch.device(DEVICE))}"
    return f"{os.cpu_count()} CPUs ({model}){mem}{gpu}, torch {torch.__version__}"


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
    # One body pushed at every step (the values do not change the cost),
    # so that the largest sizes fit in memory.
    body = safetensors_body(numel, dtype)
    res = ingest(url, name, [body] * pushes)
    del body
    Client(url).delete_run(name)
    return statistics.median(res["apply"][1:])  # the first push copies


def torch_lerp_seconds(numel: int, reps: int = 5) -> float:
    ema = torch.zeros(numel, device=DEVICE)
    w = torch.randn(numel, device=DEVICE)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        ema.lerp_(w, 0.001)
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def gpu_baselines(numel: int, tensors: int = 64, reps: int = 5) -> dict:
    """torch on the same GPU: a pinned host-to-device copy of the push's
    bytes, and ``torch._foreach_lerp_`` over the push's tensors."""
    per = numel // tensors
    host = torch.randn(per * tensors).pin_memory()
    dev = torch.empty(per * tensors, device=DEVICE)
    emas = [torch.zeros(per, device=DEVICE) for _ in range(tensors)]
    ws = list(torch.randn(per * tensors, device=DEVICE).split(per))

    def timed(fn) -> float:
        times = []
        for _ in range(reps + 1):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    return {
        "h2d_s": timed(lambda: dev.copy_(host, non_blocking=True)),
        "foreach_lerp_s": timed(lambda: torch._foreach_lerp_(emas, ws, 0.001)),
        "bytes": host.numel() * 4,
    }


def training_thread(url: str, params: int, steps: int) -> dict:
    """Training-thread time per step lost to the EMA: polyak's ``attach``
    (push in the post-step hook + the pre-step hook's wait for the deferred
    parameter copy) against ``ema_pytorch.EMA(use_foreach=True).update()``
    on the same model; the loop of ``benches/client_push.py``."""
    import client_push as cp
    import polyak

    width = 2048
    depth = max(1, round(params / (width * width + 3 * width)))
    torch.manual_seed(0)
    model = cp.build_model(width, depth)
    compute = cp.stand_in(cp.lerp_seconds(model))
    out: dict = {"params": sum(p.numel() for p in model.parameters())}
    profiles = [
        {"name": "ema", "kind": "constant", "beta": 0.999},
        {"name": "warm", "kind": "warmup", "beta": 0.9999},
        {"name": "edm", "kind": "power", "sigma_rel": 0.05},
    ]
    client = polyak.Client(url)
    for k in (1, 3):
        ema = cp.measure("ema", model, compute, steps, cp.ema_pytorch_update(model, k))
        run = client.create_run(
            f"tt{k}", profiles=profiles[:k], persist_every_secs=0, device=DEVICE
        )
        mine = cp.measure("polyak", model, compute, steps, pushers=[run.pusher()])
        client.delete_run(f"tt{k}")
        out[f"ema_pytorch_{k}"] = ema.ema
        out[f"polyak_push_{k}"] = mine.ema
        out[f"polyak_push_{k}_detail"] = {"push": mine.push, "wait": mine.wait, "note": mine.note}
    client.close()
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

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
    pending = run.snapshot(step=1, wait=False)  # a consistent cut at the next push
    ingest(url, "dl", [body], start=1)
    snap = run.wait_snapshot(pending)
    tensors = safetensors.torch.load(body)
    baseline = tmp / "baseline.safetensors"
    out_dir = tmp / "dl"
    # Alternated and deleted after each, so that neither meets the other's
    # dirty pages in the page cache; neither fsyncs in the main figure (as
    # save_file does not), both do in the second.
    times: dict[str, list[float]] = {k: [] for k in ("dl", "save", "dl_fsync", "save_fsync")}
    size = 0
    # Nine rounds: single downloads here swing by 2x with the page cache's
    # and the other tenants' state; the median of nine holds still.
    for _ in range(9):
        for durable in (False, True):
            t = time.perf_counter()
            path = run.download_to(
                snap, str(out_dir), profile="p0", layout="full", progress=False, fsync=durable
            )
            times["dl_fsync" if durable else "dl"].append(time.perf_counter() - t)
            size = path.stat().st_size
            path.unlink()
            t = time.perf_counter()
            safetensors.torch.save_file(tensors, str(baseline))
            if durable:
                fd = os.open(baseline, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            times["save_fsync" if durable else "save"].append(time.perf_counter() - t)
            baseline.unlink()
    med = {k: statistics.median(v) for k, v in times.items()}
    Client(url).delete_run("dl")
    # The floor: the same bytes through one loopback TCP connection into a
    # sink that discards them.
    raw = statistics.median(raw_tcp_rate(body, 1) for _ in range(3))
    return {
        "bytes": size,
        "raw_tcp_s": size / raw,
        "download_s": med["dl"],
        "save_file_s": med["save"],
        "download_fsync_s": med["dl_fsync"],
        "save_file_fsync_s": med["save_fsync"],
    }


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
        "--sizes",
        default="10e6,30e6,100e6,300e6,1e9",
        help="parameter counts for the growth figure",
    )
    ap.add_argument("--concurrent-seconds", type=float, default=60)
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the runs keep their EMA (cuda: also host-to-device and _foreach_lerp_ rows)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="small sizes, short runs (checks the script)"
    )
    args = ap.parse_args()
    if args.quick:
        args.params, args.sizes, args.concurrent_seconds = 4e6, "1e6,2e6,4e6", 3
    global DEVICE
    DEVICE = args.device
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {DEVICE}: torch sees no CUDA device here")
    params = int(args.params)
    results: dict = {"machine": machine(), "params": params, "device": DEVICE}
    tmp = Path(tempfile.mkdtemp(prefix="polyak-bench-"))
    table = []

    def row(figure, value, target, higher, fmt="{:.2f}"):
        table.append(
            (figure, fmt.format(value), target, verdict(value, float(target.split()[-1]), higher))
        )

    def reported(figure: str, value: str) -> None:
        """A figure without a target: printed, not judged."""
        table.append((figure, value, "reported", "-"))

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
        pushes = 7 if not args.quick else 3
        a1 = apply_seconds(url, "a1", params, 1, torch.float32, pushes)
        a4 = apply_seconds(url, "a4", params, 4, torch.float32, pushes)
        b1 = apply_seconds(url, "b1", params, 1, torch.bfloat16, pushes)
        lerp = torch_lerp_seconds(params)
        results["apply"] = {"fp32_1": a1, "fp32_4": a4, "bf16_1": b1, "torch_lerp": lerp}
        if DEVICE.startswith("cuda"):
            gpu = gpu_baselines(params)
            results["gpu"] = gpu
            reported(
                f"{DEVICE}: torch pinned host-to-device copy (GB/s)",
                f"{gpu['bytes'] / gpu['h2d_s'] / 1e9:.1f}",
            )
            reported(
                f"{DEVICE}: server apply (host-to-device + lerp) / "
                "torch copy + _foreach_lerp_ on the same GPU",
                f"{a1 / (gpu['h2d_s'] + gpu['foreach_lerp_s']):.2f}",
            )
        row("server apply time, 4 profiles / 1 profile", a4 / a1, "<= 1.5", False)
        row("bf16 body into fp32 EMA: apply rate / fp32 apply rate", a1 / b1, ">= 0.8", True)
        # The curve at a quarter of the size, every point measured alike.
        per_profile = {
            k: apply_seconds(url, f"pp{k}", params // 4, k, torch.float32, pushes)
            for k in (1, 2, 4, 8)
        }
        results["profiles_curve"] = per_profile

        # 4./5. training-thread time per push vs ema-pytorch
        tt = training_thread(url, params, steps=8 if not args.quick else 3)
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
        reported(
            "same, both fsynced (download_to's default)",
            f"{dl['save_file_fsync_s'] / dl['download_fsync_s']:.2f}",
        )
        reported(
            "full download rate / raw loopback TCP of the same bytes into a sink (the floor)",
            f"{dl['raw_tcp_s'] / dl['download_s']:.2f}",
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
        reported(
            "32 ranks: push latency p50 / p99 (s)",
            f"{many['p50']:.3f} / {many['p99']:.3f}",
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
        # Sizes alternate over rounds, each figure the median of its rounds:
        # a busy moment of this shared machine then moves one sample of a
        # size, not the size's whole figure.
        grow_sizes = [int(float(x)) for x in args.sizes.split(",")]
        samples = {s: {"polyak": [], "torch_lerp": []} for s in grow_sizes}
        for r in range(3):
            for s in grow_sizes:
                # More pushes where each is short, so the median is as steady.
                pushes = 4 if s >= 100e6 else 10
                samples[s]["polyak"].append(
                    apply_seconds(srv.url, f"g{s}r{r}", s, 1, torch.float32, pushes)
                )
                samples[s]["torch_lerp"].append(torch_lerp_seconds(s, reps=3 if s >= 100e6 else 9))
        growth = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in samples.items()}
        results["growth"] = growth
        results["growth_rounds"] = samples
        sizes = list(growth)

        # Linear growth: the cost per parameter stays the same. How far the
        # furthest size's lies from the median, and the same for torch's
        # own lerp_ in process (what the memory system does by itself).
        def spread(key: str) -> float:
            per = [growth[n][key] / n for n in sizes]
            mid = statistics.median(per)
            return max(abs(p - mid) / mid for p in per)

        results["growth_spread"] = {"polyak": spread("polyak"), "torch_lerp": spread("torch_lerp")}
        row(
            f"apply cost per parameter, {sizes[0]:.0e} to {sizes[-1]:.0e}: "
            f"furthest from the median (torch lerp_: {spread('torch_lerp'):.2f})",
            spread("polyak"),
            "<= 0.1",
            False,
        )

    results["table"] = table
    width = max(len(r[0]) for r in table)
    print(f"\npolyak end-to-end benchmark — {results['machine']}, {params / 1e6:.0f}M parameters\n")
    print(f"{'figure':<{width}}  {'measured':>12}  {'target':>9}  result")
    for figure, value, target, v in table:
        print(f"{figure:<{width}}  {value:>12}  {target:>9}  {v}")
    if args.quick:
        print("\n(quick mode: benches/README.md, results.json and e2e.png left as they are)")
    else:
        (HERE / "results.json").write_text(json.dumps(results, indent=2, default=str))
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
    base = p[ks[0]]
    axes[2].plot(ks, [p[k] / base for k in ks], "o-", label="polyak (measured)")
    # Memory traffic per parameter: the source read once, each EMA read and written.
    axes[2].plot(ks, [(1 + 2 * k) / 3 for k in ks], "--", label="bytes moved / 1 profile's")
    axes[2].legend()
    axes[2].set(
        xlabel="profiles",
        ylabel="apply time / 1 profile",
        title=f"Cost against profiles ({results['params'] // 4 / 1e6:.0f}M parameters)",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


BEGIN, END = "<!-- e2e results: written by benches/e2e.py -->", "<!-- end of e2e results -->"


def write_readme(results: dict, params: int, args) -> None:
    """Replaces the results block of ``benches/README.md``; the text around
    it (how to run, what the misses are) is kept."""
    lines = [
        BEGIN,
        f"Latest run: {results['machine']}, {params / 1e6:.0f}M float32 parameters.",
        "",
        "| figure | measured | target | result |",
        "| --- | --- | --- | --- |",
    ]
    for figure, value, target, v in results["table"]:
        lines.append(f"| {figure} | {value} | {target} | {v} |")
    lines += ["", "![cost against model size, ranks and profiles](e2e.png)", END]
    path = HERE / "README.md"
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
    else:
        head, tail = text.rstrip("\n") + "\n\n", "\n"
    path.write_text(head + "\n".join(lines) + tail)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
