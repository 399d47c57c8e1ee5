"""The Python client's download rate with 1 and N ranged connections,
against ``curl`` on the same file, and what each reads from the store.

    .venv/bin/python benches/client_download.py                # 1 GiB, file store and S3
    .venv/bin/python benches/client_download.py --mib 256 --store file
    .venv/bin/python benches/client_download.py --quick        # 64 MiB, a few seconds

For each store (the embedded file store; SeaweedFS S3 with a PostgreSQL
catalog) this starts the real server, pushes one step of ``--mib`` MiB over
one rank and takes a snapshot, then downloads its ``full`` layout
``--rounds`` times each way into a file beside the others (fsync off on
every side, the page cache taking the bytes):

- ``curl``: one connection, ``curl -s -o FILE URL`` (the baseline);
- ``client n=K``: ``Run.download_to(..., connections=K)``, which fetches by
  ranges on K connections, splices each answer into its place in the file,
  and checks every 8 MiB block against the server's digests.

Printed per way: the median seconds, MiB/s, the ratio to ``curl`` (above 1
is faster), and the store bytes read per byte served
(``polyak_store_read_bytes_total`` around the download). Rounds alternate
between the ways; the machine may be shared. Reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import polyak
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "clients" / "python-testing"))

from polyak_testing import Backends  # noqa: E402

MIB = 1 << 20


def store_read(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        int(float(m.group(1)))
        for m in re.finditer(r"^polyak_store_read_bytes_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    )


def make_snapshot(client: polyak.Client, mib: int):
    run = client.create_run(
        "bench-download", profiles=[{"name": "c", "kind": "constant", "beta": 0.9}]
    )
    g = torch.Generator().manual_seed(0)
    src = torch.randn(mib * MIB // 4 // 8, generator=g)
    pusher = run.pusher()
    pusher.push({f"layer{i}.weight": src + i for i in range(8)}, 0)
    pusher.flush()
    pusher.close()
    return run, run.snapshot(step=0, timeout=600)


def bench_store(backends: Backends, pair: str, args: argparse.Namespace, work: Path) -> None:
    srv = backends.server(pair, work / f"data-{pair}")
    srv.start()
    try:
        with polyak.Client(srv.url) as client:
            run, snap = make_snapshot(client, args.mib)
            url = f"{srv.url}/v1/runs/{run.name}/snapshots/{snap['id']}/download?profile=c"
            ways: dict[str, object] = {"curl": None}
            for n in args.connections:
                ways[f"client n={n}"] = n
            times: dict[str, list[float]] = {w: [] for w in ways}
            ratio: dict[str, list[float]] = {w: [] for w in ways}
            size = 0
            for _ in range(args.rounds):
                for way, n in ways.items():
                    out = work / "out"
                    out.mkdir(exist_ok=True)
                    for p in out.iterdir():
                        p.unlink()
                    before = store_read(srv.url)
                    t0 = time.perf_counter()
                    if n is None:
                        target = out / "curl.safetensors"
                        subprocess.run(["curl", "-s", "-f", "-o", str(target), url], check=True)
                    else:
                        target = run.download_to(
                            snap, out, "c", progress=False, fsync=False, connections=int(n)
                        )
                    times[way].append(time.perf_counter() - t0)
                    size = target.stat().st_size
                    ratio[way].append((store_read(srv.url) - before) / size)
            base = statistics.median(times["curl"])
            print(f"\n{pair}: {size / MIB:.0f} MiB full download, median of {args.rounds}")
            print(f"  {'way':<14}{'seconds':>9}{'MiB/s':>9}{'vs curl':>9}{'store/served':>14}")
            for way in ways:
                t = statistics.median(times[way])
                print(
                    f"  {way:<14}{t:9.3f}{size / MIB / t:9.0f}{base / t:9.2f}"
                    f"{statistics.median(ratio[way]):14.3f}"
                )
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--store", choices=["file", "s3", "both"], default="both")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.rounds, args.connections = 64, 1, [1, 4]
    pairs = {"file": ["sqlite-file"], "s3": ["postgres-s3"], "both": ["sqlite-file", "postgres-s3"]}
    print(f"{os.cpu_count()} CPUs; polyak {polyak.__version__}")
    with Backends() as backends, tempfile.TemporaryDirectory() as tmp:
        for pair in pairs[args.store]:
            bench_store(backends, pair, args, Path(tmp))


if __name__ == "__main__":
    main()
