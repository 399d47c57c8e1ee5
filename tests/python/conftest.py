"""Fixtures for the server reference tests: the real polyak binary on a free port.

Modules that set ``BACKEND_MATRIX = True`` run every test once per catalog
and store pair (:attr:`polyak.testing.Backends.PAIRS`); the others run on
the embedded default only.
"""

from __future__ import annotations

import pytest
from polyak.testing import Backends


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    Backends.parametrize(metafunc)


@pytest.fixture(scope="session")
def backends():
    yield from Backends.session()


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> str:
    """The catalog and store pair of this test's servers."""
    return request.param


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, backends: Backends, backend: str):
    srv = backends.server(backend, tmp_path_factory.mktemp("polyak-data"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture()
def fresh_server(tmp_path, backends: Backends, backend: str):
    """A server of its own (for tests that restart it or change its limits)."""
    srv = backends.server(backend, tmp_path / "data")
    yield srv
    srv.stop()
