"""``polyak.compat.diffusers.EMAModel`` keeps each tensor under the name
the model gives it, so its snapshots' downloads (``layout=full``) and the
live ``/ema`` load by name into the model with ``strict=True``, equal to
diffusers' own ``EMAModel`` computed in the same test. The names come from
``model_cls`` + ``model_config``, the module passed in, or ``names=``;
without any, the tensors are named by position, with one warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from compat_helpers import assert_same, one_thread  # noqa: F401 (autouse)
from diffusers import UNet2DConditionModel
from diffusers.training_utils import EMAModel as Original
from polyak.compat.diffusers import EMAModel

STEPS = 4

#: A UNet as diffusers' pipelines have them, a few thousand parameters.
TINY_UNET = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 1,
    "block_out_channels": (8, 16),
    "norm_num_groups": 4,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 8,
    "attention_head_dim": 2,
}


def tiny_unet() -> UNet2DConditionModel:
    torch.manual_seed(0)
    return UNet2DConditionModel(**TINY_UNET)


def train(unet: UNet2DConditionModel, emas: list, steps: int = STEPS) -> None:
    """Denoising-style steps on fixed noise; every EMA steps after each."""
    opt = torch.optim.SGD(unet.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(2, 4, 8, 8, generator=gen)
        text = torch.randn(2, 3, 8, generator=gen)
        t = torch.randint(0, 1000, (2,), generator=gen)
        out = unet(x, t, encoder_hidden_states=text).sample
        torch.nn.functional.mse_loss(out, torch.randn(out.shape, generator=gen)).backward()
        opt.step()
        opt.zero_grad()
        for ema in emas:
            ema.step(unet.parameters())


def diffusers_average(unet: UNet2DConditionModel, original: Original) -> dict[str, torch.Tensor]:
    """diffusers' EMA as the model's state dict (``copy_to`` a copy)."""
    model = UNet2DConditionModel(**TINY_UNET)
    original.copy_to(model.parameters())
    return {k: v.clone() for k, v in model.state_dict().items()}


def loaded(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` loaded by name, strictly, into a fresh model."""
    model = UNet2DConditionModel(**TINY_UNET)
    result = model.load_state_dict(state, strict=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("named_by", ["model_cls", "module", "names"])
def test_downloads_and_live_ema_load_by_name_strictly(server, named_by):
    unet = tiny_unet()
    assert list(unet.buffers()) == []  # every state dict entry is a parameter
    original = Original(unet.parameters(), decay=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # names known: no fallback warning
        if named_by == "model_cls":
            ours = EMAModel(
                unet.parameters(),
                decay=0.9,
                model_cls=UNet2DConditionModel,
                model_config=unet.config,
                url=server.url,
            )
        elif named_by == "module":
            # diffusers' deprecated form (a module: warmup on) and the same
            # schedule for the original.
            original = Original(unet.parameters(), decay=0.9, use_ema_warmup=True)
            ours = EMAModel(unet, decay=0.9, url=server.url)
        else:
            names = [n for n, _ in unet.named_parameters()]
            ours = EMAModel(unet.parameters(), decay=0.9, names=names, url=server.url)
    train(unet, [original, ours])
    want = diffusers_average(unet, original)

    run = ours._remote.run
    live = run.fetch_ema("ema")
    assert set(live) == set(unet.state_dict())
    assert_same(want, loaded(live))

    snap = run.snapshot()
    assert snap.step == STEPS
    downloaded = run.download(snap, "ema", progress=False)
    assert sorted(downloaded) == sorted(unet.state_dict())
    assert_same(want, loaded(downloaded))
    # The drop-in's own view agrees (read back by name).
    assert_same(
        {str(i): t for i, t in enumerate(original.shadow_params)},
        {str(i): t for i, t in enumerate(ours.shadow_params)},
    )


def test_unknown_names_fall_back_to_positions_with_one_warning(server):
    unet = tiny_unet()
    original = Original(unet.parameters(), decay=0.9)
    with pytest.warns(UserWarning, match="names are unknown") as caught:
        ours = EMAModel(unet.parameters(), decay=0.9, url=server.url)
        train(unet, [original, ours], steps=2)
        _ = ours.shadow_params
    assert len([w for w in caught if "names are unknown" in str(w.message)]) == 1
    live = ours._remote.run.fetch_ema("ema")
    assert sorted(live, key=int) == [str(i) for i in range(len(list(unet.parameters())))]
    assert_same(
        {str(i): t for i, t in enumerate(original.shadow_params)},
        {str(i): live[str(i)] for i in range(len(live))},
    )


def test_model_config_of_another_model_falls_back(server):
    """A ``model_config`` whose model has other parameters than those given
    cannot name them: positions, with the reason."""
    unet = tiny_unet()
    other = {**TINY_UNET, "block_out_channels": (8, 24)}
    with pytest.warns(UserWarning, match="has other parameters"):
        ours = EMAModel(
            unet.parameters(), model_cls=UNet2DConditionModel, model_config=other, url=server.url
        )
    assert ours._names[:2] == ["0", "1"]


def test_names_must_be_one_per_parameter(server):
    unet = tiny_unet()
    with pytest.raises(ValueError, match="names for"):
        EMAModel(unet.parameters(), names=["a", "b"], url=server.url)
