"""What the trainer integrations send as run metrics."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def finite_scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of ``metrics`` as floats (tensors and numpy
    scalars included; strings, lists and non-finite values left out: the
    server refuses them), names prefixed."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        try:
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if math.isfinite(number):
            out[f"{prefix}{key}"] = number
    return out
