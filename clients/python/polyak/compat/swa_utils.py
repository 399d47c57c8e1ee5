"""``torch.optim.swa_utils`` with the average kept by polyak.

``AveragedModel(model, device=None, avg_fn=None, multi_avg_fn=None,
use_buffers=False)`` as torch's, of which it is a subclass: its default
(SWA, ``p + (w - p) / (n + 1)``) maps to an ``swa`` profile,
``get_ema_multi_avg_fn(decay)`` / ``get_ema_avg_fn(decay)`` (these, or
torch's own) to ``constant`` with ``beta = decay``. The update pushes the
model as step ``n_averaged``; every way torch exposes the average reads
the server's average into ``.module``'s own tensors first (in place, so
tensors the caller holds see it): ``.module``, calling the object,
``state_dict``, ``parameters`` / ``named_parameters`` / ``buffers`` /
``named_buffers``, ``modules`` / ``children`` (and what walks them:
``to``, ``apply``, ``train``), pickling and copying.

What stays on the trainer:

- an ``avg_fn`` / ``multi_avg_fn`` written by the user, which the server
  cannot run: averaged here exactly as torch does, with one warning;
- with ``use_buffers=True``, integer buffers (``num_batches_tracked``): torch
  runs the averaging function on them too (integer arithmetic, a few
  bytes), so they are updated here with that same function.

``load_state_dict`` (and unpickling) starts a fresh run from the loaded
average at step ``n_averaged - 1``; an SWA average goes on there as a
``power`` profile with ``gamma = 0``, whose weight ``1 / (n + 1)`` is SWA's.
``SWALR`` is torch's own; ``update_bn`` is torch's, after reading the
server's average into an ``AveragedModel`` it is given (so the read does
not overwrite the statistics it recomputes).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import swa_utils as _torch
from torch.optim.swa_utils import SWALR

from ._remote import RemoteEma, canonical_keys

__all__ = [
    "SWALR",
    "AveragedModel",
    "get_ema_avg_fn",
    "get_ema_multi_avg_fn",
    "get_swa_avg_fn",
    "get_swa_multi_avg_fn",
    "update_bn",
]


def get_ema_multi_avg_fn(decay: float = 0.999) -> Callable[..., None]:
    """torch's, marked so that :class:`AveragedModel` keeps it on the server."""
    fn = _torch.get_ema_multi_avg_fn(decay)
    fn._polyak_profile = {"kind": "constant", "beta": float(decay)}  # type: ignore[attr-defined]
    return fn


def get_ema_avg_fn(decay: float = 0.999) -> Callable[..., torch.Tensor]:
    """torch's, marked so that :class:`AveragedModel` keeps it on the server."""
    fn = _torch.get_ema_avg_fn(decay)
    fn._polyak_profile = {"kind": "constant", "beta": float(decay)}  # type: ignore[attr-defined]
    return fn


def get_swa_multi_avg_fn() -> Callable[..., None]:
    """torch's, marked so that :class:`AveragedModel` keeps it on the server."""
    fn = _torch.get_swa_multi_avg_fn()
    fn._polyak_profile = {"kind": "swa"}  # type: ignore[attr-defined]
    return fn


def get_swa_avg_fn() -> Callable[..., torch.Tensor]:
    """torch's, marked so that :class:`AveragedModel` keeps it on the server."""
    fn = _torch.get_swa_avg_fn()
    fn._polyak_profile = {"kind": "swa"}  # type: ignore[attr-defined]
    return fn


def profile_of(fn: Callable[..., Any] | None) -> dict[str, Any] | None:
    """The server profile of an averaging function: ours carry it; torch's
    own are recognised by their name and the ``decay`` they close over.
    ``None``: a function the server cannot run."""
    if fn is None:
        return {"kind": "swa"}
    marked = getattr(fn, "_polyak_profile", None)
    if marked is not None:
        return dict(marked)
    qualname = getattr(fn, "__qualname__", "")
    if getattr(fn, "__module__", "") != _torch.__name__:
        return None
    if qualname in (
        "get_swa_multi_avg_fn.<locals>.swa_update",
        "get_swa_avg_fn.<locals>.swa_update",
    ):
        return {"kind": "swa"}
    if qualname in (
        "get_ema_multi_avg_fn.<locals>.ema_update",
        "get_ema_avg_fn.<locals>.ema_update",
    ):
        inner = inspect.unwrap(fn)  # torch.no_grad() wraps it
        cells = dict(zip(inner.__code__.co_freevars, inner.__closure__ or (), strict=True))
        if "decay" in cells:
            return {"kind": "constant", "beta": float(cells["decay"].cell_contents)}
    return None


