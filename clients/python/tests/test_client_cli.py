"""``python -m polyak``: runs, push status, a rank's EMA, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import polyak
import pytest
import safetensors.torch
import torch
from polyak.cli import main
from polyak_refs import Trainer


def test_cli_runs_status_and_ema(server, client, run_name, tmp_path, capsys):
    run = client.create_run(
        run_name, world_size=2, profiles=[{"name": "c", "kind": "constant", "beta": 0.5}]
    )
    tr = Trainer(seed=12)
    pusher = run.pusher(rank=1)
    for step in range(3):
        tr.step()
        pusher.push(tr.model, step)
    pusher.flush()

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
