"""The pytest fixtures shared by every test tree (``tests/python``,
``clients/python/tests``, ``tests/browser``), loaded by ``-p
polyak_testing.plugin`` in ``pytest.ini``.

Servers are the real binary on free ports. The binary is copied once per
session to a private temporary file (the tree's ``target/`` may be rebuilt
while the tests run); every server of the session starts from that copy.

Modules that set ``BACKEND_MATRIX = True`` run every test that asks for a
server once per catalog and store pair (:attr:`Backends.PAIRS`); the others
run on the embedded default only.
"""

from __future__ import annotations

import itertools
import shutil
import stat
from collections.abc import Iterator

import pytest

from .backends import Backends
from .netlab import NetLab
from .server import PolyakServer, find_binary


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # The parameter is session-scoped and indirect (``backend`` returns
    # ``request.param``), so the servers of one pair are shared by the
    # tests that run on it.
    if "backend" in metafunc.fixturenames:
        matrix = getattr(metafunc.module, "BACKEND_MATRIX", False)
        pairs = Backends.PAIRS if matrix else Backends.PAIRS[:1]
        metafunc.parametrize("backend", pairs, indirect=True, scope="session")


@pytest.fixture(scope="session")
def backends() -> Iterator[Backends]:
    """One set of backing services for the session, stopped at its end."""
    with Backends() as b:
        yield b


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
) -> Iterator[PolyakServer]:
    """The session's server on this test's pair, started."""
    srv = backends.server(backend, tmp_path_factory.mktemp("polyak-data"), binary=polyak_binary)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture()
def fresh_server(
    tmp_path, polyak_binary: str, backends: Backends, backend: str
) -> Iterator[PolyakServer]:
    """A server of its own (for tests that pause, stop or restart it, or
    change its limits); not started."""
    srv = backends.server(backend, tmp_path / "data", binary=polyak_binary)
    yield srv
    srv.stop()


@pytest.fixture()
def client(server: PolyakServer):
    """A ``polyak.Client`` on the session's server."""
    import polyak

    with polyak.Client(server.url) as c:
        yield c


_names = itertools.count()


@pytest.fixture()
def run_name(request: pytest.FixtureRequest) -> str:
    """A run name unique in the session, readable in the server log."""
    base = request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:80]
    return f"{base}-{next(_names)}"


@pytest.fixture()
def lab() -> Iterator[NetLab | None]:
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
