"""A tiny training job that feeds a polyak run, for the browser tests.

Run as its own process (``python feeder.py URL RUN ...``): it trains a small
MLP on random data, pushes every rank's shard of the weights each step with
the ``polyak`` client (a plain module in a multi-rank run is split between
the ranks along dim 0) and logs ``loss`` and ``lr`` to the run's metrics. It
prints ``step N`` after each step so a test can follow it, and stops after
``--steps`` steps or on SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

import torch
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.embed(x))))


class Feed:
    """Where the weights and scalars go: the polyak client, one pusher per
    rank. The one place to change if the transport changes."""

    def __init__(self, url: str, run: str, token: str | None, system_metrics: bool = False) -> None:
        import polyak

        self.client = polyak.Client(url, token=token)
        self.run = self.client.run(run)
        if system_metrics:
            # Rank 0's host figures, at most five a second.
            self.run.enable_system_metrics(rank=0, min_interval=0.2)
        self.pushers = [self.run.pusher(rank=r) for r in range(self.run.world_size)]

    def push(self, model: nn.Module, step: int) -> None:
        for pusher in self.pushers:
            pusher.push(model, step)

    def log(self, step: int, **scalars: float) -> None:
        self.run.log(step, **scalars)

    def close(self) -> None:
        for pusher in self.pushers:
            pusher.flush(timeout=30)
            pusher.close()
        self.client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("url")
    ap.add_argument("run")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between steps")
    ap.add_argument("--token", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--system-metrics", action="store_true", help="post the trainer's system metrics"
    )
    args = ap.parse_args(argv)

    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    model = TinyMLP()
    target_net = nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(args.steps, 1))
    feed = Feed(args.url, args.run, args.token, args.system_metrics)
    try:
        for step in range(args.steps):
            if stopping:
                break
            x = torch.randn(64, 16, generator=gen)
            with torch.no_grad():
                y = target_net(x).argmax(dim=1)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            # `step` counts the optimizer steps before these weights' update
            # (ema-pytorch's EMA.step when update() is entered).
            feed.push(model, step)
            feed.log(step, loss=float(loss), lr=float(sched.get_last_lr()[0]))
            print(f"step {step}", flush=True)
            time.sleep(args.interval)
    finally:
        feed.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
