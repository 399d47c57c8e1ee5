"""Training processes spawned by the distributed client tests (gloo on CPU).

Each rank trains the same :class:`TinyTransformer` wrapped in FSDP2, FSDP1,
DDP or an HSDP 2-D mesh, pushes through the client (``attach`` on the
optimizer), and keeps the anchors on an unsharded copy loaded with the
gathered weights after every step. Rank 0 saves the anchors and the checks
of ``ema_weights`` for the test process, which reads the server's EMA and
compares.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polyak
import torch
import torch.distributed as dist
from ema_pytorch import EMA
from polyak_testing.refs import (
    TinyTransformer,
    averaged_state,
    batch,
    clone_state,
    copies_held_until_waited,
    ema_pytorch_state,
    train_step,
)
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def run_ranks(
    fn: Callable[[int, int, dict[str, Any]], None], world: int, cfg: dict[str, Any]
) -> None:
    """Runs ``fn(rank, world, cfg)`` in ``world`` processes and waits for
    them (a failure in any is raised here, as ``torch.multiprocessing.spawn``
    does).

    The processes are forked from a fork server that has imported torch and
    this module once, and run nothing else: each starts in a fraction of a
    second, where a spawned one imports torch itself (three at once took
    ~13 s on a loaded 2-core machine)."""
    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", __name__])
    mp.start_processes(fn, args=(world, cfg), nprocs=world, join=True, start_method="forkserver")


def _init(rank: int, world: int, init_method: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)


def _full_from_dtensors(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
    return out


def _wrap(kind: str, model: nn.Module) -> tuple[nn.Module, Any]:
    """The wrapped model and a function returning its whole state dict."""
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for name in ("qkv", "fc1", "head"):
            fully_shard(getattr(model, name))
        fully_shard(model)
        return model, lambda: _full_from_dtensors(model)
    if kind == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, lambda: _full_from_dtensors(model)
    if kind == "fsdp1":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        wrapped = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
        full = StateDictOptions(full_state_dict=True)
        return wrapped, lambda: clone_state(get_model_state_dict(wrapped, options=full))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
        return wrapped, lambda: clone_state(wrapped.module.state_dict())
    raise ValueError(kind)


def train_worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """``cfg``: kind, init, url, runs {constant, warmup}, beta, warmup (kwargs),
    steps, out. The warmup run has ``update_every=5``. Pushes through
    ``attach`` defer their parameter copies, each held until the next
    optimizer step waits for it."""
    _init(rank, world, cfg["init"])
    try:
        torch.manual_seed(0)
        base = TinyTransformer()
        ref = copy.deepcopy(base)  # unsharded: the anchors run on it
        model, gather = _wrap(cfg["kind"], base)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
        client = polyak.Client(cfg["url"])
        run_c = client.run(cfg["runs"]["constant"])
        run_w = client.run(cfg["runs"]["warmup"])
        push_c = run_c.pusher(rank=rank)
        push_w = run_w.pusher(rank=rank)
        push_c.attach(opt, model)
        state_dict_pusher = cfg.get("warmup_from") == "get_model_state_dict"
        if not state_dict_pusher:
            push_w.attach(opt, model)
        avg = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(cfg["beta"]), use_buffers=True)
        ema = EMA(ref, update_every=5, **cfg["warmup"])
        gen = torch.Generator().manual_seed(1000 + rank)
        # Every deferred parameter copy runs only once the next step waits
        # for it: after that step's forward and backward.
        with copies_held_until_waited() as held:
            for step in range(cfg["steps"]):
                train_step(model, opt, gen)
                if state_dict_pusher and push_w.should_push(step):
                    from torch.distributed.checkpoint.state_dict import (
                        StateDictOptions,
                        get_model_state_dict,
                    )

                    sd = get_model_state_dict(
                        model, options=StateDictOptions(full_state_dict=False)
                    )
                    push_w.push(sd, step)
                ref.load_state_dict(gather())
                avg.update_parameters(ref)
                ema.update()
            push_c.flush()
            push_w.flush()
        online = gather()

        # ema_weights: the EMA swapped in for evaluation, online weights back after.
        x = batch(torch.Generator().manual_seed(7), size=4)
        model.eval()
        avg.module.eval()
        with torch.no_grad():
            out_online = model(x)
            with push_c.ema_weights(model, "c"):
                out_ema = model(x)
                inside = gather()
            out_after = model(x)
        after = gather()
        with torch.no_grad():
            out_ref = avg.module(x)
        stats = (push_c.stats(), push_w.stats())
        if rank == 0:
            torch.save(
                {
                    "online": online,
                    "after": after,
                    "inside": inside,
                    "avg": averaged_state(avg),
                    "ema_w": ema_pytorch_state(ema),
                    "out_online": out_online,
                    "out_ema": out_ema,
                    "out_after": out_after,
                    "out_ref": out_ref,
                    "stats": [s.__dict__ for s in stats],
                    "held": held,
                },
                Path(cfg["out"]) / "rank0.pt",
            )
        push_c.close()
        push_w.close()
        if "dtensor_run" in cfg:
            dtensor_round_trip(rank, cfg)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def dtensor_round_trip(rank: int, cfg: dict[str, Any]) -> None:
    """2-D mesh (2 x 2): DTensors with (Shard(0), Shard(1)), (Shard(0),
    Shard(0)), (Replicate(), Shard(0)) and (Replicate(), Replicate())
    placements, pushed as a state dict for two steps, then the EMA loaded
    back into zeroed DTensors of the same placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    placements = {
        "ss1": [Shard(0), Shard(1)],
        "ss0": [Shard(0), Shard(0)],
        "rs": [Replicate(), Shard(0)],
        "rr": [Replicate(), Replicate()],
    }
    shapes = {"ss1": (5, 3), "ss0": (7, 2), "rs": (3,), "rr": (4, 2)}
    run = polyak.Client(cfg["url"]).run(cfg["dtensor_run"])
    pusher = run.pusher(rank=rank)
    for step, seed in enumerate((11, 12)):
        g = torch.Generator().manual_seed(seed)
        whole = {k: torch.randn(shapes[k], generator=g) for k in shapes}
        sd = {k: distribute_tensor(whole[k], mesh, placements[k]) for k in shapes}
        pusher.push(sd, step)
    pusher.flush()
    zeros = {k: distribute_tensor(torch.zeros(shapes[k]), mesh, placements[k]) for k in shapes}
    pusher.load_ema_into(zeros, "c")
    loaded = {k: v.full_tensor() for k, v in zeros.items()}
    if rank == 0:
        torch.save({"loaded": loaded}, Path(cfg["out"]) / "dtensor.pt")
    pusher.close()


