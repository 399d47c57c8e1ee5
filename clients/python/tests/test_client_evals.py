"""Evaluating EMA candidates from the client.

A real training job (a small transformer, two DDP ranks on gloo, periodic
snapshots of two ``power`` profiles and a constant one, with the mirror)
runs while ``python -m polyak eval --follow`` evaluates its candidates in
a process of its own. The worker is stopped (SIGTERM) in the middle and
started again: every (snapshot, profile) and every snapshot's online
weights end with exactly one evaluation, ``evaluate`` ran once per
candidate over both processes, and each value equals the held-out loss
this test computes itself on the downloaded weights.

Then ``posthoc_search`` over 8 lengths: its rows equal a synthesis of
each length on its own evaluated here, the best is their argmin, poorly
fitted lengths are flagged and warned about, and ``GET .../best`` names
the same candidate and serves the weights of that length.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import httpx
import polyak
import polyak_testing
import pytest
import torch
from polyak.evals import POORLY_FITTED, load_weights
from polyak_testing import wait_for
from polyak_testing.refs import VOCAB, TinyTransformer, lm_loss
from polyak_workers import ddp_finish_worker, run_ranks

# Where the worker script finds polyak_testing, installed or not.
SUPPORT = Path(polyak_testing.__file__).resolve().parents[1]
STEPS = 16
SNAPSHOT_EVERY = 4
PROFILES = [
    {"name": "p05", "kind": "power", "sigma_rel": 0.05},
    {"name": "p10", "kind": "power", "sigma_rel": 0.10},
    {"name": "c", "kind": "constant", "beta": 0.9},
]

SCRIPT = """
import os, sys, time
sys.path.insert(0, {support!r})
import torch
from polyak_testing.refs import TinyTransformer, lm_loss, VOCAB, SEQ

torch.set_num_threads(1)
HELD_OUT = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(4242))
LOG = {log!r}


def build_model():
    return TinyTransformer()


def evaluate(model):
    loss = lm_loss(model, HELD_OUT).item()
    with open(LOG, "a") as f:
        f.write(f"{{loss!r}}\\n")
    calls = sum(1 for _ in open(LOG))
    # The test stops this process here, mid-run, once it has this many.
    if calls == int(os.environ.get("PAUSE_AT", "0")):
        while not os.path.exists(os.environ["GATE"]):
            time.sleep(0.02)
    return {{"val_loss": loss}}
