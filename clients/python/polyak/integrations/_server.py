"""The server's failures, kept out of the training loop: a call a
callback makes on the trainer's behalf (a checkpoint's snapshot, metrics,
finishing the run) that finds the server away or failing is logged as a
warning and the training goes on; what the trainer asked wrongly (a 4xx)
is raised as before."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from ..errors import PolyakError

log = logging.getLogger("polyak")

T = TypeVar("T")


def server_away(e: PolyakError) -> bool:
    """No server answered, or it failed (a 5xx, 408, 429)."""
    return e.status is None or e.status >= 500 or e.status in (408, 429)


def best_effort(what: str, call: Callable[[], T]) -> T | None:
    """``call()``; ``None`` (and a warning naming ``what``) when the server
    is away or failing."""
    try:
        return call()
    except PolyakError as e:
        if not server_away(e):
            raise
        log.warning("polyak: %s skipped, the server is away or failing: %s", what, e)
        return None
