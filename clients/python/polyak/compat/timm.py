"""timm's ``ModelEmaV2`` and ``ModelEmaV3`` with the EMA kept by polyak.

Subclasses of timm's classes taking all of their arguments. The EMA starts
as the model at construction (timm's ``deepcopy``), held in ``.module``
until the first ``update``, which pushes it (step 0) before the model when
the first update averages rather than copies.

- ``ModelEmaV2(model, decay)``: a ``constant`` profile; every ``update``
  pushes the next step.
- ``ModelEmaV3.update(model)`` without ``step``: ``constant`` (timm uses
  ``decay`` as is); ``update(model, step=s)``: the ``timm`` profile, whose
  decay at step ``s`` is timm's ``get_decay(s)`` (``update_after_step``,
  ``use_warmup``, ``warmup_gamma``, ``warmup_power``, ``min_decay``); steps
  must increase. ``exclude_buffers=True``: buffers are copied.

``.module``, calling the object and ``state_dict`` read the server's EMA
into ``.module``'s own tensors; ``set(model)`` starts the EMA again from
the model. What stays on the trainer: ``ModelEmaV2``'s integer buffers
(timm averages them in float and truncates: a few bytes, done here with
timm's formula). What differs: the server averages in float32, so
``ModelEmaV3``'s stochastic rounding of bfloat16 EMAs is not reproduced (a
bfloat16 ``.module`` receives the float32 EMA rounded to nearest).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from timm.utils.model_ema import ModelEmaV2 as _ModelEmaV2
from timm.utils.model_ema import ModelEmaV3 as _ModelEmaV3
from torch import nn

from ._remote import RemoteEma, canonical_keys

__all__ = ["ModelEmaV2", "ModelEmaV3"]


class _Served:
    """What both versions share: the lazily created run, the pushes paired
    by state-dict order, the read into ``.module``."""

    _owner = "ModelEma"
    _where: dict[str, Any]
    _remote: RemoteEma | None
    _local: list[str]
    _copied: list[str]
    _steps: str | None  # "count" or "given", fixed by the first update
    _last: int
    _modules: dict[str, nn.Module | None]

    def _init_served(
        self,
        *,
        url: str | None,
        token: str | None,
        run: str | None,
        pusher_options: Mapping[str, Any] | None,
        local: list[str],
        copied: list[str],
        posthoc: int | None = None,
    ) -> None:
        self.__dict__.update(
            _where={
                "url": url,
                "token": token,
                "run": run,
                "pusher_options": pusher_options,
                "posthoc": posthoc,
            },
            _remote=None,
            _local=local,
            _copied=copied,
            _steps=None,
            _last=-1,
        )
        # An unreachable server fails here, naming the URL, as the
        # original's constructor is where the EMA is set up.
        from ..client import Client
        from ..errors import PolyakError

        client = Client(url, token)
        if not client.health():
            raise PolyakError(
                f"{self._owner}: the polyak server at {client.url} is unreachable "
                "(set url= or $POLYAK_URL)",
                code="unavailable",
            )
        client.close()

    def _names(self) -> list[str]:
        module = self._modules["module"]
        assert module is not None
        return list(module.state_dict().keys())

    def _served_names(self) -> list[str]:
        return [n for n in self._names() if n not in self._local]

    def _targets(self) -> dict[str, torch.Tensor]:
        module = self._modules["module"]
        assert module is not None
        sd = module.state_dict()
        names = self._names()
        canon = dict(zip(names, canonical_keys(names), strict=True))
        return {canon[n]: sd[n] for n in self._served_names()}

    def _state_of(self, model: nn.Module) -> dict[str, torch.Tensor]:
        names = self._names()
        pair = dict(zip(names, model.state_dict().values(), strict=False))
        canon = dict(zip(names, canonical_keys(names), strict=True))
        return {canon[n]: pair[n].detach() for n in self._served_names()}

    def _connect(self, profile: Mapping[str, Any]) -> RemoteEma:
        names = self._names()
        canon = dict(zip(names, canonical_keys(names), strict=True))
        w = self._where
        return RemoteEma(
            self._owner,
            profile,
            url=w["url"],
            token=w["token"],
            run=w["run"],
            copy=[canon[n] for n in self._copied],
            pusher_options=w["pusher_options"],
            posthoc=w["posthoc"],
        )

    def _push(self, model: nn.Module, step: int, profile: Mapping[str, Any], copies: bool) -> None:
        """Pushes ``model`` as ``step``; the first push also sends the EMA
        held here (step 0) first unless this update copies anyway."""
        if self._remote is None:
            self._remote = self._connect(profile)
            if not copies:
                self._remote.push(self._targets(), 0)
        self._remote.push(self._state_of(model), step)
        self._last = step

    def _refresh(self) -> None:
        remote = self.__dict__.get("_remote")
        if remote is not None and remote.dirty:
            remote.read_into(self._targets())

    @property
    def module(self) -> nn.Module:
        """The EMA module, holding the server's EMA (read now)."""
        self._refresh()
        module = self._modules["module"]
        assert module is not None
        return module

    def set(self, model: nn.Module) -> None:
        """timm's ``set``: the EMA becomes the model, here and then on the server."""
        super().set(model)  # type: ignore[misc]
        self._set_served()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._refresh()
        return super().state_dict(*args, **kwargs)  # type: ignore[misc]

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        self._refresh()
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
        self._set_served()
        return result

    def _set_served(self) -> None:
        """After ``set`` or ``load_state_dict``: the EMA held here is the
        EMA; the next update starts the server's from it."""
        if self._remote is not None:
            self._remote.reseed(self._targets(), max(self._last, 0))


