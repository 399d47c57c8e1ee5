"""Lightning's ``WeightAveraging`` and ``EMAWeightAveraging`` with the
average kept by polyak.

Subclasses of Lightning's own callbacks (same arguments, plus keyword-only
``url=``, ``token=``, ``run=``, ``pusher_options=``) whose averaged model is
:class:`polyak.compat.swa_utils.AveragedModel`: everything else (when to
update, swapping the average in for validation, copying it into the model
at the end of training, checkpointing the average under ``state_dict`` and
resuming from it) is Lightning's code, so it behaves as Lightning
documents. Resuming from a checkpoint starts a fresh run from the average
it holds (see ``AveragedModel.load_state_dict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.callbacks import weight_averaging as _lightning
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .swa_utils import AveragedModel

__all__ = ["EMAWeightAveraging", "WeightAveraging"]


class _ServedAverage:
    """Lightning's ``setup`` with polyak's ``AveragedModel``."""

    _device: Any
    _use_buffers: bool
    _kwargs: dict[str, Any]
    _average_model: Any

    def __init__(
        self,
        *args: Any,
        url: str | None = None,
        token: str | None = None,
        run: str | None = None,
        pusher_options: Mapping[str, Any] | None = None,
        posthoc: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._polyak = {
            "url": url,
            "token": token,
            "run": run,
            "pusher_options": pusher_options,
            "posthoc": posthoc,
        }

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        device = self._device or pl_module.device
        if is_overridden("configure_model", pl_module):
            rank_zero_warn(
                "You're using the WeightAveraging callback with a model that overrides the "
                "configure_model callback. WeightAveraging doesn't support sharding model layers, "
                "so you may run out of memory."
            )
            pl_module.configure_model()
        self._average_model = AveragedModel(
            pl_module, device, use_buffers=self._use_buffers, **self._kwargs, **self._polyak
        )


class WeightAveraging(_ServedAverage, _lightning.WeightAveraging):
    """Lightning's ``WeightAveraging`` with the average kept by a polyak
    server."""


class EMAWeightAveraging(_ServedAverage, _lightning.EMAWeightAveraging):
    """Lightning's ``EMAWeightAveraging`` with the EMA kept by a polyak
    server."""
