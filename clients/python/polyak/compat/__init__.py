"""Drop-ins for the EMA classes training code already uses: change the
import line, keep the code; the EMA is kept by a polyak server.

| original | drop-in |
| --- | --- |
| ``torch.optim.swa_utils.AveragedModel`` | :mod:`polyak.compat.swa_utils` |
| ``ema_pytorch.EMA``, ``PostHocEMA`` | :mod:`polyak.compat.ema_pytorch` |
| timm ``ModelEmaV2`` / ``ModelEmaV3`` | :mod:`polyak.compat.timm` |
| diffusers ``EMAModel`` | :mod:`polyak.compat.diffusers` |
| Lightning ``EMAWeightAveraging``, ``WeightAveraging`` | :mod:`polyak.compat.lightning` |
| TRL ``BEMACallback`` | :mod:`polyak.compat.trl` |

Each class takes the original's arguments (positional and keyword, the same
defaults) plus keyword-only ``url=`` (default ``$POLYAK_URL``, else
``http://127.0.0.1:8080``), ``token=`` (``$POLYAK_TOKEN``), ``run=``
(default a generated name, logged with the server's URL) and
``pusher_options=`` (passed to :class:`polyak.Pusher`). Its schedule maps to
one server profile that gives the original's numbers; updates push the
weights, reads (``.module``, ``.ema_model``, ``shadow_params``,
``copy_to``, ``state_dict``, calling the object) copy the server's EMA into
the object's own tensors in place. A read raises when the server cannot be
reached rather than hand back stale values. The submodules are imported on
their own (``from polyak.compat.timm import ModelEmaV3``); each needs its
original installed (it subclasses it). The migration table is in the
client's README.

``posthoc=N`` (keyword-only, on every drop-in) keeps EDM2's two
power-function profiles (sigma_rel 0.05 and 0.10) beside the drop-in's own
and a snapshot every ``N`` steps; :func:`run_of` gives the run, on which
``posthoc_search``, ``EvalWorker`` and downloads work as on a native run.
"""

from ._remote import run_of

__all__ = ["run_of"]
