"""Engines benchmark: one run of 8 ranks on a server with ``--engines 2``
against the same run on ``--engines 1``, in the same process.

Eight client threads (one per rank, one connection each) push fp32 bodies
as fast as the server answers; the figure is the aggregate rate of applied
bytes (pushes x body bytes / wall seconds) on two engines over the rate on
one, end to end: the clients, the kernel's socket copies, receiving and
validating the bodies share the cores with the engines. The apply alone
(the issue's figure, target >= 1.6 on 2 cores) is measured without HTTP by
``cargo test --bench engines -- --bench``; this script shows what of it a
whole machine keeps when one box runs the trainers' side too. Small shards
(under the fused kernel's 1M-value split) are applied on one thread each;
a large shard's apply is already split over the cores by one engine.
Reported, never asserted.

``python benches/engines.py --bin target/release/polyak`` (``--quick``:
small bodies, checks the script).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "clients" / "python"))
sys.path.insert(0, str(ROOT / "clients" / "python-testing"))

from polyak.wire import HostBody, TensorSpec, WireLayout  # noqa: E402
from polyak_testing import PolyakServer  # noqa: E402

RANKS = 8


def body_of(t: torch.Tensor) -> bytes:
    body = HostBody(WireLayout([TensorSpec("w", t.dtype, tuple(t.shape))]))
    body.fill([t])
    return bytes(body.memory)


def aggregate_rate(url: str, name: str, profiles: int, bodies: list[bytes], rounds: int) -> dict:
    """Applied bytes per second over ``rounds`` pushes of every rank, the
    ranks pushing concurrently; and the median server apply seconds."""
    with httpx.Client(base_url=url, timeout=600) as c:
        r = c.post(
            "/v1/runs",
            json={
                "name": name,
                "world_size": RANKS,
                "persist_every_secs": 0,
                "drift_every": 0,
                "profiles": [
                    {"name": f"p{i}", "kind": "constant", "beta": 0.9 + 0.02 * i}
                    for i in range(profiles)
                ],
            },
        )
        assert r.status_code == 201, r.text
        engines = sorted({p["engine"] for p in c.get(f"/v1/runs/{name}/placement").json().values()})
    host, port = url.removeprefix("http://").split(":")
    applies: list[float] = []
    errors: list[BaseException] = []
    start = threading.Barrier(RANKS + 1)

    def rank_loop(rank: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        try:
            conn.request("PUT", f"/v1/runs/{name}/ranks/{rank}/steps/0", body=bodies[0])
            assert conn.getresponse().read()
            start.wait()
            for step in range(1, rounds + 1):
                conn.request(
                    "PUT", f"/v1/runs/{name}/ranks/{rank}/steps/{step}", body=bodies[step % 2]
                )
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{resp.status}: {data[:200]!r}")
                applies.append(json.loads(data)["apply_seconds"])
        except BaseException as e:  # reported after the join
            errors.append(e)
            start.abort()
        finally:
            conn.close()

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(RANKS)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    with httpx.Client(base_url=url, timeout=600) as c:
        c.delete(f"/v1/runs/{name}")
    return {
        "rate": RANKS * rounds * len(bodies[0]) / wall,
        "apply_p50": statistics.median(applies),
        "engines": engines,
    }


def lerp_ceiling(numel: int, profiles: int, repeats: int = 5) -> float:
    """The machine's own ceiling for the figure: torch's ``lerp_`` of the
    same EMAs (every profile of every rank) on 2 intra-op threads over 1.
    Memory-bound updates gain from a second core only as far as memory
    bandwidth allows; no engine layout can do better than this."""
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(numel, generator=g) for _ in range(RANKS)]
    emas = [[torch.randn(numel, generator=g) for _ in range(profiles)] for _ in range(RANKS)]
    before = torch.get_num_threads()
    best = {}
    try:
        for threads in (1, 2) * repeats:
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            for w, rank in zip(ws, emas, strict=True):
                for e in rank:
                    e.lerp_(w, 0.1)
            dt = time.perf_counter() - t0
            best[threads] = min(best.get(threads, dt), dt)
    finally:
        torch.set_num_threads(before)
    return best[1] / best[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "polyak"))
    ap.add_argument("--large", type=float, default=4e6, help="fp32 values per rank, large shards")
    ap.add_argument("--small", type=float, default=5e5, help="fp32 values per rank, small shards")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs; medians taken")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.large, args.small, args.rounds, args.repeats = 2e5, 5e4, 3, 1
    g = torch.Generator().manual_seed(0)
    shards = {
        size: [body_of(torch.randn(int(n), generator=g)) for _ in range(2)]
        for size, n in (("large", args.large), ("small", args.small))
    }
    # Small shards take more pushes for the same bytes.
    rounds = {"large": args.rounds, "small": args.rounds * max(1, int(args.large // args.small))}
    results: dict[tuple[int, str, int], list[dict]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="polyak-engines-"))
    servers = {
        n: PolyakServer(tmp / f"data-{n}", "--engines", str(n), binary=args.bin) for n in (1, 2)
    }
    cases = [("small", 4), ("large", 4), ("large", 1)]
    try:
        for srv in servers.values():
            srv.start()
        for rep in range(args.repeats):
            for size, profiles in cases:
                for n, srv in servers.items():
                    out = aggregate_rate(
                        srv.url, f"b{rep}-{size}-{profiles}", profiles, shards[size], rounds[size]
                    )
                    results.setdefault((n, size, profiles), []).append(out)
    finally:
        for srv in servers.values():
            srv.stop()

    def rate(n: int, size: str, profiles: int) -> float:
        return statistics.median(r["rate"] for r in results[(n, size, profiles)])

    mib = {size: len(b[0]) / 2**20 for size, b in shards.items()}
    print(
        f"{RANKS} ranks pushing at once, fp32 bodies of {mib['small']:.1f} MiB (small) and "
        f"{mib['large']:.1f} MiB (large), {os.cpu_count()} CPUs, medians of {args.repeats} "
        "alternating runs"
    )
    rows = []
    small = rate(2, "small", 4) / rate(1, "small", 4)
    rows.append(
        (
            "end to end over HTTP, small shards, 4 profiles: --engines 2 / --engines 1",
            f"{small:.2f}",
            "reported",
            "-",
        )
    )
    rows.append(
        (
            "machine ceiling, small shards, 4 profiles: torch lerp_ on 2 threads / 1 thread",
            f"{lerp_ceiling(int(args.small), 4):.2f}",
            "reported",
            "-",
        )
    )
    for size, profiles in cases[1:]:
        rows.append(
            (
                f"same, large shards, {profiles} profile(s)",
                f"{rate(2, size, profiles) / rate(1, size, profiles):.2f}",
                "reported",
                "-",
            )
        )
    for n in (1, 2):
        for size, profiles in cases:
            rs = results[(n, size, profiles)]
            rows.append(
                (
                    f"--engines {n} ({', '.join(rs[0]['engines'])}), {size}, {profiles} profile(s): "
                    "GB/s applied; server apply p50 ms",
                    f"{rate(n, size, profiles) / 1e9:.2f}; "
                    f"{1e3 * statistics.median(r['apply_p50'] for r in rs):.2f}",
                    "reported",
                    "-",
                )
            )
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'measured':>12}  target    result")
    for figure, value, target, result in rows:
        print(f"{figure:<{width}}  {value:>12}  {target:<8}  {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
