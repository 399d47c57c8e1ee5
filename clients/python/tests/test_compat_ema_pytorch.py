"""``polyak.compat.ema_pytorch.EMA`` against ema-pytorch 0.8.3's own,
computed in the same test: twin models, the same steps, every schedule
argument that changes the numbers."""

from __future__ import annotations

import pytest
import torch
from compat_helpers import Trainer, assert_differs, assert_same, one_thread, steps, twins  # noqa: F401 (autouse)
from ema_pytorch import EMA as Original
from polyak.compat.ema_pytorch import EMA

N = 55

CASES = {
    "warmup": {"beta": 0.99, "update_after_step": 5, "update_every": 1},
    "every-3-gamma-power-min": {
        "beta": 0.995,
        "update_after_step": 10,
        "update_every": 3,
        "inv_gamma": 2.0,
        "power": 0.75,
        "min_value": 0.3,
    },
    "no-ema-and-ignored-names": {
        "beta": 0.9,
        "update_after_step": 4,
        "update_every": 2,
        "param_or_buffer_names_no_ema": {"3.bias", "1.running_var"},
        "ignore_names": {"0.bias"},
        "ignore_startswith_names": {"1.running_m"},
    },
    "frozen": {"beta": 1.0, "update_after_step": 3, "update_every": 1},
    "hare-tortoise": {
        "beta": 0.9,
        "update_after_step": 2,
        "update_every": 1,
        "update_model_with_ema_every": 7,
        "update_model_with_ema_beta": 0.5,
    },
    "defaults": {},
}


@pytest.mark.parametrize("case", list(CASES))
def test_ema_equals_ema_pytorch(server, case):
    kw = CASES[case]
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    want = Original(ma, **kw)
    got = EMA(mb, **kw, url=server.url)
    for _ in steps(ta, tb, N):
        want.update()
        got.update()
    assert int(got.step) == int(want.step) == N
    assert_same(want.ema_model.state_dict(), got.ema_model.state_dict())
    assert_same(ma.state_dict(), mb.state_dict())  # hare and tortoise changed both alike
    if case not in ("frozen", "defaults"):
        assert_differs(want.ema_model.state_dict(), ma.state_dict())
    assert got.get_current_decay() == want.get_current_decay()

    # Resume: state_dict -> a new instance -> load_state_dict -> more updates.
    again = EMA(mb, **kw, url=server.url)
    again.load_state_dict(got.state_dict())
    for _ in steps(ta, tb, 13):
        want.update()
        again.update()
    assert_same(want.state_dict(), again.state_dict())


def test_reads_update_the_tensors_callers_hold(server):
    ma, _ = twins()
    t = Trainer(ma)
    ema = EMA(ma, beta=0.9, update_after_step=0, update_every=1, url=server.url)
    held = ema.ema_model[0].weight
    for _ in range(6):
        t.step()
        ema.update()
    before = held.clone()
    for _ in range(3):
        t.step()
        ema.update()
    out = ema(torch.ones(4, 6))  # __call__ reads the server's EMA first
    assert ema.ema_model[0].weight is held
    assert not torch.equal(before, held)
    assert out.shape == (4, 3)


def test_optimizer_post_step_hook_and_copy_back(server):
    ma, mb = twins()
    kw = {
        "beta": 0.9,
        "update_after_step": 1,
        "update_every": 1,
        "forward_method_names": ("forward",),
    }
    want = Original(ma, **kw)
    got = EMA(mb, **kw, url=server.url)
    ta, tb = Trainer(ma), Trainer(mb)
    want.add_to_optimizer_post_step_hook(ta.opt)
    got.add_to_optimizer_post_step_hook(tb.opt)
    for _ in steps(ta, tb, 12):
        pass
    assert int(got.step) == 12
    x = torch.randn(5, 6)
    # A forward method named in forward_method_names reads the server's EMA.
    want.ema_model.eval()
    got.ema_model.eval()
    torch.testing.assert_close(got.forward(x), want.forward(x), rtol=1e-5, atol=1e-6)
    want.copy_params_from_ema_to_model()
    got.copy_params_from_ema_to_model()
    assert_same(ma.state_dict(), mb.state_dict())
