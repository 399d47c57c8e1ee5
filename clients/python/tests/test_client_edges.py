"""The edges of a run through the client and the CLI: the final snapshot
without a step, ``finish``, safe ``resume``, ``exist_ok``, and the CLI's
file names, options, closed pipes and unpacked files' times."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import polyak
import pytest
import safetensors.torch
import torch
from polyak.cli import build_parser, main
from polyak_testing.refs import Trainer, train_and_push


def constant(name: str, beta: float) -> dict[str, object]:
    return {"name": name, "kind": "constant", "beta": beta}


def test_final_snapshot_and_finish(client, run_name):
    """After training, ``snapshot()`` cuts at the last step at once (nothing
    waits for a step N+1); ``finish()`` takes the final snapshot, the run
    and its ranks say ``finished``, and a later push is refused."""
    run = client.create_run(run_name, world_size=2, profiles=[constant("ema", 0.8)])
    tr = Trainer(seed=31)
    pushers = [run.pusher(rank=r) for r in (0, 1)]
    train_and_push(tr, pushers, 6)
    snap = run.snapshot(wait=False)
    assert (snap["step"], snap["detail"]["cut"]) == (5, "current")
    done = run.wait_snapshot(snap)
    assert done["status"] == "complete"
    assert run.compare(done, "live")["summary"]["max_abs_diff"] == 0.0

    answer = run.finish()
    final = answer["snapshot"]
    assert (final["step"], final["label"], final["status"]) == (5, "final", "complete")
    info = run.refresh()
    assert info["health"] == "finished" and info["finished"]["snapshot"] == final["id"]
    assert [r["status"] for r in info["ranks"]] == ["finished", "finished"]
    assert run.finish()["snapshot"]["id"] == final["id"]  # idempotent
    tr.step()
    pushers[0].push(tr.model, 6)
    with pytest.raises(polyak.PolyakError) as e:
        pushers[0].flush()
    assert (e.value.status, e.value.code) == (409, "run_finished")
    assert "finished at step 5" in e.value.message
    for p in pushers:
        p.close()


def test_resume_checks_the_step_and_restart_without_resume_is_explained(client, run_name):
    run = client.create_run(run_name, profiles=[constant("ema", 0.5)])
    tr = Trainer(seed=32)
    pusher = run.pusher()
    train_and_push(tr, [pusher], 4)  # steps 0..3
    run.snapshot()  # at step 3, at once
    # Lightning's global_step after these 4 steps is 4: as a step it is one
    # too far (the snapshot at 3 would miss step 4), as steps_taken it is exact.
    with pytest.raises(polyak.PolyakError) as e:
        run.resume(4)
    assert e.value.code == "snapshot_older" and "steps 4..=4" in e.value.message
    assert run.resume(steps_taken=4)["step"] == 3
    with pytest.raises(ValueError):
        run.resume(3, steps_taken=4)
    # A trainer restarted from scratch without resume: the refusal names it.
    fresh = run.pusher()
    fresh.push(tr.model, 0)
    with pytest.raises(polyak.PolyakError) as e:
        fresh.flush()
    assert e.value.code == "step_conflict" and "run.resume(S)" in e.value.message
    fresh.close(timeout=0)
    pusher.close()


def test_exist_ok_refuses_a_changed_configuration(client, run_name):
    client.create_run(run_name, profiles=[constant("ema", 0.9)])
    same = client.create_run(run_name, profiles=[constant("ema", 0.9)], exist_ok=True)
    assert same.config["profiles"][0]["beta"] == 0.9
    with pytest.raises(polyak.PolyakError) as e:
        client.create_run(run_name, profiles=[constant("ema", 0.5)], exist_ok=True)
    assert e.value.code == "run_exists"
    assert "profiles[0].beta: 0.9 != 0.5" in e.value.message


def test_cli_edges(server, client, run_name, tmp_path, capsys):
    run = client.create_run(run_name, world_size=2, profiles=[constant("ema", 0.7)])
    tr = Trainer(seed=33)
    train_and_push(tr, [run.pusher(rank=r) for r in (0, 1)], 3)
    url = server.url

    # --json (and --url) after the subcommand.
    assert main(["status", run_name, "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == run_name
    # Without a step, after training: the current step, complete at once.
    assert main(["--url", url, "snapshot", run_name]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith("at step 2 (the current step): complete"), line
    (snap,) = run.snapshots()

    # -o naming a .safetensors file writes that file.
    target = tmp_path / "out" / "x.safetensors"
    args = ["--url", url, "download", run_name, snap["id"], "--no-progress"]
    assert main([*args, "-o", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target) and target.is_file()
    want = run.download(snap, progress=False)
    saved = safetensors.torch.load_file(target)
    assert set(saved) == set(want) and all(torch.equal(saved[k], v) for k, v in want.items())
    # Another dtype into a directory: a file of its own, the first one kept.
    d = tmp_path / "dir"
    assert main([*args, "-o", str(d)]) == 0
    plain = Path(capsys.readouterr().out.strip())
    assert main([*args, "-o", str(d), "--dtype", "bf16"]) == 0
    half = Path(capsys.readouterr().out.strip())
    assert half != plain and half.name.endswith("-bf16.safetensors")
    assert safetensors.torch.load_file(plain)["fc1.weight"].dtype == torch.float32
    assert safetensors.torch.load_file(half)["fc1.weight"].dtype == torch.bfloat16
    # Unpacked files carry the snapshot's time, not 1970.
    assert main([*args, "-o", str(d), "--layout", "sharded"]) == 0
    unpacked = Path(capsys.readouterr().out.strip()) / "rank-00000.safetensors"
    taken = snap["completed_at_ms"] / 1000
    assert abs(unpacked.stat().st_mtime - int(taken)) <= 1, (unpacked.stat().st_mtime, taken)

    # Every option of every subcommand says what it is for.
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, (name, action.dest)


def test_cli_closed_pipe_exits_quietly(server, client, run_name):
    """``python -m polyak ... | head``: the reader is gone before the
    command writes; it stops without a traceback."""
    client.create_run(run_name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "polyak", "--url", server.url, "--json", "runs"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # long before the interpreter has imported torch
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
