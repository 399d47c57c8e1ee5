"""The catalog and object-store pairs a test server runs against, and a
test's view of the store it writes."""

from __future__ import annotations

import os
from pathlib import Path

from .netlab import NetLab
from .server import PolyakServer
from .services import PostgresService, S3Service


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
    over :attr:`PAIRS` (the ``backend`` fixture of :mod:`polyak_testing.plugin`).
    A context manager: leaving it stops what it started.
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

    def __enter__(self) -> Backends:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
