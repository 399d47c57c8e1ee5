"""Evaluations and series in the trackers people keep open.

A small transformer is trained and pushed (two ``power`` profiles and a
constant one, the mirror, periodic snapshots, drift sampled at every
update, trainer scalars logged run-level and per rank). Then:

- ``EvalWorker`` and ``posthoc_search`` with ``log_to=`` a real
  ``SummaryWriter`` and a wandb run in offline mode: TensorBoard's own
  event reader and the offline run's ``.wandb`` file (its records parsed
  with wandb's own protobuf classes) hold every posted evaluation, value
  for value, at the tags and x axes :mod:`polyak.trackers` documents;
- ``python -m polyak export RUN --tensorboard DIR``: the event file read
  back with TensorBoard's reader (``EventAccumulator.Scalars``, which sees
  only ``simple_value`` scalars) equals the API's series, per-tensor drift
  and evaluations, value for value (rounded to float32, as a
  ``simple_value`` holds them), at the API's steps and times;
  its progress is a bar on a terminal and nothing in a pipe;
- ``Pusher.post_ema_eval``: the metric a trainer computes under
  ``ema_weights`` is posted as the evaluation of the live EMA, equal to
  the metric this test computes on the snapshot it names (the periodic
  one of that step when there is one, else one taken for it).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import polyak
import pytest
import torch
from polyak.cli import main
from polyak.evals import load_weights
from polyak_testing import stderr_on_a_terminal, wait_for
from polyak_testing.refs import SEQ, VOCAB, TinyTransformer, lm_loss, train_step

STEPS = 12
SNAPSHOT_EVERY = 4
PROFILES = [
    {"name": "p05", "kind": "power", "sigma_rel": 0.05},
    {"name": "p10", "kind": "power", "sigma_rel": 0.10},
    {"name": "c", "kind": "constant", "beta": 0.9},
]
SIGMAS = [0.03, 0.06, 0.12]


def held_out() -> torch.Tensor:
    return torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(77))


def evaluate(model: torch.nn.Module) -> dict[str, float]:
    idx = held_out()
    logits = model(idx[:, :-1])
    hits = (logits.argmax(-1) == idx[:, 1:]).float().mean().item()
    return {"val_loss": lm_loss(model, idx).item(), "accuracy": hits}


# -- reading the trackers' files back ----------------------------------------


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float, float]]]:
    """``{tag: [(step, value, wall_time), ...]}`` as TensorBoard's own event
    reader loads its scalars (every point: no sampling). Every value is a
    ``simple_value`` scalar, which every reader sees: nothing is written as
    a tensor event, which ``Scalars()`` would not see."""
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        TENSORS,
        EventAccumulator,
    )

    acc = EventAccumulator(str(directory), size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    assert acc.Tags()[TENSORS] == []
    return {
        tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]
        for tag in acc.Tags()[SCALARS]
    }


def f32(value: float) -> float:
    """``value`` as a ``simple_value`` holds it (a float32)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def wandb_records(run_dir: Path) -> list:
    """The records of an offline wandb run's ``.wandb`` file: the LevelDB
    log format wandb writes (a 7-byte header, 32 KiB blocks of
    checksum-length-type chunks), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    block, pos, parts, records = 32 * 1024, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue  # padding
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    rows = []
    for r in wandb_records(run_dir):
        if r.WhichOneof("record_type") == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


# -- what the trackers must hold, from the API's evaluations ------------------


def expected_tensorboard(
    evals: list[dict], *, with_evaluator: bool = False
) -> dict[str, list[tuple[int, float]]]:
    """Live profiles and online weights at the candidate's step; post-hoc
    lengths at sigma_rel * 10^4, one curve per sweep step, with the fit
    residual beside (``with_evaluator``: a named evaluator's tags end in
    ``@<evaluator>``)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for e in evals:
        by = f"@{e['evaluator']}" if with_evaluator and e["evaluator"] else ""
        if e["kind"] == "posthoc":
            x = round(e["sigma_rel"] * 10_000)
            sweep = f"step_{e['step']}{by}"
            for m, v in e["metrics"].items():
                out.setdefault(f"posthoc/{m}/{sweep}", []).append((x, f32(v)))
            out.setdefault(f"posthoc/residual/{sweep}", []).append((x, f32(e["residual"])))
        else:
            for m, v in e["metrics"].items():
                out.setdefault(f"eval/{m}/{e['profile']}{by}", []).append((e["step"], f32(v)))
    return {k: sorted(v) for k, v in out.items()}


