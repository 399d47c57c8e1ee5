"""Evaluations written to the trackers people keep open beside polyak:
TensorBoard (a ``torch.utils.tensorboard.SummaryWriter``) and Weights &
Biases (a run from ``wandb.init``). ``EvalWorker(..., log_to=...)``,
``posthoc_search(..., log_to=...)`` and ``python -m polyak export`` write
through here.

Where an evaluation lands (one scalar per metric):

- a live profile's candidate, the online weights or a merge:
  ``eval/<metric>/<profile>`` at the candidate's step (W&B: against the
  custom x axis ``eval/step``), so each profile is a line over training;
- a post-hoc result: ``posthoc/<metric>/step_<S>``, one curve per sweep
  (``S``: the training step it was synthesised at) against the EMA
  length; and its fit residual as ``posthoc/residual/step_<S>``. W&B plots
  it against the custom x axis ``posthoc/sigma_rel``; TensorBoard's x axis
  is an integer step, so there the step is ``round(sigma_rel *
  SIGMA_REL_SCALE)`` (sigma_rel 0.05 is drawn at 500).

Neither tensorboard nor wandb is imported here: a writer is known by its
methods, so both stay optional.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "SIGMA_REL_SCALE",
    "TensorBoardLog",
    "Tracker",
    "WandbLog",
    "evaluation_scalars",
    "trackers_for",
]

#: TensorBoard's step of a post-hoc point: sigma_rel times this, rounded.
SIGMA_REL_SCALE = 10_000

#: The W&B x axes (custom step metrics) of the two families.
EVAL_AXIS = "eval/step"
POSTHOC_AXIS = "posthoc/sigma_rel"


def evaluation_scalars(
    evaluation: Mapping[str, Any], *, with_evaluator: bool = False
) -> tuple[str, float, dict[str, float]]:
    """An evaluation (as ``Run.post_eval`` and ``Run.evals`` answer it) as
    ``(axis, x, {tag: value})``: ``axis`` is :data:`EVAL_AXIS` with ``x``
    the candidate's step, or :data:`POSTHOC_AXIS` with ``x`` its sigma_rel.
    ``with_evaluator`` appends ``@<evaluator>`` to each tag of a named
    evaluator (an export holds every evaluator's evaluations)."""
    suffix = ""
    if with_evaluator and evaluation.get("evaluator"):
        suffix = f"@{evaluation['evaluator']}"
    metrics = {str(k): float(v) for k, v in evaluation["metrics"].items()}
    step = int(evaluation["step"])
    sigma_rel = evaluation.get("sigma_rel")
    if evaluation.get("kind") == "posthoc" and sigma_rel is not None:
        sweep = f"step_{step}{suffix}"
        values = {f"posthoc/{name}/{sweep}": v for name, v in metrics.items()}
        if evaluation.get("residual") is not None:
            values[f"posthoc/residual/{sweep}"] = float(evaluation["residual"])
        return POSTHOC_AXIS, float(sigma_rel), values
    profile = evaluation["profile"]
    return (
        EVAL_AXIS,
        float(step),
        {f"eval/{name}/{profile}{suffix}": v for name, v in metrics.items()},
    )


class Tracker(Protocol):
    """Something evaluations are written to."""

    def evaluation(self, evaluation: Mapping[str, Any]) -> None: ...


class TensorBoardLog:
    """Writes to a ``SummaryWriter``: each value a ``simple_value`` scalar,
    as ``add_scalar`` writes it by default, which every TensorBoard reader
    sees (``EventAccumulator.Scalars``, the scalars dashboard, tbparse).
    A ``simple_value`` is a float32: the value is rounded to it."""

    def __init__(self, writer: Any, *, with_evaluator: bool = False) -> None:
        self.writer = writer
        self.with_evaluator = with_evaluator

    def scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        self.writer.add_scalar(tag, value, step, wall_time)

    def evaluation(self, evaluation: Mapping[str, Any]) -> None:
        axis, x, values = evaluation_scalars(evaluation, with_evaluator=self.with_evaluator)
        step = round(x * SIGMA_REL_SCALE) if axis == POSTHOC_AXIS else int(x)
        at_ms = evaluation.get("at_ms")
        wall_time = None if at_ms is None else float(at_ms) / 1000.0
        for tag, value in values.items():
            self.scalar(tag, value, step, wall_time)
        # An evaluation is rare and costly: make it visible at once.
        self.writer.flush()


class WandbLog:
    """Writes to a W&B run. Each family gets its own x axis
    (``define_metric``) and is logged without ``step=``: wandb drops a
    ``step=`` below the run's current one, and an evaluation of a past
    step (or a post-hoc length) is plotted where it belongs against its
    own axis. Each evaluation takes one row of wandb's own counter
    (``_step``), which a trainer logging ``step=`` in the same run must
    stay ahead of (evaluations from another process: their own run)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._axes: set[str] = set()

    def evaluation(self, evaluation: Mapping[str, Any]) -> None:
        axis, x, values = evaluation_scalars(evaluation)
        if axis not in self._axes:
            family = axis.split("/", 1)[0]
            self.run.define_metric(axis)
            self.run.define_metric(f"{family}/*", step_metric=axis)
            self._axes.add(axis)
        self.run.log({axis: int(x) if axis == EVAL_AXIS else x, **values})


def _tracker_for(target: Any) -> Tracker:
    if callable(getattr(target, "evaluation", None)):
        return target  # already a tracker
    if callable(getattr(target, "add_scalar", None)):
        return TensorBoardLog(target)
    if callable(getattr(target, "log", None)) and callable(getattr(target, "define_metric", None)):
        return WandbLog(target)
    raise TypeError(
        f"log_to: expected a torch.utils.tensorboard.SummaryWriter or a wandb run, "
        f"got {type(target).__name__}"
    )


def trackers_for(log_to: Any) -> list[Tracker]:
    """``log_to`` (``None``, a writer, a wandb run, or a list of them) as
    trackers."""
    if log_to is None:
        return []
    if isinstance(log_to, Sequence) and not isinstance(log_to, (str, bytes)):
        return [_tracker_for(t) for t in log_to]
    return [_tracker_for(log_to)]
