"""A PyTorch Lightning callback that pushes to a polyak run.

```python
from polyak.integrations.lightning import PolyakCallback
run = polyak.Client(url).create_run("exp", world_size=trainer_world_size,
                                    profiles=[...], exist_ok=True)
trainer = L.Trainer(callbacks=[PolyakCallback(run, eval_profile="ema")])
trainer.fit(model, ckpt_path=...)   # a Lightning checkpoint resumes the EMA too
```

What it does, in Lightning's terms:

- ``on_train_start``: one pusher per process (rank ``trainer.global_rank``),
  attached to the optimizer (a push after every optimizer step, so
  ``accumulate_grad_batches`` pushes once per step). When the trainer was
  restored from a checkpoint (``trainer.global_step > 0``, the steps taken),
  global rank 0 first restores the EMA of that step
  (``run.resume(steps_taken=global_step)``) and the others wait at a barrier.
- ``on_save_checkpoint``: the checkpoint's step gets a snapshot (global rank
  0 asks for it and waits until it is durable), so resuming from that
  checkpoint is exact. Lightning may save several files for one step
  (``ModelCheckpoint(save_last=True)`` writes ``epoch=…ckpt`` and
  ``last.ckpt``): they share that step's one snapshot.
- Validation and test: with ``eval_profile``, the EMA of that profile is in
  the model for the loop and the online weights come back after it (never
  during the sanity check, which runs before any push).
- ``on_train_end``: pushes are flushed; with ``finish=True`` the run is
  finished (final snapshot).

The pushed module is ``trainer.strategy.model`` (the client unwraps DDP and
reads FSDP1 and FSDP2/DTensor state dicts), so names are those of the
LightningModule's ``state_dict()``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import Logger as _LightningLogger
from lightning.pytorch.utilities import rank_zero_only as _rank_zero_only

from ..errors import PolyakError
from ._metrics import finite_scalars
from ._server import best_effort

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ..client import Run
    from ..pusher import Attachment, Pusher

__all__ = ["PolyakCallback", "PolyakLogger"]


class PolyakCallback(Callback):
    """Pushes a LightningModule to ``run`` after every optimizer step.

    ``eval_profile``: the profile whose EMA validation and test run on
    (``None``: the online weights). ``snapshot_on_checkpoint``: a snapshot
    at each checkpoint's step (needed to resume exactly). ``finish``: finish
    the run when training ends. Other keyword arguments go to
    :meth:`Run.pusher` (``dtype``, ``skip``, ``max_queue``, ...).
    """

    def __init__(
        self,
        run: Run,
        *,
        eval_profile: str | None = None,
        snapshot_on_checkpoint: bool = True,
        finish: bool = False,
        **pusher_options: Any,
    ) -> None:
        self.run = run
        self.eval_profile = eval_profile
        self.snapshot_on_checkpoint = snapshot_on_checkpoint
        self.finish = finish
        self.pusher_options = pusher_options
        self.pusher: Pusher | None = None
        self._attachment: Attachment | None = None
        self._swapped: contextlib.ExitStack | None = None
        #: The step whose snapshot this callback took last: another
        #: checkpoint file of the same step reuses it.
        self._snapshot_step: int | None = None

    @staticmethod
    def _module(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        return trainer.strategy.model if trainer.strategy.model is not None else pl_module

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps_taken = int(trainer.global_step)
        if steps_taken > 0:
            # Restored from a Lightning checkpoint of `steps_taken` steps.
            if trainer.is_global_zero:
                self.run.resume(steps_taken=steps_taken)
            trainer.strategy.barrier("polyak-resume")
        if self.pusher is None:
            self.pusher = self.run.pusher(rank=trainer.global_rank, **self.pusher_options)
        (optimizer,) = trainer.optimizers
        self._attachment = self.pusher.attach(
            optimizer, self._module(trainer, pl_module), start_step=steps_taken
        )

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not self.snapshot_on_checkpoint or self.pusher is None or trainer.global_step == 0:
            return
        step = trainer.global_step - 1
        # Every rank sees the same global step, so all skip together (no
        # rank waits at a barrier the others never reach).
        if step == self._snapshot_step:
            return
        self.pusher.flush()
        trainer.strategy.barrier("polyak-flush")
        if trainer.is_global_zero:
            # Every rank has pushed this step: the cut is taken at once.
            best_effort(
                f"the EMA snapshot of the checkpoint at step {step} (resuming from it "
                "will not be exact)",
                lambda: self.run.snapshot(step=step, label="checkpoint"),
            )
        self._snapshot_step = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._attachment is not None:
            self._attachment.remove()
            self._attachment = None
        if self.pusher is not None:
            self.pusher.flush()
        if self.finish:
            trainer.strategy.barrier("polyak-finish")
            if trainer.is_global_zero:
                best_effort(f"finishing run {self.run.name}", self.run.finish)

    # -- evaluation on the EMA ---------------------------------------------

    def _swap_in(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.eval_profile is None or trainer.sanity_checking:
            return
        if self.pusher is None:  # `trainer.test` / `validate` without training
            self.pusher = self.run.pusher(rank=trainer.global_rank, **self.pusher_options)
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(
                self.pusher.ema_weights(self._module(trainer, pl_module), self.eval_profile)
            )
        except PolyakError as e:
            if e.code != "no_data":
                raise
            return  # nothing pushed yet: the online weights are all there is
        self._swapped = stack

    def _swap_out(self) -> None:
        if self._swapped is not None:
            self._swapped.close()
            self._swapped = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_in(trainer, pl_module)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out()


class PolyakLogger(_LightningLogger):  # type: ignore[misc]
    """A Lightning ``Logger`` that sends what ``self.log(...)`` records to
    ``run``'s metrics, at the trainer's step; usable beside TensorBoard,
    CSV or W&B loggers (``Trainer(logger=[csv, PolyakLogger(run)])``).

    Lightning calls it on global rank 0 only. Non-finite values are left
    out (the server refuses them); tensors become floats.
    """

    def __init__(self, run: Run, *, prefix: str = "") -> None:
        super().__init__()
        self.run = run
        self.prefix = prefix

    @property
    def name(self) -> str:
        return "polyak"

    @property
    def version(self) -> str:
        return self.run.name

    @_rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Hyperparameters are the run's configuration here: nothing to send."""

    @_rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        values = finite_scalars(metrics, self.prefix)
        if values and step is not None:
            best_effort("sending metrics", lambda: self.run.log(int(step), **values))
