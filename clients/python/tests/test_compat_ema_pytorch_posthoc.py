"""``polyak.compat.ema_pytorch.PostHocEMA`` against ema-pytorch 0.8.3's own,
computed in the same test: twin models, the same steps; the live EMAs
(``ema_models``) and the synthesised ones (``synthesize_ema_model``) at two
lengths, at the newest checkpoint and at a step in the middle, with float32
and with ema-pytorch's default float16 checkpoints."""

from __future__ import annotations

import io

import polyak
import pytest
import torch
from compat_helpers import (  # noqa: F401 (one_thread: autouse)
    Trainer,
    assert_differs,
    assert_same,
    one_thread,
    small_model,
    steps,
    twins,
)
from ema_pytorch import PostHocEMA as Original
from ema_pytorch.post_hoc_ema import sigma_rel_to_gamma, solve_weights
from polyak.compat.ema_pytorch import KarrasEMA, PostHocEMA
from torch import nn

N = 60
SIGMA_RELS = (0.05, 0.28)

CASES = {
    # every step updates; checkpoints every 10 updates, stored as float32
    "every-1-float32": {"update_every": 1, "checkpoint_dtype": torch.float32},
    # ema-pytorch's default float16 checkpoints; updates every 3 steps, so
    # most checkpoints fall between updates
    "every-3-float16": {"update_every": 3},
    "no-ema-and-ignored-names-bfloat16": {
        "update_every": 2,
        "checkpoint_dtype": torch.bfloat16,
        "param_or_buffer_names_no_ema": {"3.bias"},
        "ignore_names": {"0.bias"},
        "ignore_startswith_names": {"1.running_m"},
    },
}


def synthesis_tolerance(original: Original, gamma: float, step: int | None) -> float:
    """ema-pytorch adds its weighted checkpoints in float32 (in the order
    its folder lists them); the server adds them in float64. The two agree
    to float32 round-off of ``sum_i |w_i| |x_i|``: that bound, from
    ema-pytorch's own weights and checkpoints."""
    files = [*original.checkpoint_folder.glob("*.pt")]
    gammas, times = [], []
    for f in files:
        index, t = map(int, f.stem.split("."))
        gammas.append(original.gammas[index])
        times.append(t)
    w = solve_weights(
        torch.tensor(times),
        torch.tensor(gammas),
        torch.tensor([step if step is not None else max(times)]),
        torch.tensor([gamma]),
    ).squeeze(-1)
    scale = 0.0
    for f, wi in zip(files, w.tolist(), strict=True):
        ckpt = torch.load(f, weights_only=True)
        scale += abs(wi) * max(
            v.float().abs().max().item() for k, v in ckpt.items() if "ema_model" in k
        )
    return 16 * 2.0**-24 * scale


