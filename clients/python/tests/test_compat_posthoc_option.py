"""A drop-in run can be searched post hoc and evaluated without rewriting
the training loop: ``posthoc=N`` keeps EDM2's two power-function profiles
beside the drop-in's own and a snapshot of them every ``N`` steps, and
``run_of(ema)`` is the run ``posthoc_search`` and ``EvalWorker`` take.

The synthesised EMA is checked against the same synthesis on a native run
fed the same weights (computed in the same test), and the drop-in's own
EMA still equals the original's.
"""

from __future__ import annotations

import polyak
import pytest
import torch
from compat_helpers import Trainer, assert_same, one_thread, steps, twins  # noqa: F401 (autouse)
from ema_pytorch import EMA as Original
from polyak.compat import run_of
from polyak.compat.ema_pytorch import EMA
from polyak.compat.timm import ModelEmaV3
from polyak_testing import wait_for

EVERY = 5
N = 20


def _evaluate(model: torch.nn.Module) -> dict[str, float]:
    torch.manual_seed(7)
    model.eval()
    x = torch.randn(16, 6)
    return {"loss": float(model(x).pow(2).mean())}


def test_an_ema_pytorch_drop_in_is_searched_post_hoc(server):
    ma, mb = twins()
    native_model, _ = twins()
    kw = {"beta": 0.9, "update_after_step": 0, "update_every": 1}
    want = Original(ma, **kw)
    got = EMA(mb, **kw, url=server.url, posthoc=EVERY)
    # A native run fed the same weights, with the same two profiles.
    client = polyak.Client(server.url)
    native = client.create_run(
        f"native-{run_of(got).name}",
        profiles=[dict(p) for p in polyak.compat._remote.POSTHOC_PROFILES],
        snapshot_every=EVERY,
    )
    pusher = native.pusher(policy="block")
    ta, tb = Trainer(ma), Trainer(mb)
    for step in steps(ta, tb, N):
        want.update()
        got.update()
        pusher.push(mb.state_dict(), step)
    pusher.close()
    assert_same(want.ema_model.state_dict(), got.ema_model.state_dict())

    run = run_of(got)
    last = N - 1 - (N - 1) % EVERY
    wait_for(
        lambda: any(
            s["step"] == last and s["status"] == "complete"
            for s in run.snapshots()
            if s["kind"] == "periodic"
        ),
        30,
        f"the snapshot at step {last}",
    )
    profiles = {p["name"] for p in run.refresh().config["profiles"]}
    assert profiles == {"ema", "edm05", "edm10"}, profiles
    rows = run.posthoc_search([0.06, 0.08], _evaluate, native_model, step=last)
    assert sorted(r.sigma_rel for r in rows) == [0.06, 0.08]
    assert rows[0]["metrics"]["loss"] <= rows[1]["metrics"]["loss"]
    # The same synthesis on the native run gives the same weights.
    for r in rows:
        mine = run.download(r["snapshot"], r["profile"], progress=False)
        theirs_snap = native.posthoc(r.sigma_rel, step=r["step"])
        theirs = native.download(theirs_snap["id"], theirs_snap["profiles"][0], progress=False)
        # (The drop-in keeps integer buffers itself, as ema-pytorch does.)
        assert mine and set(mine) <= set(theirs), (sorted(mine), sorted(theirs))
        for k, v in mine.items():
            assert (v - theirs[k]).abs().max().item() <= 1e-6, (r.sigma_rel, k)
    # The evaluations are the run's: `best` names the winner.
    best = run.best("loss", mode="min")
    assert best.value == pytest.approx(rows[0]["metrics"]["loss"])


def test_a_timm_drop_in_takes_the_option_too(server):
    ma, _ = twins()
    ema = ModelEmaV3(ma, decay=0.9, url=server.url, posthoc=EVERY)
    t = Trainer(ma)
    for step in range(12):
        t.step()
        ema.update(ma, step=step)
    run = run_of(ema)
    assert ema.module is not None  # a read: every push acknowledged
    wait_for(
        lambda: len([s for s in run.snapshots() if s["status"] == "complete"]) >= 3, 30, "3 cuts"
    )
    snaps = [s for s in run.snapshots() if s["kind"] == "periodic"]
    assert sorted(s["step"] for s in snaps) == [0, 5, 10], snaps
    assert all({"edm05", "edm10"} <= set(s["profiles"]) for s in snaps)


def test_posthoc_must_be_a_step_count(server):
    ma, _ = twins()
    with pytest.raises(ValueError, match="posthoc="):
        EMA(ma, beta=0.9, url=server.url, posthoc=0)


def test_averaged_model_and_ema_model_take_the_option_too(server):
    from polyak.compat.diffusers import EMAModel
    from polyak.compat.swa_utils import AveragedModel, get_ema_multi_avg_fn

    ma, _ = twins()
    avg = AveragedModel(ma, multi_avg_fn=get_ema_multi_avg_fn(0.9), url=server.url, posthoc=EVERY)
    ema = EMAModel(ma, decay=0.9, url=server.url, posthoc=EVERY)
    t = Trainer(ma)
    for _ in range(7):
        t.step()
        avg.update_parameters(ma)
        ema.step(ma.parameters())
    for drop_in in (avg, ema):
        run = run_of(drop_in)
        names = {p["name"] for p in run.refresh().config["profiles"]}
        assert {"edm05", "edm10"} < names, names
        assert run.refresh().config["snapshot_every"] == EVERY
