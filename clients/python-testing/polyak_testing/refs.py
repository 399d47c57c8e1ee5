"""Models, training loops and anchors shared by the tests (and the
processes they spawn).

Anchors are computed in the same process as the training they check:
``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn`` for
``constant`` profiles and ``ema_pytorch.EMA`` for ``warmup`` profiles, run
on an unsharded copy of the model (loaded with the gathered weights after
every optimizer step when the training is sharded); EDM2's power-function
and traditional (half-life) EMAs written as in NVlabs/edm2
``training/phema.py``: ``std_to_exp`` solves the cubic with ``np.roots``,
the update is ``p_ema.copy_(p_net.lerp(p_ema, beta))``.

Two models: :class:`TinyTransformer` (a language model whose dimensions
split unevenly over ranks, trained by :class:`Trainer`) for the client's
tests, :class:`SmallNet` (a classifier with a BatchNorm, trained by
:class:`SmallNetTrainer` and :class:`EmaTrainer`) for the server's, which
push raw safetensors bodies with :func:`push`.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import safetensors.torch
import torch
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 37, 12, 31, 7


class TinyTransformer(nn.Module):
    """One pre-norm attention block and MLP. The first dimensions (37, 7, 12,
    36, 31, 1) split unevenly over 2 ranks; ``gate`` has one row, so rank 1
    of an FSDP split holds none of it. Buffers: a float causal mask and an
    integer count of training forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.lnf = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.gate = nn.Parameter(torch.ones(1))
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ)))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.seen += 1
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        h = self.ln1(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        att = (q @ k.transpose(-1, -2)) / DIM**0.5
        t = idx.shape[1]
        att = att.masked_fill(self.mask[:t, :t] == 0, float("-inf")).softmax(-1)
        x = x + self.gate * self.proj(att @ v)
        x = x + self.fc2(torch.relu(self.fc1(self.ln2(x))))
        return self.head(self.lnf(x))


def batch(gen: torch.Generator, size: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, SEQ), generator=gen)


def lm_loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> float:
    loss = lm_loss(model, batch(gen))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def clone_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def averaged_state(avg) -> dict[str, torch.Tensor]:
    return clone_state(avg.module.state_dict())


def ema_pytorch_state(ema) -> dict[str, torch.Tensor]:
    return clone_state(ema.ema_model.state_dict())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    denom = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / denom if denom > 0 else num


def assert_state_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    online: dict[str, torch.Tensor],
    rtol: float = 1e-6,
    label: str = "",
) -> None:
    """Float tensors within ``rtol`` (norm of the difference over the norm of
    the anchor); integer tensors equal to the last pushed (online) value,
    since polyak copies them."""
    assert set(got) == set(want), (label, sorted(set(got) ^ set(want)))
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape, (label, k, g.shape, w.shape)
        if w.is_floating_point():
            assert g.dtype == torch.float32, (label, k, g.dtype)
            err = rel_err(g, w.float())
            assert err <= rtol, f"{label} {k}: relative error {err:.3e} > {rtol:g}"
        else:
            assert torch.equal(g, online[k]), (label, k, g, online[k])


def train_and_push(trainer: Trainer, pushers: list, steps: int) -> None:
    """``steps`` real optimizer steps, each pushed (steps 0..) by every
    pusher; then every pusher is flushed."""
    for step in range(steps):
        trainer.step()
        for p in pushers:
            p.push(trainer.model, step)
    for p in pushers:
        p.flush()


class Trainer:
    """One process, one real AdamW loop on :class:`TinyTransformer`."""

    def __init__(self, seed: int = 0, model: nn.Module | None = None) -> None:
        torch.manual_seed(seed)
        self.model = model if model is not None else TinyTransformer()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=2e-2, weight_decay=0.01)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def step(self) -> float:
        return train_step(self.model, self.opt, self.gen)

    def state(self) -> dict[str, torch.Tensor]:
        return clone_state(self.model.state_dict())

    def checkpoint(self) -> dict[str, Any]:
        """What a trainer saves to restart from this step: weights,
        optimizer state and the data generator's position."""
        opt = self.opt.state_dict()
        return {
            "model": self.state(),
            "opt": {
                "state": {
                    i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                    for i, st in opt["state"].items()
                },
                "param_groups": opt["param_groups"],
            },
            "gen": self.gen.get_state(),
        }

    def restore(self, ckpt: dict[str, Any]) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.gen.set_state(ckpt["gen"])


