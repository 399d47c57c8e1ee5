"""The originals' own test files, run against the drop-ins with only their
imports changed. They are unittest classes that take no fixtures and name
no server, so the drop-ins find one through ``$POLYAK_URL``: one server for
this directory (the embedded catalog and store), named in the environment
around each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from polyak_testing import PolyakServer
from polyak_testing.backends import Backends


@pytest.fixture(scope="session")
def originals_server(
    tmp_path_factory: pytest.TempPathFactory, polyak_binary: str, backends: Backends
) -> Iterator[PolyakServer]:
    srv = backends.server(
        Backends.PAIRS[0], tmp_path_factory.mktemp("originals-data"), binary=polyak_binary
    )
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def polyak_url(originals_server: PolyakServer, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("POLYAK_URL", originals_server.url)
    return originals_server.url
