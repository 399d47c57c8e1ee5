"""``polyak.compat.diffusers.EMAModel`` against diffusers 0.42.1's own,
computed in the same test."""

from __future__ import annotations

import pytest
import torch
from compat_helpers import Trainer, assert_differs, assert_same, one_thread, steps, twins  # noqa: F401 (autouse)
from diffusers.training_utils import EMAModel as Original
from polyak.compat.diffusers import EMAModel

N = 55

CASES = {
    "default": {},
    "decay-cap": {"decay": 0.8},
    "after-step-min": {"update_after_step": 5, "min_decay": 0.5},
    "warmup": {"use_ema_warmup": True, "inv_gamma": 2.0, "power": 0.75, "decay": 0.999},
    "warmup-foreach": {"use_ema_warmup": True, "foreach": True, "update_after_step": 3},
}


def shadow(ema) -> dict[str, torch.Tensor]:
    return {str(i): t for i, t in enumerate(ema.shadow_params)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("frozen", [False, True])
def test_ema_model_equals_diffusers(server, case, frozen):
    if frozen and case not in ("default", "warmup"):
        pytest.skip("frozen parameters are covered by two schedules")
    kw = CASES[case]
    ma, mb = twins()
    if frozen:  # diffusers copies parameters that do not require grad
        ma[3].bias.requires_grad_(False)
        mb[3].bias.requires_grad_(False)
        with torch.no_grad():
            ma[3].bias.add_(1.0)
            mb[3].bias.add_(1.0)
    ta, tb = Trainer(ma), Trainer(mb)
    want = Original(ma.parameters(), **kw)
    got = EMAModel(mb.parameters(), **kw, url=server.url)
    for _ in steps(ta, tb, N):
        if frozen:
            with torch.no_grad():
                ma[3].bias.mul_(0.9)
                mb[3].bias.mul_(0.9)
        want.step(ma.parameters())
        got.step(mb.parameters())
    assert got.optimization_step == want.optimization_step == N
    assert got.cur_decay_value == want.cur_decay_value
    assert_same(shadow(want), shadow(got))
    assert_differs(shadow(want), {str(i): p for i, p in enumerate(ma.parameters())})

    # state_dict -> a new instance -> load_state_dict -> more steps.
    again = EMAModel(mb.parameters(), **kw, url=server.url)
    again.load_state_dict(got.state_dict())
    for _ in steps(ta, tb, 12):
        want.step(ma.parameters())
        again.step(mb.parameters())
    assert again.optimization_step == N + 12
    assert_same(shadow(want), shadow(again))


def test_zero_decay_shadow_is_the_weights_through_held_tensors(server):
    """diffusers' own test: decay 0 makes the shadow the weights; here seen
    through tensors the caller took before the steps."""
    ma, _ = twins()
    t = Trainer(ma)
    ema = EMAModel(ma.parameters(), decay=0.0, url=server.url)
    held = list(ema.shadow_params)
    for i in range(4):
        t.step()
        ema.step(ma.parameters())
        assert ema.optimization_step == i + 1
    _ = ema.shadow_params
    for h, p in zip(held, ma.parameters(), strict=True):
        torch.testing.assert_close(h, p.detach(), rtol=0, atol=0)


def test_copy_to_store_restore(server):
    ma, mb = twins()
    ta, tb = Trainer(ma), Trainer(mb)
    want = Original(ma.parameters(), decay=0.9)
    got = EMAModel(mb.parameters(), decay=0.9, url=server.url)
    for _ in steps(ta, tb, 9):
        want.step(ma.parameters())
        got.step(mb.parameters())
    online = {k: v.clone() for k, v in mb.state_dict().items()}
    got.store(mb.parameters())
    got.copy_to(mb.parameters())
    want.copy_to(ma.parameters())
    assert_same(dict(ma.named_parameters()), dict(mb.named_parameters()))
    got.restore(mb.parameters())
    assert all(torch.equal(mb.state_dict()[k], v) for k, v in online.items())


def test_save_pretrained_and_from_pretrained(server, tmp_path, monkeypatch):
    """diffusers' own save/load: the EMA saved as a model with the EMA's
    settings in its config, and loaded back into a new EMAModel whose next
    steps go on from its optimization step."""
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config

    class Tiny(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, width: int = 8) -> None:
            super().__init__()
            self.a = torch.nn.Linear(6, width)
            self.b = torch.nn.Linear(width, 3)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    ma = Tiny()
    mb = Tiny()
    mb.load_state_dict(ma.state_dict())
    opt_a = torch.optim.SGD(ma.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(mb.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(20)]

    def train(model, opt, rows):
        for x, y in rows:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            yield

    kw = {"decay": 0.9, "model_cls": Tiny}
    want = Original(ma.parameters(), model_config=ma.config, **kw)
    got = EMAModel(mb.parameters(), model_config=mb.config, **kw, url=server.url)
    for _ in zip(train(ma, opt_a, batches[:12]), train(mb, opt_b, batches[:12]), strict=True):
        want.step(ma.parameters())
        got.step(mb.parameters())
    want.save_pretrained(tmp_path / "want")
    got.save_pretrained(tmp_path / "got")
    saved_want = Tiny.from_pretrained(tmp_path / "want")
    saved_got = Tiny.from_pretrained(tmp_path / "got")
    assert_same(saved_want.state_dict(), saved_got.state_dict())
    assert saved_got.config["optimization_step"] == 12

    monkeypatch.setenv("POLYAK_URL", server.url)
    want = Original.from_pretrained(tmp_path / "want", Tiny)
    again = EMAModel.from_pretrained(tmp_path / "got", Tiny)
    assert again.optimization_step == want.optimization_step == 12
    for _ in zip(train(ma, opt_a, batches[12:]), train(mb, opt_b, batches[12:]), strict=True):
        want.step(ma.parameters())
        again.step(mb.parameters())
    assert_same(shadow(want), shadow(again))
