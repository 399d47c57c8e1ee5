"""``python -m polyak``: runs, push status, a rank's EMA, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polyak
import pytest
import safetensors.torch
import torch
from polyak.cli import main
from polyak_testing.refs import Trainer, train_and_push


def test_cli_runs_status_and_ema(server, client, run_name, tmp_path, capsys):
    run = client.create_run(
        run_name, world_size=2, profiles=[{"name": "c", "kind": "constant", "beta": 0.5}]
    )
    tr = Trainer(seed=12)
    pusher = run.pusher(rank=1)
    train_and_push(tr, [pusher], 3)

    assert main(["--url", server.url, "runs"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith(run_name))
    assert line.split()[1:4] == ["2", "1/2", "2"]

    assert main(["--url", server.url, "status", run_name]) == 0
    out = capsys.readouterr().out
    assert f"run {run_name}: waiting" in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[3:]}
    assert rows["0"][1:3] == ["never_seen", "-"]
    assert rows["1"][1:4] == ["live", "2", "3"]

    assert main(["--url", server.url, "--json", "ranks", run_name]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ranks"][1]["pushes"] == 3 and info["config"]["world_size"] == 2

    path = tmp_path / "r1.safetensors"
    assert main(["--url", server.url, "ema", run_name, "--rank", "1", "-o", str(path)]) == 0
    capsys.readouterr()
    saved = safetensors.torch.load(path.read_bytes())
    live = run.rank_ema(1, "c").tensors
    assert set(saved) == set(live)
    assert all(torch.equal(saved[k], live[k]) for k in live)

    assert main(["--url", server.url, "status", "no-such-run"]) == 1
    assert "404 run_not_found" in capsys.readouterr().err


def test_python_dash_m_polyak(server, client, run_name):
    client.create_run(run_name)
    out = subprocess.run(
        [sys.executable, "-m", "polyak", "--url", server.url, "--json", "runs"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert run_name in [r["name"] for r in json.loads(out)]
    assert polyak.__version__


def test_runs_create_attach_delete(client, run_name):
    profiles = [{"name": "c", "kind": "constant", "beta": 0.5}]
    run = client.create_run(run_name, world_size=3, update_every=2, profiles=profiles)
    assert (run.world_size, run.update_every, run.profiles) == (3, 2, ["c"])
    with pytest.raises(polyak.PolyakError) as e:
        client.create_run(run_name, world_size=3, update_every=2, profiles=profiles)
    assert (e.value.status, e.value.code) == (409, "run_exists")
    again = client.create_run(
        run_name, world_size=3, update_every=2, profiles=profiles, exist_ok=True
    )
    assert again.name == run_name and again.config == run.config
    with pytest.raises(polyak.PolyakError) as e:
        client.create_run(run_name, world_size=4, profiles=profiles, exist_ok=True)
    assert e.value.code == "run_exists" and "world_size" in e.value.message
    assert run_name in [r["name"] for r in client.runs()]
    assert [r["status"] for r in run.ranks()] == ["never_seen"] * 3
    assert run.should_push(4) and not run.should_push(5)
    run.delete()
    with pytest.raises(polyak.PolyakError) as e:
        client.run(run_name)
    assert (e.value.status, e.value.code) == (404, "run_not_found")


def test_cli_snapshots_downloads_compare_resume_posthoc(server, client, run_name, tmp_path, capsys):
    run = client.create_run(
        run_name,
        snapshot_every=2,
        profiles=[
            {"name": "p05", "kind": "power", "sigma_rel": 0.05},
            {"name": "p15", "kind": "power", "sigma_rel": 0.15},
        ],
    )
    url = server.url
    tr = Trainer(seed=25)
    pusher = run.pusher()
    train_and_push(tr, [pusher], 5)

    # A step ahead of every rank: pending until they apply it.
    args = ["--url", url, "--json", "snapshot", run_name, "--no-wait", "--label", "cli"]
    assert main([*args, "--step", "5"]) == 0
    pending = json.loads(capsys.readouterr().out)
    assert (pending["step"], pending["status"], pending["label"]) == (5, "pending", "cli")
    tr.step()
    pusher.push(tr.model, 5)
    pusher.flush()
    snap = run.wait_snapshot(pending["id"], timeout=30)

    assert main(["--url", url, "snapshots", run_name]) == 0
    rows = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines()[1:]}
    assert rows[snap["id"]][1:] == ["5", "manual", "complete", "cli"]

    out = tmp_path / "dl"
    args = ["--url", url, "download", run_name, snap["id"], "--profile", "p15", "-o", str(out)]
    assert main([*args, "--no-progress"]) == 0
    path = capsys.readouterr().out.strip()
    saved = safetensors.torch.load_file(path)
    want = run.download(snap, "p15", progress=False)
    assert set(saved) == set(want) and all(torch.equal(saved[k], v) for k, v in want.items())
    assert main([*args, "--layout", "sharded"]) == 0
    captured = capsys.readouterr()
    assert "100%" in captured.err  # the progress bar
    assert sorted(p.name for p in Path(captured.out.strip()).iterdir()) == [
        "rank-00000.safetensors"
    ]

    assert main(["--url", url, "--json", "compare", run_name, snap["id"], "--profile", "p05"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["b"], result["summary"]["max_abs_diff"]) == ("live", 0.0)
    assert main(["--url", url, "compare", run_name, snap["id"], "--profile-b", "p15"]) == 0
    table = capsys.readouterr().out
    assert "fc1.weight" in table and f"{snap['id']} (p05) vs live (p15)" in table

    assert main(["--url", url, "posthoc", run_name, "--sigma-rel", "0.1", "--step", "4"]) == 0
    line = capsys.readouterr().out.strip()
    assert "at step 4: complete, fit residual" in line and "sigma_rel 0.1" in line, line
    (made,) = run.snapshots(kind="posthoc")
    assert (made["profiles"], made["status"]) == (["posthoc"], "complete")
    # A sweep: one snapshot per length.
    args = ["--url", url, "posthoc", run_name, "--sigma-rel", "0.06,0.08", "--step", "4"]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "sigma_rel 0.06" in lines[0] and "sigma_rel 0.08" in lines[1]
    assert len(run.snapshots(kind="posthoc")) == 3
    # The plan: weights per source, nothing written.
    assert main([*args[:-2], "--step", "2", "--plan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 2; 4 sources") and out.count("residual") == 2, out
    assert len(run.snapshots(kind="posthoc")) == 3
    # A step without a snapshot: refused with the usable steps.
    assert main(["--url", url, "posthoc", run_name, "--sigma-rel", "0.1", "--step", "3"]) == 1
    assert "usable steps: [0, 2, 4, 5]" in capsys.readouterr().err
    # Merging needs the online weights (mirror).
    assert main(["--url", url, "merge", run_name, "--last", "2"]) == 1
    assert "mirror" in capsys.readouterr().err

    assert main(["--url", url, "resume", run_name, "4"]) == 0
    line = capsys.readouterr().out.strip()
    (periodic4,) = [s["id"] for s in run.snapshots(kind="periodic") if s["step"] == 4]
    assert line == f"resumed from snapshot {periodic4} at step 4", line
    assert run.rank(0)["last_step"] == 4
    assert main(["--url", url, "posthoc", run_name, "--sigma-rel", "0.9"]) == 1
    assert "422" in capsys.readouterr().err
