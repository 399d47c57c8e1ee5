"""The Python client's HTTP transport against plain ``http.client`` on the
same server, in the same process: what the client's own plumbing costs a
push and a download.

    .venv/bin/python benches/client_transport.py            # 64 MiB pushes, 256 MiB download
    .venv/bin/python benches/client_transport.py --quick    # small sizes, a few seconds

Pushes: a ``Pusher`` sends ``--steps`` pushes of a ``--push-mib`` state dict
(``push`` to ``flush``, one at a time, as a trainer whose server keeps up),
against the same safetensors bytes PUT over one keep-alive
``http.client`` connection (no copy, no queue, no thread). Downloads:
``Run.download_to`` of a ``layout=full`` snapshot against a plain
``http.client`` GET of the same URL read into one reused buffer (no file).
Both sides talk to the same real server, so its work is in both; a ratio
near 1 means the client adds little. Rounds alternate and medians are
reported; the machine may be shared. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import polyak
import safetensors.torch
import torch
from polyak_testing import PolyakServer

MIB = 1 << 20


def state_dict(mib: int, tensors: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = mib * MIB // 4 // tensors
    return {f"layer{i:03d}.weight": torch.randn(per, generator=g) for i in range(tensors)}


def connection(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=600)


def raw_pushes(url: str, run: str, body: bytes, first: int, steps: int) -> float:
    conn = connection(url)
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(body))}
    t0 = time.perf_counter()
    for step in range(first, first + steps):
        conn.request("PUT", f"/v1/runs/{run}/ranks/0/steps/{step}", body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"raw push {step}: {r.status} {data[:200]!r}")
    elapsed = time.perf_counter() - t0
    conn.close()
    return elapsed


def client_pushes(
    pusher: polyak.Pusher, sd: dict[str, torch.Tensor], first: int, steps: int
) -> float:
    t0 = time.perf_counter()
    for step in range(first, first + steps):
        pusher.push(sd, step)
        pusher.flush()
    return time.perf_counter() - t0


def raw_download(url: str, path: str) -> tuple[float, int]:
    conn = connection(url)
    buf = bytearray(8 * MIB)
    t0 = time.perf_counter()
    conn.request("GET", path)
    r = conn.getresponse()
    got = 0
    while n := r.readinto(buf):
        got += n
    elapsed = time.perf_counter() - t0
    conn.close()
    return elapsed, got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 MiB pushes, 32 MiB download")
    parser.add_argument("--push-mib", type=int, default=64)
    parser.add_argument("--download-mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="pushes per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.push_mib, args.download_mib, args.steps, args.rounds = 8, 32, 3, 3

    push_sd = state_dict(args.push_mib)
    body = safetensors.torch.save(push_sd)
    with tempfile.TemporaryDirectory() as data, PolyakServer(data, "--device", "cpu") as server:
        client = polyak.Client(server.url)
        profiles = [{"name": "ema", "kind": "constant", "beta": 0.99}]
        raw_run = client.create_run("raw", profiles=profiles)
        ours = client.create_run("client", profiles=profiles)
        pusher = ours.pusher()
        raw_times, ours_times = [], []
        # The first push of each run registers its layout: not measured.
        raw_pushes(server.url, raw_run.name, body, 0, 1)
        client_pushes(pusher, push_sd, 0, 1)
        for r in range(args.rounds):
            first = 1 + r * args.steps
            raw_times.append(raw_pushes(server.url, raw_run.name, body, first, args.steps))
            ours_times.append(client_pushes(pusher, push_sd, first, args.steps))
        pusher.close()

        dl_run = client.create_run("download", profiles=profiles)
        dl_sd = state_dict(args.download_mib, seed=1)
        with dl_run.pusher() as p:
            p.push(dl_sd, 0)
        snap = dl_run.snapshot(step=0)
        path = f"{dl_run.path}/snapshots/{snap['id']}/download?profile=ema"
        raw_dl, ours_dl = [], []
        size = 0
        with tempfile.TemporaryDirectory() as out:
            for _ in range(args.rounds):
                t, size = raw_download(server.url, path)
                raw_dl.append(t)
                t0 = time.perf_counter()
                written = dl_run.download_to(snap, out, "ema", progress=False, fsync=False)
                ours_dl.append(time.perf_counter() - t0)
                if written.stat().st_size != size:
                    raise RuntimeError(f"downloaded {written.stat().st_size} of {size} bytes")
                Path(written).unlink()
        client.close()

    pushed = len(body) * args.steps
    raw_p, ours_p = statistics.median(raw_times), statistics.median(ours_times)
    raw_d, ours_d = statistics.median(raw_dl), statistics.median(ours_dl)
    print(
        f"polyak client {polyak.__version__} from {Path(polyak.__file__).parent}, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'figure':<58}{'raw':>10}{'client':>10}{'ratio':>8}")
    print(
        f"{f'push, {args.push_mib} MiB x {args.steps}: MiB/s (raw / client time)':<58}"
        f"{pushed / MIB / raw_p:>10.0f}{pushed / MIB / ours_p:>10.0f}{raw_p / ours_p:>8.2f}"
    )
    print(
        f"{f'download_to, {size / MIB:.0f} MiB: MiB/s (raw / client time)':<58}"
        f"{size / MIB / raw_d:>10.0f}{size / MIB / ours_d:>10.0f}{raw_d / ours_d:>8.2f}"
    )
    print(f"medians of {args.rounds} alternating rounds; ratio 1 = the client adds nothing")


if __name__ == "__main__":
    main()
