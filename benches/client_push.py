"""How long the training thread blocks per step: ``Pusher.push`` against
``ema_pytorch.EMA(use_foreach=True).update()``, on the same model in the
same process, for one EMA profile and for three.

    .venv/bin/python benches/client_push.py            # ~100M parameters
    .venv/bin/python benches/client_push.py --quick    # ~5M, a few seconds

A real server (``target/{debug,release}/polyak`` or ``$POLYAK_BIN``) runs on
a free loopback port. Between two measured calls the weights change in place
(as an optimizer step would) and, for polyak, the previous push is flushed,
so each ``push`` is timed on its own: what it costs the training thread is
finding the tensors and one copy into a reused host buffer; sending and the
EMA update happen elsewhere (here on the same CPU, in a real deployment on
the server's device). ema-pytorch does the whole update on the training
thread, once per profile. Medians over the measured steps; the first step
(buffer allocation, EMA initialisation) is reported apart.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import polyak
import torch
from ema_pytorch import EMA
from polyak.testing import PolyakServer
from torch import nn


def build_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*layers)


def perturb(model: nn.Module, step: int) -> None:
    """Changes every weight in place, like an optimizer step (not timed)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 - 1e-4).add_(1e-4 * (step % 7))


def time_pushes(
    run: polyak.Run, model: nn.Module, steps: int, **options: object
) -> dict[str, float]:
    pusher = run.pusher(**options)
    blocked, flushed = [], []
    for step in range(steps + 1):
        perturb(model, step)
        t0 = time.perf_counter()
        pusher.push(model, step)
        t1 = time.perf_counter()
        pusher.flush()
        t2 = time.perf_counter()
        blocked.append(t1 - t0)
        flushed.append(t2 - t1)
    pusher.close()
    apply = run.rank(0).get("last_apply_seconds") or 0.0
    return {
        "first": blocked[0],
        "median": statistics.median(blocked[1:]),
        "flush": statistics.median(flushed[1:]),
        "apply": float(apply),
    }


def time_ema_pytorch(model: nn.Module, profiles: int, steps: int) -> dict[str, float]:
    emas = [
        EMA(model, beta=0.999, update_after_step=0, update_every=1, use_foreach=True)
        for _ in range(profiles)
    ]
    times = []
    for step in range(steps + 1):
        perturb(model, step)
        t0 = time.perf_counter()
        for ema in emas:
            ema.update()
        times.append(time.perf_counter() - t0)
    del emas
    return {"first": times[0], "median": statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~5M-parameter model, 3 steps")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 8)")
    args = parser.parse_args()
    width, depth = (2048, 24) if not args.quick else (512, 20)
    steps = args.steps or (8 if not args.quick else 3)

    torch.manual_seed(0)
    model = build_model(width, depth)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.1f}M parameters ({n_params * 4 / 2**20:.0f} MiB float32), "
        f"{len(list(model.parameters()))} tensors, CPU, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )

    three = [
        {"name": "ema", "kind": "constant", "beta": 0.999},
        {"name": "warm", "kind": "warmup", "beta": 0.9999},
        {"name": "edm", "kind": "power", "sigma_rel": 0.05},
    ]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as data, PolyakServer(data) as server:
        client = polyak.Client(server.url)
        run1 = client.create_run("bench-1", profiles=three[:1])
        run3 = client.create_run("bench-3", profiles=three)
        run3b = client.create_run("bench-3-bf16", profiles=three)
        results["polyak push, 1 profile"] = time_pushes(run1, model, steps)
        results["polyak push, 3 profiles"] = time_pushes(run3, model, steps)
        results["polyak push bf16, 3 profiles"] = time_pushes(
            run3b, model, steps, dtype=torch.bfloat16
        )
    ema1 = time_ema_pytorch(model, 1, steps)
    ema3 = time_ema_pytorch(model, 3, steps)

    print()
    header = f"{'training thread blocks per step':<34}{'median ms':>10}{'first ms':>10}{'ratio':>9}"
    print(header)
    print("-" * len(header))
    rows = [
        ("ema_pytorch EMA.update(), 1 profile", ema1, None),
        ("polyak push, 1 profile", results["polyak push, 1 profile"], ema1),
        ("ema_pytorch EMA.update(), 3 profiles", ema3, None),
        ("polyak push, 3 profiles", results["polyak push, 3 profiles"], ema3),
        ("polyak push bf16, 3 profiles", results["polyak push bf16, 3 profiles"], ema3),
    ]
    for name, r, baseline in rows:
        ratio = f"{baseline['median'] / r['median']:>8.1f}x" if baseline else f"{'1.0x':>9}"
        print(f"{name:<34}{r['median'] * 1e3:>10.1f}{r['first'] * 1e3:>10.1f}{ratio}")
    print()
    print("ratio: ema_pytorch's time on the training thread / polyak push's, same profile count")
    for name, r in results.items():
        print(
            f"{name}: off the training thread, send + server apply took {r['flush'] * 1e3:.0f} ms "
            f"(server apply {r['apply'] * 1e3:.0f} ms)"
        )


if __name__ == "__main__":
    main()