def update_bn(loader: Any, model: nn.Module, device: int | torch.device | None = None) -> None:
    """torch's ``update_bn``; an :class:`AveragedModel` reads the server's
    average first, so the statistics it recomputes stay."""
    if isinstance(model, AveragedModel):
        model._refresh()
    _torch.update_bn(loader, model, device)


class AveragedModel(_torch.AveragedModel):
    """torch's ``AveragedModel`` with the average kept by a polyak server
    (see the module's docstring)."""

    def __init__(
        self,
        model: nn.Module,
        device: int | torch.device | None = None,
        avg_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | int], torch.Tensor]
        | None = None,
        multi_avg_fn: Callable[[Any, Any, torch.Tensor | int], None] | None = None,
        use_buffers: bool = False,
        *,
        url: str | None = None,
        token: str | None = None,
        run: str | None = None,
        pusher_options: Mapping[str, Any] | None = None,
        posthoc: int | None = None,
    ) -> None:
        super().__init__(model, device, avg_fn, multi_avg_fn, use_buffers)
        fn = multi_avg_fn if multi_avg_fn is not None else avg_fn
        profile = profile_of(fn)
        self._polyak_where = {"url": url, "token": token, "run": run, "posthoc": posthoc}
        self._polyak_options = dict(pusher_options or {})
        self._remote: RemoteEma | None = None
        if profile is None:
            warnings.warn(
                "polyak AveragedModel: a user-written avg_fn/multi_avg_fn cannot run on the "
                "server; this average is kept on the training process, as torch does",
                stacklevel=2,
            )
            self._profile = None
            return
        self._profile = profile
        self._remote = self._connect(profile)

    # -- what the server keeps -------------------------------------------

    def _pushed(self) -> tuple[list[str], list[str], list[str]]:
        """Local names pushed (every parameter and buffer, except integer
        buffers averaged here), those the server copies (buffers when
        ``use_buffers=False``), those kept here."""
        module = self._modules["module"]
        assert module is not None
        params = [n for n, _ in module.named_parameters()]
        buffers = list(module.named_buffers())
        if self.use_buffers:
            local = [n for n, b in buffers if not (b.is_floating_point() or b.is_complex())]
            return params + [n for n, _ in buffers if n not in local], [], local
        return params + [n for n, _ in buffers], [n for n, _ in buffers], []

    def _connect(self, profile: Mapping[str, Any]) -> RemoteEma:
        names, copied, local = self._pushed()
        canon = dict(zip(names + local, canonical_keys(names + local), strict=True))
        return RemoteEma(
            "AveragedModel",
            profile,
            url=self._polyak_where["url"],
            token=self._polyak_where["token"],
            run=self._polyak_where["run"],
            copy=[canon[n] for n in copied],
            pusher_options=self._polyak_options,
            posthoc=self._polyak_where.get("posthoc"),
        )

    def _order(self) -> list[str]:
        """Local names of every parameter then every buffer: the order in
        which torch pairs the average with the model."""
        module = self._modules["module"]
        assert module is not None
        return [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]

    def _model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's pushed tensors under the average's canonical names."""
        names, _, _ = self._pushed()
        order = self._order()
        theirs = [t for _, t in model.named_parameters()] + [b for _, b in model.named_buffers()]
        pair = dict(zip(order, theirs, strict=False))
        canon = dict(zip(order, canonical_keys(order), strict=True))
        return {canon[n]: pair[n].detach() for n in names}

    def _targets(self) -> dict[str, torch.Tensor]:
        """The average's own tensors, by canonical name (written in place)."""
        names, _, _ = self._pushed()
        module = self._modules["module"]
        assert module is not None
        mine = dict(module.named_parameters())
        mine.update(dict(module.named_buffers()))
        order = self._order()
        canon = dict(zip(order, canonical_keys(order), strict=True))
        return {canon[n]: mine[n].data for n in names}

    def _refresh(self) -> None:
        remote = self.__dict__.get("_remote")
        if remote is not None and remote.dirty:
            remote.read_into(self._targets())

    # -- torch's API ------------------------------------------------------

    @property
    def module(self) -> nn.Module:  # type: ignore[override]
        """The averaged module, holding the server's average (read now)."""
        self._refresh()
        module = self._modules["module"]
        assert module is not None
        return module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # nn.Module reaches its submodules through these two alone (parameters,
    # buffers, modules, children, ``_apply`` behind ``to``, ``apply``,
    # ``train``, and a parent's walk): the average is read before either.
    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        self._refresh()
        return super().named_modules(*args, **kwargs)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        self._refresh()
        return super().named_children()

    def update_parameters(self, model: nn.Module) -> None:
        """Pushes ``model`` as step ``n_averaged`` (torch's first update
        copies, every later one averages; the server does the same)."""
        if self._profile is None:
            super().update_parameters(model)
            return
        if self._remote is None:
            self._resume()
        assert self._remote is not None
        step = int(self.n_averaged.item())
        self._remote.push(self._model_state(model), step)
        self._update_local_integers(model, step)
        self.n_averaged += 1

    def _update_local_integers(self, model: nn.Module, step: int) -> None:
        """Integer buffers with ``use_buffers=True``: torch's own averaging
        function on them, here (see the module's docstring)."""
        _, _, local = self._pushed()
        if not local:
            return
        module = self._modules["module"]
        assert module is not None
        mine = dict(module.named_buffers())
        theirs = [t for _, t in model.named_parameters()] + [b for _, b in model.named_buffers()]
        pair = dict(zip(self._order(), theirs, strict=False))
        avg = [mine[n].detach() for n in local]
        cur = [pair[n].detach().to(mine[n].device) for n in local]
        with torch.no_grad():
            if step == 0:
                for a, c in zip(avg, cur, strict=True):
                    a.copy_(c)
            elif self.multi_avg_fn is not None or self.avg_fn is None:
                # torch's branches: the multi function, else SWA's foreach
                # form where foreach kernels exist, else its per-tensor form.
                n = self.n_averaged.to(avg[0].device)
                for a, c in zip(avg, cur, strict=True):
                    if self.multi_avg_fn is not None:
                        self.multi_avg_fn([a], [c], n)
                    elif a.device.type in _torch._get_foreach_kernels_supported_devices():
                        _torch.get_swa_multi_avg_fn()([a], [c], n)
                    else:
                        a.copy_(_torch.get_swa_avg_fn()(a, c, n))
            else:
                n = self.n_averaged.to(avg[0].device)
                for a, c in zip(avg, cur, strict=True):
                    a.copy_(self.avg_fn(a, c, n))

    def _resume(self) -> None:
        """A fresh run from the average held here (after ``load_state_dict``
        or unpickling), at step ``n_averaged - 1``."""
        assert self._profile is not None
        n = int(self.n_averaged.item())
        profile = dict(self._profile)
        if profile["kind"] == "swa" and n > 0:
            # EDM2's power EMA with gamma 0 weighs the push at step s by
            # 1 / (s + 1): SWA's 1 / (n + 1) without a count to restore.
            profile = {"kind": "power", "gamma": 0.0}
        if self._remote is None:
            self._remote = self._connect(profile)
            if n > 0:
                self._remote.push(self._targets(), n - 1)
        elif n > 0:
            self._remote.reseed(self._targets(), n - 1, profile)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._refresh()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        self._refresh()  # pending pushes land before they are replaced
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self._profile is not None:
            self._resume()
        return result

    def __getstate__(self) -> dict[str, Any]:
        self._refresh()
        state = dict(self.__dict__)
        state["_remote"] = None  # threads and sockets stay with this process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # The copy's next update starts a run of its own (a generated name).
        self._polyak_where = {**self._polyak_where, "run": None}
