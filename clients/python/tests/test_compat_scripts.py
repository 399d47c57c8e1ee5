"""A training script written for each original runs unchanged but for its
import line against a real server, giving the original's numbers; the
server's run shows its pushes and profile. Also: memory on the trainer,
and what happens when the server is unreachable."""

from __future__ import annotations

import socket
from pathlib import Path

import polyak
import pytest
import torch
from compat_helpers import Trainer, one_thread, twins  # noqa: F401 (autouse)
from polyak import PolyakError, RetryPolicy

SCRIPTS = Path(__file__).parent / "compat_scripts"

# script -> (the original import line, the one line that replaces it, profile kinds)
PORTS = {
    "train_swa_utils.py": (
        "from torch.optim.swa_utils import",
        "from polyak.compat.swa_utils import",
        {"swa", "constant"},
    ),
    "train_ema_pytorch.py": (
        "from ema_pytorch import",
        "from polyak.compat.ema_pytorch import",
        {"warmup"},
    ),
    "train_ema_pytorch_posthoc.py": (
        "from ema_pytorch import",
        "from polyak.compat.ema_pytorch import",
        {"karras"},
    ),
    "train_timm.py": (
        "from timm.utils.model_ema import",
        "from polyak.compat.timm import",
        {"timm"},
    ),
    "train_diffusers.py": (
        "from diffusers.training_utils import",
        "from polyak.compat.diffusers import",
        {"diffusers"},
    ),
}


def run_script(source: str) -> dict[str, torch.Tensor]:
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(source, "<training script>", "exec"), namespace)
    return namespace["RESULT"]  # type: ignore[return-value]


@pytest.mark.parametrize("script", list(PORTS))
def test_training_script_runs_with_one_import_changed(server, monkeypatch, tmp_path, script):
    original, replacement, kinds = PORTS[script]
    monkeypatch.chdir(tmp_path)  # where a script writes its files (checkpoints)
    source = (SCRIPTS / script).read_text()
    lines = source.splitlines(keepends=True)
    changed = [i for i, line in enumerate(lines) if line.startswith(original)]
    assert len(changed) == 1
    ported = "".join(
        line.replace(original, replacement, 1) if i in changed else line
        for i, line in enumerate(lines)
    )
    assert sum(a != b for a, b in zip(lines, ported.splitlines(keepends=True), strict=True)) == 1

    want = run_script(source)
    monkeypatch.setenv("POLYAK_URL", server.url)
    with polyak.Client(server.url) as client:
        before = {r["name"] for r in client.runs()}
        got = run_script(ported)
        new = [r for r in client.runs() if r["name"] not in before]
        assert new, "the drop-in made no run"
        seen_kinds = set()
        for row in new:
            seen_kinds |= {p["kind"] for p in row["config"]["profiles"]}
            assert row["last_step"] is not None and row["last_step"] > 0
        assert kinds <= seen_kinds
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        if w.is_floating_point():
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(g, w), name


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_unreachable_at_construction_names_the_url():
    from polyak.compat.diffusers import EMAModel
    from polyak.compat.ema_pytorch import EMA, PostHocEMA
    from polyak.compat.swa_utils import AveragedModel
    from polyak.compat.timm import ModelEmaV2, ModelEmaV3

    url = closed_port()
    model, _ = twins()
    for make in (
        lambda: AveragedModel(model, url=url),
        lambda: EMA(model, url=url),
        lambda: PostHocEMA(model, sigma_rels=(0.05, 0.28), url=url),
        lambda: ModelEmaV2(model, url=url),
        lambda: ModelEmaV3(model, url=url),
        lambda: EMAModel(model.parameters(), url=url),
    ):
        with pytest.raises(PolyakError, match=url) as err:
            make()
        assert err.value.code == "unavailable"


def test_unreachable_later_raises_on_read(fresh_server):
    from polyak.compat.ema_pytorch import EMA

    fresh_server.start()
    model, _ = twins()
    t = Trainer(model)
    ema = EMA(
        model,
        beta=0.9,
        update_after_step=0,
        update_every=1,
        url=fresh_server.url,
        pusher_options={"retry": RetryPolicy(base_delay=0.05, max_delay=0.2, report_after=1.0)},
    )
    for _ in range(3):
        t.step()
        ema.update()
    held = ema.ema_model[0].weight.clone()
    fresh_server.stop()
    t.step()
    ema.update()  # queued; the pusher retries
    with pytest.raises(PolyakError):
        _ = ema.ema_model
    # Nothing stale was handed back: the tensors are those of the last read.
    assert torch.equal(ema._modules["ema_model"][0].weight, held)
    # Its pusher would go on retrying for the rest of the session.
    ema.__dict__["_remote"].end(0.0)


def _bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@pytest.mark.parametrize("which", ["AveragedModel", "EMA"])
def test_trainer_memory_is_one_host_copy_and_the_read_back(server, which, capsys):
    """The training process holds the read-back tensors (what the
    original's EMA module is) and the pusher's host copies of the weights;
    nothing else grows with the model. Measured and printed."""
    from ema_pytorch import EMA as OriginalEMA
    from polyak.compat.ema_pytorch import EMA
    from polyak.compat.swa_utils import AveragedModel
    from torch.optim.swa_utils import AveragedModel as OriginalAveragedModel

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    weights = _bytes(model.state_dict())
    if which == "AveragedModel":
        original = OriginalAveragedModel(model)
        dropin = AveragedModel(model, url=server.url)
        update = dropin.update_parameters
        original_state = original.module.state_dict()
    else:
        original = OriginalEMA(model, update_after_step=0, update_every=1)
        dropin = EMA(model, update_after_step=0, update_every=1, url=server.url)
        update = dropin.update
        original_state = original.ema_model.state_dict()
    for _ in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        update(model) if which == "AveragedModel" else update()
    dropin.state_dict()  # a read: the server's EMA into the module
    module = dropin._modules["module" if which == "AveragedModel" else "ema_model"]
    read_back = _bytes(module.state_dict())
    host = dropin._remote.host_bytes()
    with capsys.disabled():
        print(
            f"\n{which}: weights {weights / 2**20:.1f} MiB; original EMA state "
            f"{_bytes(original_state) / 2**20:.1f} MiB on the trainer; drop-in: read-back "
            f"{read_back / 2**20:.1f} MiB + pusher host copies {host / 2**20:.1f} MiB "
            f"({host / weights:.2f} x the weights), no averaging state"
        )
    assert read_back == _bytes(original_state)
    assert 0 < host <= 2 * (weights + 64 * 1024)  # at most one in flight and one waiting
