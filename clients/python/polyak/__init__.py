"""Client for polyak, the network-served EMA service for PyTorch training.

```python
import polyak
client = polyak.Client("http://127.0.0.1:8080")
run = client.create_run("exp1", world_size=2, profiles=[{"name": "ema", "kind": "constant", "beta": 0.999}])
pusher = run.pusher(rank=rank)
pusher.attach(optimizer, model)          # pushes after every optimizer.step()
...
pusher.flush()
with pusher.ema_weights(model, "ema"):
    evaluate(model)
```

Layout:

- :mod:`polyak.client`: ``Client`` and ``Run`` (runs, ranks, the live EMA,
  snapshots, downloads, compare, resume, post-hoc EMA, metrics).
- :mod:`polyak.pusher`: ``Pusher`` (host copies: buffers on the training
  thread, parameters on a copy thread with ``attach``; a bounded queue, a
  sender thread with retries), ``attach``, ``load_ema_into`` and
  ``ema_weights``.
- :mod:`polyak.shards`: what this rank holds (FSDP2/DTensor, FSDP1, DDP,
  ``torch.compile``, plain), and joining chunks back.
- :mod:`polyak.wire`: safetensors push bodies written in place; reading EMA files.
- :mod:`polyak.downloads`: snapshot downloads with a progress bar.
- :mod:`polyak.evals`: evaluations of EMA candidates, ``EvalWorker`` and
  ``posthoc_search``.
- :mod:`polyak.contract`: the values the server sends (snapshot statuses
  and kinds, event kinds, run health, rank and node statuses, alert kinds,
  download layouts) as enums.
- :mod:`polyak.views`: typed answers (``RunInfo``, ``RankInfo``,
  ``SnapshotInfo``, ``Evaluation``, ``Best``, ``PosthocResult``) that
  still read as their JSON mappings.
- :mod:`polyak._transport`: the one way to the server (connection reuse,
  auth headers, retries, streamed bodies); :mod:`polyak._push`: the
  pusher's queue, copy thread, encoding and sender.
- :mod:`polyak.compat`: drop-ins for ``AveragedModel``, ema-pytorch's
  ``EMA`` and ``PostHocEMA``, timm's ``ModelEmaV2/V3``, diffusers' ``EMAModel`` and Lightning's
  weight averaging, with the EMA on the server.
- :mod:`polyak.cli`: ``python -m polyak``.
"""

from ._version import __version__
from .client import Client, RankEma, Run
from .errors import PolyakError
from .evals import EvalWorker
from .pusher import Attachment, Pusher, PushStats, RetryPolicy
from .shards import assemble
from .views import Best, Evaluation, PosthocResult, RankInfo, RunInfo, SnapshotInfo
from .wire import Chunk

__all__ = [
    "Attachment",
    "Best",
    "Chunk",
    "Client",
    "EvalWorker",
    "Evaluation",
    "PolyakError",
    "PosthocResult",
    "PushStats",
    "Pusher",
    "RankEma",
    "RankInfo",
    "RetryPolicy",
    "Run",
    "RunInfo",
    "SnapshotInfo",
    "__version__",
    "assemble",
]
