"""Trainer metrics reach the run without glue: what Lightning's own CSV
logger records beside ``PolyakLogger``, what the transformers Trainer
keeps in ``state.log_history`` (training logs and ``evaluate``'s metrics),
and what ``accelerator.log`` gives a tracker beside ``PolyakTracker``
equal the run's metric series step for step."""

from __future__ import annotations

import csv
import math

import torch
from test_integrations import data, net
from torch import nn


def series(run, names) -> dict[str, dict[int, float]]:
    got = run.metrics(names)
    return {n: dict(got.get(n, [])) for n in names}


def test_lightning_logger_beside_the_csv_logger(client, run_name, tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from polyak.integrations.lightning import PolyakLogger

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net(3)

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    run = client.create_run(run_name, profiles=[{"name": "ema", "kind": "constant", "beta": 0.9}])
    loader = torch.utils.data.DataLoader(data(), batch_size=16)
    val = torch.utils.data.DataLoader(data(7), batch_size=16)
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(
        max_epochs=2,
        logger=[csv_logger, PolyakLogger(run)],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
    )
    trainer.fit(Module(), loader, val)
    want: dict[str, dict[int, float]] = {"train_loss": {}, "val_loss": {}, "epoch": {}}
    with open(csv_logger.log_dir + "/metrics.csv") as f:
        for row in csv.DictReader(f):
            for name in want:
                if row.get(name):
                    want[name][int(row["step"])] = float(row[name])
    assert len(want["train_loss"]) == 12 and len(want["val_loss"]) == 2
    got = series(run, list(want))
    for name in want:
        assert set(got[name]) == set(want[name]), name
        for step, value in want[name].items():
            # The CSV holds the value as text: equal to float32 precision.
            assert math.isclose(got[name][step], value, rel_tol=1e-6), (name, step)


def test_transformers_callback_forwards_logs_and_evaluations(client, run_name, tmp_path):
    import transformers
    from polyak.integrations.transformers import PolyakTrainerCallback

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net(9)

        def forward(self, x, labels):
            out = self.net(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    # `labels`: the Trainer computes an evaluation loss only with them.
    rows = [{"x": x, "labels": y} for x, y in data()]
    evals = [{"x": x, "labels": y} for x, y in data(7)]
    run = client.create_run(run_name, profiles=[{"name": "ema", "kind": "constant", "beta": 0.9}])
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=16,
        max_steps=8,
        eval_strategy="steps",
        eval_steps=4,
        logging_steps=1,
        save_strategy="no",
        learning_rate=2e-2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=3,
    )
    trainer = transformers.Trainer(
        model=Regressor(),
        args=args,
        train_dataset=rows,
        eval_dataset=evals,
        callbacks=[PolyakTrainerCallback(run)],
    )
    trainer.train()
    final = trainer.evaluate()
    want: dict[str, dict[int, float]] = {}
    for entry in trainer.state.log_history:
        for name, value in entry.items():
            if name != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                want.setdefault(name, {})[int(entry["step"])] = float(value)
    assert len(want["loss"]) == 8 and set(want["eval_loss"]) == {4, 8}
    assert want["eval_loss"][8] == final["eval_loss"]
    got = series(run, list(want))
    assert got == want
    # Each point once: `evaluate` logs its metrics and calls `on_evaluate`.
    raw = client.request("GET", f"{run.path}/metrics", params={"names": "eval_loss"}).json()
    (eval_series,) = raw["series"]
    assert [p[0] for p in eval_series["points"]] == [4, 8, 8][: len(eval_series["points"])]
    assert len(eval_series["points"]) == 3  # two during training, one after


def test_accelerate_tracker_beside_another(client, run_name, tmp_path):
    import accelerate
    from accelerate.tracking import GeneralTracker
    from polyak.integrations.accelerate import PolyakTracker

    class Recording(GeneralTracker):
        """A tracker writing what it is given, as accelerate's own do."""

        name = "recording"
        requires_logging_directory = False
        main_process_only = True

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[int, dict]] = []

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            self.logged.append((step, dict(values)))

    run = client.create_run(run_name, profiles=[{"name": "ema", "kind": "constant", "beta": 0.9}])
    recording = Recording()
    accelerator = accelerate.Accelerator(cpu=True, log_with=[recording, PolyakTracker(run)])
    accelerator.init_trackers("metrics")
    model = net(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = accelerator.prepare(model, opt)
    x, y = data().tensors
    for step in range(6):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        accelerator.log({"loss": loss, "lr": 0.05, "note": "text is left out"}, step=step)
    accelerator.end_training()
    want: dict[str, dict[int, float]] = {"loss": {}, "lr": {}}
    for step, values in recording.logged:
        for name in want:
            value = values[name]
            want[name][step] = float(value.item() if hasattr(value, "item") else value)
    assert len(want["loss"]) == 6
    assert series(run, ["loss", "lr"]) == want
    assert "note" not in run.metrics()
