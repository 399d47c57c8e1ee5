"""``polyak.compat.ema_pytorch.PostHocEMA`` against ema-pytorch 0.8.3's own,
computed in the same test: twin models, the same steps; the live EMAs
(``ema_models``) and the synthesised ones (``synthesize_ema_model``) at two
lengths, at the newest checkpoint and at a step in the middle, with float32
and with ema-pytorch's default float16 checkpoints."""

from __future__ import annotations

import polyak
import pytest
import torch
from compat_helpers import Trainer, assert_differs, assert_same, one_thread, steps, twins  # noqa: F401 (autouse)
from ema_pytorch import PostHocEMA as Original
from ema_pytorch.post_hoc_ema import sigma_rel_to_gamma, solve_weights
from polyak.compat.ema_pytorch import KarrasEMA, PostHocEMA

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
    with pytest.raises(NotImplementedError):
        ema.ema_models[0].update()
    with pytest.raises(NotImplementedError):
        ema.load_state_dict(ema.state_dict())


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