@contextlib.contextmanager
def copies_held_until_waited(timeout: float = 60.0) -> Iterator[dict[str, int]]:
    """Holds every deferred parameter copy of a pusher until a thread waits
    for that pusher's copies (``Pusher.wait_copied``: the optimizer
    pre-step hook of ``attach``; or ``flush``). Each copy then runs after
    the next forward and backward (when buffers have changed) and right
    before the next step, which must wait for it: an exactness check under
    the slowest possible copier, with no timing involved. Yields counts:
    ``released`` copies, and ``timed_out`` ones that nobody waited for
    within ``timeout``."""
    from polyak._push.copier import CopyThread
    from polyak.pusher import Pusher

    # Keyed by the pusher's copy thread: its waits release its copies.
    waiting: collections.defaultdict[int, threading.Event] = collections.defaultdict(
        threading.Event
    )
    counts = {"released": 0, "timed_out": 0}
    wait_copied, flush, copy_deferred = Pusher.wait_copied, Pusher.flush, CopyThread._copy

    def waiting_for(method):
        def wrapper(self, *args, **kwargs):
            waiting[id(self._copier)].set()
            try:
                return method(self, *args, **kwargs)
            finally:
                waiting[id(self._copier)].clear()

        return wrapper

    def held_copy(self, job):
        if waiting[id(self)].wait(timeout):
            counts["released"] += 1
        else:
            counts["timed_out"] += 1
        return copy_deferred(self, job)

    Pusher.wait_copied = waiting_for(wait_copied)
    Pusher.flush = waiting_for(flush)
    CopyThread._copy = held_copy
    try:
        yield counts
    finally:
        Pusher.wait_copied, Pusher.flush, CopyThread._copy = (
            wait_copied,
            flush,
            copy_deferred,
        )


class SmallNet(nn.Module):
    """Embedding, Linear, LayerNorm, BatchNorm (with num_batches_tracked)."""

    def __init__(self, vocab: int = 40, dim: int = 16, hidden: int = 24, classes: int = 5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).mean(1)
        x = torch.relu(self.ln(self.fc1(x)))
        return self.fc2(self.bn(x))


class SmallNetTrainer:
    """One real AdamW loop on :class:`SmallNet` classifying random data;
    ``step()`` runs one update."""

    def __init__(self, seed: int = 0, lr: float = 3e-2):
        torch.manual_seed(seed)
        self.model = SmallNet()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def step(self) -> float:
        idx = torch.randint(0, 40, (32, 6), generator=self.gen)
        target = torch.randint(0, 5, (32,), generator=self.gen)
        loss = nn.functional.cross_entropy(self.model(idx), target)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


class EmaTrainer:
    """A real optimizer loop beside one ``AveragedModel`` EMA per profile
    (``betas``: name -> beta) of what it pushes. ``step()`` trains once and
    returns the state dict to push; with ``cast`` the floating point
    tensors are pushed (and averaged) rounded to that dtype, as a bf16
    trainer sends them. ``want()``: every profile's reference state now."""

    def __init__(
        self,
        seed: int,
        betas: dict[str, float],
        *,
        cast: torch.dtype | None = None,
        vocab: int = 40,
        **net: int,
    ):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        torch.manual_seed(seed)
        self.vocab = vocab
        self.model = SmallNet(vocab=vocab, **net)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2)
        self.gen = torch.Generator().manual_seed(seed + 7)
        self.cast = cast
        # The model as pushed (cast and back), which the references average.
        self.pushed = copy.deepcopy(self.model)
        self.refs = {
            name: AveragedModel(
                self.pushed, multi_avg_fn=get_ema_multi_avg_fn(beta), use_buffers=True
            )
            for name, beta in betas.items()
        }

    def step(self) -> dict[str, torch.Tensor]:
        idx = torch.randint(0, self.vocab, (16, 6), generator=self.gen)
        target = torch.randint(0, 5, (16,), generator=self.gen)
        loss = nn.functional.cross_entropy(self.model(idx), target)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.cast is not None:
            state = {k: v.to(self.cast) if v.is_floating_point() else v for k, v in state.items()}
        self.pushed.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        )
        for ref in self.refs.values():
            ref.update_parameters(self.pushed)
        return state

    def want(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: averaged_state(ref) for name, ref in self.refs.items()}


def std_to_exp(std: float) -> float:
    """EDM2 ``phema.std_to_exp``."""
    tmp = np.float64(std) ** -2
    return float(np.roots([1, 7, 16 - tmp, 12 - tmp]).real.max())


class Edm2Ema:
    """EDM2 EMA over a state dict: float tensors averaged, others copied."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.ema = {k: v.clone() for k, v in state.items()}

    def update(self, state: dict[str, torch.Tensor], beta: float) -> None:
        for k, p_net in state.items():
            p_ema = self.ema[k]
            if p_net.is_floating_point():
                p_ema.copy_(p_net.lerp(p_ema, beta))
            else:
                p_ema.copy_(p_net)


def power_beta(gamma: float, t: float, delta: float) -> float:
    """``phema.power_function_beta`` with t_next = t, t_delta = delta."""
    return (1 - delta / t) ** (gamma + 1)


def half_life_beta(steps: float, rampup_ratio: float | None, t: float, delta: float) -> float:
    """``phema.TraditionalEMA.update``."""
    h = steps
    if rampup_ratio is not None:
        h = min(h, t * rampup_ratio)
    return 0.5 ** (delta / max(h, 1e-8))


def push(client: httpx.Client, run: str, rank: int, step: int, state, metadata=None) -> dict:
    body = safetensors.torch.save({k: v.contiguous() for k, v in state.items()}, metadata=metadata)
    r = client.put(f"/v1/runs/{run}/ranks/{rank}/steps/{step}", content=body)
    assert r.status_code == 200, r.text
    return r.json()


def fetch_ema(client: httpx.Client, run: str, rank: int, profile: str) -> dict[str, torch.Tensor]:
    r = client.get(f"/v1/runs/{run}/ranks/{rank}/ema", params={"profile": profile})
    assert r.status_code == 200, r.text
    return safetensors.torch.load(r.content)
