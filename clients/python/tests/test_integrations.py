"""The trainer integrations, each with the real framework: a tiny model
trained for 24 optimizer steps with gradient accumulation, the EMA equal to
the framework's own (Lightning's ``EMAWeightAveraging``) or to torch's
``AveragedModel``; then killed at step 12 and resumed from the framework's
own checkpoint, the final EMA bit for bit that of the run that never
stopped."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

BETA = 0.8
STEPS = 24
ACCUMULATE = 2
BATCH = 4
# One epoch is 12 optimizer steps, so the restart falls on an epoch boundary.
SAMPLES = 12 * ACCUMULATE * BATCH


def data(seed: int = 5) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = x @ torch.randn(6, 3, generator=g) + 0.1 * torch.randn(SAMPLES, 3, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> bool:
    return set(a) == set(b) and all(torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in a)


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def averaged(avg: AveragedModel) -> dict[str, torch.Tensor]:
    """The averaged module's state dict (its own names)."""
    return {k: v.detach() for k, v in avg.module.state_dict().items()}


def profiles() -> list[dict[str, object]]:
    return [{"name": "ema", "kind": "constant", "beta": BETA}]


# -- PyTorch Lightning -------------------------------------------------------


def lightning_kit():
    """The LightningModule and the trainer the Lightning tests train with."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net(7)
            self.val_losses: list[float] = []

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, _):
            x, y = batch
            self.val_losses.append(float(nn.functional.mse_loss(self.net(x), y)))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=2e-2)

    def trainer(epochs: int, callbacks: list, root, checkpoints: bool = False) -> pl.Trainer:
        return pl.Trainer(
            max_epochs=epochs,
            accumulate_grad_batches=ACCUMULATE,
            callbacks=callbacks,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=checkpoints,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=root,
        )

    return Module, trainer


def lightning_loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data(), batch_size=BATCH, shuffle=False)


def test_lightning_callback(client, run_name, tmp_path):
    from lightning.pytorch.callbacks import EMAWeightAveraging
    from polyak.integrations.lightning import PolyakCallback

    Module, make_trainer = lightning_kit()
    loader = lightning_loader

    def trainer(epochs: int, callbacks: list):
        return make_trainer(epochs, callbacks, tmp_path)

    # Uninterrupted, beside Lightning's own EMA.
    straight = client.create_run(f"{run_name}-a", profiles=profiles())
    module = Module()
    own = EMAWeightAveraging(decay=BETA)
    t = trainer(2, [PolyakCallback(straight), own])
    t.fit(module, loader())
    assert t.global_step == STEPS
    # Lightning swapped its average into the module at the end of training.
    lightning_ema = {k: v.detach() for k, v in module.state_dict().items()}
    assert close(straight.fetch_ema("ema"), lightning_ema)

    # Killed after the first epoch (a Lightning checkpoint), resumed from it.
    run = client.create_run(f"{run_name}-b", profiles=profiles())
    module = Module()
    t = trainer(1, [PolyakCallback(run)])
    t.fit(module, loader())
    ckpt = tmp_path / "epoch1.ckpt"
    t.save_checkpoint(ckpt)
    (snap,) = run.snapshots()
    assert (snap["step"], snap["label"]) == (11, "checkpoint")
    run.pusher().push(module, 12)  # a push the dead trainer sent after its checkpoint
    module = Module()
    callback = PolyakCallback(run, eval_profile="ema", finish=True)
    t = trainer(2, [callback])
    t.fit(module, loader(), ckpt_path=ckpt)
    assert t.global_step == STEPS
    assert equal(run.fetch_ema("ema"), straight.fetch_ema("ema"))
    assert run.refresh()["health"] == "finished"

    # Validation on the EMA: the same loss as the EMA loaded by hand, and the
    # online weights back afterwards.
    online = {k: v.clone() for k, v in module.state_dict().items()}
    t.validate(module, loader(), verbose=False)
    ema_loss = module.val_losses[-1]
    assert equal(module.state_dict(), online)
    by_hand = Module()
    by_hand.load_state_dict(run.fetch_ema("ema"))
    x, y = data()[SAMPLES - BATCH :]
    with torch.no_grad():
        assert ema_loss == float(nn.functional.mse_loss(by_hand.net(x), y))


def test_lightning_checkpoint_files_of_one_step_share_one_snapshot(client, run_name, tmp_path):
    """``ModelCheckpoint(save_last=True)`` saves ``epoch=…ckpt`` and
    ``last.ckpt`` for the same step: one snapshot of that step, not two."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from polyak.integrations.lightning import PolyakCallback

    Module, make_trainer = lightning_kit()
    run = client.create_run(run_name, profiles=profiles())
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=-1)
    t = make_trainer(2, [PolyakCallback(run), saves], tmp_path, checkpoints=True)
    t.fit(Module(), lightning_loader())
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["epoch=0-step=12.ckpt", "epoch=1-step=24.ckpt", "last.ckpt"], files
    snaps = run.snapshots()
    assert [(s["step"], s["label"]) for s in snaps] == [(11, "checkpoint"), (23, "checkpoint")]


