"""Anchors for the reference tests, computed in the test process.

- ``ema_pytorch.EMA`` and ``torch.optim.swa_utils.AveragedModel`` as they are.
- EDM2's power-function and traditional (half-life) EMAs, written as in
  NVlabs/edm2 ``training/phema.py``: ``std_to_exp`` solves the cubic with
  ``np.roots``; the update is ``p_ema.copy_(p_net.lerp(p_ema, beta))``.
"""

from __future__ import annotations

import copy

import httpx
import numpy as np
import safetensors.torch
import torch
from torch import nn


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


class Trainer:
    """A real optimizer loop on random data; ``step()`` runs one update."""

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


def averaged_state(avg: torch.optim.swa_utils.AveragedModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in avg.module.state_dict().items()}


def ema_pytorch_state(ema) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ema.ema_model.state_dict().items()}


def push(client: httpx.Client, run: str, rank: int, step: int, state, metadata=None) -> dict:
    body = safetensors.torch.save({k: v.contiguous() for k, v in state.items()}, metadata=metadata)
    r = client.put(f"/v1/runs/{run}/ranks/{rank}/steps/{step}", content=body)
    assert r.status_code == 200, r.text
    return r.json()


def fetch_ema(client: httpx.Client, run: str, rank: int, profile: str) -> dict[str, torch.Tensor]:
    r = client.get(f"/v1/runs/{run}/ranks/{rank}/ema", params={"profile": profile})
    assert r.status_code == 200, r.text
    return safetensors.torch.load(r.content)


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
    """Float tensors within ``rtol`` (relative norm); integer tensors equal to
    the online model's (polyak copies them)."""
    assert set(got) == set(want), (label, set(got) ^ set(want))
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape, (label, k, g.shape, w.shape)
        if w.is_floating_point():
            assert g.dtype == torch.float32, (label, k, g.dtype)
            err = rel_err(g, w.float())
            assert err <= rtol, f"{label} {k}: relative error {err:.3e} > {rtol:g}"
        else:
            assert torch.equal(g, online[k]), (label, k, g, online[k])


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
