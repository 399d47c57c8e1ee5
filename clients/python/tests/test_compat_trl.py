"""``polyak.compat.trl.BEMACallback`` against trl 1.16.0's own
``BEMACallback``, both on the same ``transformers.Trainer`` run (same model,
same steps), computed in the same test: the server's BEMA (``running_model``,
live ``/ema``, a snapshot's download, the saved ``{output_dir}/bema``)
equals TRL's ``running_model`` to 1e-6, in one process, across a server
crash, and under DDP on 2 gloo ranks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import polyak
import pytest
import torch
from compat_helpers import assert_same, one_thread  # noqa: F401 (autouse)
from polyak.compat.trl import BEMACallback
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback
from trl import BEMACallback as TrlBEMACallback
from trl_helpers import arguments, dataset, tiny_model

STEPS = 12

CASES = {
    # TRL's own schedule: beta and alpha at the global step, w0 at update_after.
    "from-start": {"update_freq": 3, "update_after": 0, "lag": 2, "ema_power": 0.5},
    "after-burn-in": {
        "update_freq": 3,
        "update_after": 4,
        "bias_power": 0.3,
        "multiplier": 1.5,
        "min_ema_multiplier": 0.2,
    },
}


def _train(tmp_path: Path, callbacks: list, steps: int = STEPS) -> GPT2LMHeadModel:
    model = tiny_model()
    Trainer(
        model=model, args=arguments(tmp_path, steps), train_dataset=dataset(), callbacks=callbacks
    ).train()
    return model


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_bema(want: TrlBEMACallback, got: BEMACallback, trained: torch.nn.Module) -> None:
    """The drop-in's BEMA is TRL's, and differs from the trained weights."""
    assert_same(want.running_model.state_dict(), got.running_model.state_dict())
    moved = max(
        (p - want.running_model.state_dict()[n]).abs().max().item()
        for n, p in _params(trained).items()
    )
    assert moved > 1e-3, "BEMA equal to the trained weights proves nothing"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_bema_equals_trl_on_the_same_trainer(server, tmp_path, case):
    kw = CASES[case]
    want = TrlBEMACallback(**kw)
    got = BEMACallback(**kw, url=server.url)
    # TRL saves first, the drop-in overwrites {output_dir}/bema after it.
    trained = _train(tmp_path, [want, got])
    _assert_bema(want, got, trained)
    reference = _params(want.running_model)

    run = polyak.Client(server.url).run(got.run_name)
    assert run.profiles == ["bema"]
    live = run.fetch_ema("bema")
    assert_same(reference, live)
    last = max(s for s in range(STEPS + 1) if got._changes_bema(s) or s == 0)
    snap = run.snapshot(step=last)
    assert_same(reference, run.download(snap, "bema", progress=False))

    saved = GPT2LMHeadModel.from_pretrained(tmp_path / "bema")
    assert_same(want.running_model.state_dict(), saved.state_dict())


class _CrashServer(TrainerCallback):
    """At ``at``: the drop-in's pushes acknowledged, the run's state
    persisted, the server killed (nothing flushed) and started again on
    the same data dir; training goes on against the restored state."""

    def __init__(self, srv, got: BEMACallback, at: int) -> None:
        self.srv, self.got, self.at = srv, got, at
        self.restored: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.at:
            return
        self.got.flush()
        run = self.got.run
        run.client.request("POST", f"{run.path}/persist")
        self.srv.kill()
        self.srv.start(same_port=True)
        self.restored = run.rank(0).last_step


@pytest.mark.slow
def test_bema_hidden_buffers_survive_a_crash(fresh_server, tmp_path):
    """w0 and the plain EMA are in the state snapshot and restored: after a
    kill -9 mid-run the result is still TRL's (a restart that lost them, or
    took them from the served weights, would differ)."""
    srv = fresh_server.start()
    kw = CASES["after-burn-in"]
    want = TrlBEMACallback(**kw)
    got = BEMACallback(**kw, url=srv.url)
    crash = _CrashServer(srv, got, at=7)
    trained = _train(tmp_path, [want, got, crash])
    assert crash.restored == 7  # restored at the last push before the crash
    _assert_bema(want, got, trained)
    # The state snapshot offers the profile only; its hidden parts are
    # files of it, beside the profile's.
    run = polyak.Client(srv.url).run(got.run_name)
    state = run.snapshots(kind="state", status="complete")
    assert state and all(s.profiles == ("bema",) for s in state), state
    parts = {f.part for f in run.get_snapshot(state[0].id).files}
    assert parts == {"bema", "__bema_w0__.bema", "__bema_ema__.bema"}, parts


WORKER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch
    from transformers import Trainer
    from trl import BEMACallback as TrlBEMACallback
    from polyak.compat.trl import BEMACallback
    from trl_helpers import arguments, dataset, tiny_model

    url, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    kw = dict(update_freq=3, update_after=2, lag=4)
    want, got = TrlBEMACallback(**kw), BEMACallback(**kw, url=url, run=sys.argv[3])
    model = tiny_model()
    args = arguments(out, 10, ddp_backend="gloo")
    Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[want, got]).train()
    torch.save({
        "trl": want.running_model.state_dict(),
        "polyak": got.running_model.state_dict(),
        "trained": dict(model.state_dict()),
    }, out / f"result-{rank}.pt")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_bema_equals_trl_under_ddp(server, tmp_path, run_name):
    """Two gloo ranks, each pushing its half of the replicated parameters:
    the server's BEMA is TRL's on every rank, the live ``/ema`` too."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), server.url, str(tmp_path), run_name],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-4000:]
    results = [torch.load(tmp_path / f"result-{r}.pt") for r in range(2)]
    for r in results:
        assert_same(r["trl"], r["polyak"])
    assert_same(results[0]["trl"], results[1]["trl"])
    run = polyak.Client(server.url).run(run_name)
    assert run.world_size == 2
    reference = {n: t for n, t in results[0]["trl"].items() if n != "lm_head.weight"}
    live = run.fetch_ema("bema")
    assert_same({n: t for n, t in reference.items() if n in live}, live)
    assert set(live) == {n for n, _ in tiny_model().named_parameters()}
    moved = (
        (
            results[0]["trained"]["transformer.h.0.mlp.c_fc.weight"]
            - reference["transformer.h.0.mlp.c_fc.weight"]
        )
        .abs()
        .max()
    )
    assert moved > 1e-3
    saved = GPT2LMHeadModel.from_pretrained(tmp_path / "bema")
    assert_same(results[0]["trl"], saved.state_dict())


def test_bema_profile_is_validated(client, run_name):
    """Bad BEMA parameters are a 422 naming the field, and nothing is created."""
    for bad, field in [
        ({"update_freq": 0}, "update_freq"),
        ({"ema_power": -1}, "ema_power"),
        ({"min_ema_multiplier": 2}, "min_ema_multiplier"),
        ({"lag": 0, "multiplier": 0}, "lag"),
    ]:
        with pytest.raises(polyak.PolyakError) as e:
            client.create_run(run_name, profiles=[{"name": "b", "kind": "bema", **bad}])
        assert e.value.status == 422 and f"profiles[0].{field}" in str(e.value), e.value
    assert run_name not in [r.name for r in client.runs()]
