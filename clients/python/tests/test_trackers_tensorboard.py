"""What :mod:`polyak.trackers` writes to a ``SummaryWriter`` (``log_to=``
and ``python -m polyak export``) is ``simple_value`` scalars, as
``SummaryWriter.add_scalar`` writes them: TensorBoard's
``EventAccumulator.Scalars`` (which the scalars dashboard and most readers
use) sees every value, and no tensor events are written."""

from __future__ import annotations

import struct

from polyak.trackers import TensorBoardLog, trackers_for
from tensorboard.backend.event_processing.event_accumulator import (
    SCALARS,
    TENSORS,
    EventAccumulator,
)
from torch.utils.tensorboard import SummaryWriter


def f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def read(directory) -> EventAccumulator:
    acc = EventAccumulator(str(directory), size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    return acc


def test_log_to_writes_scalars_every_reader_sees(tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path))
    (tracker,) = trackers_for(writer)
    tracker.evaluation(
        {
            "kind": "ema",
            "profile": "p10",
            "step": 40,
            "metrics": {"val_loss": 0.16912345678, "accuracy": 0.5},
            "at_ms": 1_700_000_000_250,
        }
    )
    tracker.evaluation(
        {
            "kind": "posthoc",
            "profile": "posthoc",
            "step": 40,
            "sigma_rel": 0.05,
            "residual": 0.003,
            "metrics": {"val_loss": 0.186},
        }
    )
    writer.close()
    acc = read(tmp_path)
    assert acc.Tags()[TENSORS] == []
    assert sorted(acc.Tags()[SCALARS]) == [
        "eval/accuracy/p10",
        "eval/val_loss/p10",
        "posthoc/residual/step_40",
        "posthoc/val_loss/step_40",
    ]
    (point,) = acc.Scalars("eval/val_loss/p10")
    assert (point.step, point.value, point.wall_time) == (40, f32(0.16912345678), 1_700_000_000.25)
    (point,) = acc.Scalars("posthoc/val_loss/step_40")
    assert (point.step, point.value) == (500, f32(0.186))  # sigma_rel 0.05 at 500
    (point,) = acc.Scalars("posthoc/residual/step_40")
    assert (point.step, point.value) == (500, f32(0.003))


def test_export_scalar_is_a_simple_value(tmp_path):
    """The export's series go through ``TensorBoardLog.scalar``."""
    writer = SummaryWriter(log_dir=str(tmp_path))
    log = TensorBoardLog(writer)
    for step, value in [(0, 2.5), (1, 1.25), (2, 0.1)]:
        log.scalar("train_loss", value, step, 100.0 + step)
    writer.close()
    acc = read(tmp_path)
    assert acc.Tags()[TENSORS] == []
    assert [(e.step, e.value, e.wall_time) for e in acc.Scalars("train_loss")] == [
        (0, 2.5, 100.0),
        (1, 1.25, 101.0),
        (2, f32(0.1), 102.0),
    ]
