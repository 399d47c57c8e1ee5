"""Run a real polyak server from Python, for tests and notebooks.

``PolyakServer(data_dir).start()`` launches ``polyak serve`` on a free
loopback port and waits until it prints its address. The binary is taken
from ``$POLYAK_BIN``, else ``target/{debug,release}/polyak`` above the
current directory, else ``polyak`` on ``PATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "Backends",
    "LabHost",
    "NetLab",
    "PolyakServer",
    "PostgresService",
    "S3Service",
    "check_compare",
    "compare_stats",
    "find_binary",
    "free_port",
    "read_sse",
    "state_step",
]


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


def compare_stats(a: dict, b: dict) -> dict[str, dict]:
    """Per tensor what ``GET .../compare`` reports, computed with torch in
    float64 over whole tensors: norms, ``rel_diff = norm_diff / norm_a``,
    cosine, max abs diff (the anchor the compare tests check against)."""
    out: dict[str, dict] = {}
    for k in a:
        x, y = a[k].double().flatten(), b[k].double().flatten()
        na, nb, nd = x.norm().item(), y.norm().item(), (x - y).norm().item()
        out[k] = {
            "norm_a": na,
            "norm_b": nb,
            "norm_diff": nd,
            "rel_diff": nd / na if na > 0 else nd,
            "cosine": (x @ y).item() / (na * nb) if na > 0 and nb > 0 else None,
            "max_abs_diff": (x - y).abs().max().item() if x.numel() else 0.0,
        }
    return out


def wait_settled(client: Any, run: str, sid: str, timeout: float = 30.0) -> dict:
    """The catalog row of snapshot ``sid`` once it is no longer ``pending``
    (complete or failed: tests look at either), polled through an
    ``httpx.Client`` on the server."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = client.get(f"/v1/runs/{run}/snapshots/{sid}").json()
        if row["status"] != "pending":
            return row
        time.sleep(0.05)
    raise AssertionError(f"snapshot {sid} still pending after {timeout:g} s")


def check_wire_totals(wire: dict, ranks: list[dict]) -> None:
    """Asserts that a run's ``wire`` figures are its ranks' summed (bytes
    and mismatches exactly, seconds to rounding) and that its ratio is
    logical over wire bytes."""
    import pytest

    for key in ("wire_bytes", "logical_bytes", "mirror_mismatches"):
        assert wire[key] == sum(r[key] for r in ranks), key
    for key in ("encode_seconds", "decode_seconds"):
        assert wire[key] == pytest.approx(sum(r[key] for r in ranks), rel=1e-9, abs=1e-12)
    assert wire["ratio"] == pytest.approx(wire["logical_bytes"] / wire["wire_bytes"])


def check_compare(result: dict, a: dict, b: dict) -> None:
    """Asserts that a ``GET .../compare`` answer matches :func:`compare_stats`
    of the same tensors to 1e-6 relative, tensor by tensor (shapes too),
    and that its summary holds the count, the whole ``norm_a`` and the
    largest ``max_abs_diff``."""
    want = compare_stats(a, b)
    got = {t["name"]: t for t in result["tensors"]}
    assert set(got) == set(want), set(got) ^ set(want)
    for name, fields in want.items():
        assert got[name]["shape"] == list(a[name].shape), name
        for field, value in fields.items():
            if value is None:
                assert got[name][field] is None, (name, field)
                continue
            assert abs(got[name][field] - value) <= 1e-6 * abs(value) + 1e-12, (
                name,
                field,
                got[name][field],
                value,
            )
    summary = result["summary"]
    assert summary["tensors"] == len(a)
    norm_a = sum(v.double().square().sum().item() for v in a.values()) ** 0.5
    assert abs(summary["norm_a"] - norm_a) <= 1e-6 * norm_a
    assert summary["max_abs_diff"] == max(t["max_abs_diff"] for t in result["tensors"])


