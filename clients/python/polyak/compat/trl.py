"""Drop-in for TRL's ``BEMACallback``: BEMA kept by a polyak server.

```python
from polyak.compat.trl import BEMACallback   # was: from trl import BEMACallback

trainer = Trainer(..., callbacks=[BEMACallback(update_freq=400, update_after=1000)])
trainer.train()   # {output_dir}/bema holds the BEMA model, as TRL saves it
```

BEMA (Block and Zhang, arXiv 2508.00180) serves
``running = ema + alpha_t * (theta_t - theta_0)``, the bias-corrected EMA,
with ``beta_t = max((lag + multiplier * t)^-ema_power, min_ema_multiplier)``
and ``alpha_t = (lag + multiplier * t)^-bias_power``, ``t`` the Trainer's
``global_step``. TRL keeps ``theta_0``, the EMA and a whole running model on
the trainer's machine; this callback keeps none of them: the run's ``bema``
profile holds all three on the server, which applies TRL's own arithmetic.

- ``on_train_begin``: the run is created (or joined: every DDP rank pushes
  its share of the replicated parameters) and the trainable parameters
  pushed at ``global_step`` (0): the server's ``theta_0``, EMA and running
  weights start from them, as TRL clones them there.
- ``on_step_end``: the trainable parameters are pushed at the steps that
  change BEMA (``update_after``, and every ``update_freq`` steps after it);
  the other steps leave it as it is, on the server as in TRL.
- ``on_train_end``: every rank's pushes acknowledged, the world process
  zero saves the BEMA model to ``{output_dir}/bema`` with
  ``save_pretrained``, as TRL does.

``running_model`` is TRL's: the model class built from the model's config,
holding what the model held at ``on_train_begin`` with the server's BEMA in
its trainable parameters (read from the server when it is read). As in TRL,
only parameters with ``requires_grad`` are averaged; buffers and frozen
parameters stay as they were at ``on_train_begin``.

Keyword-only arguments besides TRL's: ``url=`` (default ``$POLYAK_URL``),
``token=``, ``run=`` (default a generated name, printed once),
``pusher_options=`` (passed to :class:`polyak.Pusher`). The run's profile is
``bema`` with TRL's parameters (``update_freq``, ``ema_power``,
``bias_power``, ``lag``, ``update_after``, ``multiplier``,
``min_ema_multiplier``), so its snapshots, downloads, comparisons and
evaluations serve the bias-corrected weights.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Mapping
from typing import Any

import torch
from trl import BEMACallback as _TrlBEMACallback

from ..client import Client, Run
from ..errors import PolyakError
from ..pusher import Pusher
from ..shards import canonical_name

__all__ = ["PROFILE", "BEMACallback"]

#: The run's profile holding the BEMA weights.
PROFILE = "bema"

#: Seconds the end of training waits for the pushes to be acknowledged.
READ_TIMEOUT = 120.0


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class BEMACallback(_TrlBEMACallback):  # type: ignore[misc]
    """TRL's ``BEMACallback`` (same arguments and defaults), its BEMA kept
    by a polyak server. ``device`` is where ``running_model`` is built."""

    def __init__(
        self,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: int = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        device: str = "cpu",
        *,
        url: str | None = None,
        token: str | None = None,
        run: str | None = None,
        pusher_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            update_freq=update_freq,
            ema_power=ema_power,
            bias_power=bias_power,
            lag=lag,
            update_after=update_after,
            multiplier=multiplier,
            min_ema_multiplier=min_ema_multiplier,
            device=device,
        )
        self.client = Client(url, token)
        self.run_name = run
        self._generated = run is None
        #: The run's profile (TRL's parameters).
        self.profile: dict[str, Any] = {
            "name": PROFILE,
            "kind": "bema",
            "update_freq": int(update_freq),
            "ema_power": float(ema_power),
            "bias_power": float(bias_power),
            "lag": float(lag),
            "update_after": int(update_after),
            "multiplier": float(multiplier),
            "min_ema_multiplier": float(min_ema_multiplier),
        }
        # Every push matters to BEMA: the queue blocks rather than drop one.
        self.pusher_options = {"max_queue": 1, "pipeline": 1, "policy": "block"}
        self.pusher_options.update(pusher_options or {})
        self.run: Run | None = None
        self.pusher: Pusher | None = None
        self._model: torch.nn.Module | None = None
        # The running model's entries that are not trainable parameters
        # (buffers, frozen parameters), as at on_train_begin.
        self._fixed: dict[str, torch.Tensor] = {}
        # State-dict key -> the server's name of the trainable parameter it
        # holds (tied weights appear under several keys).
        self._keys: dict[str, str] = {}
        self._running: torch.nn.Module | None = None
        self._stale = True

    # TRL assigns `running_model` in its constructor; here it is built from
    # the server's BEMA when read.
    @property
    def running_model(self) -> torch.nn.Module | None:
        if self._model is None:
            return None
        if self._running is None or self._stale:
            self._running = self._load_running(self._running)
            self._stale = False
        return self._running

    @running_model.setter
    def running_model(self, value: torch.nn.Module | None) -> None:
        self._running = value

    def _trainable(self) -> dict[str, torch.Tensor]:
        assert self._model is not None
        return {
            canonical_name(n): p.detach()
            for n, p in self._model.named_parameters()
            if p.requires_grad
        }

    def _open(self, args: Any) -> None:
        world, rank = int(getattr(args, "world_size", 1)), int(getattr(args, "process_index", 0))
        name = self.run_name or f"bemacallback-{uuid.uuid4().hex[:10]}"
        dist = _dist()
        if dist is not None and world > 1:
            shared = [name]
            dist.broadcast_object_list(shared, src=0)
            name = shared[0]
        try:
            self.run = self.client.create_run(
                name, world_size=world, update_every=1, profiles=[self.profile], exist_ok=True
            )
        except PolyakError as e:
            if e.code == "unavailable":
                raise PolyakError(
                    f"BEMACallback: the polyak server at {self.client.url} is unreachable "
                    f"(set url= or $POLYAK_URL): {e}",
                    code="unavailable",
                ) from e
            raise
        self.run_name = name
        self.pusher = self.run.pusher(rank, **self.pusher_options)
        if self._generated and rank == 0:
            print(
                f"polyak: BEMACallback keeps its BEMA in run {name} at {self.client.url}",
                file=sys.stderr,
                flush=True,
            )

    def _push(self, step: int) -> None:
        assert self.pusher is not None
        self.pusher.push(self._trainable(), int(step))
        self._stale = True

    def _changes_bema(self, step: int) -> bool:
        """TRL's ``on_step_end``: a restart at ``update_after``, an update
        every ``update_freq`` steps after it, nothing otherwise."""
        if step < self.update_after:
            return False
        return step == self.update_after or (step - self.update_after) % self.update_freq == 0

    @torch.no_grad()
    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        model = self._unwrap_model(model)
        self._model = model
        trainable = {
            id(p): canonical_name(n) for n, p in model.named_parameters() if p.requires_grad
        }
        self._fixed, self._keys = {}, {}
        for key, value in model.state_dict(keep_vars=True).items():
            if id(value) in trainable:
                self._keys[key] = trainable[id(value)]
            else:
                self._fixed[key] = value.detach().clone().to(self.device)
        self.param_names = list(trainable.values())
        self._running = None
        if self.pusher is None:
            self._open(args)
        self._push(int(state.global_step))

    @torch.no_grad()
    def on_step_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        step = int(state.global_step)
        if self._model is not None and self._changes_bema(step):
            self._push(step)

    def flush(self, timeout: float = READ_TIMEOUT) -> None:
        """Waits until this rank's pushes are acknowledged."""
        if self.pusher is not None:
            self.pusher.flush(timeout)

    def _load_running(self, into: torch.nn.Module | None) -> torch.nn.Module:
        """The running model (``into``, or a new one of the model's class
        and config) holding the server's BEMA in its trainable parameters."""
        assert self._model is not None and self.run is not None
        self.flush()
        bema = self.run.fetch_ema(PROFILE)
        missing = sorted({n for n in self._keys.values() if n not in bema})
        if missing:
            raise PolyakError(
                f"run {self.run.name}: the BEMA lacks {missing[:5]}", code="ema_incomplete"
            )
        if into is None:
            model = self._model
            into = type(model)(model.config).to(self.device)
        state = dict(self._fixed)
        for key, name in self._keys.items():
            state[key] = bema[name]
        into.load_state_dict(state)
        return into

    @torch.no_grad()
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.pusher is None:
            return
        self.flush()
        dist = _dist()
        if dist is not None:
            dist.barrier()  # every rank's share acknowledged
        if state.is_world_process_zero:
            running = self.running_model
            assert running is not None
            running.save_pretrained(f"{args.output_dir}/bema")
        if dist is not None:
            dist.barrier()
