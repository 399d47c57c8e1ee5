"""Engines benchmark: one run of 8 ranks on a server with ``--engines 2``
against the same run on ``--engines 1``, in the same process.

Eight client threads (one per rank, one connection each) push fp32 bodies
as fast as the server answers; the figure is the aggregate rate of applied
bytes (pushes x body bytes / wall seconds) on two engines over the rate on
one. With 4 profiles the apply is most of the server's work per push
(reading the body once and each EMA twice); with 1 profile receiving and
validating the body weigh more. Printed with its target (``--engines 2``
over 1 >= 1.6 on 2 cores), never asserted.

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

from polyak.testing import PolyakServer  # noqa: E402
from polyak.wire import HostBody, TensorSpec, WireLayout  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "polyak"))
    ap.add_argument("--numel", type=float, default=4e6, help="fp32 values per rank")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs; medians taken")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.numel, args.rounds, args.repeats = 2e5, 3, 1
    numel = int(args.numel)
    g = torch.Generator().manual_seed(0)
    bodies = [body_of(torch.randn(numel, generator=g)) for _ in range(2)]
    results: dict[tuple[int, int], list[dict]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="polyak-engines-"))
    servers = {
        n: PolyakServer(tmp / f"data-{n}", "--engines", str(n), binary=args.bin) for n in (1, 2)
    }
    try:
        for srv in servers.values():
            srv.start()
        for rep in range(args.repeats):
            for profiles in (4, 1):
                for n, srv in servers.items():
                    out = aggregate_rate(
                        srv.url, f"b{rep}-{profiles}", profiles, bodies, args.rounds
                    )
                    results.setdefault((n, profiles), []).append(out)
    finally:
        for srv in servers.values():
            srv.stop()

    def rate(n: int, profiles: int) -> float:
        return statistics.median(r["rate"] for r in results[(n, profiles)])

    print(
        f"{RANKS} ranks x {numel * 4 / 2**20:.0f} MiB fp32 bodies, {args.rounds} pushes each, "
        f"{os.cpu_count()} CPUs, medians of {args.repeats} alternating runs"
    )
    rows = []
    ratio4 = rate(2, 4) / rate(1, 4)
    rows.append(
        (
            "aggregate apply rate, 4 profiles: --engines 2 / --engines 1",
            f"{ratio4:.2f}",
            ">= 1.6",
            "PASS" if ratio4 >= 1.6 else "MISS",
        )
    )
    ratio1 = rate(2, 1) / rate(1, 1)
    rows.append(("same, 1 profile: --engines 2 / --engines 1", f"{ratio1:.2f}", "reported", "-"))
    for n in (1, 2):
        for profiles in (4, 1):
            rs = results[(n, profiles)]
            rows.append(
                (
                    f"--engines {n} ({', '.join(rs[0]['engines'])}), {profiles} profile(s): "
                    "GB/s applied; server apply p50 ms",
                    f"{rate(n, profiles) / 1e9:.2f}; "
                    f"{1e3 * statistics.median(r['apply_p50'] for r in rs):.1f}",
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