# ---------------------------------------------------------------------------
# Throwaway backing services: PostgreSQL (catalog) and SeaweedFS (S3 store)
# ---------------------------------------------------------------------------


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the OS's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NetLab:
    """Test hosts on this machine: network namespaces (``ip netns``) joined
    by veth pairs to one bridge, on a /24 of their own (10.231.N.0/24; the
    bridge is .1, host ``i`` is .(10 + i)). Each host's link can be cut
    (its veth set down) without touching what runs in it. Needs root and
    ``ip``; :meth:`unavailable` says why not otherwise. Services on this
    machine's loopback are reached from a host through a
    :class:`TcpProxy` listening on the bridge address (:meth:`proxy`)."""

    def __init__(self) -> None:
        tag = os.getpid() % 10000
        self.prefix = f"pk{tag}"
        self.subnet = f"10.231.{20 + os.getpid() % 200}"
        self.bridge = f"{self.prefix}br"
        self.gateway = f"{self.subnet}.1"
        self.hosts: list[LabHost] = []
        self._proxies: list[TcpProxy] = []
        self._up = False

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here (``None``: they can)."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2)"
        probe = f"pkprobe{os.getpid() % 100000}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def start(self) -> NetLab:
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._up = True
        self._ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        return self

    def host(self) -> LabHost:
        """A new host: its namespace, with a veth to the bridge."""
        i = len(self.hosts)
        host = LabHost(
            ns=f"{self.prefix}h{i}",
            ip=f"{self.subnet}.{10 + i}",
            link=f"{self.prefix}v{i}",
        )
        peer = f"{self.prefix}p{i}"
        self._ip("netns", "add", host.ns)
        self.hosts.append(host)
        self._ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
        self._ip("link", "set", peer, "netns", host.ns)
        self._ip("link", "set", host.link, "master", self.bridge, "up")
        inside = ("netns", "exec", host.ns, "ip")
        self._ip(*inside, "addr", "add", f"{host.ip}/24", "dev", peer)
        self._ip(*inside, "link", "set", peer, "up")
        self._ip(*inside, "link", "set", "lo", "up")
        return host

    def proxy(self, target: tuple[str, int]) -> TcpProxy:
        """``target`` (on this machine's loopback) as the hosts reach it: a
        proxy on the bridge address (one per target)."""
        for proxy in self._proxies:
            if proxy.target == target:
                return proxy
        proxy = TcpProxy(target, listen=self.gateway)
        self._proxies.append(proxy)
        return proxy

    def reach_url(self, url: str) -> str:
        """``url`` (``postgres://user@host:port/db``, ``http://host:port``)
        with its address replaced by its proxy's, for the hosts."""
        head, sep, rest = url.partition("://")
        auth, at, hostpart = rest.rpartition("@")
        netloc, slash, path = hostpart.partition("/")
        host, _, port = netloc.rpartition(":")
        proxy = self.proxy((host, int(port)))
        return f"{head}{sep}{auth}{at}{self.gateway}:{proxy.port}{slash}{path}"

    def close(self) -> None:
        for proxy in self._proxies:
            proxy.close()
        for host in self.hosts:
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)
        self.hosts.clear()
        if self._up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self._up = False


class LabHost:
    """One host of a :class:`NetLab`: its namespace, its address, and the
    bridge side of its link."""

    def __init__(self, ns: str, ip: str, link: str) -> None:
        self.ns = ns
        self.ip = ip
        self.link = link

    def run_in(self, server: PolyakServer) -> PolyakServer:
        """Makes ``server`` start in this host, bound to its address (which
        only the test net reaches: served without a token)."""
        server.prefix = ["ip", "netns", "exec", self.ns]
        server.host = self.ip
        if "--insecure" not in server.args:
            server.args.append("--insecure")
        return server

    def cut(self) -> None:
        """Its link down: nothing reaches it and it reaches nothing."""
        NetLab._ip("link", "set", self.link, "down")

    def mend(self) -> None:
        NetLab._ip("link", "set", self.link, "up")


