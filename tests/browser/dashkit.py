"""Shared by the dashboard tests: the run they watch, the training process
that feeds it, console-error bookkeeping and screenshots."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from playwright.sync_api import Page

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "artifacts" / "screenshots"
RUN = "browser-demo"
WORLD_SIZE = 2
PROFILES = [
    {"name": "ema", "kind": "constant", "beta": 0.99},
    {"name": "edm", "kind": "power", "sigma_rel": 0.05},
]
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WIDTHS = (1280, 800)


def chromium_path() -> str:
    for candidate in (os.environ.get("POLYAK_CHROMIUM"), shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return candidate
    raise RuntimeError(
        "no chromium for the browser tests: install Debian's `chromium` "
        "(./scripts/test does) or set POLYAK_CHROMIUM"
    )


class Feeder:
    """The training process: ``feeder.py`` pushing every rank each step."""

    def __init__(self, url: str, run: str, *args: str) -> None:
        self.url = url
        self.run = run
        self.step = -1
        self.output: list[str] = []
        self._seen = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("feeder.py")), url, run, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._seen:
                self.output.append(line)
                del self.output[:-200]
                m = re.fullmatch(r"step (\d+)\n?", line)
                if m:
                    self.step = int(m.group(1))
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def wait_step(self, step: int, timeout: float = 120.0) -> int:
        """Blocks until the trainer has pushed ``step`` (or fails)."""
        deadline = time.monotonic() + timeout
        with self._seen:
            while self.step < step:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(
                        f"the feeder did not reach step {step} (at {self.step}):\n"
                        + "".join(self.output[-30:])
                    )
                self._seen.wait(min(left, 1.0))
            return self.step

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ConsoleErrors:
    """Console errors and uncaught exceptions of a page; a test may allow
    some it causes on purpose (a 401 before the token is entered)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.allowed: list[re.Pattern[str]] = []

    def allow(self, pattern: str) -> None:
        self.allowed.append(re.compile(pattern))

    def unexpected(self) -> list[str]:
        return [e for e in self.errors if not any(p.search(e) for p in self.allowed)]


def screenshot(page: Page, name: str) -> list[Path]:
    """Full-page screenshots of the current page at 1280 and 800 px."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    paths = []
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        # Charts follow their container's size one frame after a resize.
        page.evaluate(
            "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"
        )
        path = SCREENSHOTS / f"{name}-{width}.png"
        page.screenshot(path=str(path), full_page=True)
        paths.append(path)
    page.set_viewport_size({"width": WIDTHS[0], "height": 900})
    return paths
