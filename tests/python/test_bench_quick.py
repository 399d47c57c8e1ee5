"""The end-to-end benchmark in quick mode, so that it never rots.

Nothing is timed here: the test checks that `benches/e2e.py --quick` runs
against the real server, prints every figure of the suite with a target and
a verdict, that its 32 concurrent ranks got no error, and that quick mode
leaves the recorded results alone.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from polyak.testing import find_binary

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


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


@pytest.mark.slow
def test_e2e_quick_prints_every_figure_and_writes_nothing():
    recorded = ["README.md", "results.json", "e2e.png"]
    before = {name: digest(BENCHES / name) for name in recorded}
    proc = subprocess.run(
        [sys.executable, str(BENCHES / "e2e.py"), "--quick", "--bin", find_binary()],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
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