def averaged(ema, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The synthesised EMA's float tensors (what ema-pytorch sums)."""
    return {
        k: v
        for k, v in ema.ema_model.state_dict().items()
        if v.is_floating_point() and (names is None or k in names)
    }


@pytest.mark.parametrize("case", list(CASES))
def test_posthoc_ema_equals_ema_pytorch(server, tmp_path, case):
    kw = CASES[case]
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    common = {"sigma_rels": SIGMA_RELS, "checkpoint_every_num_steps": 10, **kw}
    want = Original(ma, checkpoint_folder=str(tmp_path / "original"), **common)
    got = PostHocEMA(mb, checkpoint_folder=str(tmp_path / "dropin"), **common, url=server.url)
    for _ in steps(ta, tb, N):
        want.update()
        got.update()
    assert int(got.step) == int(want.step) == N
    assert not (tmp_path / "dropin").exists()  # the checkpoints are the server's
    assert len([*want.checkpoint_folder.glob("*.pt")]) == 2 * N // 10

    # The live EMAs: ema-pytorch's KarrasEMA models.
    assert len(got.ema_models) == 2
    for w, g in zip(want.ema_models, got.ema_models, strict=True):
        assert isinstance(g, KarrasEMA) and g.gamma == w.gamma
        assert_same(w.ema_model.state_dict(), g.ema_model.state_dict())
        assert_differs(w.ema_model.state_dict(), ma.state_dict())
    x = torch.randn(4, 6)
    for w_out, g_out in zip(want.eval()(x), got.eval()(x), strict=True):
        torch.testing.assert_close(g_out, w_out, rtol=1e-5, atol=1e-6)

    # The synthesised EMAs: two lengths, the newest checkpoint and a step
    # in the middle (between checkpoints: ema-pytorch takes any step).
    live = [averaged(m) for m in want.ema_models]
    seen = []
    for sigma_rel in (0.10, 0.20):
        for step in (None, 35):
            w = want.synthesize_ema_model(sigma_rel=sigma_rel, step=step)
            g = got.synthesize_ema_model(sigma_rel=sigma_rel, step=step)
            assert type(g) is type(w) and g.gamma == w.gamma
            assert_synthesis_equal(want, w, g, w.gamma, step)
            wa = averaged(w)
            for other in [*live, *seen]:
                assert_differs(wa, other)
            seen.append(wa)
    # gamma= as well as sigma_rel=.
    w = want.synthesize_ema_model(gamma=5.0, step=20)
    g = got.synthesize_ema_model(gamma=5.0, step=20)
    assert g.gamma == w.gamma == 5.0
    assert_synthesis_equal(want, w, g, 5.0, 20)


def assert_synthesis_equal(original: Original, w, g, gamma: float, step: int | None) -> None:
    """The drop-in's synthesis ``g`` equals ema-pytorch's ``w``: averaged
    tensors to the float32 round-off of the sum, the rest (the online
    model's, as ema-pytorch takes them) exactly."""
    assert type(g) is type(w) and g.gamma == w.gamma
    tol = synthesis_tolerance(original, gamma, step)
    wa, ga = averaged(w), averaged(g)
    assert set(wa) == set(ga)
    for name, wt in wa.items():
        diff = (ga[name].double() - wt.double()).abs().max().item()
        assert diff <= tol, f"gamma {gamma} step {step} {name}: {diff:.3g} > {tol:.3g}"
    rest_w = {k: v for k, v in w.ema_model.state_dict().items() if k not in wa}
    rest_g = {k: v for k, v in g.ema_model.state_dict().items() if k not in wa}
    assert_same(rest_w, rest_g, rel=0.0)


def test_frozen_posthoc_ema_keeps_the_first_copy(server, tmp_path):
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    common = {
        "sigma_rels": SIGMA_RELS,
        "checkpoint_every_num_steps": 5,
        "update_every": 1,
        "frozen": True,
        "checkpoint_dtype": torch.float32,
    }
    want = Original(ma, checkpoint_folder=str(tmp_path / "original"), **common)
    got = PostHocEMA(mb, **common, url=server.url)
    for _ in steps(ta, tb, 15):
        want.update()
        got.update()
    for w, g in zip(want.ema_models, got.ema_models, strict=True):
        assert_same(w.ema_model.state_dict(), g.ema_model.state_dict())
    # The first update's copy, not the model trained on since.
    assert_differs(averaged(got.ema_models[0]), ma.state_dict())
    w = want.synthesize_ema_model(sigma_rel=0.1, step=7)
    g = got.synthesize_ema_model(sigma_rel=0.1, step=7)
    assert_synthesis_equal(want, w, g, w.gamma, 7)


def test_posthoc_ema_rounds_like_float16_checkpoints(server, tmp_path):
    """The float16 rounding of ema-pytorch's checkpoints shows in its
    synthesis (more than the comparison's tolerance): the server's rounded
    sources are what make the drop-in equal, not a loose tolerance."""
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    common = {"sigma_rels": SIGMA_RELS, "checkpoint_every_num_steps": 10, "update_every": 1}
    want16 = Original(ma, checkpoint_folder=str(tmp_path / "fp16"), **common)
    want32 = Original(
        ma, checkpoint_folder=str(tmp_path / "fp32"), checkpoint_dtype=torch.float32, **common
    )
    got = PostHocEMA(mb, **common, url=server.url)
    for _ in steps(ta, tb, 40):
        want16.update()
        want32.update()
        got.update()
    w16 = averaged(want16.synthesize_ema_model(sigma_rel=0.15, step=25))
    w32 = averaged(want32.synthesize_ema_model(sigma_rel=0.15, step=25))
    g = averaged(got.synthesize_ema_model(sigma_rel=0.15, step=25))
    tol = synthesis_tolerance(want16, sigma_rel_to_gamma(0.15), 25)
    worst16 = max((g[k].double() - w16[k].double()).abs().max().item() for k in w16)
    worst32 = max((g[k].double() - w32[k].double()).abs().max().item() for k in w16)
    assert worst16 <= tol, (worst16, tol)
    assert worst32 > 4 * tol, (worst32, tol)


def test_posthoc_run_holds_karras_profiles_and_checkpoints(server, tmp_path):
    ma, _ = twins()
    t = Trainer(ma)
    ema = PostHocEMA(
        ma,
        sigma_rels=(0.05, 0.15, 0.28),
        update_every=4,
        checkpoint_every_num_steps="manual",
        url=server.url,
        run="posthoc-manual",
    )
    for _ in range(9):
        t.step()
        ema.update()
    ema.checkpoint()  # by hand, after 9 updates: between two updates
    with polyak.Client(server.url) as client:
        run = client.run("posthoc-manual")
        kinds = [
            (p["name"], p["kind"], p["update_every"]) for p in run.refresh()["config"]["profiles"]
        ]
        assert kinds == [("ema", "karras", 4), ("ema1", "karras", 4), ("ema2", "karras", 4)]
        snaps = [run.wait_snapshot(s) for s in run.snapshots(kind="manual")]
        assert [s["step"] for s in snaps] == [8]  # ema-pytorch names it 9: t = step + 1


def test_posthoc_options_refuse_bad_input(server, tmp_path):
    """The server's ``ema_pytorch`` method and ``source_dtype``: a step past
    the newest checkpoint and an unknown dtype are 422, nothing written;
    EDM2's method still refuses a step between checkpoints."""
    ma, _ = twins()
    t = Trainer(ma)
    ema = PostHocEMA(
        ma, sigma_rels=SIGMA_RELS, update_every=1, checkpoint_every_num_steps=5, url=server.url
    )
    for _ in range(10):
        t.step()
        ema.update()
    _ = ema.synthesize_ema_model(sigma_rel=0.1, step=7)  # waits for the checkpoints
    run = ema._remote.run
    before = run.snapshots()
    for kwargs in (
        {"method": "ema_pytorch", "step": 10},  # the newest checkpoint is step 9 (ema-pytorch's 10)
        {"method": "ema_pytorch", "source_dtype": "fp32"},
        {"method": "polyak"},
        {"step": 6},  # EDM2: only at a checkpoint's step
    ):
        with pytest.raises(polyak.PolyakError) as err:
            run.posthoc(0.1, **kwargs)
        assert err.value.status == 422, (kwargs, err.value)
    assert run.snapshots() == before
    plan = run.posthoc_plan(0.1, step=6, method="ema_pytorch")
    assert [s["step"] for s in plan["sources"]] == [4, 4, 9, 9]
    assert abs(sum(plan["targets"][0]["weights"]) - 1.0) > 1e-9  # as solved, not scaled
    edm2 = run.posthoc_plan(0.1, step=4)
    assert [s["step"] for s in edm2["sources"]] == [4, 4]
    assert abs(sum(edm2["targets"][0]["weights"]) - 1.0) < 1e-9


def saved(state: dict) -> dict:
    """``state`` as a checkpoint file gives it back (copies, not the live
    tensors)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def restarted(t: Trainer) -> Trainer:
    """A trainer as one restarted from a checkpoint of ``t`` taken now:
    the model, the optimizer and the batch stream where they are."""
    model = small_model()
    model.load_state_dict(saved(t.model.state_dict()))
    again = Trainer(model)
    again.opt.load_state_dict(saved(t.opt.state_dict()))
    again.gen.set_state(t.gen.get_state())
    return again


RESUME_CASES = {
    # state_dict -> new instances -> load_state_dict -> more updates
    "every-1-float32": ({"update_every": 1, "checkpoint_dtype": torch.float32}, 0),
    # The trainer went on 12 steps (past a checkpoint) after it saved, then
    # restarted from what it saved: the run goes back to the checkpoint.
    "every-3-no-ema-names-steps-lost": (
        {"update_every": 3, "param_or_buffer_names_no_ema": {"3.bias"}, "ignore_names": {"0.bias"}},
        12,
    ),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_posthoc_ema_resumes_as_ema_pytorch(server, tmp_path, case):
    kw, lost = RESUME_CASES[case]
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    common = {"sigma_rels": SIGMA_RELS, "checkpoint_every_num_steps": 10, **kw}
    folder = str(tmp_path / "original")
    want = Original(ma, checkpoint_folder=folder, **common)
    got = PostHocEMA(mb, **common, url=server.url)
    for _ in steps(ta, tb, 30):
        want.update()
        got.update()
    state_w, state_g = saved(want.state_dict()), saved(got.state_dict())
    # ema-pytorch's keys, and the run standing for its checkpoint folder.
    assert set(state_g) == {*state_w, "_extra_state"}
    assert state_g["_extra_state"] == {"polyak_run": got._remote.name}
    ra, rb = restarted(ta), restarted(tb)
    for _ in steps(ta, tb, lost):
        want.update()
        got.update()
    got._remote.close()  # the trainer stops; ema-pytorch's files stay

    want = Original(ra.model, checkpoint_folder=folder, **common)
    again = PostHocEMA(rb.model, **common, url=server.url)
    fresh = again._remote.name
    want.load_state_dict(state_w)
    again.load_state_dict(state_g)
    assert again._remote.name == got._remote.name
    with polyak.Client(server.url) as client:
        assert fresh not in {r["name"] for r in client.runs()}  # unused, deleted
    for w, g in zip(want.ema_models, again.ema_models, strict=True):
        assert int(g.step) == int(w.step) == 30 and bool(g.initted)
        assert_same(w.ema_model.state_dict(), g.ema_model.state_dict())
    for _ in steps(ra, rb, 10):
        want.update()
        again.update()
    # Loaded again, through a module holding it: the same run goes on.
    holder = nn.ModuleDict({"ema": again})
    holder.load_state_dict(saved(holder.state_dict()))
    assert again._remote.name == got._remote.name
    for _ in steps(ra, rb, 15):
        want.update()
        again.update()
    assert int(again.step) == int(want.step) == 55
    for w, g in zip(want.ema_models, again.ema_models, strict=True):
        assert_same(w.ema_model.state_dict(), g.ema_model.state_dict())
        assert_differs(w.ema_model.state_dict(), ra.model.state_dict())
    # Syntheses from the checkpoints before and after the restart.
    for step in (None, 20, 45):
        w = want.synthesize_ema_model(sigma_rel=0.15, step=step)
        g = again.synthesize_ema_model(sigma_rel=0.15, step=step)
        assert_synthesis_equal(want, w, g, w.gamma, step)


def test_posthoc_resume_refuses_what_it_cannot_serve(server, tmp_path):
    ma, mb = twins()
    t = Trainer(ma)
    common = {"sigma_rels": SIGMA_RELS, "update_every": 1, "checkpoint_every_num_steps": "manual"}
    ema = PostHocEMA(ma, **common, url=server.url)
    for _ in range(5):
        t.step()
        ema.update()
    state = saved(ema.state_dict())
    for _ in range(2):
        t.step()
        ema.update()
    ema._remote.pusher.flush()
    run = ema._remote.run

    again = PostHocEMA(mb, **common, url=server.url)
    own = again._remote.name
    before = saved(again.state_dict())
    # The run went on past the state (step 4) and has no checkpoint since.
    with pytest.raises(polyak.PolyakError) as err:
        again.load_state_dict(state)
    assert err.value.code == "snapshot_older" and "checkpoint" in str(err.value)
    # ema-pytorch's own state dict does not name a run.
    original = Original(small_model(), checkpoint_folder=str(tmp_path / "o"), **common)
    with pytest.raises(ValueError, match="_extra_state"):
        again.load_state_dict(original.state_dict())
    # EMAs at different steps cannot share one server run.
    uneven = {**state, "ema_models.1.step": torch.tensor(3)}
    with pytest.raises(ValueError, match="different steps"):
        again.load_state_dict(uneven)
    # A run of other EMAs (ema-pytorch would synthesise from the wrong
    # gammas): the server names the difference.
    other = PostHocEMA(small_model(), **{**common, "sigma_rels": (0.05, 0.2)}, url=server.url)
    mine = other._remote.name
    with pytest.raises(polyak.PolyakError) as err:
        other.load_state_dict(saved(ema.state_dict()))  # the run's own step: no going back
    assert err.value.code == "run_exists" and "gamma" in str(err.value)
    other.update()  # still its own run, still pushing
    other._remote.pusher.flush()
    assert other._remote.name == mine and other._remote.run.rank(0)["last_step"] == 0
    # Nothing changed: the new object, its run, the old run.
    after = again.state_dict()
    assert before.pop("_extra_state") == after.pop("_extra_state") == {"polyak_run": own}
    assert_same(before, after, rel=0.0)
    assert run.rank(0)["last_step"] == 6


def test_each_karras_ema_updated_on_its_own_as_ema_pytorch(server, tmp_path):
    """``for m in ema.ema_models: m.update()`` (and checkpoints by hand):
    the last EMA of each round pushes for all; an EMA updated again before
    the others, and reads in the middle of a round, raise."""
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    common = {
        "sigma_rels": SIGMA_RELS,
        "checkpoint_every_num_steps": "manual",
        "update_every": 2,
        "checkpoint_dtype": torch.float32,
    }
    want = Original(ma, checkpoint_folder=str(tmp_path / "original"), **common)
    got = PostHocEMA(mb, **common, url=server.url)
    for i in steps(ta, tb, 24):
        for w, g in zip(want.ema_models, got.ema_models, strict=True):
            w.update()
            g.update()
        if i % 6 == 5:
            want.checkpoint()
            got.checkpoint()
    assert int(got.step) == int(want.step) == 24
    for w, g in zip(want.ema_models, got.ema_models, strict=True):
        assert int(g.step) == int(w.step)
        assert_same(w.ema_model.state_dict(), g.ema_model.state_dict())
        assert_differs(w.ema_model.state_dict(), ma.state_dict())
    for step in (None, 15):
        w = want.synthesize_ema_model(sigma_rel=0.15, step=step)
        g = got.synthesize_ema_model(sigma_rel=0.15, step=step)
        assert_synthesis_equal(want, w, g, w.gamma, step)

    got.ema_models[0].update()
    with pytest.raises(NotImplementedError, match="updated again before the others"):
        got.ema_models[0].update()
    for read in (lambda: got.ema_models[1].ema_model, got.update, got.checkpoint):
        with pytest.raises(RuntimeError, match="different steps"):
            read()
    got.ema_models[1].update()  # the round completes: reads work again
    want.update()
    assert_same(want.ema_models[0].ema_model.state_dict(), got.ema_models[0].ema_model.state_dict())


def test_copy_params_from_model_to_ema_before_the_first_update(server, tmp_path):
    """Before the first update the EMAs are only local: the copy is served
    as ema-pytorch's; after it, it would reset the server's EMAs and raises."""
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    common = {"sigma_rels": SIGMA_RELS, "checkpoint_every_num_steps": 5, "update_every": 1}
    want = Original(ma, checkpoint_folder=str(tmp_path / "original"), **common)
    got = PostHocEMA(mb, **common, url=server.url)
    first = saved(got.ema_models[0].ema_model.state_dict())
    for _ in steps(ta, tb, 3):  # the model moves on from the EMAs' copies
        pass
    want.copy_params_from_model_to_ema()
    got.copy_params_from_model_to_ema()
    for w, g in zip(want.ema_models, got.ema_models, strict=True):
        assert_same(w.ema_model.state_dict(), g.ema_model.state_dict())
    assert_differs(got.ema_models[0].ema_model.state_dict(), first)
    got.ema_models[1].copy_params_from_model_to_ema()  # one of them alone, too
    for _ in steps(ta, tb, 12):
        want.update()
        got.update()
    for w, g in zip(want.ema_models, got.ema_models, strict=True):
        assert_same(w.ema_model.state_dict(), g.ema_model.state_dict())
    for copy in (
        got.copy_params_from_model_to_ema,
        got.ema_models[0].copy_params_from_model_to_ema,
    ):
        with pytest.raises(NotImplementedError, match="before its first update"):
            copy()