def expected_wandb(evals: list[dict]) -> list[dict]:
    rows = []
    for e in evals:
        if e["kind"] == "posthoc":
            row = {"posthoc/sigma_rel": e["sigma_rel"]}
            row.update({f"posthoc/{m}/step_{e['step']}": v for m, v in e["metrics"].items()})
            row[f"posthoc/residual/step_{e['step']}"] = e["residual"]
        else:
            row = {"eval/step": e["step"]}
            row.update({f"eval/{m}/{e['profile']}": v for m, v in e["metrics"].items()})
        rows.append(row)
    return rows


# -- the run ------------------------------------------------------------------


def attached(run, seed: int):
    """A model, its optimizer, a pusher attached to it and a data stream."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    pusher = run.pusher()
    pusher.attach(opt, model)
    return model, opt, pusher, torch.Generator().manual_seed(100 + seed)


@pytest.fixture(scope="module")
def trained(server):
    """A finished run: pushed every step, scalars logged run-level and for
    rank 0, periodic snapshots at 0, 4, 8 and the final one at 11."""
    client = polyak.Client(server.url)
    run = client.create_run(
        "tracked",
        mirror=True,
        snapshot_every=SNAPSHOT_EVERY,
        profiles=PROFILES,
        drift_every=1,
    )
    model, opt, pusher, gen = attached(run, seed=0)
    for step in range(STEPS):
        loss = train_step(model, opt, gen)
        run.log(step, train_loss=loss, lr=2e-2 * (1 - step / STEPS))
        run.log(step, rank=0, tokens=float((step + 1) * 8 * SEQ))
    pusher.flush()
    pusher.close()
    run.finish()
    yield run
    client.close()


@pytest.fixture(scope="module")
def logged(trained, tmp_path_factory):
    """The worker and a sweep, each writing to a SummaryWriter and to an
    offline wandb run."""
    import wandb  # in the test extra: a missing one fails, not skips
    from torch.utils.tensorboard import SummaryWriter

    tmp = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        # Offline, and nothing written outside the test's directory.
        for var, value in {
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_DIR": str(tmp),
            "WANDB_CONFIG_DIR": str(tmp / "config"),
            "WANDB_CACHE_DIR": str(tmp / "cache"),
            "WANDB_DATA_DIR": str(tmp / "data"),
        }.items():
            mp.setenv(var, value)
        writer = SummaryWriter(log_dir=str(tmp / "tb"))
        wb = wandb.init(project="polyak-test", mode="offline", dir=str(tmp))
        try:
            worker = polyak.EvalWorker(
                trained, TinyTransformer, evaluate, log_to=[writer, wb], progress=False
            )
            worker.run(follow=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # poorly fitted lengths
                rows = trained.posthoc_search(
                    SIGMAS, evaluate, TinyTransformer(), log_to=[writer, wb], metric="val_loss"
                )
        finally:
            writer.close()
            run_dir = Path(wb.dir).parent
            wb.finish()
            with contextlib.suppress(Exception):
                wandb.teardown()
    return {"tb": tmp / "tb", "wandb": run_dir, "worker": worker, "rows": rows}


def unnamed_evals(run) -> list[dict]:
    """The evaluations the worker and the sweep posted (no evaluator name)."""
    return [e for e in run.evals() if not e["evaluator"]]


def test_log_to_a_summary_writer_holds_every_evaluation(trained, logged):
    evals = unnamed_evals(trained)
    kinds = {e["kind"] for e in evals}
    assert kinds == {"ema", "online", "posthoc"}, kinds
    # Every candidate of the 4 cuts (3 profiles and the online weights)
    # and every length of the sweep.
    assert logged["worker"].evaluated == 4 * 4 == len(evals) - len(SIGMAS)
    got = {
        tag: sorted((step, value) for step, value, _ in points)
        for tag, points in tensorboard_scalars(logged["tb"]).items()
    }
    assert got == expected_tensorboard(evals)
    # The tags a person reads: a line per candidate family over training,
    # and the sweep's curve against sigma_rel.
    final = max(e["step"] for e in evals)
    assert {f"eval/val_loss/{p}" for p in ("p05", "p10", "c", "online")} <= set(got)
    assert [x for x, _ in got[f"posthoc/val_loss/step_{final}"]] == [300, 600, 1200]
    by_sigma = {r["sigma_rel"]: r for r in logged["rows"]}
    for x, value in got[f"posthoc/val_loss/step_{final}"]:
        assert value == by_sigma[x / 10_000]["metrics"]["val_loss"]


def test_log_to_an_offline_wandb_run_holds_every_evaluation(trained, logged):
    evals = unnamed_evals(trained)
    history = wandb_history(logged["wandb"])

    # One row per evaluation, in the order they were posted (the worker's,
    # by step; then the sweep's).
    def text(rows):
        return sorted(json.dumps(r, sort_keys=True) for r in rows)

    assert text(history) == text(expected_wandb(evals))
    assert len(history) == len(evals)
    # Each family is plotted against its own x axis.
    axes = {
        r.metric.glob_name: r.metric.step_metric
        for r in wandb_records(logged["wandb"])
        if r.WhichOneof("record_type") == "metric" and r.metric.glob_name
    }
    assert axes == {"eval/*": "eval/step", "posthoc/*": "posthoc/sigma_rel"}


def stable_series(run) -> dict:
    """The run's series once two reads a moment apart agree (the server
    writes points in batches)."""
    last = None

    def settled():
        nonlocal last
        now = run.client.request(
            "GET", f"{run.path}/metrics", params={"limit": 1_000_000}, token=run.read_token
        ).json()["series"]
        same, last = now == last, now
        return same and now

    return wait_for(settled, 60, "the metric series to settle")


def test_export_to_tensorboard_equals_the_api(trained, logged, tmp_path, capsys):
    run = trained
    final = [s for s in run.snapshots() if s["kind"] in ("manual", "periodic")][-1]
    run.post_eval(final, "c", {"val_loss": 1.5}, evaluator="judge")
    before = stable_series(run)
    wait_for(
        lambda: all(
            len(run.tensor_drift(p["name"], limit=2000)["steps"]) == STEPS for p in PROFILES
        ),
        60,
        "every update's tensor drift",
    )
    out = tmp_path / "tb"
    argv = ["--url", run.url, "export", run.name, "--tensorboard", str(out), "--tensor-drift"]
    assert main(argv) == 0
    printed = capsys.readouterr()
    # No terminal here: no bar drawn.
    assert "\r" not in printed.err
    series = run.client.request(
        "GET", f"{run.path}/metrics", params={"limit": 1_000_000}, token=run.read_token
    ).json()["series"]
    assert series == before
    got = tensorboard_scalars(out)

    want: dict[str, list[tuple[int, float, float]]] = {}
    for s in series:
        tag = s["name"] if s["rank"] is None else f"{s['name']}/rank{s['rank']}"
        want[tag] = [(step, f32(value), at_ms / 1000.0) for step, value, at_ms in s["points"]]
    evals = run.evals()
    want.update(expected_tensorboard(evals, with_evaluator=True))
    for p in PROFILES:
        drift = run.tensor_drift(p["name"], limit=2000)
        assert len(drift["steps"]) == STEPS  # sampled at every update
        for tensor, row in zip(drift["tensors"], drift["values"], strict=True):
            points = [
                (s, f32(v)) for s, v in zip(drift["steps"], row, strict=True) if v is not None
            ]
            want[f"tensor_drift/{p['name']}/{tensor}"] = points
    assert want["eval/val_loss/c@judge"] == [(final["step"], 1.5)]

    metric_tags = {t for t in want if not t.startswith(("eval/", "posthoc/", "tensor_drift/"))}
    assert {t: got[t] for t in metric_tags} == {t: want[t] for t in metric_tags}
    evaluation_tags = set(want) - metric_tags  # evaluations and tensor drift: no times
    assert {t: sorted(p[:2] for p in got[t]) for t in evaluation_tags} == {
        t: sorted(want[t]) for t in evaluation_tags
    }
    assert set(got) == set(want)
    # What was exported: the trainer's scalars (run-level and rank 0's),
    # the EMA drift of every profile, every evaluation.
    assert {"train_loss", "lr", "tokens/rank0"} <= metric_tags
    assert {f"ema_drift/{p['name']}" for p in PROFILES} <= metric_tags
    assert len(got["train_loss"]) == STEPS
    assert "tensor_drift/p05/fc1.weight" in got
    assert f"{len(evals)} evaluations" in printed.out
    # A second export into the same directory would draw every point twice.
    with pytest.raises(SystemExit) as refused:
        main(["--url", run.url, "export", run.name, "--tensorboard", str(out)])
    assert "already holds TensorBoard event files" in str(refused.value)


def test_post_ema_eval_evaluates_the_live_ema(client, run_name):
    run = client.create_run(
        run_name,
        snapshot_every=SNAPSHOT_EVERY,
        profiles=[{"name": "ema", "kind": "constant", "beta": 0.8}],
    )
    model, opt, pusher, gen = attached(run, seed=1)
    posted = []
    for step in range(7):
        train_step(model, opt, gen)
        if step in (4, 6):
            with pusher.ema_weights(model, "ema"):
                model.eval()
                with torch.no_grad():
                    val = lm_loss(model, held_out()).item()
                model.train()
            posted.append((step, val, pusher.post_ema_eval({"val_loss": val}, "ema")))
            with torch.no_grad():
                online = lm_loss(model, held_out()).item()
            assert online != val  # the EMA was evaluated, not the online weights
    pusher.close()

    snaps = {s["id"]: s for s in run.snapshots()}
    for step, val, stored in posted:
        assert (stored["step"], stored["profile"], stored["kind"]) == (step, "ema", "ema")
        assert stored["metrics"] == {"val_loss": val}
        state = run.download(stored["snapshot"], "ema", progress=False)
        mine = load_weights(TinyTransformer(), state).eval()
        with torch.no_grad():
            assert lm_loss(mine, held_out()).item() == pytest.approx(val, rel=1e-6, abs=0)
    # Step 4 has a periodic cut: the evaluation is attached to it. Step 6
    # has none: one is taken for it, of that profile.
    (_, _, at4), (_, _, at6) = posted
    assert snaps[at4["snapshot"]]["kind"] == "periodic"
    assert snaps[at6["snapshot"]]["kind"] == "manual"
    assert snaps[at6["snapshot"]]["label"] == "live-eval"
    assert [e["snapshot"] for e in run.evals()] == [at4["snapshot"], at6["snapshot"]]
    # Other ranks post nothing (one evaluation, one snapshot per call).
    two = client.create_run(
        f"{run_name}-2", world_size=2, profiles=[{"name": "ema", "kind": "constant", "beta": 0.8}]
    )
    assert two.pusher(rank=1).post_ema_eval({"val_loss": 0.0}) is None
    assert two.snapshots() == []


def test_export_progress_is_a_bar_on_a_terminal_only(trained, tmp_path):
    """Through ``python -m polyak``: on a terminal tqdm draws its bar;
    into a pipe nothing but the summary line is written."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "polyak", "--url", trained.url, "export", trained.name]
    piped = subprocess.run(
        [*command, "--tensorboard", str(tmp_path / "piped")],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert piped.returncode == 0, piped.stderr
    assert piped.stderr == "" and "scalars" in piped.stdout, piped

    status, shown = stderr_on_a_terminal(
        [*command, "--tensorboard", str(tmp_path / "shown")], env=env
    )
    assert status == 0, shown[-400:]
    assert "\r" in shown and "100%|" in shown and "scalar" in shown, repr(shown[-400:])
    assert f"{trained.name} export" in shown


def test_eval_command_writes_to_tensorboard(trained, tmp_path):
    """``python -m polyak eval RUN --script ... --tensorboard DIR``: the
    worker's evaluations, in DIR too."""
    script = tmp_path / "eval.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "from polyak_testing.refs import TinyTransformer as build_model\n"
        "from test_client_trackers import evaluate\n"
    )
    out = tmp_path / "tb"
    argv = ["--url", trained.url, "eval", trained.name, "--script", str(script)]
    argv += ["--profiles", "c", "--no-online", "--evaluator", "cli", "--tensorboard", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    evals = trained.evals(evaluator="cli")
    assert {e["profile"] for e in evals} == {"c"} and len(evals) == 4
    got = {
        tag: sorted((step, value) for step, value, _ in points)
        for tag, points in tensorboard_scalars(out).items()
    }
    assert got == expected_tensorboard(evals)
