"""The run that keeps one drop-in object's EMA: its pusher, and the
read-back into the object's own tensors.

Every class of :mod:`polyak.compat` owns one :class:`RemoteEma`. It creates
the run at construction (so an unreachable server fails there, naming the
URL), pushes through the ordinary :class:`~polyak.Pusher` (nothing is
averaged on the training process), and on a read flushes the pusher, fetches
the run's live EMA and copies it into the tensors the original class would
hold, in place, so references the caller keeps see the new values.

A run whose name was generated here is printed once when it is created
(stderr: it is the one place the user learns it) and finished when the
process exits normally (an ``atexit`` handler: what is queued is flushed
for at most ``polyak.pusher.EXIT_WAIT_SECONDS``, then ``finish``), so it reads ``finished`` rather than
raising a ``stale_rank`` alert a minute later. A run named by the caller
(``run=``) is left open: a later process may go on pushing to it. The
server's failures never end the trainer: pushes are retried by the
pusher, and the exit handler only warns.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import sys
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..client import Client, Run
from ..errors import PolyakError
from ..shards import canonical_name

__all__ = ["POSTHOC_PROFILES", "PROFILE", "RemoteEma", "canonical_keys", "run_of"]

log = logging.getLogger("polyak")

#: The one profile a drop-in's run keeps.
PROFILE = "ema"

#: The profiles ``posthoc=`` adds beside the drop-in's own: EDM2's two
#: power-function EMAs (sigma_rel 0.05 and 0.10), from whose snapshots any
#: length is synthesised afterwards (``run.posthoc``, ``posthoc_search``).
POSTHOC_PROFILES = (
    {"name": "edm05", "kind": "power", "sigma_rel": 0.05},
    {"name": "edm10", "kind": "power", "sigma_rel": 0.10},
)

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
    the same pushes (``PostHocEMA``'s EMAs). ``posthoc=N`` adds
    :data:`POSTHOC_PROFILES` and a snapshot every ``N`` steps, so the run
    can be searched post hoc and evaluated (``run_of(ema)`` is the run).
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
        posthoc: int | None = None,
    ) -> None:
        self.owner = owner
        self.more = [{"name": n, **p} for n, p in (more or {}).items()]
        if posthoc is not None:
            if isinstance(posthoc, bool) or int(posthoc) < 1:
                raise ValueError(
                    f"{owner}: posthoc= is the steps between snapshots (an integer >= 1), "
                    f"not {posthoc!r}"
                )
            self.more += [dict(p) for p in POSTHOC_PROFILES]
        #: Periodic snapshots of every profile (``posthoc=``), else none.
        self.snapshot_every = None if posthoc is None else int(posthoc)
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
        #: Runs this object created under generated names: finished at exit.
        self._owned: list[Run] = []
        self._open(self.base, profile)
        _LIVE.add(self)

    def _open(self, name: str, profile: Mapping[str, Any]) -> None:
        self.profile = {"name": PROFILE, **profile}
        try:
            self.run = self.client.create_run(
                name,
                update_every=self.update_every,
                profiles=[self.profile, *self.more],
                copy_patterns=[_glob_exact(n) for n in self.copy] or None,
                snapshot_every=self.snapshot_every,
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
        if self._generated:
            self._owned.append(self.run)
            # Printed, not logged: the generated name is found nowhere else.
            print(
                f"polyak: {self.owner} keeps its EMA in run {name} at {self.client.url}",
                file=sys.stderr,
                flush=True,
            )
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

    def end(self, timeout: float) -> None:
        """At a normal exit: the pushes flushed (for at most ``timeout``
        seconds; what is left is warned about), and every run generated
        here that was pushed to finished. Warns, never raises."""
        try:
            self.pusher.close(timeout)
        except PolyakError as e:  # the server away, or a push refused earlier
            log.warning("polyak: %s: %s", self.owner, e)
        for run in self._owned:
            try:
                info = run.refresh()
                if info.finished is not None or info.last_step is None:
                    continue  # finished already, or never pushed to
                run.finish(wait=False)
            except PolyakError as e:
                log.warning("polyak: %s: run %s not finished at exit: %s", self.owner, run.name, e)


def run_of(drop_in: Any) -> Run:
    """The :class:`polyak.Run` keeping a drop-in's EMA (an ``EMA``,
    ``ModelEmaV3``, ``EMAModel``, ``AveragedModel``, a Lightning callback):
    with ``posthoc=``, ``run_of(ema).posthoc_search(...)`` and
    ``EvalWorker(run_of(ema), ...)`` work on it as on a native run."""
    for holder in (drop_in, getattr(drop_in, "_average_model", None)):
        remote = getattr(holder, "__dict__", {}).get("_remote") if holder is not None else None
        if isinstance(remote, RemoteEma):
            return remote.run
    # A callback that keeps its run itself (`polyak.compat.trl.BEMACallback`).
    run = getattr(drop_in, "__dict__", {}).get("run")
    if isinstance(run, Run):
        return run
    raise TypeError(
        f"{type(drop_in).__name__} keeps no polyak run (not a polyak.compat drop-in, "
        "or nothing connected it yet)"
    )


def _glob_exact(name: str) -> str:
    """A glob matching only ``name`` (``[``, ``*`` and ``?`` escaped)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in name)


#: Every drop-in's run of this process, ended at exit.
_LIVE: weakref.WeakSet[RemoteEma] = weakref.WeakSet()


def _end_all_at_exit() -> None:
    """Ends every live drop-in's runs, unless the process is exiting on an
    uncaught exception (then the run stays open and its ``stale_rank``
    alert says the trainer stopped)."""
    if getattr(sys, "last_value", None) is not None:
        return
    from .. import pusher as _pusher

    # One budget for all of them, as the pushers' own exit wait has.
    deadline = time.monotonic() + _pusher.EXIT_WAIT_SECONDS
    for remote in list(_LIVE):
        remote.end(max(0.0, deadline - time.monotonic()))


atexit.register(_end_all_at_exit)
