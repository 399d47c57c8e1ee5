"""Failover: one node of three is killed (SIGKILL) while a trainer pushes.

The run's three ranks sit one per node. The trainer (one process, a real
AdamW loop, one pusher per rank) pushes every step; node b persists its
rank's state (its own ``state`` snapshot) and acknowledges a few more
steps, then is killed. Within the lease plus 5 s a survivor holds b's
rank (epoch 2, restored from b's newest state snapshot) and serves it; the
trainer never stops, its pushes to b are retried to the new owner and
every ``flush()`` succeeds. The steps lost (acknowledged by b after its
snapshot) are reported in the rank view, as ``failover`` events and in
Prometheus, and the rank's EMA equals the anchors (``AveragedModel``,
``ema_pytorch.EMA``) fed every step up to the restored one and every step
from the first push after the failover, and not the anchors fed them all.
The catalog records one owner per (rank, epoch). b restarts, rejoins the
service holding nothing, and a new run is placed on it.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import polyak
import pytest
import torch
from ema_pytorch import EMA
from polyak import RetryPolicy
from polyak_testing import Backends, state_step, wait_for
from polyak_testing.refs import TinyTransformer, Trainer, averaged_state, ema_pytorch_state, rel_err
from test_client_cluster import _catalog_rows
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

LEASE = 3.0
BETA = 0.9
WARMUP = dict(beta=0.99, update_after_step=5, inv_gamma=1.0, power=0.75, min_value=0.0)
STEPS = 30
#: Steps 0..PERSISTED are in b's state snapshot; b acknowledges steps up
#: to KILL_AT - 1 after it, then is killed.
PERSISTED = 9
KILL_AT = 15


def _references(history: list[dict[str, torch.Tensor]], steps: list[int]) -> dict:
    """Both profiles' anchors fed the weights of ``steps`` (in order), each
    update at its own step."""
    model = TinyTransformer()
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(BETA), use_buffers=True)
    ema = EMA(model, update_every=1, **WARMUP)
    for step in steps:
        model.load_state_dict(history[step])
        avg.update_parameters(model)
        # ema-pytorch's decay follows its step counter: the step pushed.
        ema.step.fill_(step)
        ema.update()
    return {"c": averaged_state(avg), "w": ema_pytorch_state(ema)}


def _max_err(file, want: dict[str, torch.Tensor], online: dict[str, torch.Tensor]) -> float:
    """The largest relative error of a rank file's float tensors against
    the matching regions of whole anchor tensors; integer tensors must
    equal the last pushed (``online``) ones, which polyak copies."""
    worst = 0.0
    for name, t in file.tensors.items():
        chunk = file.chunks.get(name)
        region = (
            tuple(slice(o, o + s) for o, s in zip(chunk.offsets, t.shape, strict=True))
            if chunk
            else tuple(slice(None) for _ in t.shape)
        )
        if not t.is_floating_point():
            assert torch.equal(t, online[name][region]), name
        elif t.numel():
            worst = max(worst, rel_err(t, want[name][region].float()))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("delta", [None, "xor"], ids=["full", "xor"])
def test_a_killed_nodes_ranks_are_taken_over(
    tmp_path, backends: Backends, run_name, lab, delta: str | None
):
    """With ``delta="xor"`` the run keeps a mirror and the trainer pushes
    XOR deltas against it: the new owner's mirror (b's, at its state
    snapshot) is behind the trainer's copy, so its first XOR push is
    refused with ``needs_keyframe`` and the pusher sends that step again in
    full; nothing is rejected and the EMA is exact (XOR is lossless)."""
    # Each node in a test host of its own where this machine makes them.
    catalog, (a, b, c) = backends.cluster(
        tmp_path / "nodes", 3, "--lease-secs", str(LEASE), lab=lab
    )
    for node in (a, b, c):
        node.start()
    try:
        with polyak.Client(a.url) as client:
            run = client.create_run(
                run_name,
                world_size=3,
                persist_every_secs=3,
                mirror=delta is not None,
                profiles=[
                    {"name": "c", "kind": "constant", "beta": BETA},
                    {"name": "w", "kind": "warmup", **WARMUP},
                ],
            )
            placement = run.placement()
            on_b = [r for r, p in placement.items() if p["node"] == "node-b"]
            assert len(on_b) == 1, placement
            lost_rank = on_b[0]
            retry = RetryPolicy(base_delay=0.05, max_delay=0.5)
            # `block`: nothing dropped while b's rank is away, so the steps
            # lost are exactly those b acknowledged after its snapshot.
            pushers = [
                run.pusher(rank=r, retry=retry, delta=delta, policy="block") for r in range(3)
            ]
            trainer = Trainer(seed=5)
            history: list[dict[str, torch.Tensor]] = []

            def train(steps: range) -> None:
                for step in steps:
                    trainer.step()
                    history.append(trainer.state())
                    for p in pushers:
                        p.push(trainer.model, step)

            train(range(PERSISTED + 1))
            for p in pushers:
                p.flush()
            # b writes its rank's state; then acknowledges steps it will lose.
            wait_for(
                lambda: state_step(a.url, run_name, lost_rank) == PERSISTED,
                30,
                "b's state snapshot",
            )
            train(range(PERSISTED + 1, KILL_AT))
            for p in pushers:
                p.flush()

            # Watch the placement (through a) while the trainer goes on.
            taken: dict = {}

            def watch() -> None:
                with polyak.Client(a.url) as watcher:
                    view = watcher.run(run_name)
                    while time.monotonic() - killed_at < 60:
                        owner = view.placement()[lost_rank]
                        if owner["node"] != "node-b":
                            taken.update(owner, after=time.monotonic() - killed_at)
                            return
                        time.sleep(0.1)

            killed_at = time.monotonic()
            b.kill()
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            train(range(KILL_AT, STEPS))
            for p in pushers:
                p.flush()  # the trainer never restarted: everything delivered
            watcher.join(60)
            assert taken, "nobody took b's rank"
            assert taken["after"] < LEASE + 5, taken
            assert taken["epoch"] == 2 and taken["node"] in ("node-a", "node-c"), taken
            for p in pushers:
                stats = p.stats()
                assert stats.dropped == 0 and stats.rejected == 0 and stats.pending == 0
                p.close()

            # The loss is reported on the rank, known at the first push after.
            def reported():
                f = run.rank(lost_rank).get("failover")
                return f if f and f.get("lost_steps") is not None else None

            failover = wait_for(reported, 30, "the failover report", lambda: run.rank(lost_rank))
            restored, resumed = failover["restored_step"], failover["resumed_step"]
            assert failover["from_node"] == "node-b" and failover["epoch"] == 2, failover
            assert PERSISTED <= restored < KILL_AT, failover
            assert resumed == KILL_AT, failover
            assert failover["lost_steps"] == resumed - restored - 1, failover
            # (b's state snapshot; later ones of the new owner may have
            # replaced it under the run's retention.)
            assert failover["snapshot"], failover
            events = httpx.get(
                f"{a.url}/v1/runs/{run_name}/events",
                headers={"Accept": "application/json"},
                params={"kinds": "failover"},
                timeout=10,
            ).json()
            mine = [e for e in events if e["rank"] == lost_rank]
            assert [e["detail"]["lost_steps"] for e in mine] == [None, failover["lost_steps"]]
            if failover["lost_steps"]:
                _loss_said_on_every_node(run_name, (a, c), taken["url"])
            text = httpx.get(f"{taken['url']}/metrics", timeout=10).text
            got = re.search(
                rf'^polyak_failover_steps_lost_total{{run="{run_name}"}} (\d+)', text, re.M
            )
            assert got and int(got.group(1)) == failover["lost_steps"], text
            assert f'polyak_failover_ranks_total{{run="{run_name}"}} 1' in text

            # The EMA: every rank against the anchors. b's rank misses the
            # lost steps: the anchors restarted from the restored step.
            applied = [s for s in range(STEPS) if s <= restored or s >= resumed]
            everything = _references(history, list(range(STEPS)))
            with_gap = _references(history, applied)
            for rank in range(3):
                want = with_gap if rank == lost_rank else everything
                for profile in ("c", "w"):
                    file = run.rank_ema(rank, profile)
                    assert file.step == STEPS - 1
                    err = _max_err(file, want[profile], history[-1])
                    assert err <= 1e-6, (rank, profile, err)
            if failover["lost_steps"]:
                # The check can tell: the anchors fed every step differ.
                file = run.rank_ema(lost_rank, "c")
                assert _max_err(file, everything["c"], history[-1]) > 1e-4
            if delta is not None:
                # The lost rank's pusher sent a keyframe after the failover
                # (its first one and the periodic ones aside).
                keyframes = [p.stats().keyframes for p in pushers]
                assert keyframes[lost_rank] > max(
                    k for r, k in enumerate(keyframes) if r != lost_rank
                ), keyframes

            # One owner per (rank, epoch), ever.
            log = _catalog_rows(
                backends,
                catalog,
                f"SELECT rank, epoch, node_id FROM placement_log WHERE run = '{run_name}'",
            )
            assert len({(r, e) for r, e, _ in log}) == len(log) == 4, log
            assert (str(lost_rank), "2", taken["node"]) in {tuple(x) for x in log}

            # b restarts and rejoins: it holds none of the old run, and a new
            # run is placed on it too.
            b.start()
            wait_for(
                lambda: any(
                    n["node"] == "node-b" and n["status"] == "live"
                    for n in httpx.get(f"{a.url}/v1/nodes", timeout=10).json()["nodes"]
                ),
                30,
                "b to rejoin",
            )
            assert run.placement()[lost_rank]["node"] == taken["node"]
            fresh = client.create_run(f"{run_name}-new", world_size=3)
            placed = fresh.placement()
            assert "node-b" in {p["node"] for p in placed.values()}, placed
            rank_on_b = next(r for r, p in placed.items() if p["node"] == "node-b")
            with fresh.pusher(rank=rank_on_b) as p:
                p.push({"w": torch.arange(4.0)}, 0)
                p.flush()
            wait_for(lambda: fresh.rank(rank_on_b)["last_step"] == 0, 30, "b's push to show")
    finally:
        for node in (a, b, c):
            node.stop()


def _loss_said_on_every_node(run_name: str, nodes, taker_url: str) -> None:
    """The node that took the rank over fires `steps_lost`; every live
    node's view of the run says `degraded` until someone acknowledges it,
    on any node, and then none does."""

    def health(node) -> str:
        return httpx.get(f"{node.url}/v1/runs/{run_name}", timeout=10).json()["health"]

    def losses() -> list[dict]:
        listed = httpx.get(f"{nodes[0].url}/v1/runs/{run_name}/alerts", timeout=10).json()
        return [x for x in listed["alerts"] if x["kind"] == "steps_lost"]

    alerts = wait_for(losses, 30, "the steps_lost alert")
    assert len(alerts) == 1 and alerts[0]["state"] == "firing", alerts
    for node in nodes:
        assert health(node) == "degraded", (node.url, health(node))
    # Acknowledged on a node that did not fire it.
    other = next((n for n in nodes if n.url.rstrip("/") != taker_url.rstrip("/")), nodes[0])
    r = httpx.post(f"{other.url}/v1/runs/{run_name}/alerts/{alerts[0]['id']}/ack", timeout=10)
    assert r.status_code == 200, r.text
    for node in nodes:
        wait_for(lambda node=node: health(node) != "degraded", 10, f"{node.url} to say it")