"""


def held_out_loss(state: dict[str, torch.Tensor]) -> float:
    """The held-out loss of weights, as this test computes it."""
    from polyak_testing.refs import SEQ

    model = load_weights(TinyTransformer(), state)
    model.eval()
    idx = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(4242))
    with torch.no_grad():
        return lm_loss(model, idx).item()


def _worker(server, run: str, script: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polyak",
            "--url",
            server.url,
            "eval",
            run,
            "--script",
            str(script),
            "--follow",
            "--until-finished",
            "--no-progress",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def evaluated(server, tmp_path_factory):
    """The training job, evaluated by a worker stopped and restarted."""
    tmp = tmp_path_factory.mktemp("evals")
    client = polyak.Client(server.url)
    run = client.create_run(
        "evaluated-ddp",
        world_size=2,
        mirror=True,
        snapshot_every=SNAPSHOT_EVERY,
        profiles=PROFILES,
    )
    log, gate = tmp / "calls.log", tmp / "gate"
    script = tmp / "eval.py"
    script.write_text(SCRIPT.format(support=str(SUPPORT), log=str(log)))
    first = _worker(server, run.name, script, PAUSE_AT="3", GATE=str(gate))
    try:
        cfg = {
            "init": f"file://{tmp / 'store'}",
            "url": server.url,
            "run": run.name,
            "steps": STEPS,
        }
        run_ranks(ddp_finish_worker, 2, cfg)
        # Stopped in the middle: it holds its third evaluation.
        wait_for(
            lambda: log.exists() and len(log.read_text().splitlines()) >= 3, 120, "3 evaluations"
        )
        first.send_signal(signal.SIGTERM)
        gate.touch()
        _, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
    first_calls = len(log.read_text().splitlines())
    second = _worker(server, run.name, script)
    _, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    yield {"client": client, "run": run, "first_calls": first_calls, "log": log}
    client.close()


def test_every_candidate_is_evaluated_once_across_a_restart(evaluated):
    run = evaluated["run"]
    snaps = [s for s in run.snapshots() if s["kind"] in ("periodic", "manual")]
    assert {s["status"] for s in snaps} == {"complete"}
    # Periodic cuts during training and the final snapshot.
    assert len(snaps) >= 1 + STEPS // SNAPSHOT_EVERY - 1
    want = {(s["id"], p) for s in snaps for p in ("p05", "p10", "c", "online")}
    got = run.evals()
    assert sorted((e["snapshot"], e["profile"]) for e in got) == sorted(want)
    # `evaluate` ran once per candidate over both processes: the stopped
    # worker posted the evaluation it held, the restarted one skipped it.
    assert evaluated["first_calls"] == 3
    calls = evaluated["log"].read_text().splitlines()
    assert len(calls) == len(want)

    step_of = {s["id"]: s["step"] for s in snaps}
    for e in got:
        assert e["step"] == step_of[e["snapshot"]]
        assert e["kind"] == ("online" if e["profile"] == "online" else "ema")
        state = run.download(e["snapshot"], e["profile"], progress=False)
        mine = held_out_loss(state)
        assert e["metrics"]["val_loss"] == pytest.approx(mine, rel=1e-6, abs=0), e
    # The EMAs are candidates worth comparing: they differ from the online
    # weights at the final step.
    final = max(snaps, key=lambda s: (s["step"], s["kind"] == "manual"))
    at_end = {e["profile"]: e["metrics"]["val_loss"] for e in got if e["snapshot"] == final["id"]}
    assert len(set(at_end.values())) == 4, at_end


def test_posthoc_search_equals_synthesis_by_hand_and_best_serves_it(evaluated):
    run = evaluated["run"]
    idx_gen = torch.Generator().manual_seed(4242)
    from polyak_testing.refs import SEQ

    held = torch.randint(0, VOCAB, (16, SEQ), generator=idx_gen)

    def evaluate(model):
        return {"val_loss": lm_loss(model, held).item()}

    sigmas = [0.005, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = run.posthoc_search(sigmas, evaluate, TinyTransformer(), evaluator="search")
    assert sorted(r["sigma_rel"] for r in rows) == sorted(sigmas)
    # By hand: each length synthesised on its own, downloaded, evaluated.
    by_hand = {}
    for s in sigmas:
        snap = run.posthoc(s)
        state = run.download(snap, progress=False)
        by_hand[s] = (held_out_loss(state), snap["detail"]["residual"], state)
    for r in rows:
        loss, residual, _ = by_hand[r["sigma_rel"]]
        assert r["metrics"]["val_loss"] == pytest.approx(loss, rel=1e-6, abs=0)
        assert r["residual"] == pytest.approx(residual, rel=1e-9)
        assert r["poorly_fitted"] == (residual > POORLY_FITTED)
    # Best first, and the best is the argmin of the losses by hand.
    losses = [r["metrics"]["val_loss"] for r in rows]
    assert losses == sorted(losses)
    argmin = min(sigmas, key=lambda s: by_hand[s][0])
    assert rows[0]["sigma_rel"] == argmin
    # Poorly fitted lengths are flagged and warned about (at least the
    # shortest; not every one).
    flagged = {r["sigma_rel"] for r in rows if r["poorly_fitted"]}
    assert 0.005 in flagged and len(flagged) < len(sigmas)
    warned = {str(w.message).split(":")[0] for w in caught if w.category is UserWarning}
    assert warned == {f"sigma_rel={s:g}" for s in flagged}

    # The evaluations are stored; GET .../best names the same candidate and
    # its download is the weights of that length.
    best = run.best("val_loss", kind="posthoc", evaluator="search")
    assert (best["evaluation"]["snapshot"], best["value"]) == (rows[0]["snapshot"], losses[0])
    assert best["evaluation"]["sigma_rel"] == argmin
    assert best["evaluation"]["residual"] == pytest.approx(rows[0]["residual"], rel=1e-12)
    r = httpx.get(run.url + best["download"], timeout=60)
    assert r.status_code == 200
    import safetensors.torch

    served = safetensors.torch.load(r.content)
    expected = by_hand[argmin][2]
    assert served.keys() == expected.keys()
    for k in served:
        assert torch.equal(served[k], expected[k]), k
    assert not math.isnan(losses[0])


def test_eval_script_without_the_functions_is_a_usage_error(server, tmp_path):
    from polyak.cli import main

    script = tmp_path / "empty.py"
    script.write_text("x = 1\n")
    with pytest.raises(SystemExit) as refused:
        main(["--url", server.url, "eval", "r", "--script", str(script)])
    assert "defines no build_model or evaluate()" in str(refused.value)
