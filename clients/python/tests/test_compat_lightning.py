"""``polyak.compat.lightning`` against Lightning's own ``EMAWeightAveraging``
and ``WeightAveraging``: the same module and data, the average kept by
polyak; the final weights swapped in at the end of training; resume from
Lightning's own checkpoint equal to the run that never stopped."""

from __future__ import annotations

import torch
from compat_helpers import assert_same, one_thread  # noqa: F401 (autouse)
from torch import nn

STEPS_PER_EPOCH = 12
BATCH = 4


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(STEPS_PER_EPOCH * BATCH, 6, generator=g)
    y = x @ torch.randn(6, 3, generator=g) + 0.1 * torch.randn(len(x), 3, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def make_module():
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(7)
            self.net = nn.Sequential(
                nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)
            )

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val", nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=2e-2)

    return Module()


def trainer(tmp_path, epochs: int, callbacks: list):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    return pl.Trainer(
        max_epochs=epochs,
        callbacks=callbacks,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )


def loader():
    return torch.utils.data.DataLoader(data(), batch_size=BATCH, shuffle=False)


def fit(tmp_path, callback, epochs: int = 3, ckpt=None, module=None, val=True, more=()):
    module = module or make_module()
    t = trainer(tmp_path, epochs, [callback, *more])
    t.fit(module, loader(), loader() if val else None, ckpt_path=ckpt)
    return t, module


def test_ema_weight_averaging_equals_lightning(server, tmp_path):
    from lightning.pytorch.callbacks import EMAWeightAveraging as Original
    from polyak.compat.lightning import EMAWeightAveraging

    kw = {"decay": 0.8, "update_every_n_steps": 2, "update_starting_at_step": 3}
    _, want = fit(tmp_path, Original(**kw), epochs=2)
    cb = EMAWeightAveraging(**kw, url=server.url)
    t, got = fit(tmp_path, cb, epochs=2)
    assert cb._average_model._remote is not None  # kept by the server
    # The average was swapped into the module at the end of training.
    assert_same(want.state_dict(), got.state_dict())
    assert t.global_step == 2 * STEPS_PER_EPOCH


def test_weight_averaging_swa_equals_lightning(server, tmp_path):
    from lightning.pytorch.callbacks import WeightAveraging as Original
    from polyak.compat.lightning import WeightAveraging

    _, want = fit(tmp_path, Original(), epochs=2)
    _, got = fit(tmp_path, WeightAveraging(url=server.url), epochs=2)
    assert_same(want.state_dict(), got.state_dict())


def test_resume_from_lightnings_checkpoint_equals_uninterrupted(server, tmp_path):
    from lightning.pytorch.callbacks import EMAWeightAveraging as Original
    from lightning.pytorch.callbacks import ModelCheckpoint
    from polyak.compat.lightning import EMAWeightAveraging

    _, want = fit(tmp_path, Original(decay=0.7), epochs=3, val=False)
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    _, straight = fit(
        tmp_path,
        EMAWeightAveraging(decay=0.7, url=server.url),
        epochs=3,
        val=False,
        more=[every_epoch],
    )
    assert_same(want.state_dict(), straight.state_dict())
    (ckpt,) = (tmp_path / "ckpt").glob("epoch=0-*.ckpt")
    cb = EMAWeightAveraging(decay=0.7, url=server.url)
    _, resumed = fit(tmp_path, cb, epochs=3, ckpt=str(ckpt), val=False)
    assert_same(want.state_dict(), resumed.state_dict())
    assert cb._average_model._remote.last_step == 3 * STEPS_PER_EPOCH - 1
