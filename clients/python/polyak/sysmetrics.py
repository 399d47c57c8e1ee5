"""An opt-in sampler of the trainer's system metrics, posted with the
trainer's own scalars at a bounded rate (``Run.enable_system_metrics``).

Series (per rank): ``sys/cpu_percent`` (this process, since the previous
sample; 100 = one core), ``sys/rss_bytes`` (this process),
``sys/host_mem_used_fraction`` (the host), and on CUDA
``sys/cuda_mem_allocated_bytes``, ``sys/cuda_mem_reserved_bytes`` (what
torch's caching allocator reports for the current device) and
``sys/cuda_utilization`` (percent, when torch can read it through NVML).

``psutil`` is used when installed (``pip install polyak[system]``);
otherwise ``/proc`` and :mod:`resource` give the same figures on Linux.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

__all__ = ["SystemSampler"]


def _host_mem_used_fraction() -> float | None:
    try:
        import psutil

        return float(psutil.virtual_memory().percent) / 100.0
    except ImportError:
        pass
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0])
        total, available = fields["MemTotal"], fields["MemAvailable"]
        return (total - available) / total if total else None
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _rss_bytes() -> float | None:
    try:
        import psutil

        return float(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return None


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class SystemSampler:
    """Samples at most once every ``min_interval`` seconds: :meth:`due`
    says whether a sample is owed, :meth:`sample` takes it."""

    def __init__(
        self, min_interval: float = 10.0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if min_interval <= 0:
            raise ValueError("min_interval must be positive")
        self.min_interval = float(min_interval)
        self._clock = clock
        self._last: float | None = None
        self._cpu_mark = (clock(), _cpu_seconds())

    def due(self) -> bool:
        return self._last is None or self._clock() - self._last >= self.min_interval

    def sample(self) -> dict[str, float]:
        """The figures now (only those this machine can give)."""
        now = self._clock()
        self._last = now
        out: dict[str, float] = {}
        cpu = _cpu_seconds()
        t0, c0 = self._cpu_mark
        if now > t0:
            out["sys/cpu_percent"] = 100.0 * (cpu - c0) / (now - t0)
        self._cpu_mark = (now, cpu)
        for name, value in (
            ("sys/rss_bytes", _rss_bytes()),
            ("sys/host_mem_used_fraction", _host_mem_used_fraction()),
        ):
            if value is not None:
                out[name] = value
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["sys/cuda_mem_allocated_bytes"] = float(torch.cuda.memory_allocated())
            out["sys/cuda_mem_reserved_bytes"] = float(torch.cuda.memory_reserved())
            try:
                out["sys/cuda_utilization"] = float(torch.cuda.utilization())
            except Exception:
                pass
        return out

    def maybe_sample(self) -> dict[str, float] | None:
        """A sample when one is due, else ``None``."""
        return self.sample() if self.due() else None
