"""``ema_pytorch.EMA`` and ``PostHocEMA`` with the EMAs kept by polyak.

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

``PostHocEMA`` takes all of ema-pytorch's arguments (its ``KarrasEMA``
ones as keywords). Each of its EMAs (``ema_models``) is one ``karras``
profile of one run (``ema``, ``ema1``, ...): ema-pytorch's
``(1 - 1/(step + 2))^(gamma + 1)`` every ``update_every`` steps, the
gammas from ema-pytorch's own ``sigma_rel_to_gamma``. ``update()`` pushes
the online model once for all of them. ``checkpoint()`` (every
``checkpoint_every_num_steps`` updates, or by hand) asks the server for a
snapshot at the step ema-pytorch names the file by (a push marks that step
when it is not an update step; the profiles leave their EMA as it is), so
the synthesis uses the same times. Nothing is written to
``checkpoint_folder``. ``synthesize_ema_model(sigma_rel=|gamma=, step=)``
is the server's post-hoc synthesis solved as ema-pytorch solves it
(``method="ema_pytorch"``: every checkpoint, also those after ``step``,
float32 exponents, weights as solved) from the checkpoints rounded to
``checkpoint_dtype`` (``float16`` by default, ``bfloat16``; others are
exact), into a new ema-pytorch ``KarrasEMA`` whose averaged tensors hold
the result; ema-pytorch accumulates the weighted sum in float32, the server
in float64, so the two agree to float32 round-off of that sum.
Names in ``param_or_buffer_names_no_ema`` and ``ignore_names`` /
``ignore_startswith_names`` and integer buffers stay on the trainer (as
ema-pytorch copies or keeps them).

The run stands where ema-pytorch's checkpoint folder does: ``state_dict``
holds ema-pytorch's keys (each EMA's ``step``, ``initted`` and module) and
``_extra_state`` naming the run; ``load_state_dict`` into a new object
goes on in that run (its checkpoints and the new ones are synthesised
together, as ema-pytorch's folder keeps its files), after rolling the run
back (``resume``) to a checkpoint taken since the state's last update when
the trainer went on past the state. ``ema_models[i].update()`` is served
when every EMA is updated once per step (the last of each round pushes);
``copy_params_from_model_to_ema`` before the first update. Not served, and
raising: a state dict without the run (ema-pytorch's own), a run that went
on past the state with no checkpoint to go back to, EMAs at different
steps (one updated again before the others), and
``copy_params_from_model_to_ema`` after the first update (it would reset
the server's EMAs and lose their checkpoints).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from ema_pytorch import EMA as _EMA
from ema_pytorch import PostHocEMA as _PostHocEMA
from ema_pytorch.post_hoc_ema import KarrasEMA as _KarrasEMA
from ema_pytorch.post_hoc_ema import sigma_rel_to_gamma
from torch import nn

from ..errors import PolyakError
from ._remote import PROFILE, READ_TIMEOUT, RemoteEma, canonical_keys

__all__ = ["EMA", "PostHocEMA"]


def _tensors(
    owner: Any, module: nn.Module, local: Callable[[str], bool]
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of ``module`` that ema-pytorch's ``owner`` (``EMA``
    or ``KarrasEMA``) handles, in its order, less the names it keeps
    locally (``local``)."""
    return [
        (n, t)
        for n, t in [*owner.get_params_iter(module), *owner.get_buffers_iter(module)]
        if not local(n)
    ]


