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

The server keeps each tensor under the name the model gives it, so live
``/ema``, snapshots and downloads load by name (``load_state_dict(...,
strict=True)`` of a model without buffers). The names come from, first to
last: ``names=`` (one per parameter, in order), the module passed in place
of the parameters, or ``model_cls`` + ``model_config`` (the model built on
the meta device, whose parameters must have the parameters' shapes).
Without any of them the tensors are named by position (``"0"``, ``"1"``,
...), with one warning.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from diffusers.training_utils import EMAModel as _EMAModel

from ._remote import RemoteEma, canonical_keys

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
        names: Sequence[str] | None = None,
        posthoc: int | None = None,
        **kwargs: Any,
    ) -> None:
        self._remote: RemoteEma | None = None
        module = None
        if isinstance(parameters, torch.nn.Module):
            # diffusers' deprecated form: a module means warmup on.
            module = parameters
            parameters = parameters.parameters()
            use_ema_warmup = True
        parameters = list(parameters)
        self._names = tensor_names(parameters, names, module, model_cls, model_config)
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
            copy=[n for n, p in zip(self._names, parameters, strict=True) if not p.requires_grad],
            pusher_options=pusher_options,
            posthoc=posthoc,
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
            remote.read_into(dict(zip(self.__dict__["_names"], shadow, strict=True)))
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
        if len(parameters) != len(self._names):
            raise ValueError(
                f"EMAModel.step: {len(parameters)} parameters, but the EMA has {len(self._names)}"
            )
        self._remote.push(
            {n: p.detach() for n, p in zip(self._names, parameters, strict=True)},
            self.optimization_step,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _ = self.shadow_params  # pending pushes land before they are replaced
        super().load_state_dict(state_dict)
        if self._remote is None:
            return
        shadow = dict(zip(self._names, self.__dict__["_shadow"], strict=True))
        if self.optimization_step > 0:
            self._remote.reseed(shadow, self.optimization_step, self._profile())
        elif self._profile() != {k: v for k, v in self._remote.profile.items() if k != "name"}:
            self._remote.reseed(shadow, 0, self._profile())


def tensor_names(
    parameters: Sequence[torch.Tensor],
    names: Sequence[str] | None,
    module: torch.nn.Module | None,
    model_cls: Any | None,
    model_config: Mapping[str, Any] | None,
) -> list[str]:
    """The names the server keeps ``parameters`` under (see the module's
    docstring), canonical as the pusher makes them."""
    if names is not None:
        names = [str(n) for n in names]
        if len(names) != len(parameters):
            raise ValueError(f"EMAModel: {len(names)} names for {len(parameters)} parameters")
        return _unique(canonical_keys(names))
    if module is not None:
        return _unique(canonical_keys([n for n, _ in module.named_parameters()]))
    why = "pass names=, the module, or model_cls and model_config"
    if model_cls is not None and model_config is not None:
        try:
            # The model's own names without its memory: built on the meta device.
            with torch.device("meta"):
                model = model_cls.from_config(model_config)
            named = list(model.named_parameters())
        except Exception as e:  # a model that cannot be built on meta
            named, why = [], f"{model_cls.__name__} could not be built on the meta device ({e})"
        shapes = [tuple(p.shape) for p in parameters]
        if named and [tuple(p.shape) for _, p in named] == shapes:
            return _unique(canonical_keys([n for n, _ in named]))
        if named:
            why = f"{model_cls.__name__}.from_config(model_config) has other parameters"
    warnings.warn(
        f"polyak EMAModel: the parameters' names are unknown ({why}): the EMA's tensors are "
        "named by position ('0', '1', ...), so its downloads load by position, not by name",
        stacklevel=3,
    )
    return [str(i) for i in range(len(parameters))]


def _unique(names: list[str]) -> list[str]:
    doubled = sorted(n for n, count in Counter(names).items() if count > 1)
    if doubled:
        raise ValueError(f"EMAModel: tensor names given twice: {doubled[:5]}")
    return names
