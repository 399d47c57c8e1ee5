"""The run that keeps one drop-in object's EMA: its pusher, and the
read-back into the object's own tensors.

Every class of :mod:`polyak.compat` owns one :class:`RemoteEma`. It creates
the run at construction (so an unreachable server fails there, naming the
URL), pushes through the ordinary :class:`~polyak.Pusher` (nothing is
averaged on the training process), and on a read flushes the pusher, fetches
the run's live EMA and copies it into the tensors the original class would
hold, in place, so references the caller keeps see the new values.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..client import Client, Run
from ..errors import PolyakError
from ..shards import canonical_name

__all__ = ["PROFILE", "RemoteEma", "canonical_keys"]

log = logging.getLogger("polyak")

#: The one profile a drop-in's run keeps.
PROFILE = "ema"

#: Seconds a read waits for the pushes before it to be acknowledged; past
#: that it raises (``flush_timeout``) rather than hand back stale numbers.
READ_TIMEOUT = 120.0


def canonical_keys(keys: Sequence[str]) -> list[str]:
    """The names the server keeps ``keys`` under: wrapper segments dropped
    (``_orig_mod``, FSDP's), and a common ``module.`` prefix (a DDP model)
    dropped, as the pusher does for a state dict."""
    names = [canonical_name(k) for k in keys]
    if names and all(n.startswith("module.") for n in names):
        names = [n[len("module.") :] for n in names]
    return names


class RemoteEma:
    """One run on a polyak server holding one profile, ``ema``.

    ``owner`` names the drop-in class in the log line and the generated run
    name; ``profile`` is the profile without its name; ``copy`` are exact
    names the server copies instead of averaging; ``skip`` exact names
    never pushed (the drop-in keeps them itself). ``more`` are further
    profiles of the same run (name -> profile without its name), fed by
    the same pushes (``PostHocEMA``'s EMAs).
    """

    def __init__(
        self,
        owner: str,
        profile: Mapping[str, Any],
        *,
        url: str | None,
        token: str | None,
        run: str | None,
        update_every: int = 1,
        copy: Sequence[str] = (),
        skip: Sequence[str] = (),
        pusher_options: Mapping[str, Any] | None = None,
        more: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.owner = owner
        self.more = [{"name": n, **p} for n, p in (more or {}).items()]
        self.client = Client(url, token)
        self.base = run or f"{owner.lower()}-{uuid.uuid4().hex[:10]}"
        #: The run's name was made up here: nobody else knows it, so an
        #: unused one may be deleted when the object moves to another run.
        self._generated = run is None
        self.update_every = int(update_every)
        self.copy = sorted(set(copy))
        self.skip = sorted(set(skip))
        # One push in flight and one waiting: at most two host copies of
        # the weights (usually one), the originals' memory budget.
        self.pusher_options = {"max_queue": 1, "pipeline": 1, **(pusher_options or {})}
        self._suffix = itertools.count(1)
        self.run: Run
        self.profile: dict[str, Any] = {}
        self._open(self.base, profile)

    def _open(self, name: str, profile: Mapping[str, Any]) -> None:
        self.profile = {"name": PROFILE, **profile}
        try:
            self.run = self.client.create_run(
                name,
                update_every=self.update_every,
                profiles=[self.profile, *self.more],
                copy_patterns=[_glob_exact(n) for n in self.copy] or None,
                exist_ok=True,
            )
        except PolyakError as e:
            if e.code == "unavailable":
                raise PolyakError(
                    f"{self.owner}: the polyak server at {self.client.url} is unreachable "
                    f"(set url= or $POLYAK_URL): {e}",
                    code="unavailable",
                ) from e
            raise
        self.pusher = self.run.pusher(
            0,
            skip=[_glob_exact(n) for n in self.skip],
            copy_only=[_glob_exact(n) for n in self.copy],
            **self.pusher_options,
        )
        #: The last step pushed (``None``: nothing yet on this run).
        self.last_step: int | None = None
        #: Pushed since the last read.
        self.dirty = False
        log.info(
            "polyak: %s keeps its EMA in run %s at %s (profile %s)",
            self.owner,
            name,
            self.client.url,
            self.profile,
        )

    @property
    def name(self) -> str:
        return self.run.name

    def push(self, state: Mapping[str, torch.Tensor], step: int) -> bool:
        """Queues ``state`` (canonical names) as ``step``; ``False`` when the
        run does not apply that step (``step % update_every != 0``)."""
        if not self.pusher.push(state, int(step)):
            return False
        self.last_step = int(step)
        self.dirty = True
        return True

    def reseed(
        self, state: Mapping[str, torch.Tensor], step: int, profile: Mapping[str, Any] | None = None
    ) -> None:
        """Starts the EMA from ``state`` (a loaded checkpoint) as it was
        after ``step``: the first push of a run copies, and the schedule goes
        on from there. A run that already has pushes (or a different
        profile) is left as it is and a new one, ``<run>-<n>``, is made."""
        profile = (
            dict(profile)
            if profile is not None
            else {k: v for k, v in self.profile.items() if k != "name"}
        )
        if self.last_step is not None or {"name": PROFILE, **profile} != self.profile:
            self.close()
            self._open(f"{self.base}-{next(self._suffix)}", profile)
        step = int(step) - int(step) % self.update_every
        self.push(state, step)

    def attach(self, name: str) -> None:
        """Makes the existing run ``name`` (of this same configuration, else
        ``run_exists`` naming the differences) the one pushed to and read
        from, with a new pusher; what was pushed before is acknowledged
        first. The run left, when its name was generated here and nothing
        was pushed to it, is deleted. A refusal changes nothing."""
        left, unused = self.run, self._generated and self.last_step is None
        pusher = self.pusher
        pusher.flush(READ_TIMEOUT)
        # Checks the run's configuration before anything is left.
        self._open(name, {k: v for k, v in self.profile.items() if k != "name"})
        pusher.close()
        if unused and left.name != name:
            try:
                left.delete()
            except PolyakError as e:
                log.warning("polyak: could not delete the unused run %s: %s", left.name, e)
        self._generated = False

    def read_into(self, targets: Mapping[str, torch.Tensor], profile: str = PROFILE) -> None:
        """Copies the run's EMA (of ``profile``) into ``targets`` (canonical
        name -> the caller's tensor) in place, after every push is
        acknowledged; raises when the server cannot be reached or lacks a
        name, never hands back stale values silently."""
        if self.last_step is None:
            return  # nothing pushed: the local tensors are the EMA
        self.pusher.flush(READ_TIMEOUT)
        ema = self.run.fetch_ema(profile)
        missing = [n for n in targets if n not in ema]
        if missing:
            raise PolyakError(
                f"run {self.name}: the EMA lacks {missing[:5]}", code="ema_incomplete"
            )
        with torch.no_grad():
            for name, tensor in targets.items():
                tensor.copy_(ema[name])
        self.dirty = False

    def host_bytes(self) -> int:
        """Bytes of the pusher's host copies of the weights."""
        layout = self.pusher._layout
        return 0 if layout is None else self.pusher._queue.allocated * layout.nbytes

    def close(self) -> None:
        self.pusher.close()


def _glob_exact(name: str) -> str:
    """A glob matching only ``name`` (``[``, ``*`` and ``?`` escaped)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in name)
