"""What persisting a run's state costs at the default cadence.

A crash loses what was pushed after the last `state` write, so the server
writes state again as soon as the last write finished and the run's
`persist_every_secs` (default 5) passed, or later after a long write:
writing takes at most `PERSIST_BUSY_SHARE` (0.1) of the time and its CPU
time at most that share of one core (docs/contract.md).

For each state size (10 MB, 1 GiB and, with `--big`, 8 GiB: one run, one
fp32 constant profile, spread over ranks of at most 1 GiB) this starts the
real server and lets it write state at its own default cadence while the
run is otherwise idle: every rank pushes one step (one prepared body,
reused by every rank and step); once a state write holding every rank
completed (A), rank 0 pushes once, which makes the run dirty, and the next
periodic write (B) follows; once B completed, rank 0 pushes again and the
next write (C) starts when B's cost lets it. Measured, from the server's
live event stream, its timestamps and `/proc`:

- write s: B's duration, capture to commit (`polyak_state_write_seconds`);
- write CPU s: the server's CPU seconds (every thread) from A's completion
  to B's, less the dirtying push's and the idle rate's (measured over 5 s
  with nothing to write);
- period s: B's cycle, from its start to C's start;
- core share: write CPU / period; disk share: baseline / period, where the
  baseline is the same bytes written to a new file beside the server's
  data and fsynced by Python (the disk's own rate);
- copies GB: the most bytes of copies B held at once
  (`polyak_state_write_held_bytes`): a state write copies its ranks one
  after the other as the earlier ones are written, within the server's
  `--capture-backlog` (left at its default, 2 GiB; one rank always fits);
- server peak GB: the server's peak resident memory (`VmHWM`): the EMA,
  those copies and one push body.

`python benches/persist.py [--bin target/release/polyak] [--big]
[--sizes 2GiB,...] [--quick]`. Reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "clients" / "python-testing"))

from polyak_testing import PolyakServer  # noqa: E402

RANK_MAX = 1 << 30
RUN = "persist"
IDLE_S = 5.0
SETTLE_S = 0.5


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    unit = {
        None: 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KiB": 1 << 10,
        "MiB": 1 << 20,
        "GiB": 1 << 30,
    }[m.group(2)]
    return int(float(m.group(1)) * unit)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss(pid: int) -> int:
    """Peak resident bytes of process ``pid`` (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def body_of(numel: int) -> bytearray:
    """A safetensors body of one fp32 tensor ``w`` of ``numel`` random
    values, built in place."""
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [numel], "data_offsets": [0, 4 * numel]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    buf = bytearray(8 + len(header) + 4 * numel)
    buf[:8] = len(header).to_bytes(8, "little")
    buf[8 : 8 + len(header)] = header
    data = np.frombuffer(buf, dtype=np.float32, offset=8 + len(header))
    rng = np.random.default_rng(0)
    step = 1 << 24
    for i in range(0, numel, step):
        data[i : i + step] = rng.random(min(step, numel - i), dtype=np.float32)
    del data
    return buf


def chunks(body: bytearray, size: int = 16 << 20):
    """``body`` sent a slice at a time (no copy of the whole of it)."""
    view = memoryview(body)
    for i in range(0, len(body), size):
        yield bytes(view[i : i + size])


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


class StateWrites:
    """The run's completed `state` writes, read off its live event stream."""

    def __init__(self, url: str):
        self.client = httpx.Client(base_url=url, timeout=httpx.Timeout(10, read=3600))
        self.stream = self.client.stream("GET", f"/v1/runs/{RUN}/events")
        self.lines = self.stream.__enter__().iter_lines()

    def next(self) -> str:
        """Waits for the next state write to complete; returns its id."""
        for line in self.lines:
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            detail = event.get("detail") or {}
            if (
                event["kind"] == "snapshot"
                and detail.get("kind") == "state"
                and detail.get("status") == "complete"
            ):
                return detail["id"]
        raise RuntimeError("the event stream ended")

    def close(self) -> None:
        self.stream.__exit__(None, None, None)
        self.client.close()


def measure(binary: str, nbytes: int, work: Path) -> dict:
    ranks = max(1, -(-nbytes // RANK_MAX))
    numel = nbytes // ranks // 4  # fp32 values
    m = server_side(binary, ranks, numel, work / f"data-{nbytes}")
    baseline = disk_baseline(work, ranks * numel * 4)
    return {
        **m,
        "bytes": ranks * numel * 4,
        "ranks": ranks,
        "baseline_s": baseline,
        "core_share": m["cpu_s"] / m["period_s"],
        "disk_share": baseline / m["period_s"],
    }


def server_side(binary: str, ranks: int, numel: int, data: Path) -> dict:
    """The periodic state write of ``ranks`` ranks of ``numel`` fp32 values
    on a server of its own: its duration, CPU seconds and period."""
    body = body_of(numel)
    srv = PolyakServer(data, binary=binary)
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=3600) as c:
            r = c.post(
                "/v1/runs",
                json={
                    "name": RUN,
                    "world_size": ranks,
                    "drift_every": 0,
                    "profiles": [{"name": "ema", "kind": "constant", "beta": 0.999}],
                },
            )
            assert r.status_code == 201, r.text
            interval = r.json()["config"]["persist_every_secs"]
            writes = StateWrites(srv.url)

            def push(rank: int, step: int) -> float:
                """Pushes ``body``; returns the server's CPU seconds it took."""
                cpu0 = cpu_seconds(srv.pid)
                r = c.put(
                    f"/v1/runs/{RUN}/ranks/{rank}/steps/{step}",
                    content=chunks(body),
                    headers={"Content-Length": str(len(body))},
                )
                assert r.status_code == 200, r.text
                return cpu_seconds(srv.pid) - cpu0

            def row(snapshot: str) -> dict:
                return c.get(f"/v1/runs/{RUN}/snapshots/{snapshot}").json()

            def gauge(name: str) -> float:
                metric = re.search(rf'^{name}{{run="{RUN}"}} (\S+)$', c.get("/metrics").text, re.M)
                return float(metric.group(1))

            def took() -> float:
                """The last state write's duration, capture to commit (read
                a moment after its completion event: set just after it)."""
                time.sleep(SETTLE_S)
                return gauge("polyak_state_write_seconds")

            try:
                for rank in range(ranks):
                    push(rank, 0)
                # A: the first write that holds every rank (one started
                # while ranks were still pushing holds fewer).
                # (Rows are read at once: older state snapshots are pruned.)
                while len((row_a := row(writes.next()))["detail"]["rank_steps"]) < ranks:
                    pass
                # B, the write measured: its CPU from A's end to its own.
                cpu_a = cpu_seconds(srv.pid)
                pushed = push(0, 1)
                b = writes.next()
                cpu_b = cpu_seconds(srv.pid)
                row_b = row(b)
                took_b = took()
                held_b = gauge("polyak_state_write_held_bytes")
                # C: the next one, which starts when B's cost lets it.
                push(0, 2)
                row_c = row(writes.next())
                took_c = took()
                # The idle rate: nothing is dirty, nothing is written.
                cpu_c = cpu_seconds(srv.pid)
                time.sleep(IDLE_S)
                idle = (cpu_seconds(srv.pid) - cpu_c) / IDLE_S
            finally:
                writes.close()
            assert row_b["detail"]["rank_steps"]["0"] == 1, row_b
            assert row_c["detail"]["rank_steps"]["0"] == 2, row_c
            # B's cycle: from its start to C's start.
            period = (row_c["completed_at_ms"] - row_b["completed_at_ms"]) / 1000
            period += took_b - took_c
            window = (row_b["completed_at_ms"] - row_a["completed_at_ms"]) / 1000
            cpu = cpu_b - cpu_a - pushed - idle * window
            write = took_b
            peak = peak_rss(srv.pid)
    finally:
        srv.stop()
    return {
        "interval": interval,
        "write_s": write,
        "cpu_s": cpu,
        "period_s": period,
        "held": held_b,
        "server_peak": peak,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("POLYAK_BIN"))
    ap.add_argument("--big", action="store_true", help="also 8 GiB (about 12 GB of memory)")
    ap.add_argument("--quick", action="store_true", help="10 MB only: checks the script")
    ap.add_argument(
        "--sizes",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        help="these state sizes only, e.g. 2GiB (a memory estimate before --big)",
    )
    args = ap.parse_args()
    if args.sizes:
        sizes = args.sizes
    elif args.quick:
        sizes = [10_000_000]
    else:
        sizes = [10_000_000, 1 << 30] + ([8 << 30] if args.big else [])
    print(
        "| state | write s | write CPU s | baseline s | write / baseline | period s "
        "| core share | disk share | copies GB | server peak GB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    with tempfile.TemporaryDirectory(dir=os.environ.get("POLYAK_BENCH_DIR")) as tmp:
        for nbytes in sizes:
            m = measure(args.bin, nbytes, Path(tmp))
            print(
                f"| {m['bytes'] / 1e6:,.0f} MB ({m['ranks']} rank{'s' if m['ranks'] > 1 else ''}) "
                f"| {m['write_s']:.3f} | {m['cpu_s']:.3f} | {m['baseline_s']:.3f} "
                f"| {m['write_s'] / m['baseline_s']:.2f} | {m['period_s']:.1f} "
                f"| {m['core_share']:.3f} | {m['disk_share']:.3f} "
                f"| {m['held'] / 1e9:.2f} | {m['server_peak'] / 1e9:.1f} |",
                flush=True,
            )
    py_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"persist_every_secs {m['interval']} (the default); this script's peak {py_peak / 1e9:.1f} GB"
    )


if __name__ == "__main__":
    main()
