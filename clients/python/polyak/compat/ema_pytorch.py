"""``ema_pytorch.EMA`` with the EMA kept by polyak.

A subclass of ema-pytorch's ``EMA`` taking all of its arguments. Its
schedule (copy while ``step <= update_after_step``, then ema-pytorch's
warmup clamped to ``[min_value, beta]``, every ``update_every`` steps; a
frozen EMA for ``beta == 1``) is the server's ``warmup`` profile with the
run's ``update_every``; ``update()`` pushes the online model as step
``EMA.step``. Names in ``param_or_buffer_names_no_ema`` are copied by the
server. ``ema_model``, calling the object, ``forward_eval``,
``copy_params_from_ema_to_model``, ``update_model_with_ema`` (hare and
tortoise) and ``state_dict`` read the server's EMA into ``ema_model``'s own
tensors.

What stays on the trainer: names in ``ignore_names`` /
``ignore_startswith_names`` (never averaged: ema-pytorch copies them only
while ``step <= update_after_step``, which is done here) and integer
buffers (ema-pytorch leaves them as they were copied at construction).
``load_state_dict`` starts a fresh run from the loaded EMA at its step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from ema_pytorch import EMA as _EMA
from torch import nn

from ._remote import RemoteEma, canonical_keys

__all__ = ["EMA"]


class EMA(_EMA):
    """ema-pytorch's ``EMA`` with the EMA kept by a polyak server (see the
    module's docstring)."""

    def __new__(cls, model: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise TypeError(
                "polyak's EMA takes an nn.Module (ema-pytorch's pytree EMA is not served)"
            )
        return nn.Module.__new__(cls)

    def __init__(
        self,
        model: nn.Module,
        ema_model: nn.Module | Callable[[], nn.Module] | None = None,
        beta: float = 0.9999,
        update_after_step: int = 100,
        update_every: int = 10,
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
        min_value: float = 0.0,
        param_or_buffer_names_no_ema: set[str] = set(),  # noqa: B006 (ema-pytorch's default)
        ignore_names: set[str] = set(),  # noqa: B006
        ignore_startswith_names: set[str] = set(),  # noqa: B006
        include_online_model: bool = True,
        allow_different_devices: bool = False,
        use_foreach: bool = False,
        update_model_with_ema_every: int | None = None,
        update_model_with_ema_beta: float = 0.0,
        forward_method_names: tuple[str, ...] = (),
        move_ema_to_online_device: bool = False,
        coerce_dtype: bool = False,
        lazy_init_ema: bool = False,
        *,
        url: str | None = None,
        token: str | None = None,
        run: str | None = None,
        pusher_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.__dict__["_remote"] = None
        super().__init__(
            model,
            ema_model,
            beta,
            update_after_step,
            update_every,
            inv_gamma,
            power,
            min_value,
            param_or_buffer_names_no_ema,
            ignore_names,
            ignore_startswith_names,
            include_online_model,
            allow_different_devices,
            use_foreach,
            update_model_with_ema_every,
            update_model_with_ema_beta,
            forward_method_names,
            move_ema_to_online_device,
            coerce_dtype,
            lazy_init_ema,
        )
        self._remote = RemoteEma(
            "EMA",
            {
                "kind": "warmup",
                "beta": float(beta),
                "update_after_step": int(update_after_step),
                "inv_gamma": float(inv_gamma),
                "power": float(power),
                "min_value": float(min_value),
            },
            url=url,
            token=token,
            run=run,
            update_every=update_every,
            copy=canonical_keys(sorted(param_or_buffer_names_no_ema)),
            pusher_options=pusher_options,
        )

    # -- the EMA module, read from the server ------------------------------

    @property
    def ema_model(self) -> nn.Module | None:  # type: ignore[override]
        """The EMA module, holding the server's EMA (read now)."""
        module = self._modules.get("ema_model")
        remote = self.__dict__.get("_remote")
        if module is not None and remote is not None and remote.dirty:
            remote.read_into(self._targets(module))
        return module

    @ema_model.setter
    def ema_model(self, value: nn.Module | None) -> None:
        self._modules["ema_model"] = value

    def init_ema(self, ema_model: nn.Module | None = None) -> None:
        super().init_ema(ema_model)
        # ema-pytorch binds these to the EMA module; a call reads it first.
        for name in self.forward_method_names:
            setattr(self, name, self._reading(name))

    def _reading(self, name: str) -> Callable[..., Any]:
        def method(*args: Any, **kwargs: Any) -> Any:
            return getattr(self.ema_model, name)(*args, **kwargs)

        return method

    def _ignored(self, name: str) -> bool:
        return name in self.ignore_names or any(
            name.startswith(p) for p in self.ignore_startswith_names
        )

    def _served(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of what the server keeps, in ema-pytorch's order."""
        return [
            (n, t)
            for n, t in [*self.get_params_iter(module), *self.get_buffers_iter(module)]
            if not self._ignored(n)
        ]

    def _targets(self, module: nn.Module) -> dict[str, torch.Tensor]:
        served = self._served(module)
        return dict(
            zip(canonical_keys([n for n, _ in served]), [t.data for _, t in served], strict=True)
        )

    def _state_of(self, online: nn.Module) -> dict[str, torch.Tensor]:
        """The online model's tensors under the EMA module's names (paired
        in order, as ema-pytorch pairs them)."""
        ema = self._modules["ema_model"]
        assert ema is not None
        names = [n for n, _ in self._served(ema)]
        theirs = [t for n, t in self._served(online)]
        return dict(zip(canonical_keys(names), [t.detach() for t in theirs], strict=True))

    def _copy_ignored(self) -> None:
        """ema-pytorch's copies of the names the server never sees."""
        ema = self._modules["ema_model"]
        assert ema is not None
        pairs = zip(
            [*self.get_params_iter(ema), *self.get_buffers_iter(ema)],
            [*self.get_params_iter(self.model), *self.get_buffers_iter(self.model)],
            strict=True,
        )
        for (name, mine), (_, theirs) in pairs:
            if self._ignored(name):
                self.inplace_copy(mine.data, theirs.data)

    # -- ema-pytorch's API --------------------------------------------------

    def update(self) -> None:
        """ema-pytorch's ``update``: the online model is pushed as step
        ``EMA.step``; the server copies, averages or skips it as ema-pytorch
        would."""
        step = int(self.step.item())
        self.step += 1
        assert self._remote is not None
        if not self.initted.item():
            if self._modules.get("ema_model") is None:
                self.init_ema()
            self._remote.push(self._state_of(self.model), step)
            self._copy_ignored()
            self.initted.data.copy_(torch.tensor(True))
            return
        should_update = step % self.update_every == 0
        if should_update:
            self._remote.push(self._state_of(self.model), step)
            if step <= self.update_after_step:
                self._copy_ignored()
                return
        if (
            self.update_model_with_ema_every is not None
            and step % self.update_model_with_ema_every == 0
        ):
            self.update_model_with_ema()

    def copy_params_from_model_to_ema(self) -> None:
        """Sets the EMA to the online model: done here, then the server's
        EMA starts again from it."""
        super().copy_params_from_model_to_ema()
        self._reseed()

    def _reseed(self) -> None:
        step = int(self.step.item())
        if self._remote is not None and self.initted.item() and step > 0:
            ema = self._modules["ema_model"]
            assert ema is not None
            self._remote.reseed(self._targets(ema), step - 1)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        _ = self.ema_model  # the server's EMA into the module first
        return super().state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        _ = self.ema_model  # pending pushes land before they are replaced
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._reseed()
        return result
