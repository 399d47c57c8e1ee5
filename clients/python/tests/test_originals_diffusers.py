"""diffusers' own ``tests/others/test_ema.py`` through the drop-in, with
only its import changed (``originals/diffusers_test_ema.py``). It turns on
torch's deterministic mode when it is imported, so it runs in a pytest
process of its own, against the same server binary; every one of its tests
must pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_diffusers_own_ema_tests_pass_through_the_drop_in(polyak_binary: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "originals" / "diffusers_test_ema.py"),
        ],
        env={**os.environ, "POLYAK_BIN": polyak_binary},
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert "6 passed" in done.stdout, tail
