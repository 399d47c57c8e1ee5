"""Fixtures for the Python client tests: the real polyak binary on free ports.

The server binary is copied once per session to a private temporary file
(the tree's ``target/`` may be rebuilt while the tests run); every server of
the session starts from that copy.
"""

from __future__ import annotations

import itertools
import shutil
import stat

import polyak
import pytest
from polyak.testing import Backends, NetLab, find_binary


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Modules with BACKEND_MATRIX = True run on every catalog and store pair.
    Backends.parametrize(metafunc)


@pytest.fixture(scope="session")
def backends():
    yield from Backends.session()


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> str:
    """The catalog and store pair of this test's servers."""
    return request.param


@pytest.fixture(scope="session")
def polyak_binary(tmp_path_factory: pytest.TempPathFactory) -> str:
    copy = tmp_path_factory.mktemp("polyak-bin") / "polyak"
    shutil.copy2(find_binary(), copy)
    copy.chmod(copy.stat().st_mode | stat.S_IXUSR)
    return str(copy)


@pytest.fixture(scope="session")
def server(
    tmp_path_factory: pytest.TempPathFactory, polyak_binary: str, backends: Backends, backend: str
):
    srv = backends.server(backend, tmp_path_factory.mktemp("polyak-data"), binary=polyak_binary)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture()
def fresh_server(tmp_path, polyak_binary: str, backends: Backends, backend: str):
    """A server of its own (for tests that pause, stop or restart it); not started."""
    srv = backends.server(backend, tmp_path / "data", binary=polyak_binary)
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    with polyak.Client(server.url) as c:
        yield c


_names = itertools.count()


@pytest.fixture()
def run_name(request: pytest.FixtureRequest) -> str:
    """A run name unique in the session, readable in the server log."""
    base = request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:80]
    return f"{base}-{next(_names)}"


@pytest.fixture()
def lab():
    """Test hosts (network namespaces on a bridge, see ``NetLab``) where
    this machine can make them (root, ``ip``); ``None`` elsewhere, and the
    tests use loopback ports instead."""
    if NetLab.unavailable() is not None:
        yield None
        return
    net = NetLab().start()
    try:
        yield net
    finally:
        net.close()
