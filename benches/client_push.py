"""What the EMA costs the training thread per step: polyak (``Pusher.attach``,
parameter copies deferred to the copy thread) against
``ema_pytorch.EMA(use_foreach=True).update()``, on the same model in the
same process, for one EMA profile and for three.

    .venv/bin/python benches/client_push.py                # ~100M parameters
    .venv/bin/python benches/client_push.py --step fwdbwd  # a real forward/backward as the step
    .venv/bin/python benches/client_push.py --quick        # ~5M, a few seconds

Each measured step is: the step's compute, then ``optimizer.step()`` (SGD,
changing every weight in place), then the EMA. The compute is either
``lerp`` (default): a compute-bound stand-in calibrated here to last as long
as one ``torch._foreach_lerp_`` over the model's parameters, the shortest
step behind which a deferred copy of the same size could hide; or
``fwdbwd``: a forward and backward of the model on a small batch.

For ema-pytorch the training thread blocks for its ``update()`` calls. For
polyak it blocks for ``push`` (in the post-step hook: finding the tensors,
copying the buffers, queueing) plus the pre-step hook's wait for the
deferred parameter copy of the previous push; both come from
``pusher.stats()`` (``push_seconds``, ``wait_seconds``). The copy thread,
the sender and the server (a real ``polyak serve`` on loopback, on the same
CPUs here) run concurrently; between steps, outside the timed region, the
bench waits until the server has acknowledged the previous push, as a
server on its own device keeps up. What the concurrent work costs the
training thread's compute shows in the step-time column against the same
loop without any EMA, and the client's own CPU time (all its threads) in
the CPU column; the "copy only" row leaves out sending and the server
(its sender acknowledges at once), as with a server on another machine.
Medians over the measured steps; the first step (allocation, EMA
initialisation) is not measured. ``--threads 1`` gives steadier numbers
on a machine shared with other work (OpenMP barriers wait for descheduled
threads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polyak
import torch
from ema_pytorch import EMA
from polyak._push.sender import Sender
from polyak_testing import PolyakServer
from torch import nn


def build_model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*layers)


def lerp_seconds(model: nn.Module, repeats: int = 5) -> float:
    """One EMA update's worth of work: a foreach lerp over every parameter."""
    params = [p.detach() for p in model.parameters()]
    shadow = [p.clone() for p in params]
    torch._foreach_lerp_(shadow, params, 1e-3)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch._foreach_lerp_(shadow, params, 1e-3)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def stand_in(seconds: float) -> Callable[[], None]:
    """A compute-bound step of about ``seconds``: matmuls on small matrices
    that stay in cache (no traffic to the model's memory)."""
    a = torch.randn(256, 256)
    b = torch.randn(256, 256)

    def matmuls(n: int) -> None:
        c = a
        for _ in range(n):
            c = torch.mm(c, b).mul_(1e-3)

    matmuls(20)
    t0 = time.perf_counter()
    matmuls(200)
    per = (time.perf_counter() - t0) / 200
    n = max(1, round(seconds / per))
    return lambda: matmuls(n)


def forward_backward(model: nn.Module, batch: int, width: int) -> Callable[[], None]:
    x = torch.randn(batch, width)

    def run() -> None:
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()

    return run


@dataclass
class Result:
    name: str
    #: Median training-thread time lost to the EMA per step.
    ema: float
    #: Median step time (compute + optimizer step + EMA).
    step: float
    push: float = 0.0
    wait: float = 0.0
    #: CPU seconds of this process per measured step (all threads).
    cpu: float = 0.0
    note: str = ""