class TcpProxy:
    """Forwards ``listen:<port>`` (default ``127.0.0.1``) to ``target``
    (host, port) until
    :meth:`cut`, which drops every connection and refuses new ones (a link
    cut between a server and what it reaches), until :meth:`mend`. Setting
    :attr:`lose_next` loses the next answer: the request is forwarded, the
    response swallowed and the connection closed (a network failure after
    the server acted); :attr:`lost` counts them."""

    def __init__(self, target: tuple[str, int], listen: str = "127.0.0.1") -> None:
        self.target = target
        self.host = listen
        self._listener = socket.create_server((listen, 0))
        self.port = int(self._listener.getsockname()[1])
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        self._closed = False
        self.lose_next = threading.Event()
        self.lost = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    client.close()
                    continue
                try:
                    upstream = socket.create_connection(self.target, timeout=5)
                except OSError:
                    client.close()
                    continue
                upstream.settimeout(None)
                self._open += [client, upstream]
            for a, b, answers in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(a, b, answers), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while data := src.recv(65536):
                if answers and self.lose_next.is_set():
                    self.lose_next.clear()
                    self.lost += 1
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Drops every connection (reset) and refuses new ones."""
        with self._lock:
            self._cut = True
            for s in self._open:
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    s.close()
                except OSError:
                    pass
            self._open.clear()

    def mend(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()


def _wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as e:
            last = e
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not come up in {timeout:.0f} s: {last!r}")


def _postgres_bindir() -> Path:
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True)
        bindir = Path(out.stdout.strip())
        if (bindir / "initdb").is_file():
            return bindir
    except (OSError, subprocess.CalledProcessError):
        pass
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "initdb").is_file():
            return candidate
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    raise FileNotFoundError("no PostgreSQL server binaries (install Debian's postgresql package)")


class PostgresService:
    """A PostgreSQL cluster of its own on ``127.0.0.1:<free port>``.

    ``initdb`` and ``postgres`` run as an unprivileged system user when the
    caller is root (PostgreSQL refuses to run as root); trust authentication
    is limited to loopback connections. ``url`` is a database URL for the
    ``postgres`` superuser role ``polyak``; :meth:`new_database` gives each
    server a database of its own. With ``$POLYAK_TEST_DATABASE_URL`` set,
    that service is used instead and nothing is started.
    """

    USER = "polyak-pg"
    ROLE = "polyak"

    def __init__(self) -> None:
        self.external = os.environ.get("POLYAK_TEST_DATABASE_URL") or None
        self.bindir = _postgres_bindir()
        self.dir: Path | None = None
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dbs = 0

    @property
    def url(self) -> str:
        if self.external:
            return self.external
        return f"postgres://{self.ROLE}@127.0.0.1:{self.port}/postgres"

    def _as_user(self, cmd: list[str]) -> list[str]:
        if os.geteuid() != 0:
            return cmd
        # setpriv execs the command itself, so the child's PID is postgres's.
        return ["setpriv", f"--reuid={self.USER}", f"--regid={self.USER}", "--init-groups", *cmd]

    def _ensure_user(self) -> None:
        if os.geteuid() != 0:
            return
        import pwd

        try:
            pwd.getpwnam(self.USER)
        except KeyError:
            subprocess.run(
                [
                    "useradd",
                    "--system",
                    "--user-group",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                    self.USER,
                ],
                check=True,
            )

    def start(self, timeout: float = 60.0) -> PostgresService:
        """Creates and starts the cluster; after ``stop(keep_data=True)``,
        starts the same cluster again on the same port (an outage ends)."""
        if self.external:
            return self
        if self.dir is not None:
            self._launch(timeout)
            return self
        self._ensure_user()
        self.dir = Path(tempfile.mkdtemp(prefix="polyak-pg-"))
        data = self.dir / "data"
        if os.geteuid() == 0:
            shutil.chown(self.dir, self.USER, self.USER)
        subprocess.run(
            self._as_user(
                [
                    str(self.bindir / "initdb"),
                    "-D",
                    str(data),
                    "-U",
                    self.ROLE,
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-sync",
                ]
            ),
            check=True,
            capture_output=True,
        )
        # Only loopback may connect, and only over TCP or the private socket.
        (data / "pg_hba.conf").write_text(
            "local all all trust\nhost all all 127.0.0.1/32 trust\n", encoding="utf-8"
        )
        self._launch(timeout)
        return self

    def _launch(self, timeout: float) -> None:
        assert self.dir is not None
        self.port = self.port or free_port()
        log = open(self.dir / "postgres.log", "ab")
        self.proc = subprocess.Popen(
            self._as_user(
                [
                    str(self.bindir / "postgres"),
                    "-D",
                    str(self.dir / "data"),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.dir),
                    "-c",
                    "fsync=off",
                    "-c",
                    "max_connections=200",
                ]
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        _wait_for(lambda: self.psql("SELECT 1") == "1", timeout, "PostgreSQL")

    def psql(self, sql: str, database: str | None = None) -> str:
        """Runs one statement with ``psql`` and returns its unaligned output."""
        url = self.url if database is None else self.database_url(database)
        out = subprocess.run(
            [
                str(self.bindir / "psql"),
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                url,
                "-c",
                sql,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return out.stdout.strip()

    def database_url(self, name: str) -> str:
        base, _, _ = self.url.rpartition("/")
        return f"{base}/{name}"

    def new_database(self) -> str:
        """Creates an empty database and returns its URL."""
        self._dbs += 1
        name = f"polyak_{os.getpid()}_{self._dbs}_{int(time.time() * 1000) % 10**9}"
        self.psql(f'CREATE DATABASE "{name}"')
        return self.database_url(name)

    def stop(self, timeout: float = 30.0, *, keep_data: bool = False) -> None:
        """Stops the cluster (fast shutdown); ``keep_data`` for a restart."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.dir is not None and not keep_data:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class S3Service:
    """An S3 endpoint: SeaweedFS's ``weed server -s3`` on loopback ports.

    Every port (master, volume, filer, S3 and their gRPC ports) is chosen
    free on 127.0.0.1; the data lives in a temporary directory; one access
    key is configured and the bucket ``bucket`` is created. :meth:`stop`
    and :meth:`start` again keep the ports and the data (an outage).
    ``$POLYAK_TEST_S3_ENDPOINT`` (with ``_BUCKET``, ``_ACCESS_KEY_ID``,
    ``_SECRET_ACCESS_KEY``, ``_REGION``) points at an existing service.
    """

    def __init__(self, bucket: str = "polyak-test") -> None:
        self.external = os.environ.get("POLYAK_TEST_S3_ENDPOINT") or None
        self.bucket = os.environ.get("POLYAK_TEST_S3_BUCKET", bucket)
        self.access_key = os.environ.get("POLYAK_TEST_S3_ACCESS_KEY_ID", "polyak")
        self.secret_key = os.environ.get("POLYAK_TEST_S3_SECRET_ACCESS_KEY", "polyak-test-secret")
        self.region = os.environ.get("POLYAK_TEST_S3_REGION", "us-east-1")
        self.dir: Path | None = None
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._prefixes = 0

    @property
    def endpoint(self) -> str:
        return self.external or f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The AWS variables a server (or boto3) needs for this endpoint."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }

    def client(self):
        """A boto3 S3 client for this endpoint (tests inspect objects with it)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=30),
        )

    def new_prefix(self) -> str:
        """``s3://bucket/<unique prefix>`` for one server's store."""
        self._prefixes += 1
        return (
            f"s3://{self.bucket}/p{os.getpid()}-{self._prefixes}-{int(time.time() * 1000) % 10**9}"
        )

    def start(self, timeout: float = 120.0) -> S3Service:
        """Starts the service (again, after :meth:`stop` with ``keep_data``).
        A first start whose ports were taken meanwhile (they are chosen free,
        then bound by weed) is tried again on new ones."""
        if self.external:
            self._ensure_bucket(timeout)
            return self
        first = self.dir is None
        for attempt in range(3 if first else 1):
            try:
                return self._launch(timeout)
            except RuntimeError:
                log = self.dir / "weed.log" if self.dir is not None else None
                tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
                self.stop(keep_data=not first)
                if attempt == 2 or not first:
                    raise RuntimeError(f"SeaweedFS did not start; its log ends:\n{tail}") from None
        raise AssertionError("unreachable")

    def _launch(self, timeout: float) -> S3Service:
        weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="polyak-s3-"))
            names = ("master", "volume", "filer", "s3")
            self.ports = {n: free_port() for n in names}
            self.ports.update({f"{n}.grpc": free_port() for n in names})
            config = {
                "identities": [
                    {
                        "name": "polyak",
                        "credentials": [
                            {"accessKey": self.access_key, "secretKey": self.secret_key}
                        ],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
            (self.dir / "s3.json").write_text(json.dumps(config), encoding="utf-8")
            (self.dir / "data").mkdir()
        p = self.ports
        cmd = [
            weed,
            "server",
            f"-dir={self.dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.dir / 's3.json'}",
            "-master.volumeSizeLimitMB=256",
            "-volume.max=0",
            "-metricsPort=0",
        ]
        log = open(self.dir / "weed.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        log.close()
        self._ensure_bucket(timeout)
        return self

    def _ensure_bucket(self, timeout: float) -> None:
        s3 = self.client()

        def ready() -> bool:
            try:
                s3.head_bucket(Bucket=self.bucket)
            except Exception:  # absent, or the service still starting
                s3.create_bucket(Bucket=self.bucket)
            return True

        _wait_for(ready, timeout, "the S3 service")

    def open_uploads(self, prefix: str = "") -> list[dict]:
        """Multipart uploads started and neither completed nor aborted."""
        out = self.client().list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return list(out.get("Uploads", []))

    def objects(self, prefix: str = "") -> dict[str, int]:
        """``{key: size}`` under ``prefix``."""
        s3 = self.client()
        found: dict[str, int] = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                found[obj["Key"]] = obj["Size"]
        return found

    def stop(self, timeout: float = 5.0, *, keep_data: bool = False) -> None:
        """Stops the service (SIGTERM, then SIGKILL: ``weed`` can take long
        to drain); ``keep_data`` for a restart."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if not keep_data and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class StoreView:
    """A test's view of one server's object store, whichever it is: files
    under the data dir, or keys under the server's S3 prefix (read and
    written with boto3), to inspect, corrupt or remove snapshot parts."""

    def __init__(self, server: PolyakServer, s3: S3Service | None = None) -> None:
        self.server = server
        self.s3 = s3
        self.prefix = ""
        self.is_s3 = False
        if "--store" in server.args:
            url = server.args[server.args.index("--store") + 1]
            if url.startswith("s3://"):
                if s3 is None:
                    raise ValueError("an S3 store needs its S3Service")
                _bucket, _, prefix = url[len("s3://") :].partition("/")
                self.prefix = prefix.strip("/")
                self.is_s3 = True

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def read(self, key: str) -> bytes:
        if self.is_s3:
            assert self.s3 is not None
            got = self.s3.client().get_object(Bucket=self.s3.bucket, Key=self._key(key))
            return got["Body"].read()
        return (self.server.data_dir / key).read_bytes()

    def write(self, key: str, data: bytes) -> None:
        if self.is_s3:
            assert self.s3 is not None
            self.s3.client().put_object(Bucket=self.s3.bucket, Key=self._key(key), Body=data)
        else:
            (self.server.data_dir / key).write_bytes(data)

    def delete(self, key: str) -> None:
        if self.is_s3:
            assert self.s3 is not None
            self.s3.client().delete_object(Bucket=self.s3.bucket, Key=self._key(key))
        else:
            (self.server.data_dir / key).unlink()

    def keys(self, prefix: str = "runs/") -> dict[str, int]:
        """``{key: size}`` of every stored object (or file) under ``prefix``,
        temporary files included."""
        if self.is_s3:
            assert self.s3 is not None
            skip = len(self.prefix) + 1
            return {k[skip:]: n for k, n in self.s3.objects(self._key(prefix)).items()}
        root = self.server.data_dir
        found: dict[str, int] = {}
        base = root / prefix
        if base.exists():
            for path in base.rglob("*"):
                if path.is_file():
                    found[path.relative_to(root).as_posix()] = path.stat().st_size
        return found

    def open_uploads(self) -> list[dict]:
        """Multipart uploads under the server's prefix neither completed nor
        aborted (none can exist for files)."""
        if not self.is_s3:
            return []
        assert self.s3 is not None
        return self.s3.open_uploads(self.prefix + "/")


class Backends:
    """The catalog and object-store pairs a test server can run against.

    ``sqlite-file`` is the embedded default (SQLite and files under the data
    dir); ``postgres-s3`` keeps the catalog in a database of its own on a
    throwaway PostgreSQL and the snapshot parts under a prefix of their own
    on a throwaway SeaweedFS S3 endpoint (each started on first use, stopped
    by :meth:`close`); ``postgres-file`` pairs that catalog with files.
    Suites that must hold on every pair parametrise their server fixture
    over :attr:`PAIRS`.
    """

    PAIRS = ("sqlite-file", "postgres-s3")
    KNOWN = ("sqlite-file", "postgres-file", "sqlite-s3", "postgres-s3")

    def __init__(self) -> None:
        self._postgres: PostgresService | None = None
        self._s3: S3Service | None = None

    def postgres(self) -> PostgresService:
        if self._postgres is None:
            self._postgres = PostgresService().start()
        return self._postgres

    def s3(self) -> S3Service:
        if self._s3 is None:
            self._s3 = S3Service().start()
        return self._s3

    def server_args(self, pair: str) -> list[str]:
        """Flags for a new server on ``pair`` (a fresh, empty catalog and
        store)."""
        if pair not in self.KNOWN:
            raise ValueError(f"unknown backend pair {pair!r}")
        catalog, _, store = pair.partition("-")
        args: list[str] = []
        if catalog == "postgres":
            args += ["--catalog", self.postgres().new_database()]
        if store == "s3":
            s3 = self.s3()
            args += ["--store", s3.new_prefix(), "--s3-endpoint", s3.endpoint]
            # The scale-out pair also spreads every run over two CPU engines,
            # so each matrix suite covers cuts, restores and finishing across
            # engines (the default pair keeps one engine on small machines).
            args += ["--engines", "2"]
        return args

    def server_env(self, pair: str) -> dict[str, str]:
        """The environment a server on ``pair`` needs (S3 credentials)."""
        return self.s3().env() if pair.endswith("-s3") else {}

    def server(
        self, pair: str, data_dir: str | os.PathLike[str], *args: str, binary: str | None = None
    ) -> PolyakServer:
        """A server (not started) on ``pair`` with its data under ``data_dir``."""
        return PolyakServer(
            data_dir,
            *self.server_args(pair),
            *args,
            binary=binary,
            env=self.server_env(pair),
        )

    def cluster(
        self,
        data_root: str | os.PathLike[str],
        count: int = 3,
        *args: str,
        binary: str | None = None,
        lab: NetLab | None = None,
    ) -> tuple[str, list[PolyakServer]]:
        """``count`` nodes of one service (not started): servers sharing a
        fresh PostgreSQL catalog and S3 prefix, named ``node-a``, ``node-b``,
        ...; their data under ``data_root/<letter>``. With ``lab``, each
        runs in a test host of its own, reaching the catalog and the store
        through the lab's proxies. Returns the catalog's database URL (as
        this machine reaches it) with them."""
        catalog = self.postgres().new_database()
        s3 = self.s3()
        store = s3.new_prefix()
        root = Path(data_root)
        servers = []
        for letter in "abcdefgh"[:count]:
            reach_catalog, reach_s3 = catalog, s3.endpoint
            if lab is not None:
                reach_catalog = lab.reach_url(catalog)
                reach_s3 = lab.reach_url(s3.endpoint)
            server = PolyakServer(
                root / letter,
                "--catalog",
                reach_catalog,
                "--store",
                store,
                "--s3-endpoint",
                reach_s3,
                "--node-id",
                f"node-{letter}",
                *args,
                binary=binary,
                env=s3.env(),
            )
            if lab is not None:
                lab.host().run_in(server)
            servers.append(server)
        return catalog, servers

    def store_of(self, server: PolyakServer) -> StoreView:
        """The object store ``server`` keeps its snapshot parts in."""
        return StoreView(server, self._s3)

    def close(self) -> None:
        if self._postgres is not None:
            self._postgres.stop()
            self._postgres = None
        if self._s3 is not None:
            self._s3.stop()
            self._s3 = None

    @classmethod
    def parametrize(cls, metafunc: Any) -> None:
        """The body of a conftest's ``pytest_generate_tests``: a test that
        asks for the ``backend`` fixture runs once per pair of :attr:`PAIRS`
        when its module sets ``BACKEND_MATRIX = True``, else on the embedded
        default only. The parameter is session-scoped and indirect (the
        conftest's ``backend`` fixture returns ``request.param``), so the
        servers of one pair are shared by the tests that run on it.
        """
        if "backend" in metafunc.fixturenames:
            pairs = (
                cls.PAIRS if getattr(metafunc.module, "BACKEND_MATRIX", False) else cls.PAIRS[:1]
            )
            metafunc.parametrize("backend", pairs, indirect=True, scope="session")

    @classmethod
    def session(cls) -> Iterator[Backends]:
        """The body of a conftest's session-scoped ``backends`` fixture: one
        set of backends for the session, closed at its end."""
        b = cls()
        try:
            yield b
        finally:
            b.close()


def read_sse(
    url: str, stop_after: int, timeout: float, headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Reads an event stream (``text/event-stream``) until ``stop_after``
    events came (or the stream ends): each as its JSON ``data`` with the
    SSE ``event`` and ``sse_id`` (the SSE ``id``, what ``Last-Event-ID``
    resumes after; ``None`` for a transient event, which has none)."""
    events: list[dict[str, Any]] = []
    with httpx.stream("GET", url, headers=headers or {}, timeout=timeout) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        block: dict[str, str] = {}
        for line in r.iter_lines():
            if not line:
                if "data" in block:
                    events.append(
                        {
                            "event": block["event"],
                            **json.loads(block["data"]),
                            "sse_id": int(block["id"]) if "id" in block else None,
                        }
                    )
                    if len(events) >= stop_after:
                        return events
                block = {}
                continue
            if line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            block[key] = value.lstrip()
    return events


def state_step(url: str, run: str, rank: int) -> int | None:
    """The rank's step in the newest complete ``state`` snapshot of ``run``
    that holds it, as the server at ``url`` lists them (``None``: none)."""
    snaps = httpx.get(f"{url}/v1/runs/{run}/snapshots", params={"kind": "state"}, timeout=10)
    steps = [
        s["detail"]["rank_steps"].get(str(rank))
        for s in snaps.json()["snapshots"]
        if s["status"] == "complete"
    ]
    return max((s for s in steps if s is not None), default=None)
