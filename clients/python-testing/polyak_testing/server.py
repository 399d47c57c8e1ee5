"""A real polyak server as a child process, for tests and benchmarks.

``PolyakServer(data_dir).start()`` launches ``polyak serve`` on a free
loopback port and waits until it prints its address. The binary is taken
from ``$POLYAK_BIN``, else ``target/{debug,release}/polyak`` above the
current directory, else ``polyak`` on ``PATH``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path


def find_binary() -> str:
    env = os.environ.get("POLYAK_BIN")
    if env:
        return env
    here = Path.cwd().resolve()
    for base in [here, *here.parents]:
        for profile in ("debug", "release"):
            candidate = base / "target" / profile / "polyak"
            if candidate.is_file():
                return str(candidate)
    found = shutil.which("polyak-server") or shutil.which("polyak")
    if found:
        return found
    raise FileNotFoundError(
        "no polyak server binary: build it with `cargo build` or set POLYAK_BIN"
    )


class PolyakServer:
    """A ``polyak serve`` child process on ``127.0.0.1:<free port>``."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *args: str,
        binary: str | None = None,
        env: dict[str, str] | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.args = list(args)
        self.env = dict(env or {})
        self.binary = binary or find_binary()
        self.proc: subprocess.Popen[str] | None = None
        self.url: str = ""
        self.log: list[str] = []
        self._port = 0
        #: The address it binds, and a command it runs under (``ip netns
        #: exec NAME``: a test host of its own, see :class:`NetLab`).
        self.host = "127.0.0.1"
        self.prefix: list[str] = []

    def start(self, *extra: str, timeout: float = 60.0, same_port: bool = False) -> PolyakServer:
        """Starts the server; ``same_port`` reuses the previous port (restarts)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("server already running")
        bind = f"{self.host}:{self._port if same_port else 0}"
        cmd = [
            *self.prefix,
            self.binary,
            "serve",
            "--bind",
            bind,
            "--data-dir",
            str(self.data_dir),
            *self.args,
            *extra,
        ]
        env = dict(os.environ)
        env.update(self.env)
        env.setdefault("RUST_LOG", "polyak=info")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("polyak listening on "):
                self.url = line.split("listening on ", 1)[1].strip()
                self._port = int(self.url.rsplit(":", 1)[1])
                break
            if not line and self.proc.poll() is not None:
                break
        if not self.url or self.proc.poll() is not None:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"polyak did not start: {line!r}\n{err}")
        threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()
        return self

    def _drain(self, proc: subprocess.Popen[str]) -> None:
        if proc.stderr is None:
            return
        for line in proc.stderr:
            self.log.append(line)
            if len(self.log) > 5000:
                del self.log[:1000]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int | None:
        """Graceful stop (SIGTERM), then SIGKILL after ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, *extra: str, graceful: bool = True) -> PolyakServer:
        if graceful:
            self.stop()
        else:
            self.kill()
        return self.start(*extra, same_port=True)

    def __enter__(self) -> PolyakServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the OS's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
