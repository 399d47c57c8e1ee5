"""What persisting a run's state costs at the default cadence.

A crash loses what was pushed after the last `state` write, so the server
writes state again as soon as the last write finished and the run's
`persist_every_secs` (default 5) passed; a write that took `w` seconds
waits at least `w x (1/share - 1)` (`PERSIST_BUSY_SHARE` = 0.1) so that
writing never takes more than a tenth of the time.

For each state size (10 MB, 1 GB and, with `--big`, 8 GB: one run, one
fp32 constant profile, spread over ranks of at most 1 GiB) this starts the
real server, pushes one step, and times `POST /persist` (a state write:
capture, serialise, sha256, write, fsync, commit) with the server's CPU
seconds read from `/proc` around it. The baseline, in the same process: the
same bytes written to a file beside the server's data and fsynced (the
disk's own rate). Printed per size:

- write / baseline: the state write's time over the disk's;
- the period at the default cadence: write + max(interval, 9 x write);
- the share of one core: server CPU seconds of the write / period;
- the share of the disk's bandwidth: baseline seconds / period.

`python benches/persist.py [--bin target/release/polyak] [--big] [--quick]`
Reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import safetensors.torch
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "clients" / "python-testing"))

from polyak_testing import PolyakServer  # noqa: E402

SHARE = 0.1
RANK_MAX = 1 << 30


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def disk_baseline(directory: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file in ``directory`` and fsync."""
    chunk = os.urandom(1 << 20) * 16
    path = directory / "baseline.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    dir_fd = os.open(directory, os.O_RDONLY)
    os.fsync(dir_fd)
    os.close(dir_fd)
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def measure(binary: str, nbytes: int, work: Path) -> dict:
    ranks = max(1, -(-nbytes // RANK_MAX))
    per_rank = nbytes // ranks // 4  # fp32 values
    data = work / f"data-{nbytes}"
    srv = PolyakServer(data, "--capture-backlog", f"{nbytes + (1 << 30)}", binary=binary)
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=3600) as c:
            r = c.post(
                "/v1/runs",
                json={
                    "name": "persist",
                    "world_size": ranks,
                    "persist_every_secs": 0,
                    "drift_every": 0,
                    "profiles": [{"name": "ema", "kind": "constant", "beta": 0.999}],
                },
            )
            assert r.status_code == 201, r.text
            interval = 5  # the run field's default (docs/contract.md)
            for rank in range(ranks):
                body = safetensors.torch.save({"w": torch.rand(per_rank)})
                r = c.put(f"/v1/runs/persist/ranks/{rank}/steps/0", content=body)
                assert r.status_code == 200, r.text
                del body
            writes = []
            for step in (1, 2):
                for rank in range(ranks):
                    body = safetensors.torch.save({"w": torch.rand(per_rank)})
                    r = c.put(f"/v1/runs/persist/ranks/{rank}/steps/{step}", content=body)
                    assert r.status_code == 200, r.text
                    del body
                cpu0, t0 = cpu_seconds(srv.pid), time.perf_counter()
                r = c.post("/v1/runs/persist/persist")
                assert r.status_code == 200, r.text
                writes.append((time.perf_counter() - t0, cpu_seconds(srv.pid) - cpu0))
            write, cpu = min(writes)
    finally:
        srv.stop()
    baseline = disk_baseline(work, ranks * per_rank * 4)
    period = write + max(interval, write * (1 / SHARE - 1))
    return {
        "bytes": ranks * per_rank * 4,
        "ranks": ranks,
        "write_s": write,
        "cpu_s": cpu,
        "baseline_s": baseline,
        "period_s": period,
        "core_share": cpu / period,
        "disk_share": baseline / period,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("POLYAK_BIN"))
    ap.add_argument("--big", action="store_true", help="also 8 GB (needs ~20 GB of memory)")
    ap.add_argument("--quick", action="store_true", help="10 MB only: checks the script")
    args = ap.parse_args()
    sizes = [10_000_000] if args.quick else [10_000_000, 1 << 30]
    if args.big:
        sizes.append(8 << 30)
    print(
        "| state | write s | baseline s | write / baseline | period s | core share | disk share |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(dir=os.environ.get("POLYAK_BENCH_DIR")) as tmp:
        for nbytes in sizes:
            m = measure(args.bin, nbytes, Path(tmp))
            print(
                f"| {m['bytes'] / 1e6:,.0f} MB ({m['ranks']} rank{'s' if m['ranks'] > 1 else ''}) "
                f"| {m['write_s']:.3f} | {m['baseline_s']:.3f} "
                f"| {m['write_s'] / m['baseline_s']:.2f} | {m['period_s']:.1f} "
                f"| {m['core_share']:.3f} | {m['disk_share']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