def _by_canonical_name(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors' data under the names the server keeps them by."""
    return dict(
        zip(canonical_keys([n for n, _ in tensors]), [t.data for _, t in tensors], strict=True)
    )


def _paired(owner: Any, ema: nn.Module, online: nn.Module) -> Any:
    """((name, EMA tensor), (name, online tensor)) in ema-pytorch's order."""
    return zip(
        [*owner.get_params_iter(ema), *owner.get_buffers_iter(ema)],
        [*owner.get_params_iter(online), *owner.get_buffers_iter(online)],
        strict=True,
    )


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
        posthoc: int | None = None,
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
            posthoc=posthoc,
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
        return _tensors(self, module, self._ignored)

    def _targets(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return _by_canonical_name(self._served(module))

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
        for (name, mine), (_, theirs) in _paired(self, ema, self.model):
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


# -- PostHocEMA -------------------------------------------------------------

#: ema-pytorch's ``checkpoint_dtype`` -> the server's ``source_dtype``
#: (other dtypes hold float32 values exactly).
_SOURCE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

#: The profile the server stores a synthesis under.
_SYNTHESIZED = "posthoc"

#: The key of ``PostHocEMA``'s ``_extra_state`` naming its run.
_RUN_KEY = "polyak_run"

#: Snapshot kinds a run can be resumed from (not derived ones).
_RESTORABLE = ("manual", "periodic", "state")


def _profile_name(index: int) -> str:
    return PROFILE if index == 0 else f"{PROFILE}{index}"


def _settled(run: Any, applied: int) -> list[dict[str, Any]]:
    """``run``'s complete snapshots once those of the steps it applied
    are written (a checkpoint asked for just before a trainer stopped)."""
    out = []
    for snap in run.snapshots():
        if snap["status"] == "pending" and int(snap["step"]) <= applied:
            try:
                snap = run.wait_snapshot(snap, timeout=READ_TIMEOUT)
            except PolyakError:
                continue  # failed: not a checkpoint
        if snap["status"] == "complete":
            out.append(snap)
    return out


def gamma_to_sigma_rel(gamma: float) -> float:
    """EDM2 ``exp_to_std``: the relative standard deviation of the power
    profile of exponent ``gamma``."""
    gamma = float(gamma)
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


class KarrasEMA(_KarrasEMA):
    """One EMA of a :class:`PostHocEMA` (its ``ema_models``, made by it):
    ema-pytorch's ``KarrasEMA`` whose ``ema_model`` holds the server's EMA
    of one profile of the ``PostHocEMA``'s run (read when used)."""

    def __init__(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_remote"] = None
        self.__dict__["_read_at"] = None
        #: The PostHocEMA holding this one (a weak reference: it holds us).
        self.__dict__["_owner"] = None
        super().__init__(model, *args, **kwargs)
        self._profile = PROFILE

    @property
    def ema_model(self) -> nn.Module | None:  # type: ignore[override]
        """The EMA module, holding the server's EMA (read now)."""
        module = self._modules.get("ema_model")
        remote = self.__dict__.get("_remote")
        if module is not None and remote is not None and remote.last_step is not None:
            self._holder()._check_in_step("read one of ema_models")
            if self.__dict__["_read_at"] != remote.last_step:
                remote.read_into(self._targets(module), self._profile)
                self.__dict__["_read_at"] = remote.last_step
        return module

    @ema_model.setter
    def ema_model(self, value: nn.Module | None) -> None:
        self._modules["ema_model"] = value

    def _kept_here(self, name: str) -> bool:
        """Names ema-pytorch copies (``param_or_buffer_names_no_ema``) or
        leaves (``ignore_*``) rather than averages."""
        return (
            name in self.ignore_names
            or any(name.startswith(p) for p in self.ignore_startswith_names)
            or name in self.param_or_buffer_names_no_ema
        )

    def _averaged(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of what the server averages, in ema-pytorch's order."""
        return _tensors(self, module, self._kept_here)

    def _targets(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return _by_canonical_name(self._averaged(module))

    def _holder(self) -> PostHocEMA:
        owner = self.__dict__["_owner"]
        holder = owner() if owner is not None else None
        if holder is None:
            raise RuntimeError("polyak's KarrasEMA is made and updated by a PostHocEMA")
        return holder

    def _advance(self) -> bool:
        """ema-pytorch's ``update`` less the averaging: the step count, the
        first copy, the copies of ``param_or_buffer_names_no_ema``. True
        when the step updates the EMA."""
        step = int(self.step.item())
        self.step += 1
        if step % self.update_every != 0:
            return False
        ema = self._modules["ema_model"]
        assert ema is not None
        if not self.initted.item():
            self._copy_online()
            self.initted.data.copy_(torch.tensor(True))
        if self.frozen:
            return True
        for (name, mine), (_, theirs) in _paired(self, ema, self.model):
            if name in self.param_or_buffer_names_no_ema:
                self.inplace_copy(mine.data, theirs.data)
        return True

    def _copy_online(self) -> None:
        # The first update's copy: made on the module itself (the server's
        # first push copies too).
        ema = self._modules["ema_model"]
        assert ema is not None
        for (_, mine), (_, theirs) in _paired(self, ema, self.model):
            self.inplace_copy(mine.data, theirs.data)

    def copy_params_from_model_to_ema(self) -> None:
        """ema-pytorch's copy of the online model into the EMA: served
        until the first push (see ``PostHocEMA.copy_params_from_model_to_ema``)."""
        self._holder()._check_unpushed("copy_params_from_model_to_ema")
        self._copy_online()

    def update(self) -> None:
        """ema-pytorch's ``KarrasEMA.update``, served when every one of the
        ``PostHocEMA``'s EMAs is updated once per step (the server's EMAs
        of one run take one push together): the last of them to be updated
        pushes the online model."""
        self._holder()._update_one(self)


class PostHocEMA(_PostHocEMA):
    """ema-pytorch's ``PostHocEMA`` with its EMAs kept, checkpointed and
    synthesised by a polyak server (see the module's docstring)."""

    def __init__(
        self,
        model: nn.Module,
        ema_model: Callable[[], nn.Module] | None = None,
        sigma_rels: tuple[float, ...] | None = None,
        gammas: tuple[float, ...] | None = None,
        checkpoint_every_num_steps: int | Literal["manual"] = 1000,
        checkpoint_folder: str = "./post-hoc-ema-checkpoints",
        checkpoint_dtype: torch.dtype = torch.float16,
        *,
        url: str | None = None,
        token: str | None = None,
        run: str | None = None,
        pusher_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # ema-pytorch's __init__ less the checkpoint folder: the
        # checkpoints are the server's snapshots.
        nn.Module.__init__(self)
        assert (sigma_rels is not None) ^ (gammas is not None)
        if sigma_rels is not None:
            gammas = tuple(map(sigma_rel_to_gamma, sigma_rels))
        assert gammas is not None
        assert len(gammas) > 1, (
            "at least 2 ema models with different gammas in order to synthesize new ema "
            "models of a different gamma"
        )
        assert len(set(gammas)) == len(gammas), "calculated gammas must be all unique"
        self.maybe_ema_model = ema_model
        self.gammas = gammas
        self.num_ema_models = len(gammas)
        self._model = [model]
        self.ema_models = nn.ModuleList(
            [KarrasEMA(model, ema_model=ema_model, gamma=gamma, **kwargs) for gamma in gammas]
        )
        self.checkpoint_folder = Path(checkpoint_folder)
        self.checkpoint_every_num_steps = checkpoint_every_num_steps
        self.checkpoint_dtype = checkpoint_dtype
        self.ema_kwargs = kwargs
        specs = [
            {
                "kind": "karras",
                "gamma": float(m.gamma),
                "update_every": int(m.update_every),
                "frozen": bool(m.frozen),
            }
            for m in self.ema_models
        ]
        self._remote = RemoteEma(
            "PostHocEMA",
            specs[0],
            url=url,
            token=token,
            run=run,
            # The run applies every push; the profiles skip the steps
            # between updates (a push there marks a checkpoint's step).
            update_every=1,
            pusher_options=pusher_options,
            more={_profile_name(i): spec for i, spec in enumerate(specs) if i > 0},
        )
        for i, m in enumerate(self.ema_models):
            m._remote = self._remote
            m._profile = _profile_name(i)
            m.__dict__["_owner"] = weakref.ref(self)
        #: Checkpoint snapshots asked for and not yet seen complete.
        self._pending: list[dict[str, Any]] = []

    def _online_state(self) -> dict[str, torch.Tensor]:
        """The online model's averaged tensors under the EMA module's
        canonical names (paired in order, as ema-pytorch pairs them)."""
        first: KarrasEMA = self.ema_models[0]  # type: ignore[assignment]
        ema = first._modules["ema_model"]
        assert ema is not None
        names = [n for n, _ in first._averaged(ema)]
        theirs = [t.detach() for _, t in first._averaged(self.model)]
        return dict(zip(canonical_keys(names), theirs, strict=True))

    def _counts(self) -> list[int]:
        return [int(m.step.item()) for m in self.ema_models]

    def _check_in_step(self, what: str) -> None:
        """The EMAs have taken the same number of updates (between two
        rounds of ``ema_models[i].update()``), else ``what`` cannot be
        served: the server's EMAs took the round's push together or not."""
        counts = self._counts()
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"cannot {what} while ema_models are at different steps {counts}: polyak "
                "updates them together; update each of them once (or call PostHocEMA.update())"
            )

    def _check_unpushed(self, what: str) -> None:
        if self._remote.last_step is not None:
            raise NotImplementedError(
                f"polyak's PostHocEMA serves {what} only before its first update: the server's "
                "EMAs go on from their first copy, and setting them again would lose the "
                "checkpoints already taken"
            )

    def _update_one(self, m: KarrasEMA) -> None:
        """``ema_models[i].update()``: one EMA steps; the last of a round
        pushes for all (ema-pytorch's EMAs would each average the online
        model as it is then; it has not changed within the round)."""
        counts = self._counts()
        if int(m.step.item()) > min(counts):
            raise NotImplementedError(
                f"an EMA of polyak's PostHocEMA updated again before the others (steps {counts}): "
                "the server's EMAs of one run take every push together; update each of "
                "ema_models once per step (or call PostHocEMA.update())"
            )
        step = int(m.step.item())
        updated = m._advance()
        if updated and len(set(self._counts())) == 1:
            self._remote.push(self._online_state(), step)

    def update(self) -> None:
        """ema-pytorch's ``update``: every EMA steps; on an update step the
        online model is pushed once for all of them; every
        ``checkpoint_every_num_steps`` updates, a checkpoint."""
        self._check_in_step("update()")
        step = int(self.step.item())
        updates = [m._advance() for m in self.ema_models]  # type: ignore[operator]
        if any(updates):
            self._remote.push(self._online_state(), step)
        if self.checkpoint_every_num_steps == "manual":
            return
        if int(self.step.item()) % self.checkpoint_every_num_steps == 0:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Asks the server for a snapshot of every EMA as it is after the
        updates so far, at the step ema-pytorch would name the checkpoint
        file by (its ``step``: updates so far); it is written while
        training goes on."""
        self._check_in_step("checkpoint()")
        count = int(self.step.item())
        if count == 0:
            raise ValueError("PostHocEMA.checkpoint() before the first update(): nothing averaged")
        step = count - 1
        remote = self._remote
        if remote.last_step is None or remote.last_step < step:
            # Not an update step: the karras profiles leave their EMAs as
            # they are; the push makes the run's step the checkpoint's.
            remote.push(self._online_state(), step)
        # A cut at a step the run has not applied yet waits for it: the
        # trainer goes on while the push and the snapshot are written.
        self._pending.append(
            remote.run.snapshot(step, wait=False, label=f"PostHocEMA checkpoint {count}")
        )

    def copy_params_from_model_to_ema(self) -> None:
        """ema-pytorch's copy of the online model into every EMA: served
        before the first update (e.g. after loading weights into the
        model), when the EMAs are still only local; after it, the server's
        EMAs cannot be set again without losing their checkpoints: raises."""
        self._check_unpushed("copy_params_from_model_to_ema")
        for m in self.ema_models:
            m._copy_online()  # type: ignore[operator]

    def copy_params_from_ema_to_model(self) -> None:
        for m in self.ema_models:
            _ = m.ema_model  # the server's EMA into the module first
            m.copy_params_from_ema_to_model()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        for m in self.ema_models:
            _ = m.ema_model
        return super().state_dict(*args, **kwargs)

    # The run stands where ema-pytorch's checkpoint folder does: a state
    # dict names it (``_extra_state``), and loading one goes on in it.

    def get_extra_state(self) -> dict[str, str]:
        return {_RUN_KEY: self._remote.name}

    def set_extra_state(self, state: Any) -> None:
        pass  # read (and acted on) before anything loads: _load_from_state_dict

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Called by load_state_dict, also of a module holding this one,
        # before the EMAs' step, initted and tensors load: the server goes
        # back first, so a refusal leaves everything as it was.
        extra = state_dict.get(f"{prefix}_extra_state")
        run = extra.get(_RUN_KEY) if isinstance(extra, Mapping) else None
        if not isinstance(run, str):
            raise ValueError(
                "polyak's PostHocEMA resumes from its own state_dict(), which names the run "
                f"holding the EMAs and their checkpoints ({prefix}_extra_state); this one does "
                "not (ema-pytorch's own cannot seed the server's EMAs)"
            )
        try:
            counts = {
                int(state_dict[f"{prefix}ema_models.{i}.step"]) for i in range(len(self.ema_models))
            }
        except KeyError as e:
            raise ValueError(f"the state dict lacks {e.args[0]}") from None
        if len(counts) != 1:
            raise ValueError(
                f"the state dict's EMAs are at different steps {sorted(counts)}: the server "
                "updates all of them together"
            )
        self._resume(run, counts.pop())
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _settle(self) -> None:
        """Every push acknowledged and every checkpoint asked for written."""
        remote = self._remote
        if remote.last_step is not None:
            remote.pusher.flush(READ_TIMEOUT)
        for snap in self._pending:
            remote.run.wait_snapshot(snap)
        self._pending.clear()

    def _resume(self, run: str, count: int) -> None:
        """Goes on in ``run`` from a state saved after ``count`` updates:
        the run as it was then (when it went on past that, rolled back with
        ``resume`` to the newest checkpoint since the state's last update;
        the checkpoints after it stay, as ema-pytorch's files do until it
        writes them again), then pushes continue there."""
        remote = self._remote
        self._settle()
        if count == 0:
            # Saved before the first update: nothing of it is on a server.
            if remote.last_step is not None:
                raise ValueError(
                    "the state dict is from before the first update: polyak's PostHocEMA "
                    "cannot reset the EMAs it already pushed"
                )
            return
        last = count - 1  # the step of the state's last update() (0-based)
        every = int(self.ema_models[0].update_every)
        averaged = last - last % every  # the last step its EMAs changed
        found = remote.client.run(run)
        applied = found.rank(0).get("last_step")
        if applied is None or int(applied) < averaged:
            raise ValueError(
                f"run {run} has applied {'nothing' if applied is None else f'step {applied}'}, "
                f"older than the state dict's last update (step {averaged}): it cannot be "
                "resumed from this state"
            )
        back_to: int | None = None
        if int(applied) > last:
            # The trainer went on after the state was saved: back to a
            # checkpoint holding the state's EMAs (none changed after
            # ``averaged``).
            steps = [
                int(s["step"])
                for s in _settled(found, int(applied))
                if s["kind"] in _RESTORABLE and averaged <= int(s["step"]) <= last
            ]
            if not steps:
                raise PolyakError(
                    f"run {run} went on to step {applied} after the state dict's step {last}, "
                    f"and has no checkpoint from steps {averaged}..={last} to go back to: "
                    "save the state right after a checkpoint()",
                    code="snapshot_older",
                )
            back_to = max(steps)
        remote.attach(run)
        if back_to is not None:
            remote.run.resume(step=back_to)
            applied = back_to
        remote.last_step = int(applied)
        for m in self.ema_models:
            m.__dict__["_read_at"] = None  # read the server's EMA when next used

    def synthesize_ema_model(
        self,
        gamma: float | None = None,
        sigma_rel: float | None = None,
        step: int | None = None,
    ) -> _KarrasEMA:
        """ema-pytorch's ``synthesize_ema_model``, computed by the server
        from its checkpoints (``step``: an update count up to the newest
        checkpoint's, default that one). Returns ema-pytorch's own
        ``KarrasEMA``, not tied to the server."""
        assert (gamma is not None) ^ (sigma_rel is not None)
        if sigma_rel is not None:
            gamma = sigma_rel_to_gamma(sigma_rel)
        else:
            sigma_rel = gamma_to_sigma_rel(gamma)  # type: ignore[arg-type]
        remote = self._remote
        remote.pusher.flush(READ_TIMEOUT)
        for snap in self._pending:
            remote.run.wait_snapshot(snap)
        self._pending.clear()
        if step is not None and int(step) < 1:
            raise PolyakError(f"step: {step} is before the first update", code="invalid_request")
        row = remote.run.posthoc(
            float(sigma_rel),  # type: ignore[arg-type]
            step=None if step is None else int(step) - 1,
            name=_SYNTHESIZED,
            method="ema_pytorch",
            source_dtype=_SOURCE_DTYPES.get(self.checkpoint_dtype),
        )
        try:
            tensors = remote.run.download(row, _SYNTHESIZED, progress=False)
        finally:
            # The result lives on in the returned module; the derived
            # snapshot would only take room.
            remote.run.delete_snapshot(row)
        synthesized = _KarrasEMA(
            model=self.model, ema_model=self.maybe_ema_model, gamma=gamma, **self.ema_kwargs
        )
        # Placed as KarrasEMA does it (the synthesis never copies ignored
        # names: they stay the online model's).
        helper: KarrasEMA = self.ema_models[0]  # type: ignore[assignment]
        with torch.no_grad():
            for name, t in helper._targets(synthesized.ema_model).items():
                t.copy_(tensors[name])
        return synthesized
