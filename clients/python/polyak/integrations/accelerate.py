"""polyak in a training loop written with HuggingFace ``accelerate``.

```python
from polyak.integrations.accelerate import PolyakAccelerate
ema = PolyakAccelerate(accelerator, run)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
ema.attach(model, optimizer, steps_taken=steps_done)   # 0, or the checkpoint's
for batch in loader:
    with accelerator.accumulate(model):
        accelerator.backward(loss(model, batch))
        optimizer.step()          # a push after each real optimizer step
        optimizer.zero_grad()
ema.save_state(out_dir, steps_taken)   # accelerator.save_state + a snapshot
```

``attach`` hooks the optimizer under accelerate's ``AcceleratedOptimizer``,
whose ``step()`` steps it only when gradients are synchronised, so gradient
accumulation pushes once per optimizer step. With ``steps_taken > 0``
(after ``accelerator.load_state``) the main process first restores the EMA
of that step with ``run.resume``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import accelerate
    import torch
    from torch import nn

    from ..client import Run
    from ..pusher import Attachment, Pusher

__all__ = ["PolyakAccelerate", "PolyakTracker"]


class PolyakAccelerate:
    """One process's pushes for a loop run by ``accelerator``."""

    def __init__(self, accelerator: accelerate.Accelerator, run: Run, **pusher_options: Any):
        self.accelerator = accelerator
        self.run = run
        self.pusher: Pusher = run.pusher(rank=accelerator.process_index, **pusher_options)
        self.attachment: Attachment | None = None

    def attach(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, steps_taken: int = 0
    ) -> Attachment:
        """Pushes ``model`` after every optimizer step; ``steps_taken``: the
        optimizer steps the loop already took (restored from a checkpoint)."""
        if steps_taken > 0:
            if self.accelerator.is_main_process:
                self.run.resume(steps_taken=steps_taken)
            self.accelerator.wait_for_everyone()
        inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer
        self.attachment = self.pusher.attach(
            inner, self.accelerator.unwrap_model(model), start_step=steps_taken
        )
        return self.attachment

    def save_state(self, output_dir: str, steps_taken: int, **kwargs: Any) -> Any:
        """``accelerator.save_state(output_dir)`` and a snapshot of the EMA
        at that step, so that resuming from it is exact."""
        out = self.accelerator.save_state(output_dir, **kwargs)
        self.snapshot(steps_taken)
        return out

    def snapshot(self, steps_taken: int) -> dict[str, Any] | None:
        """A snapshot at ``steps_taken - 1`` once every process pushed it
        (the main process asks and waits; others get ``None``)."""
        self.pusher.flush()
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            from ._server import best_effort

            return best_effort(
                f"the EMA snapshot of the checkpoint at step {steps_taken - 1}",
                lambda: self.run.snapshot(step=steps_taken - 1, label="checkpoint"),
            )
        return None

    def close(self, *, finish: bool = False) -> None:
        """Flushes and stops the pusher; ``finish``: finish the run."""
        if self.attachment is not None:
            self.attachment.remove()
        self.pusher.close()
        if finish:
            self.accelerator.wait_for_everyone()
            if self.accelerator.is_main_process:
                from ._server import best_effort

                best_effort(f"finishing run {self.run.name}", self.run.finish)


def _general_tracker() -> type:
    from accelerate.tracking import GeneralTracker

    return GeneralTracker


class PolyakTracker(_general_tracker()):  # type: ignore[misc]
    """An accelerate tracker: ``Accelerator(log_with=[PolyakTracker(run)])``
    sends what ``accelerator.log(values, step=step)`` records to ``run``'s
    metrics at that step (on the main process; non-finite values and
    non-numbers left out)."""

    name = "polyak"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run

    @property
    def tracker(self) -> Run:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """The run's configuration lives on the server: nothing to store."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        from ._metrics import finite_scalars
        from ._server import best_effort

        scalars = finite_scalars(values)
        if scalars and step is not None:
            best_effort("sending metrics", lambda: self.run.log(int(step), **scalars))
