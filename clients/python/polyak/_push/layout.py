"""A rank's wire layout: fixed by its first push, checked on every later one."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import torch

from ..errors import PolyakError
from ..shards import Piece, matches
from ..wire import ALIASES_KEY, TensorSpec, WireLayout

__all__ = ["LayoutKeeper"]


class LayoutKeeper:
    """The names, wire dtypes, shapes and chunks this rank pushes, and its
    tied names: built at the first push (with the header every body
    carries), and every later push must match it, as the server's does."""

    def __init__(
        self,
        *,
        dtype: torch.dtype | None,
        copy_only: Sequence[str],
        copy_patterns: Sequence[str],
        run_name: str,
        rank: int,
    ) -> None:
        self.dtype = dtype
        self.copy_only = tuple(copy_only)
        self.copy_patterns = list(copy_patterns)
        self.run_name = run_name
        self.rank = rank
        self.layout: WireLayout | None = None
        self.aliases: dict[str, str] = {}
        self._keeps_dtype: dict[str, bool] = {}

    def wire_dtype(self, name: str, t: torch.Tensor) -> torch.dtype:
        """``dtype`` for floating point tensors, but for names that are
        copied rather than averaged (``copy_only``, the run's copy patterns)."""
        if self.dtype is None or not t.is_floating_point():
            return t.dtype
        keep = self._keeps_dtype.get(name)
        if keep is None:
            keep = matches(name, self.copy_only) or matches(name, self.copy_patterns)
            self._keeps_dtype[name] = keep
        return t.dtype if keep else self.dtype

    def of(self, pieces: Sequence[Piece], aliases: Mapping[str, str]) -> WireLayout:
        """The layout of a push of ``pieces``: the first push's, checked."""
        specs = [
            TensorSpec(p.name, self.wire_dtype(p.name, p.tensor), tuple(p.tensor.shape), p.chunk)
            for p in pieces
        ]
        if self.layout is not None:
            self._check(specs, aliases)
            return self.layout
        if self.copy_only:
            self._check_copy_only(pieces)
        # Tied names travel once; the server records the aliases and writes
        # every name back in downloads and the live EMA.
        self.aliases = dict(aliases)
        meta = {ALIASES_KEY: json.dumps(self.aliases, sort_keys=True)} if aliases else None
        self.layout = WireLayout(specs, meta)
        return self.layout

    def _check(self, specs: list[TensorSpec], aliases: Mapping[str, str]) -> None:
        assert self.layout is not None
        if aliases != self.aliases:
            raise PolyakError(
                f"tied names changed since the first push ({self.aliases} -> "
                f"{dict(aliases)}); a run's layout is fixed",
                code="layout_changed",
                rank=self.rank,
            )
        if tuple((s.name, s.dtype, s.shape, s.chunk) for s in specs) != self.layout.signature:
            raise PolyakError(
                "the pushed tensors differ from the first push's "
                f"({self.layout.describe_difference(specs)}); a run's layout is fixed",
                code="layout_changed",
                rank=self.rank,
            )

    def _check_copy_only(self, pieces: Sequence[Piece]) -> None:
        """Floating point ``copy_only`` names must be in the run's copy
        patterns: the server, not the pusher, decides what is averaged."""
        uncovered = [
            p.name
            for p in pieces
            if matches(p.name, self.copy_only)
            and p.tensor.is_floating_point()
            and not matches(p.name, self.copy_patterns)
        ]
        if uncovered:
            raise PolyakError(
                f"copy_only names {uncovered[:5]} are floating point and not in run "
                f"`{self.run_name}`'s copy_patterns {self.copy_patterns}; the server "
                "would average them. Create the run with copy_patterns covering them.",
                code="copy_only_not_configured",
                rank=self.rank,
            )
