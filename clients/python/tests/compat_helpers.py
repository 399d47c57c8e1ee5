"""What the drop-in tests share: a small model with float and integer
buffers, the same training steps for two copies, and the comparison."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models: one intra-op thread. Spinning pool threads on a busy
    machine make each step of these models tens of times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_model(seed: int = 0) -> nn.Module:
    """Parameters, float buffers (BatchNorm statistics) and an integer one
    (``num_batches_tracked``)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def twins(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """Two identical models: one for the original, one for the drop-in."""
    a = small_model(seed)
    return a, copy.deepcopy(a)


class Trainer:
    """SGD on a fixed stream of batches: every step changes the parameters
    and the BatchNorm buffers; two trainers of the same seed take the same
    steps."""

    def __init__(self, model: nn.Module, seed: int = 1, lr: float = 0.1) -> None:
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        x = torch.randn(16, 6, generator=self.gen) * 2 + 0.5
        y = torch.randn(16, 3, generator=self.gen)
        self.model.train()
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()


def steps(a: Trainer, b: Trainer, n: int) -> Iterator[int]:
    """``n`` identical training steps of both; yields after each."""
    for i in range(n):
        a.step()
        b.step()
        yield i


def assert_same(
    want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], rel: float = 1e-6
) -> None:
    """Every tensor of ``want`` in ``got``, equal to ``rel`` relative
    (integer tensors exactly)."""
    assert set(want) == set(got), (sorted(want), sorted(got))
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        if not w.is_floating_point():
            assert torch.equal(g, w), (name, g, w)
            continue
        scale = w.detach().abs().max().item()
        diff = (g.detach().double() - w.detach().double()).abs().max().item()
        assert diff <= rel * max(scale, 1e-3), f"{name}: max |diff| {diff:.3g} vs scale {scale:.3g}"


def assert_differs(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    """The comparison is not vacuous: the EMA is not the online model."""
    assert any(
        v.is_floating_point() and not torch.allclose(v, b[k], rtol=1e-4, atol=1e-5)
        for k, v in a.items()
    )
