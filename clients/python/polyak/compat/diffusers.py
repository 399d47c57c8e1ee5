"""diffusers' ``EMAModel`` with the EMA kept by polyak.

A subclass of ``diffusers.training_utils.EMAModel`` taking all of its
arguments. Its schedule (``get_decay(optimization_step)``: 0 up to
``update_after_step + 1``, then ``(1 + e) / (10 + e)`` or the warmup with
``inv_gamma`` and ``power``, clamped to ``[min_decay, decay]``) is the
server's ``diffusers`` profile; ``step(parameters)`` pushes the parameters
as step ``optimization_step`` (1 at the first). Parameters with
``requires_grad=False`` at construction are copied, as diffusers copies
them. ``shadow_params``, ``copy_to``, ``state_dict``, ``to`` and
``save_pretrained`` read the server's EMA into the shadow tensors in place
(tensors the caller holds see the new values). ``load_state_dict`` and
``from_pretrained`` start a fresh run from the loaded EMA at its
``optimization_step``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from diffusers.training_utils import EMAModel as _EMAModel

from ._remote import RemoteEma

__all__ = ["EMAModel"]


class EMAModel(_EMAModel):
    """diffusers' ``EMAModel`` with the EMA kept by a polyak server (see the
    module's docstring)."""

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_ema_warmup: bool = False,
        inv_gamma: float | int = 1.0,
        power: float | int = 2 / 3,
        foreach: bool = False,
        model_cls: Any | None = None,
        model_config: dict[str, Any] | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        run: str | None = None,
        pusher_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._remote: RemoteEma | None = None
        if isinstance(parameters, torch.nn.Module):
            # diffusers' deprecated form: a module means warmup on.
            parameters = parameters.parameters()
            use_ema_warmup = True
        parameters = list(parameters)
        super().__init__(
            parameters,
            decay,
            min_decay,
            update_after_step,
            use_ema_warmup,
            inv_gamma,
            power,
            foreach,
            model_cls,
            model_config,
            **kwargs,
        )
        self._remote = RemoteEma(
            "EMAModel",
            self._profile(),
            url=url,
            token=token,
            run=run,
            copy=[str(i) for i, p in enumerate(parameters) if not p.requires_grad],
            pusher_options=pusher_options,
        )

    def _profile(self) -> dict[str, Any]:
        return {
            "kind": "diffusers",
            "decay": float(self.decay),
            "min_decay": float(self.min_decay),
            "update_after_step": int(self.update_after_step),
            "use_ema_warmup": bool(self.use_ema_warmup),
            "inv_gamma": float(self.inv_gamma),
            "power": float(self.power),
        }

    # -- the shadow parameters, read from the server -------------------------

    @property
    def shadow_params(self) -> list[torch.Tensor]:
        """The EMA, holding the server's values (read now, in place)."""
        remote = self.__dict__.get("_remote")
        shadow = self.__dict__["_shadow"]
        if remote is not None and remote.dirty:
            remote.read_into({str(i): t for i, t in enumerate(shadow)})
        return shadow

    @shadow_params.setter
    def shadow_params(self, value: list[torch.Tensor]) -> None:
        self.__dict__["_shadow"] = value

    @torch.no_grad()
    def step(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """diffusers' ``step``: the parameters are pushed as step
        ``optimization_step``; the server applies ``get_decay`` of it."""
        if isinstance(parameters, torch.nn.Module):
            parameters = parameters.parameters()
        parameters = list(parameters)
        self.optimization_step += 1
        self.cur_decay_value = self.get_decay(self.optimization_step)
        assert self._remote is not None
        self._remote.push(
            {str(i): p.detach() for i, p in enumerate(parameters)}, self.optimization_step
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _ = self.shadow_params  # pending pushes land before they are replaced
        super().load_state_dict(state_dict)
        if self._remote is None:
            return
        shadow = {str(i): t for i, t in enumerate(self.__dict__["_shadow"])}
        if self.optimization_step > 0:
            self._remote.reseed(shadow, self.optimization_step, self._profile())
        elif self._profile() != {k: v for k, v in self._remote.profile.items() if k != "name"}:
            self._remote.reseed(shadow, 0, self._profile())
