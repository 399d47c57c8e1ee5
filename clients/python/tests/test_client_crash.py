"""A server crash costs the trainer nothing.

The server is killed with SIGKILL while a trainer pushes every step with
the client's defaults (two pushes in flight, ``Polyak-Prev-Step``) and is
started again on the same data directory a while later. The trainer, a
process of its own, never sees it: every ``optimizer.step()`` returns
within the pusher's bounded wait, the pushes that could not wait are
dropped oldest first and counted, delivery resumes after the restart,
and the process exits 0 with every later step applied. The same for two
DDP ranks and for the ``ema_pytorch`` drop-in.

Also here: a full queue with the server gone (drops the oldest, counts,
warns once; ``flush``/``close`` warn after their bounded wait and
return), a drop-in script that ends normally (its run ``finished``, no
alert, its generated name printed once), the EMA after a restart (the
reference EMA up to the restored step, bridged to the first step after
it, then every later step), and the evaluation worker across a restart.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import polyak
import pytest
import torch
from polyak_testing import state_step, wait_for
from polyak_testing.server import PolyakServer

#: ``Pusher(max_wait=...)``'s default: the longest a full queue may hold
#: the training step while the server is not (yet) known to be away.
MAX_WAIT = 10.0
BETA = 0.9
#: A half-life profile decays a gap of k steps as k single steps
#: (``0.5 ** (k / h)``): the bridge over the lost steps shows in it.
HALF_LIFE = 20.0
PROFILES = [
    {"name": "c", "kind": "constant", "beta": BETA},
    {"name": "hl", "kind": "half_life", "steps": HALF_LIFE},
]

# One training process: a small model, SGD, a push after every
# optimizer.step() through the client's defaults (`attach`), or through the
# ema_pytorch drop-in. It trains until the file `stop` appears (every rank
# agrees on the step), then 20 steps more, and writes each step's time in
# optimizer.step(), the weights of every step and the pusher's counters.
TRAINER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import torch
    import polyak

    url, run_name, out, mode = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group(
            "gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=world
        )
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ema = pusher = None
    if mode == "ema_pytorch":
        from polyak.compat.ema_pytorch import EMA
        ema = EMA(model, beta=0.9, update_after_step=0, update_every=1, url=url)
    else:
        pusher = polyak.Client(url).run(run_name).pusher(rank)
        pusher.attach(opt, model)
    gen = torch.Generator().manual_seed(100 + rank)
    stamps, history, until = [], [], None
    while True:
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        t0 = time.time()
        opt.step()
        if ema is not None:
            ema.update()
        stamps.append((t0, time.time()))
        inner = getattr(model, "module", model)
        history.append({k: v.detach().clone() for k, v in inner.state_dict().items()})
        stop = torch.tensor([float((out / "stop").exists())])
        if world > 1:
            dist.all_reduce(stop)
        if until is None and stop.item() > 0:
            until = len(stamps) + 20
        if until is not None and len(stamps) >= until:
            break
        if len(stamps) % 10 == 0:
            (out / f"progress-{rank}").write_text(str(len(stamps)))
        time.sleep(0.04)
    if pusher is not None:
        pusher.close()
        stats = pusher.stats()
    else:
        ema._remote.pusher.flush()
        stats = ema._remote.pusher.stats()
    torch.save(history, out / f"history-{rank}.pt")
    (out / f"result-{rank}.json").write_text(json.dumps({
        "stamps": stamps,
        "pushed": stats.pushed,
        "acknowledged": stats.acknowledged,
        "dropped": stats.dropped,
        "rejected": stats.rejected,
        "superseded": getattr(stats, "superseded", 0),
    }))
    if world > 1:
        dist.destroy_process_group()
    """
)


def _start_trainers(url: str, run: str, out: Path, mode: str, world: int) -> list:
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", TRAINER, url, run, str(out), mode],
                env=env,
                stdout=open(out / f"stdout-{rank}.txt", "w"),
                stderr=open(out / f"stderr-{rank}.txt", "w"),
            )
        )
    return procs


def _progress(out: Path, world: int) -> int:
    """The fewest steps any rank has taken (as its progress file says)."""
    steps = []
    for rank in range(world):
        f = out / f"progress-{rank}"
        steps.append(int(f.read_text() or 0) if f.exists() else 0)
    return min(steps)


