"""Every way torch exposes an ``AveragedModel``'s average holds the
server's average right after ``update_parameters``: each view is the first
read after the updates (nothing read the average before it), and equals
torch's own ``AveragedModel`` computed in the same test."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from compat_helpers import Trainer, assert_same, one_thread, steps, twins  # noqa: F401 (autouse)
from polyak.compat import swa_utils as ours
from torch import nn
from torch.optim import swa_utils as theirs

N = 7


def by_name(pairs) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in pairs}


def modules_state(avg: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of each submodule reached through ``modules()``."""
    out = {}
    for i, m in enumerate(avg.modules()):
        for name, t in m.named_parameters(recurse=False):
            out[f"{i}.{name}"] = t.detach().clone()
        for name, t in m.named_buffers(recurse=False):
            out[f"{i}.{name}"] = t.detach().clone()
    return out


def children_state(avg: nn.Module) -> dict[str, torch.Tensor]:
    """``children()``: the one child, ``module``, read through its own
    ``state_dict`` (no method of the AveragedModel itself)."""
    (child,) = list(avg.children())
    return {k: v.clone() for k, v in nn.Module.state_dict(child).items()}


def forward_out(avg: nn.Module) -> dict[str, torch.Tensor]:
    """Calling the object (in training mode: ``eval()`` walks the children,
    a view of its own)."""
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return {"out": avg(x)}


VIEWS: dict[str, Callable[[nn.Module], dict[str, torch.Tensor]]] = {
    "parameters": lambda a: {str(i): p.detach().clone() for i, p in enumerate(a.parameters())},
    "named_parameters": lambda a: by_name(a.named_parameters()),
    "buffers": lambda a: {str(i): b.detach().clone() for i, b in enumerate(a.buffers())},
    "named_buffers": lambda a: by_name(a.named_buffers()),
    "state_dict": lambda a: {k: v.clone() for k, v in a.state_dict().items()},
    "module": lambda a: by_name(a.module.named_parameters()),
    "call": forward_out,
    "to_float64": lambda a: by_name(a.to(torch.float64).named_parameters()),
    "modules": modules_state,
    "children": children_state,
    "deepcopy": lambda a: by_name(copy.deepcopy(a).named_parameters()),
}


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("kind", ["swa", "ema"])
def test_every_view_holds_the_servers_average(server, view, kind):
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    kw_theirs = {} if kind == "swa" else {"multi_avg_fn": theirs.get_ema_multi_avg_fn(0.8)}
    kw_ours = {} if kind == "swa" else {"multi_avg_fn": ours.get_ema_multi_avg_fn(0.8)}
    want = theirs.AveragedModel(ma, **kw_theirs)
    got = ours.AveragedModel(mb, **kw_ours, url=server.url)
    assert got._remote is not None
    for _ in steps(ta, tb, N):
        want.update_parameters(ma)
        got.update_parameters(mb)
    assert got._remote.dirty  # nothing read the average since the updates
    read = VIEWS[view]
    expected, seen = read(want), read(got)
    # The first copy (what a stale view holds) is far from the average.
    first = twins()[0]
    stale = by_name(first.named_parameters())
    average = by_name(want.module.named_parameters())
    assert max((stale[n] - average[n]).abs().max().item() for n in stale) > 0.05
    assert_same(expected, seen)
