"""A HuggingFace ``transformers`` ``TrainerCallback`` that pushes to polyak.

```python
from polyak.integrations.transformers import PolyakTrainerCallback
trainer = Trainer(model, args, ..., callbacks=[PolyakTrainerCallback(run)])
trainer.train(resume_from_checkpoint=...)   # resumes the EMA of that checkpoint too
```

- ``on_step_end`` (after each optimizer step, so with
  ``gradient_accumulation_steps`` once per step): pushes the model at
  ``state.global_step - 1`` (``global_step`` counts steps taken).
- ``on_save`` (``save_steps``, ``save_strategy``): a snapshot at the saved
  step, so resuming from that checkpoint is exact.
- ``on_train_begin`` after ``resume_from_checkpoint``
  (``state.global_step > 0``): the EMA of that step is restored
  (``run.resume(steps_taken=global_step)``) before the first push.
- ``on_train_end``: flushed; with ``finish=True`` the run is finished.

Evaluating on the EMA: ``with callback.ema_weights(trainer.model):
trainer.evaluate()`` (the Trainer has no hook before evaluation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from ._metrics import finite_scalars
from ._server import best_effort

if TYPE_CHECKING:
    from torch import nn

    from ..client import Run
    from ..pusher import Pusher

__all__ = ["PolyakTrainerCallback"]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class PolyakTrainerCallback(TrainerCallback):  # type: ignore[misc]
    """Pushes the Trainer's model to ``run`` after every optimizer step.

    ``snapshot_on_save``: a snapshot at each checkpoint's step (needed to
    resume exactly). ``finish``: finish the run when training ends. Other
    keyword arguments go to :meth:`Run.pusher`.
    """

    def __init__(
        self,
        run: Run,
        *,
        snapshot_on_save: bool = True,
        finish: bool = False,
        log_metrics: bool = True,
        **pusher_options: Any,
    ) -> None:
        self.run = run
        self.snapshot_on_save = snapshot_on_save
        self.finish = finish
        self.log_metrics = log_metrics
        self.pusher_options = pusher_options
        self.pusher: Pusher | None = None
        # What the last `on_log` sent: `evaluate` logs its metrics and then
        # calls `on_evaluate` with the same ones, sent once.
        self._logged: tuple[int, set[str]] = (-1, set())

    def _pusher(self) -> Pusher:
        if self.pusher is None:
            self.pusher = self.run.pusher(rank=_rank(), **self.pusher_options)
        return self.pusher

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step > 0:  # resume_from_checkpoint
            if state.is_world_process_zero:
                self.run.resume(steps_taken=state.global_step)
            _barrier()
        self._pusher()

    def on_step_end(
        self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
    ) -> None:
        if model is not None:
            self._pusher().push(model, state.global_step - 1)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.snapshot_on_save or state.global_step == 0:
            return
        self._pusher().flush()
        _barrier()
        if state.is_world_process_zero:
            step = state.global_step - 1
            best_effort(
                f"the EMA snapshot of the checkpoint at step {step}",
                lambda: self.run.snapshot(step=step, label="checkpoint"),
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._pusher().flush()
        if self.finish:
            _barrier()
            if state.is_world_process_zero:
                best_effort(f"finishing run {self.run.name}", self.run.finish)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """The Trainer's logs (``loss``, ``learning_rate``, ``eval_*``) as
        run metrics at ``state.global_step``, as its own loggers record them."""
        if not self.log_metrics or not logs or not state.is_world_process_zero:
            return
        values = finite_scalars(logs)
        if values:
            step = int(state.global_step)
            best_effort("sending metrics", lambda: self.run.log(step, **values))
        self._logged = (int(state.global_step), set(values))

    def on_evaluate(
        self,
        args: Any,
        state: Any,
        control: Any,
        metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Evaluation metrics not already sent through ``on_log``."""
        if not self.log_metrics or not metrics or not state.is_world_process_zero:
            return
        step, sent = self._logged
        values = finite_scalars(metrics)
        if step == int(state.global_step):
            values = {k: v for k, v in values.items() if k not in sent}
        if values:
            step = int(state.global_step)
            best_effort("sending metrics", lambda: self.run.log(step, **values))

    @contextlib.contextmanager
    def ema_weights(self, model: nn.Module, profile: str | None = None) -> Iterator[nn.Module]:
        """The EMA in ``model`` for the block (``trainer.evaluate()``), the
        online weights restored after it."""
        with self._pusher().ema_weights(model, profile):
            yield model
