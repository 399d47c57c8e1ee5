"""``polyak.compat.swa_utils.AveragedModel`` against torch's own, computed
in the same test: the same model, the same steps."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from compat_helpers import Trainer, assert_differs, assert_same, one_thread, steps, twins  # noqa: F401 (autouse)
from polyak.compat import swa_utils as ours
from torch.optim import swa_utils as theirs

N = 55

CASES = {
    "swa": ({}, {}),
    "swa-buffers": ({"use_buffers": True}, {"use_buffers": True}),
    "ema-multi-ours": (
        {"multi_avg_fn": theirs.get_ema_multi_avg_fn(0.9)},
        {"multi_avg_fn": ours.get_ema_multi_avg_fn(0.9)},
    ),
    "ema-multi-torch-buffers": (
        {"multi_avg_fn": theirs.get_ema_multi_avg_fn(0.8), "use_buffers": True},
        {"multi_avg_fn": theirs.get_ema_multi_avg_fn(0.8), "use_buffers": True},
    ),
    "ema-avg-fn": (
        {"avg_fn": theirs.get_ema_avg_fn(0.95)},
        {"avg_fn": ours.get_ema_avg_fn(0.95)},
    ),
    # (torch's own SWA functions fail on integer buffers with use_buffers.)
    "swa-multi-fn": (
        {"multi_avg_fn": theirs.get_swa_multi_avg_fn()},
        {"multi_avg_fn": ours.get_swa_multi_avg_fn()},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_averaged_model_equals_torch(server, case):
    kw_theirs, kw_ours = CASES[case]
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    want = theirs.AveragedModel(ma, **kw_theirs)
    got = ours.AveragedModel(mb, **kw_ours, url=server.url)
    assert got._remote is not None  # kept by the server, not averaged here
    for _ in steps(ta, tb, N):
        want.update_parameters(ma)
        got.update_parameters(mb)
    assert int(got.n_averaged) == int(want.n_averaged) == N
    assert_same(want.module.state_dict(), got.module.state_dict())
    assert_differs(want.module.state_dict(), ma.state_dict())
    assert_same(ma.state_dict(), mb.state_dict())

    # state_dict -> a new instance -> load_state_dict -> more updates.
    again = ours.AveragedModel(mb, **kw_ours, url=server.url)
    again.load_state_dict(got.state_dict())
    assert int(again.n_averaged) == N
    for _ in steps(ta, tb, 12):
        want.update_parameters(ma)
        again.update_parameters(mb)
    assert_same(want.state_dict(), again.state_dict())


def test_closed_form_and_references_see_new_values(server):
    """torch's own test: the first update copies, then each decays."""
    decay = 0.7
    ma, _ = twins()
    t = Trainer(ma)
    avg = ours.AveragedModel(ma, multi_avg_fn=ours.get_ema_multi_avg_fn(decay), url=server.url)
    held = avg.module[0].weight  # a reference kept by the caller
    expected = None
    for i in range(10):
        t.step()
        w = ma[0].weight.detach().clone()
        expected = w if i == 0 else decay * expected + (1 - decay) * w
        avg.update_parameters(ma)
    assert int(avg.n_averaged) == 10
    got = avg.module[0].weight
    assert got is held
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    out = avg(torch.ones(2, 6))  # forward reads through the averaged module
    assert out.shape == (2, 3)


def test_pickle_round_trip_goes_on(server):
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    want = theirs.AveragedModel(ma)
    got = ours.AveragedModel(mb, url=server.url)
    for _ in steps(ta, tb, 8):
        want.update_parameters(ma)
        got.update_parameters(mb)
    clone = pickle.loads(pickle.dumps(got))
    assert_same(want.module.state_dict(), clone.module.state_dict())
    for _ in steps(ta, tb, 6):
        want.update_parameters(ma)
        clone.update_parameters(mb)
    assert_same(want.state_dict(), clone.state_dict())
    assert clone._remote is not None and clone._remote.name != got._remote.name


def test_user_avg_fn_is_averaged_locally_with_one_warning(server):
    def halfway(avg, cur, n):
        return (avg + cur) / 2

    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    want = theirs.AveragedModel(ma, avg_fn=halfway)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ours.AveragedModel(mb, avg_fn=halfway, url=server.url)
        for _ in steps(ta, tb, 5):
            want.update_parameters(ma)
            got.update_parameters(mb)
    mine = [w for w in caught if "cannot run on the server" in str(w.message)]
    assert len(mine) == 1
    assert got._remote is None
    assert_same(want.state_dict(), got.state_dict())


def test_reexports_are_torchs():
    assert ours.SWALR is theirs.SWALR
    assert ours.profile_of(theirs.get_ema_multi_avg_fn(0.5)) == {"kind": "constant", "beta": 0.5}
    assert ours.profile_of(theirs.get_swa_avg_fn()) == {"kind": "swa"}
    assert ours.profile_of(lambda a, b, n: a) is None
