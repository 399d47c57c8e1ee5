"""Fixtures for the server reference tests: the real polyak binary on a free port."""

from __future__ import annotations

import pytest
from polyak.testing import PolyakServer


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = PolyakServer(tmp_path_factory.mktemp("polyak-data"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture()
def fresh_server(tmp_path):
    """A server of its own (for tests that restart it or change its limits)."""
    srv = PolyakServer(tmp_path / "data")
    yield srv
    srv.stop()
