"""Throwaway backing services: PostgreSQL (the catalog) and SeaweedFS (an
S3 store), each on free loopback ports with its data in a temporary
directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .server import free_port


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


def _end(proc: subprocess.Popen[bytes] | None, sig: int, timeout: float) -> None:
    """Sends ``sig`` to a running ``proc``, and SIGKILL if it has not exited
    after ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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

    ``data_root``: the cluster's data directory is made under this folder
    (a small filesystem a test fills, say) instead of beside its log and
    socket in a temporary directory; such a cluster is always started,
    whatever ``$POLYAK_TEST_DATABASE_URL`` says.
    """

    USER = "polyak-pg"
    ROLE = "polyak"

    def __init__(self, data_root: Path | None = None) -> None:
        self.data_root = data_root
        self.external = None if data_root else os.environ.get("POLYAK_TEST_DATABASE_URL") or None
        self.bindir = _postgres_bindir()
        self.dir: Path | None = None
        #: The cluster's data directory (once started).
        self.data: Path | None = None
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
        if self.data_root is None:
            data = self.dir / "data"
        else:
            data = self.data_root / self.dir.name  # initdb makes it
            if os.geteuid() == 0:
                shutil.chown(self.data_root, self.USER, self.USER)
        self.data = data
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
        assert self.dir is not None and self.data is not None
        self.port = self.port or free_port()
        log = open(self.dir / "postgres.log", "ab")
        self.proc = subprocess.Popen(
            self._as_user(
                [
                    str(self.bindir / "postgres"),
                    "-D",
                    str(self.data),
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
        _end(self.proc, signal.SIGINT, timeout)  # SIGINT: fast shutdown
        self.proc = None
        if self.dir is not None and not keep_data:
            if self.data is not None and self.data_root is not None:
                shutil.rmtree(self.data, ignore_errors=True)
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
            self.data = None


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
        _end(self.proc, signal.SIGTERM, timeout)
        self.proc = None
        if not keep_data and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
