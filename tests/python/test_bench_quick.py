"""The end-to-end benchmark in quick mode and a short soak, so that neither rots.

Nothing is timed here. The tests check that `benches/e2e.py --quick` runs
against the real server, prints every figure of the suite with a target and
a verdict, that its 32 concurrent ranks got no error, and that quick mode
leaves the recorded results alone; and that `benches/soak.py` runs a short
soak with snapshots, state and downloads and no error.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from polyak_testing import find_binary

ROOT = Path(__file__).resolve().parents[2]
BENCHES = ROOT / "benches"

# Each figure the suite must print, judged (PASS/MISS) or reported.
JUDGED = [
    "server / raw loopback TCP",
    "4 profiles / 1 profile",
    "bf16 body into fp32 EMA",
    "/ ema_pytorch.EMA(use_foreach).update(), 1 profile",
    "3 profiles / three ema-pytorch EMAs",
    "full download written to disk / save_file",
    "shards, 3 s: errors",
    "aggregate throughput / one rank's",
    "server peak RSS / (EMA + mirror + 2 x largest body)",
    "apply cost per parameter",
]
REPORTED = [
    "both fsynced",
    "raw loopback TCP of the same bytes",
    "push latency p50 / p99",
]


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs ``benches/NAME`` against the server binary; it must succeed."""
    proc = subprocess.run(
        [sys.executable, str(BENCHES / name), *args, "--bin", find_binary()],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


@pytest.mark.slow
def test_e2e_quick_prints_every_figure_and_writes_nothing():
    recorded = ["README.md", "results.json", "e2e.png"]
    before = {name: digest(BENCHES / name) for name in recorded}
    proc = run_script("e2e.py", "--quick")
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("figure "))
    table = [line for line in lines[start + 1 :] if line.strip() and not line.startswith("(")]

    def rows(fragment: str) -> list[str]:
        return [line for line in table if fragment in line]

    for fragment in JUDGED:
        found = rows(fragment)
        assert len(found) == 1, (fragment, table)
        words = found[0].split()
        assert words[-1] in ("PASS", "MISS"), found[0]
        assert words[-3] in ("<=", ">=", "=="), found[0]
    for fragment in REPORTED:
        found = rows(fragment)
        assert len(found) == 1, (fragment, table)
        assert found[0].split()[-2:] == ["reported", "-"], found[0]
    assert len(table) == len(JUDGED) + len(REPORTED), table

    errors = rows("shards, 3 s: errors")[0].split()
    assert errors[-4] == "0" and errors[-1] == "PASS", errors
    assert "left as they are" in proc.stdout
    assert {name: digest(BENCHES / name) for name in recorded} == before


@pytest.mark.slow
def test_soak_short_run_reports_resources_without_errors():
    proc = run_script(
        "soak.py",
        *("--seconds", "12", "--interval", "3", "--ranks", "2", "--shard-mb", "1", "--no-plot"),
    )
    samples = [line for line in proc.stdout.splitlines() if line.startswith("t=")]
    assert len(samples) >= 3, proc.stdout
    # The run advanced from sample to sample, and snapshots completed.
    steps = [int(line.split("step=")[1].split()[0]) for line in samples]
    assert steps == sorted(steps) and steps[-1] > steps[0], samples
    assert int(samples[-1].split("snapshots=")[1]) >= 1, samples
    assert ", 0 errors;" in proc.stdout and ", 0 failed" in proc.stdout, proc.stdout
    assert "anonymous RSS median: first half" in proc.stdout, proc.stdout


# The wire benchmark's figures (benches/wire.py), judged or reported.
WIRE_JUDGED = [
    "pipelined ingest, 64 MB fp32 bodies",
    "codec on trained bf16 weights",
    "codec on XOR deltas of consecutive fp32 pushes",
    "server decode rate (polyak-bgz)",
    "fp8_e4m3 deltas (block 256): wire bytes per parameter",
    "fp8_e4m3 deltas: EMA (beta 0.999",
    "int8 deltas (block 256): wire bytes per parameter",
    "int8 deltas: EMA (beta 0.999",
    "bf16 deltas (block 128): wire bytes per parameter",
    "bf16 deltas: EMA (beta 0.999",
    "server apply rate, fp8_e4m3 delta / fp32 full push",
    "server apply rate, int8 delta / fp32 full push",
    "server apply rate, bf16 delta / fp32 full push",
]


@pytest.mark.slow
def test_wire_quick_prints_every_figure_with_a_verdict():
    proc = run_script("wire.py", "--quick")
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("figure "))
    table = [line for line in lines[start + 1 :] if line.strip()]
    for fragment in WIRE_JUDGED:
        found = [line for line in table if fragment in line]
        assert len(found) == 1, (fragment, table)
        words = found[0].split()
        assert words[-1] in ("PASS", "MISS") and words[-3] in ("<=", ">="), found[0]
    reported = [line for line in table if line.split()[-2:] == ["reported", "-"]]
    assert any("client encode CPU time per push" in line for line in reported), table
    assert len(table) == len(WIRE_JUDGED) + len(reported), table


@pytest.mark.slow
def test_cluster_quick_prints_its_figures_and_no_push_asks_the_catalog():
    """`benches/cluster.py --quick` runs a one-node and a three-node service
    (its own PostgreSQL and SeaweedFS); a push asks the catalog nothing on
    either, every judged figure has its target and a verdict, and a node
    killed last has its rank served by a survivor."""
    proc = run_script("cluster.py", "--quick")
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("figure "))
    table = [line for line in lines[start + 1 :] if line.strip()]
    latency = next(line for line in table if line.startswith("push latency p50, 3 nodes / 1"))
    assert latency.split()[-1] in ("PASS", "MISS"), latency
    queries = next(line for line in table if line.startswith("catalog queries while answering"))
    assert "0.000; 0.000" in queries and queries.split()[-1] == "PASS", queries
    # The failover figure: a killed node's rank is acknowledged by a
    # survivor; nothing was lost past b's state snapshot of the last step.
    took = next(line for line in table if line.startswith("failover: SIGKILL"))
    assert took.split()[-1] in ("PASS", "MISS") and " s " in took, took
    lost = next(line for line in table if line.startswith("failover: steps lost"))
    assert lost.split()[-3] == "0", lost
    assert "node-a, node-b, node-c" in proc.stdout