class ModelEmaV2(_Served, _ModelEmaV2):
    """timm's ``ModelEmaV2`` with the EMA kept by a polyak server."""

    _owner = "ModelEmaV2"

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        device: torch.device | str | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        run: str | None = None,
        pusher_options: Mapping[str, Any] | None = None,
        posthoc: int | None = None,
    ) -> None:
        super().__init__(model, decay, device)
        sd = self._modules["module"].state_dict()  # type: ignore[union-attr]
        ints = [n for n, t in sd.items() if not t.is_floating_point()]
        self._init_served(
            url=url,
            token=token,
            run=run,
            pusher_options=pusher_options,
            posthoc=posthoc,
            local=ints,
            copied=[],
        )

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self._push(
            model,
            self._last + 1 if self._last >= 0 else 1,
            {"kind": "constant", "beta": float(self.decay)},
            copies=False,
        )
        # timm's float arithmetic on integer buffers, truncated by copy_.
        mine = self._modules["module"].state_dict()  # type: ignore[union-attr]
        pair = dict(zip(self._names(), model.state_dict().values(), strict=False))
        for n in self._local:
            m = pair[n] if self.device is None else pair[n].to(device=self.device)
            mine[n].copy_(self.decay * mine[n] + (1.0 - self.decay) * m)


class ModelEmaV3(_Served, _ModelEmaV3):
    """timm's ``ModelEmaV3`` with the EMA kept by a polyak server."""

    _owner = "ModelEmaV3"

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_warmup: bool = False,
        warmup_gamma: float = 1.0,
        warmup_power: float = 2 / 3,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        stochastic_rounding: bool = True,
        stochastic_rounding_seed: int = 0,
        foreach: bool = True,
        exclude_buffers: bool = False,
        *,
        url: str | None = None,
        token: str | None = None,
        run: str | None = None,
        pusher_options: Mapping[str, Any] | None = None,
        posthoc: int | None = None,
    ) -> None:
        super().__init__(
            model,
            decay,
            min_decay,
            update_after_step,
            use_warmup,
            warmup_gamma,
            warmup_power,
            device,
            dtype,
            stochastic_rounding,
            stochastic_rounding_seed,
            foreach,
            exclude_buffers,
        )
        module = self._modules["module"]
        assert module is not None
        copied = [n for n, _ in module.named_buffers()] if exclude_buffers else []
        self._init_served(
            url=url,
            token=token,
            run=run,
            pusher_options=pusher_options,
            posthoc=posthoc,
            local=[],
            copied=copied,
        )

    def _profile(self) -> dict[str, Any]:
        return {
            "kind": "timm",
            "decay": float(self.decay),
            "min_decay": float(self.min_decay),
            "update_after_step": int(self.update_after_step),
            "use_warmup": bool(self.use_warmup),
            "warmup_gamma": float(self.warmup_gamma),
            "warmup_power": float(self.warmup_power),
        }

    @torch.no_grad()
    def update(self, model: nn.Module, step: int | None = None) -> None:
        mode = "count" if step is None else "given"
        if self._steps is None:
            self._steps = mode
        elif self._steps != mode:
            raise ValueError(
                "polyak ModelEmaV3: give `step` to every update or to none "
                "(the server keeps one schedule per EMA)"
            )
        if step is None:
            profile = {"kind": "constant", "beta": float(self.decay)}
            self._push(model, self._last + 1 if self._last >= 0 else 1, profile, copies=False)
            return
        step = int(step)
        if step <= self._last:
            raise ValueError(f"polyak ModelEmaV3: steps must increase ({step} after {self._last})")
        self._push(model, step, self._profile(), copies=self.get_decay(step) == 0.0)