# -- HuggingFace transformers Trainer -----------------------------------------


def test_transformers_trainer_callback(client, run_name, tmp_path):
    import transformers
    from polyak.integrations.transformers import PolyakTrainerCallback

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net(9)

        def forward(self, x, y):
            return {"loss": nn.functional.mse_loss(self.net(x), y)}

    rows = [{"x": x, "y": y} for x, y in data()]

    class Anchor(transformers.TrainerCallback):
        """torch's own EMA of the same optimizer steps."""

        def __init__(self, model: nn.Module) -> None:
            self.avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(BETA))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.avg.update_parameters(model)

    class KillAt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 12:
                control.should_training_stop = True

    def trainer(model: nn.Module, out: str, callbacks: list) -> transformers.Trainer:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out),
            per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=ACCUMULATE,
            max_steps=STEPS,
            save_strategy="steps",
            save_steps=12,
            learning_rate=2e-2,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            report_to=[],
            use_cpu=True,
            logging_strategy="no",
            disable_tqdm=True,
            seed=3,
        )
        return transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks)

    straight = client.create_run(f"{run_name}-a", profiles=profiles())
    model = Regressor()
    anchor = Anchor(model)
    trainer(model, "a", [PolyakTrainerCallback(straight), anchor]).train()
    assert close(straight.fetch_ema("ema"), averaged(anchor.avg))
    assert [s["step"] for s in straight.snapshots()] == [11, 23]  # save_steps -> snapshots

    run = client.create_run(f"{run_name}-b", profiles=profiles())
    trainer(Regressor(), "b", [PolyakTrainerCallback(run), KillAt()]).train()
    callback = PolyakTrainerCallback(run, finish=True)
    resumed = trainer(Regressor(), "b", [callback])
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-12"))
    assert equal(run.fetch_ema("ema"), straight.fetch_ema("ema"))
    assert run.refresh()["health"] == "finished"
    # Evaluating on the EMA, the online weights back after it.
    online = {k: v.clone() for k, v in resumed.model.state_dict().items()}
    with callback.ema_weights(resumed.model, "ema") as m:
        assert equal(m.state_dict(), run.fetch_ema("ema"))
    assert equal(resumed.model.state_dict(), online)


# -- accelerate ---------------------------------------------------------------


def test_accelerate_helper(client, run_name, tmp_path):
    import accelerate
    from polyak.integrations.accelerate import PolyakAccelerate

    def train(run, stop: int, load: str | None = None, anchor: AveragedModel | None = None):
        # A new process each time: accelerate keeps its state per process.
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate.state.GradientState._reset_state()
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
        torch.manual_seed(11)
        model = net(11)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
        loader = torch.utils.data.DataLoader(data(), batch_size=BATCH, shuffle=False)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        ema = PolyakAccelerate(accelerator, run)
        steps = 0
        if load is not None:
            accelerator.load_state(load)
            steps = 12
        ema.attach(model, opt, steps_taken=steps)
        while steps < stop:
            for x, y in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(nn.functional.mse_loss(model(x), y))
                    opt.step()
                    opt.zero_grad()
                if accelerator.sync_gradients:
                    steps += 1
                    if anchor is not None:
                        anchor.update_parameters(accelerator.unwrap_model(model))
                    if steps == 12 and load is None:
                        ema.save_state(str(tmp_path / "ckpt"), steps)
                if steps == stop:
                    break
        ema.close()
        return model

    straight = client.create_run(f"{run_name}-a", profiles=profiles())
    anchor = AveragedModel(net(0), multi_avg_fn=get_ema_multi_avg_fn(BETA))
    train(straight, STEPS, anchor=anchor)
    assert close(straight.fetch_ema("ema"), averaged(anchor))

    run = client.create_run(f"{run_name}-b", profiles=profiles())
    train(run, 12)
    train(run, STEPS, load=str(tmp_path / "ckpt"))
    assert equal(run.fetch_ema("ema"), straight.fetch_ema("ema"))