def snapshot_worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """FSDP2 (uneven shards) trained with AdamW and pushed with ``attach``,
    every deferred parameter copy held until the next pre-step hook waits
    for it. ``cfg``: init, url, run, beta, steps, snap_step, out. Rank 0
    saves the anchor (``AveragedModel`` on the gathered weights) and the
    online weights at ``snap_step``, and the pushers' stats."""
    _init(rank, world, cfg["init"])
    try:
        torch.manual_seed(0)
        base = TinyTransformer()
        ref = copy.deepcopy(base)
        model, gather = _wrap("fsdp2", base)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
        pusher = polyak.Client(cfg["url"]).run(cfg["run"]).pusher(rank=rank)
        pusher.attach(opt, model)
        avg = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(cfg["beta"]), use_buffers=True)
        gen = torch.Generator().manual_seed(2000 + rank)
        saved: dict[str, Any] = {}
        with copies_held_until_waited() as held:
            for step in range(cfg["steps"]):
                train_step(model, opt, gen)
                ref.load_state_dict(gather())
                avg.update_parameters(ref)
                if step == cfg["snap_step"]:
                    saved = {"avg": averaged_state(avg), "online": clone_state(ref.state_dict())}
            pusher.flush()
        if rank == 0:
            torch.save(
                {**saved, "stats": pusher.stats().__dict__, "held": held},
                Path(cfg["out"]) / "snapshot-rank0.pt",
            )
        pusher.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def dcp_load_worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """Loads a ``layout=sharded`` download with
    ``torch.distributed.checkpoint`` into DTensors ``Shard(0)`` on a 1-D mesh
    of ``world`` processes (scalars and integer tensors plain); rank 0
    saves the ``full_tensor()`` of each. ``cfg``: init, dir, shapes
    ``{name: (shape, dtype)}``, out."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    _init(rank, world, cfg["init"])
    try:
        mesh = init_device_mesh("cpu", (world,))
        sd: dict[str, Any] = {}
        for name, (shape, dtype) in cfg["shapes"].items():
            zeros = torch.zeros(shape, dtype=dtype)
            sharded = len(shape) >= 1 and dtype.is_floating_point
            sd[name] = distribute_tensor(zeros, mesh, [Shard(0)]) if sharded else zeros
        dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(cfg["dir"]))
        local_rows = {k: tuple(v.to_local().shape) for k, v in sd.items() if isinstance(v, DTensor)}
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
        if rank == 0:
            torch.save({"full": full}, Path(cfg["out"]) / "dcp-full.pt")
        torch.save(local_rows, Path(cfg["out"]) / f"dcp-local-{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def dcp_loads(shard_dir: Path, want: dict, tmp_path: Path) -> tuple[dict, dict, list[dict]]:
    """Loads a ``layout=sharded`` download through DCP into world size 1
    (no process group) and 3 (DTensors ``Shard(0)``, see
    :func:`dcp_load_worker`): the two state dicts, and each of the three
    ranks' local shapes."""
    import torch.distributed.checkpoint as dcp

    one = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(one, storage_reader=dcp.HuggingFaceStorageReader(str(shard_dir)))
    load_cfg = {
        "init": f"file://{tmp_path / 'store3'}",
        "dir": str(shard_dir),
        "shapes": {k: (tuple(v.shape), v.dtype) for k, v in want.items()},
        "out": str(tmp_path),
    }
    run_ranks(dcp_load_worker, 3, load_cfg)
    three = torch.load(tmp_path / "dcp-full.pt")["full"]
    rows = [torch.load(tmp_path / f"dcp-local-{r}.pt") for r in range(3)]
    return one, three, rows


def ddp_finish_worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """DDP trained with AdamW and pushed with ``attach`` for ``steps`` steps
    (``cfg``: init, url, run, steps); then rank 0 finishes the run (its
    final snapshot)."""
    _init(rank, world, cfg["init"])
    try:
        torch.manual_seed(0)
        model, _ = _wrap("ddp", TinyTransformer())
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
        run = polyak.Client(cfg["url"]).run(cfg["run"])
        pusher = run.pusher(rank=rank)
        pusher.attach(opt, model)
        gen = torch.Generator().manual_seed(3000 + rank)
        for _ in range(cfg["steps"]):
            train_step(model, opt, gen)
        pusher.flush()
        pusher.close()
        dist.barrier()
        if rank == 0:
            run.finish()
        dist.barrier()
    finally:
        dist.destroy_process_group()