def _wait_trainers(procs: list, out: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    try:
        for rank, p in enumerate(procs):
            p.wait(max(1.0, deadline - time.monotonic()))
            err = (out / f"stderr-{rank}.txt").read_text()
            assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{err[-4000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _crash_while_training(
    srv: PolyakServer, run: str, out: Path, mode: str, world: int, outage: float
) -> dict:
    """Starts the trainers, kills the server once they are well under way,
    starts it again ``outage`` seconds later on the same data directory,
    lets them go on a while and stop; what each rank wrote."""
    procs = _start_trainers(srv.url, run, out, mode, world)
    try:
        wait_for(lambda: _progress(out, world) >= 30, 120, "30 steps on every rank")
        killed_at = time.time()
        srv.kill()
        time.sleep(outage)
        srv.start(same_port=True)
        back_at = time.time()
        # A few seconds of pushing after the restart, then the trainers stop.
        at_restart = _progress(out, world)
        wait_for(lambda: _progress(out, world) >= at_restart + 30, 120, "30 steps after")
        (out / "stop").touch()
        _wait_trainers(procs, out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = {}
    for rank in range(world):
        result = json.loads((out / f"result-{rank}.json").read_text())
        result["killed_at"], result["back_at"] = killed_at, back_at
        results[rank] = result
    return results


def _check_kept_training(result: dict) -> int:
    """Training went on while the server was down, no step held longer
    than the pusher's bounded wait (plus a margin for a loaded machine),
    and every push is accounted for. The number of steps taken."""
    stamps = result["stamps"]
    down = [s for s in stamps if result["killed_at"] + 1 < s[0] < result["back_at"] - 1]
    longest = max(end - start for start, end in stamps)
    print(
        f"{len(stamps)} steps, {len(down)} while the server was down; longest "
        f"optimizer.step() {longest:.3f}s; dropped {result['dropped']}, "
        f"superseded {result['superseded']}"
    )
    assert len(down) >= 5, (len(down), result["killed_at"], result["back_at"])
    assert longest < MAX_WAIT + 5, longest
    assert result["rejected"] == 0
    assert result["dropped"] > 0  # the queue filled while the server was away
    assert result["pushed"] == len(stamps)
    assert result["acknowledged"] + result["dropped"] + result["superseded"] == result["pushed"]
    return len(stamps)


def _survives(fresh_server, tmp_path, mode: str, world: int, outage: float) -> None:
    srv = fresh_server.start()
    run_name = f"crash-{mode}-{world}"
    if mode == "pusher":
        polyak.Client(srv.url).create_run(run_name, world_size=world, profiles=PROFILES)
    results = _crash_while_training(srv, run_name, tmp_path / "out", mode, world, outage)
    if mode == "ema_pytorch":
        err = (tmp_path / "out" / "stderr-0.txt").read_text()
        names = re.findall(r"keeps its EMA in run (\S+) at", err)
        assert len(names) == 1, err
        run_name = names[0]
    with polyak.Client(srv.url) as client:
        run = client.run(run_name)
        for rank, result in results.items():
            steps = _check_kept_training(result)
            # Delivery resumed after the restart: the last step is applied.
            view = run.rank(rank)
            assert view["last_step"] == steps - 1
            # The restart is reported as a failover to itself, its loss exact.
            f = view["failover"]
            assert f is not None and f["restart"] is True, view
            assert f["restored_step"] is None or f["restored_step"] < f["resumed_step"], f
            from_step = -1 if f["restored_step"] is None else f["restored_step"]
            assert f["lost_steps"] == f["resumed_step"] - from_step - 1, f
            print(
                f"rank {rank}: restored at {f['restored_step']} (catalog had {f['last_seen_step']}), "
                f"resumed at {f['resumed_step']}: {f['lost_steps']} steps lost"
            )


@pytest.mark.slow
def test_a_trainer_outlives_a_server_killed_and_restarted_12s_later(fresh_server, tmp_path):
    _survives(fresh_server, tmp_path, "pusher", 1, 12.0)


@pytest.mark.slow
def test_a_trainer_outlives_a_restart_past_the_predecessor_timeout(fresh_server, tmp_path):
    """45 s down: longer than the server's 30 s wait for a predecessor."""
    _survives(fresh_server, tmp_path, "pusher", 1, 45.0)


@pytest.mark.slow
def test_two_ddp_ranks_outlive_a_server_restart(fresh_server, tmp_path):
    _survives(fresh_server, tmp_path, "pusher", 2, 8.0)


@pytest.mark.slow
def test_the_ema_pytorch_drop_in_outlives_a_server_restart(fresh_server, tmp_path):
    _survives(fresh_server, tmp_path, "ema_pytorch", 1, 8.0)


# -- the queue with the server gone ------------------------------------------


def _messages(caplog, pattern: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if re.search(pattern, r.getMessage())]


def test_a_full_queue_with_the_server_gone_drops_the_oldest_and_warns_once(fresh_server, caplog):
    srv = fresh_server.start()
    url = srv.url
    run = polyak.Client(url).create_run("gone", profiles=PROFILES)
    srv.kill()
    caplog.set_level(logging.WARNING, logger="polyak")
    retry = polyak.RetryPolicy(base_delay=0.02, max_delay=0.2)
    pusher = run.pusher(flush_timeout=2.0, retry=retry)
    assert (pusher.policy, pusher.max_queue, pusher.pipeline) == ("drop_oldest", 2, 2)
    w = torch.arange(8.0)
    for step in range(12):
        assert pusher.push({"w": w + step}, step)  # never raises
    stats = pusher.stats()
    # Step 0 in flight (retried), one later step too when the second
    # connection took one (which one depends on when its thread ran: it
    # takes the oldest queued then), the newest two queued: the others were
    # dropped, oldest first.
    kept = stats.pending
    assert kept in (3, 4) and (stats.pushed, stats.dropped, stats.acknowledged) == (
        12,
        12 - kept,
        0,
    )
    assert stats.rejected == 0 and stats.retries > 0
    assert stats.blocked_seconds < MAX_WAIT
    assert len(_messages(caplog, "dropping the oldest queued push")) == 1
    assert len(_messages(caplog, r"not delivered to .*retrying in the background")) == 1
    # flush waits its bounded time, then warns and returns.
    assert pusher.flush() is False
    warned = _messages(caplog, rf"{kept} push\(es\) not acknowledged after 2s")
    steps = re.search(r"\(steps ([\d, ]+)\)", warned[0]) if len(warned) == 1 else None
    assert steps is not None, warned
    listed = [int(s) for s in steps.group(1).split(", ")]
    assert listed[0] == 0 and listed[-2:] == [10, 11] and len(listed) == kept, warned
    assert kept == 3 or 0 < listed[1] < 10, warned

    # Back: what was kept is delivered, and the end of the outage is said once.
    srv.start(same_port=True)
    assert srv.url == url
    assert pusher.flush(timeout=60) is True
    resumed = _messages(caplog, r"delivered again")
    assert len(resumed) == 1 and f"{12 - kept} push(es) dropped meanwhile" in resumed[0]
    stats = pusher.stats()
    assert (stats.acknowledged, stats.dropped, stats.rejected, stats.pending) == (
        kept,
        12 - kept,
        0,
        0,
    )
    assert run.rank(0)["last_step"] == 11
    # Gone again: close waits its bounded time, warns, and returns.
    srv.kill()
    pusher.push({"w": w}, 12)
    pusher.close()
    assert len(_messages(caplog, r"1 push\(es\) not acknowledged after 2s")) == 1
    assert pusher.stats().pending == 0


def test_a_refused_push_is_still_raised(fresh_server):
    """The trainer's own mistake (NaN in a run that refuses it) reaches
    ``flush`` and the next ``push`` as before; nothing of the server's does."""
    srv = fresh_server.start()
    run = polyak.Client(srv.url).create_run("refused", profiles=PROFILES, nonfinite="reject")
    with run.pusher() as pusher:
        pusher.push({"w": torch.zeros(4)}, 0)
        pusher.push({"w": torch.tensor([0.0, float("nan"), 0.0, 0.0])}, 1)
        with pytest.raises(polyak.PolyakError) as err:
            pusher.flush()
        assert (err.value.status, err.value.code, err.value.step) == (422, "nonfinite", 1)
        assert pusher.stats().rejected == 1


# -- the EMA after a restart ---------------------------------------------------


def _reference(
    history: list[dict[str, torch.Tensor]], applied: list[int]
) -> dict[str, dict[str, torch.Tensor]]:
    """Both profiles' EMAs of the pushes of ``applied`` (steps, in order),
    as the server's schedules compute them: a copy first, then
    ``ema.lerp_(w, 1 - beta)`` with beta of the profile over the interval
    since the previous applied step (constant: ``BETA`` whatever the gap;
    half-life: ``0.5 ** (gap / h)``)."""
    out: dict[str, dict[str, torch.Tensor]] = {"c": {}, "hl": {}}
    prev = None
    for step in applied:
        w = history[step]
        for profile in out:
            ema = out[profile]
            if prev is None:
                out[profile] = {k: v.float().clone() for k, v in w.items()}
                continue
            beta = BETA if profile == "c" else 0.5 ** ((step - prev) / HALF_LIFE)
            for k, v in w.items():
                ema[k].lerp_(v.float(), 1.0 - beta)
        prev = step
    return out


def test_the_ema_after_a_restart_is_the_bridged_reference(fresh_server):
    """Steps 0-39 persisted, 40-49 acknowledged and lost with a SIGKILL,
    50-89 pushed after the restart by the same pusher: the EMA is the
    reference of steps 0-39, bridged by one interval of decay to step 50
    (``resumed_step``), then every later step."""
    srv = fresh_server.start()
    client = polyak.Client(srv.url)
    # No periodic state write in this test's time: only the one asked for.
    run = client.create_run("bridged", profiles=PROFILES, persist_every_secs=3600)
    g = torch.Generator().manual_seed(9)
    history = [{"w": torch.randn(256, generator=g)} for _ in range(90)]
    pusher = run.pusher(retry=polyak.RetryPolicy(base_delay=0.02, max_delay=0.3))
    for step in range(40):
        pusher.push(history[step], step)
    assert pusher.flush(timeout=60)
    client.request("POST", "/v1/runs/bridged/persist")
    wait_for(lambda: state_step(srv.url, "bridged", 0) == 39, 30, "the state at step 39")
    for step in range(40, 50):
        pusher.push(history[step], step)
    assert pusher.flush(timeout=60)
    srv.kill()
    srv.start(same_port=True)
    for step in range(50, 90):
        pusher.push(history[step], step)
    assert pusher.flush(timeout=60)
    stats = pusher.stats()
    pusher.close()
    assert (stats.acknowledged, stats.dropped, stats.rejected) == (90, 0, 0)
    rank = polyak.Client(srv.url).run("bridged").rank(0)
    failover = rank.get("failover")
    assert failover is not None and failover["restart"] is True, rank
    assert (failover["restored_step"], failover["resumed_step"]) == (39, 50), failover
    assert rank["last_step"] == 89
    want = _reference(history, [*range(40), *range(50, 90)])
    run = polyak.Client(srv.url).run("bridged")
    for profile in ("c", "hl"):
        got = run.fetch_ema(profile)["w"]
        worst = (got - want[profile]["w"]).abs().max().item()
        assert worst <= 1e-6, (profile, worst)


# -- drop-in runs end ----------------------------------------------------------

DROP_IN = textwrap.dedent(
    """
    import sys
    import torch
    from polyak.compat.ema_pytorch import EMA

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = EMA(model, beta=0.9, update_after_step=0, update_every=1, url=sys.argv[1])
    for _ in range(5):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    """
)


def test_a_drop_in_script_that_ends_normally_finishes_its_run(fresh_server):
    srv = fresh_server.start()
    done = subprocess.run(
        [sys.executable, "-c", DROP_IN, srv.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    names = re.findall(r"keeps its EMA in run (\S+) at", done.stderr)
    assert len(names) == 1, done.stderr
    with polyak.Client(srv.url) as client:
        run = client.run(names[0])
        info = run.refresh()
        # Five updates: steps 0-4, the last one the final snapshot's.
        assert run.rank(0)["last_step"] == 4
        assert info.finished is not None and info.finished["step"] == 4
        assert info.health == "finished"
        assert info.alerts_firing == 0
        assert run.alerts()["firing"] == 0


# -- evaluation across a restart ------------------------------------------------

# The first evaluation holds until the test has killed the server, so the
# worker's next request (posting it) finds no server.
EVAL_SCRIPT = """
import os, time
import torch

def build_model():
    return torch.nn.Linear(4, 1, bias=False)

def evaluate(model):
    mark, gate = os.environ["MARK"], os.environ["GATE"]
    if not os.path.exists(mark):
        open(mark, "w").close()
        while not os.path.exists(gate):
            time.sleep(0.02)
    return {"norm": float(model.weight.norm())}
"""


@pytest.mark.slow
def test_the_eval_worker_outlives_a_server_restart(fresh_server, tmp_path):
    srv = fresh_server.start()
    client = polyak.Client(srv.url)
    run = client.create_run("evaluated", profiles=[{"name": "c", "kind": "constant", "beta": BETA}])
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    with run.pusher() as pusher:
        pusher.push({"weight": w}, 0)
    first = run.snapshot(step=0)
    script = tmp_path / "eval.py"
    script.write_text(EVAL_SCRIPT)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polyak",
            "--url",
            srv.url,
            "eval",
            run.name,
            "--script",
            str(script),
            "--follow",
            "--until-finished",
            "--no-progress",
        ],
        env={**os.environ, "MARK": str(tmp_path / "mark"), "GATE": str(tmp_path / "gate")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: (tmp_path / "mark").exists(), 60, "the first evaluation under way")
        srv.kill()
        (tmp_path / "gate").touch()
        time.sleep(4)  # posting it, the event stream and the reads fail meanwhile
        assert worker.poll() is None, worker.communicate()[1]
        srv.start(same_port=True)
        client = polyak.Client(srv.url)
        run = client.run(run.name)
        with run.pusher() as pusher:
            pusher.push({"weight": w * 2}, 1)
        second = run.snapshot(step=1)
        run.finish()
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err
    finally:
        if worker.poll() is None:
            worker.kill()
    rows = run.evals()
    evals = {e["snapshot"]: e["metrics"]["norm"] for e in rows}
    assert len(evals) == len(rows)  # each snapshot evaluated once
    final = run.refresh().finished["snapshot"]
    final = final["id"] if isinstance(final, dict) else final
    assert {first["id"], second["id"], final} <= set(evals)
    for sid in evals:
        want = float(run.download(sid, "c", progress=False)["weight"].norm())
        assert evals[sid] == pytest.approx(want, rel=1e-6)
    assert evals[first["id"]] == pytest.approx(float(w.norm()), rel=1e-6)


def test_the_eval_command_waits_for_a_server_that_is_away_at_its_start(fresh_server, tmp_path):
    """``python -m polyak eval --follow`` started while the server is down
    (restarting) waits for it instead of exiting on "Connection refused"."""
    srv = fresh_server.start()
    client = polyak.Client(srv.url)
    run = client.create_run(
        "evaluated-late", profiles=[{"name": "c", "kind": "constant", "beta": BETA}]
    )
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    with run.pusher() as pusher:
        pusher.push({"weight": w}, 0)
    first = run.snapshot(step=0)
    srv.kill()
    script = tmp_path / "eval.py"
    script.write_text(EVAL_SCRIPT)
    (tmp_path / "gate").touch()
    worker = subprocess.Popen(
        [sys.executable, "-m", "polyak", "--url", srv.url, "eval", run.name, "--script",
         str(script), "--follow", "--until-finished", "--no-progress"],
        env={**os.environ, "MARK": str(tmp_path / "mark"), "GATE": str(tmp_path / "gate")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        time.sleep(3)
        assert worker.poll() is None, worker.communicate()[1]
        srv.start(same_port=True)
        run = polyak.Client(srv.url).run(run.name)
        wait_for(lambda: bool(run.evals()), 60, "the snapshot evaluated")
        run.finish()
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err
        assert "the server is away" in err, err
    finally:
        if worker.poll() is None:
            worker.kill()
    evals = {e["snapshot"]: e["metrics"]["norm"] for e in run.evals()}
    assert evals[first["id"]] == pytest.approx(float(w.norm()), rel=1e-6)
