"""What polyak's tests, benchmarks and fuzz seeds stand on; not part of the
client (``polyak`` imports nothing from here, and it is never installed for
users).

Layout:

- :mod:`.server`: ``PolyakServer``, the real binary as a child process on a
  free loopback port; ``find_binary``, ``free_port``.
- :mod:`.services`: throwaway PostgreSQL (``PostgresService``) and SeaweedFS
  S3 (``S3Service``) instances.
- :mod:`.backends`: ``Backends``, the catalog and store pairs a server runs
  on; ``StoreView``, a test's view of the store a server writes.
- :mod:`.netlab`: ``NetLab`` test hosts in network namespaces, ``TcpProxy``
  links a test cuts.
- :mod:`.checks`: checks and reads over a running server, ``wait_for``,
  ``stderr_on_a_terminal``.
- :mod:`.refs`: models, training loops and anchors (imports torch; import it
  by name: ``from polyak_testing.refs import Trainer``).
- :mod:`.plugin`: the pytest fixtures every test tree shares (``-p
  polyak_testing.plugin`` in ``pytest.ini``).
"""

from __future__ import annotations

from .backends import Backends, StoreView
from .checks import (
    check_compare,
    check_wire_totals,
    compare_stats,
    read_sse,
    state_step,
    stderr_on_a_terminal,
    wait_for,
    wait_settled,
)
from .netlab import LabHost, NetLab, TcpProxy
from .server import PolyakServer, find_binary, free_port
from .services import PostgresService, S3Service

__all__ = [
    "Backends",
    "LabHost",
    "NetLab",
    "PolyakServer",
    "PostgresService",
    "S3Service",
    "StoreView",
    "TcpProxy",
    "check_compare",
    "check_wire_totals",
    "compare_stats",
    "find_binary",
    "free_port",
    "read_sse",
    "state_step",
    "stderr_on_a_terminal",
    "wait_for",
    "wait_settled",
]
