"""``polyak.compat.timm`` against timm 1.0.31's ``ModelEmaV2`` and
``ModelEmaV3``, computed in the same test."""

from __future__ import annotations

import pytest
import torch
from compat_helpers import Trainer, assert_differs, assert_same, one_thread, steps, twins  # noqa: F401 (autouse)
from polyak.compat.timm import ModelEmaV2, ModelEmaV3
from timm.utils.model_ema import ModelEmaV2 as OriginalV2
from timm.utils.model_ema import ModelEmaV3 as OriginalV3

N = 55

V3_CASES = {
    # (constructor arguments, whether update() gets the step)
    "constant": ({"decay": 0.9}, False),
    "steps": ({"decay": 0.95}, True),
    "after-step-min": ({"decay": 0.97, "update_after_step": 6, "min_decay": 0.5}, True),
    "warmup": (
        {"decay": 0.999, "use_warmup": True, "warmup_gamma": 2.0, "warmup_power": 0.75},
        True,
    ),
    "warmup-min-after": (
        {"decay": 0.99, "use_warmup": True, "min_decay": 0.6, "update_after_step": 4},
        True,
    ),
    "exclude-buffers": ({"decay": 0.9, "exclude_buffers": True}, True),
    "no-foreach": ({"decay": 0.9, "foreach": False}, False),
}


@pytest.mark.parametrize("case", list(V3_CASES))
def test_model_ema_v3_equals_timm(server, case):
    kw, given = V3_CASES[case]
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    want = OriginalV3(ma, **kw)
    got = ModelEmaV3(mb, **kw, url=server.url)
    for i in steps(ta, tb, N):
        want.update(ma, step=i + 1 if given else None)
        got.update(mb, step=i + 1 if given else None)
    assert_same(want.module.state_dict(), got.module.state_dict())
    assert_differs(want.module.state_dict(), ma.state_dict())
    assert got.get_decay(30) == want.get_decay(30)

    again = ModelEmaV3(mb, **kw, url=server.url)
    again.load_state_dict(got.state_dict())
    for i in steps(ta, tb, 12):
        want.update(ma, step=N + i + 1 if given else None)
        again.update(mb, step=N + i + 1 if given else None)
    assert_same(want.state_dict(), again.state_dict())


def test_model_ema_v3_first_step_averages_the_constructed_copy(server):
    """A first update whose decay is not 0 averages into the model as it
    was at construction (timm's deepcopy), which polyak pushes first."""
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    want = OriginalV3(ma, decay=0.8)
    got = ModelEmaV3(mb, decay=0.8, url=server.url)
    for i in steps(ta, tb, 5):
        want.update(ma, step=i + 10)
        got.update(mb, step=i + 10)
    assert_same(want.module.state_dict(), got.module.state_dict())
    with pytest.raises(ValueError, match="steps must increase"):
        got.update(mb, step=3)
    with pytest.raises(ValueError, match="every update or to none"):
        got.update(mb)


def test_model_ema_v2_equals_timm(server):
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    # 0.9: timm's float arithmetic moves num_batches_tracked now and then.
    want = OriginalV2(ma, decay=0.9)
    got = ModelEmaV2(mb, decay=0.9, url=server.url)
    for _ in steps(ta, tb, N):
        want.update(ma)
        got.update(mb)
    assert_same(want.module.state_dict(), got.module.state_dict())
    assert_differs(want.module.state_dict(), ma.state_dict())
    held = got.module[0].weight
    again = ModelEmaV2(mb, decay=0.9, url=server.url)
    again.load_state_dict(got.state_dict())
    for _ in steps(ta, tb, 12):
        want.update(ma)
        again.update(mb)
        got.update(mb)
    assert_same(want.state_dict(), again.state_dict())
    assert_same(want.state_dict(), got.state_dict())
    assert got.module[0].weight is held
    out = got(torch.ones(2, 6))
    assert out.shape == (2, 3)


def test_set_restarts_from_the_model(server):
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    want = OriginalV3(ma, decay=0.9)
    got = ModelEmaV3(mb, decay=0.9, url=server.url)
    for _ in steps(ta, tb, 6):
        want.update(ma)
        got.update(mb)
    want.set(ma)
    got.set(mb)
    for _ in steps(ta, tb, 6):
        want.update(ma)
        got.update(mb)
    assert_same(want.module.state_dict(), got.module.state_dict())