def measure(
    name: str,
    model: nn.Module,
    compute: Callable[[], None],
    steps: int,
    ema_update: Callable[[], None] | None = None,
    pushers: list[polyak.Pusher] | None = None,
    defer: bool = True,
) -> Result:
    """Steps of compute + SGD step + EMA; see the module doc for what is timed."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.full_like(p, 1e-3)
    for pusher in pushers or []:
        pusher.attach(opt, model, defer=defer)
    ema_times, step_times, push_times, wait_times = [], [], [], []
    cpu0 = 0.0
    for i in range(steps + 1):
        if i == 1:
            cpu0 = _cpu_seconds()
        before = [(p.stats().push_seconds, p.stats().wait_seconds) for p in pushers or []]
        t0 = time.perf_counter()
        compute()
        opt.step()
        t1 = time.perf_counter()
        if ema_update is not None:
            ema_update()
        t2 = time.perf_counter()
        push = wait = 0.0
        for p, (push0, wait0) in zip(pushers or [], before, strict=True):
            s = p.stats()
            push += s.push_seconds - push0
            wait += s.wait_seconds - wait0
        if i > 0:  # the first step allocates buffers and initialises the EMAs
            ema_times.append((t2 - t1) + push + wait)
            step_times.append(t2 - t0)
            push_times.append(push)
            wait_times.append(wait)
        # Untimed: the server has the previous push (it keeps up).
        for p in pushers or []:
            deadline = time.monotonic() + 300
            while p.stats().acknowledged < i:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"push {i - 1} not acknowledged")
                time.sleep(0.001)
    notes = []
    for p in pushers or []:
        p.flush()
        s = p.stats()
        notes.append(
            f"copy thread {s.deferred_copy_seconds / max(1, s.deferred) * 1e3:.0f} ms/push, "
            f"{s.deferred}/{s.pushed} pushes deferred, {s.waits} pre-step waits"
        )
    cpu = (_cpu_seconds() - cpu0) / steps
    for p in pushers or []:
        p.close()
    opt.zero_grad(set_to_none=True)
    return Result(
        name,
        ema=statistics.median(ema_times),
        step=statistics.median(step_times),
        push=statistics.median(push_times),
        wait=statistics.median(wait_times),
        cpu=cpu,
        note="; ".join(notes),
    )


class CopyOnlySender(Sender):
    """A sender that acknowledges without sending (bench instrumentation)."""

    def deliver(self, conn: Any, job: Any, prev: Any = None, wire: Any = None) -> dict[str, Any]:
        job.body.wait_ready()
        return {"applied": True, "duplicate": False}


class CopyOnlyPusher(polyak.Pusher):
    """A pusher whose sender acknowledges without sending: what is left is
    the training thread's part and the copy thread's, as with a server on
    another machine that keeps up, minus the network."""

    _sender_class = CopyOnlySender


def _cpu_seconds() -> float:
    """CPU time of this process (every thread: training, copy, sender)."""
    t = os.times()
    return t.user + t.system


def ema_pytorch_update(model: nn.Module, profiles: int) -> Callable[[], None]:
    emas = [
        EMA(model, beta=0.999, update_after_step=0, update_every=1, use_foreach=True)
        for _ in range(profiles)
    ]

    def update() -> None:
        for ema in emas:
            ema.update()

    return update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~5M-parameter model, 3 steps")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 8)")
    parser.add_argument(
        "--step",
        choices=["lerp", "fwdbwd"],
        default="lerp",
        help="the step's compute: a stand-in as long as one lerp of the model (default), "
        "or a forward/backward of the model",
    )
    parser.add_argument("--batch", type=int, default=8, help="batch of --step fwdbwd")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    width, depth = (2048, 24) if not args.quick else (512, 20)
    steps = args.steps or (8 if not args.quick else 3)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = build_model(width, depth)
    n_params = sum(p.numel() for p in model.parameters())
    load_before = os.getloadavg()
    lerp = lerp_seconds(model)
    if args.step == "lerp":
        compute = stand_in(lerp)
        step_text = f"compute stand-in as long as one lerp of the model ({lerp * 1e3:.0f} ms)"
    else:
        compute = forward_backward(model, args.batch, width)
        step_text = (
            f"forward/backward, batch {args.batch} (one lerp of the model: {lerp * 1e3:.0f} ms)"
        )
    print(
        f"model: {n_params / 1e6:.1f}M parameters ({n_params * 4 / 2**20:.0f} MiB float32), "
        f"{len(list(model.parameters()))} tensors, CPU, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs"
    )
    print(f"step: {step_text} + SGD step; {steps} measured steps")

    three = [
        {"name": "ema", "kind": "constant", "beta": 0.999},
        {"name": "warm", "kind": "warmup", "beta": 0.9999},
        {"name": "edm", "kind": "power", "sigma_rel": 0.05},
    ]
    # The machine may be shared: the no-EMA step is measured first and last.
    base_first = measure("no EMA", model, compute, steps)
    ema1 = measure("ema_pytorch, 1 profile", model, compute, steps, ema_pytorch_update(model, 1))
    ema3 = measure("ema_pytorch, 3 profiles", model, compute, steps, ema_pytorch_update(model, 3))
    with tempfile.TemporaryDirectory() as data, PolyakServer(data, "--device", "cpu") as server:
        client = polyak.Client(server.url)

        def polyak_run(
            name: str, profiles: int, *, defer: bool = True, copy_only: bool = False, **options: Any
        ) -> tuple[Result, float]:
            slug = "".join(c if c.isalnum() else "-" for c in name)
            run = client.create_run(slug, profiles=three[:profiles])
            pusher = CopyOnlyPusher(run, 0, **options) if copy_only else run.pusher(**options)
            result = measure(name, model, compute, steps, pushers=[pusher], defer=defer)
            return result, float(run.rank(0).get("last_apply_seconds") or 0.0)

        p1, apply1 = polyak_run("polyak, 1 profile", 1)
        # attach(defer=False): every tensor copied in the post-step hook (the old push).
        p1s, _ = polyak_run("polyak, 1 profile, defer=False", 1, defer=False)
        p3, apply3 = polyak_run("polyak, 3 profiles", 3)
        p3b, _ = polyak_run("polyak bf16, 3 profiles", 3, dtype=torch.bfloat16)
        p1p, _ = polyak_run("polyak, 1 profile, copy only", 1, copy_only=True)
    base_last = measure("no EMA", model, compute, steps)
    base_step = (base_first.step + base_last.step) / 2
    base_cpu = (base_first.cpu + base_last.cpu) / 2
    load_after = os.getloadavg()

    results: list[tuple[Result, Result | None]] = [
        (ema1, None),
        (p1, ema1),
        (p1s, ema1),
        (ema3, None),
        (p3, ema3),
        (p3b, ema3),
        (p1p, ema1),
    ]
    print()
    header = (
        f"{'per step':<34}{'EMA ms':>9}{'push':>8}{'wait':>8}"
        f"{'ratio':>8}{'step ms':>10}{'+step':>8}{'+CPU ms':>9}"
    )
    print(header)
    print("-" * len(header))
    name = "no EMA (compute + SGD step)"
    print(f"{name:<34}{'-':>9}{'':>24}{base_step * 1e3:>10.1f}{'':>8}{base_cpu * 1e3:>9.0f}")
    for r, baseline in results:
        ratio = f"{r.ema / baseline.ema:>8.2f}" if baseline else f"{'1':>8}"
        push = f"{r.push * 1e3:>8.1f}" if baseline else ""
        wait = f"{r.wait * 1e3:>8.1f}" if baseline else ""
        extra = f"{(r.step - base_step) * 1e3:>+8.0f}{(r.cpu - base_cpu) * 1e3:>+9.0f}"
        print(
            f"{r.name:<34}{r.ema * 1e3:>9.1f}{push:>8}{wait:>8}{ratio}{r.step * 1e3:>10.1f}{extra}"
        )
    print()
    print(
        "EMA ms: training-thread time lost to the EMA per step (ema_pytorch: update(); "
        "polyak: push in the post-step hook + wait in the pre-step hook for the deferred copy)"
    )
    print("ratio: polyak's EMA ms / ema_pytorch's with the same number of profiles")
    print(
        f"+step: step time minus the no-EMA step (first {base_first.step * 1e3:.0f} ms, "
        f"last {base_last.step * 1e3:.0f} ms, mean used); includes contention from the copy "
        "thread, the sender and the server, which here share the CPUs"
    )
    print(
        "+CPU ms: CPU time of this process per step (every thread: training, copy, sender; "
        "not the server's) minus the no-EMA loop's (its absolute value on that row)"
    )
    print(
        "copy only: the sender acknowledges without sending (nothing sent or applied): "
        "what the client itself costs, as with a server elsewhere that keeps up"
    )
    for r in (p1, p1s, p3, p3b, p1p):
        print(f"{r.name}: {r.note}")
    print(
        f"server apply of one push: 1 profile {apply1 * 1e3:.0f} ms, "
        f"3 profiles {apply3 * 1e3:.0f} ms"
    )
    print(
        "load average before {:.2f} {:.2f} {:.2f}, after {:.2f} {:.2f} {:.2f}".format(
            *load_before, *load_after
        )
    )


if __name__ == "__main__":
    main()
