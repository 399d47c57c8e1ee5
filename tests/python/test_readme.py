"""The READMEs' first examples, run as written against the real server: the
quick start of ``README.md`` (its ``curl`` and both Python blocks) and the
first section of ``clients/python/README.md`` (creating a run, training
with ``attach``, attaching to the run by name with ``Client.run``,
downloading, finishing). Only the address changes (the documented
``127.0.0.1:8080`` becomes the test server's free port), and the
``./scripts/serve &`` line is the test's own server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import safetensors.torch

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTED = ("http://127.0.0.1:8080", "http://localhost:8080", "localhost:8080")


def section_blocks(path: Path, title: str) -> list[tuple[str, str]]:
    """The fenced code blocks (language, code) of one ``## title`` section."""
    text = path.read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"{path.name} has no section `{title}`"
    return re.findall(r"^```(\w+)\n(.*?)^```", m.group(1), re.S | re.M)


def at(code: str, url: str) -> str:
    """The example pointed at ``url`` instead of the documented address."""
    for documented in DOCUMENTED:
        code = code.replace(documented, url if documented.startswith("http") else url[7:])
    assert "8080" not in code, code
    return code


def run_example(command: list[str], code: str, cwd: Path) -> str:
    """Runs one example (``command`` followed by its code); its stdout."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    done = subprocess.run(
        [*command, code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"the example failed:\n{code}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_python(code: str, cwd: Path) -> str:
    return run_example([sys.executable, "-c"], code, cwd)


def run_shell(code: str, cwd: Path) -> str:
    # The server the example starts first is the test's own.
    lines = [ln for ln in code.splitlines() if not ln.startswith("./scripts/serve")]
    return run_example(["bash", "-euo", "pipefail", "-c"], "\n".join(lines), cwd)


def test_quick_start_runs_as_written_and_ends_finished(fresh_server, tmp_path):
    srv = fresh_server.start()
    blocks = section_blocks(ROOT / "README.md", "Quick start")
    assert [lang for lang, _ in blocks] == ["sh", "python", "python"]
    (_, shell), (_, raw), (_, client) = blocks
    assert "./scripts/serve" in shell and "curl" in shell

    created = json.loads(run_shell(at(shell, srv.url), tmp_path))
    assert created["name"] == "exp1"
    run_python(at(raw, srv.url), tmp_path)
    run_python(at(client, srv.url), tmp_path)

    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for name, pushed in (("exp1", 100), ("exp2", 100)):
            view = c.get(f"/v1/runs/{name}").json()
            # Finished: not a trainer gone quiet, so no stale rank and no alert.
            assert view["health"] == "finished", (name, view["health"])
            assert [r["last_step"] for r in view["ranks"]] == [pushed - 1], name
            final = c.get(f"/v1/runs/{name}/snapshots/{view['finished']['snapshot']}").json()
            assert (final["status"], final["label"], final["step"]) == ("complete", "final", 99)
        # The client example attached by name, snapshotted and downloaded.
        labels = [s["label"] for s in c.get("/v1/runs/exp2/snapshots").json()["snapshots"]]
        assert labels == [None, "final"], labels


def test_client_readme_first_section_runs_as_written(fresh_server, tmp_path):
    srv = fresh_server.start()
    blocks = section_blocks(
        ROOT / "clients" / "python" / "README.md", "Three lines in a training loop"
    )
    assert [lang for lang, _ in blocks] == ["python"]
    code = blocks[0][1]
    # What the section promises to show.
    for shown in ("create_run(", "attach(", ".run(", "download(", "download_to(", "finish()"):
        assert shown in code, shown
    run_python(at(code, srv.url), tmp_path)

    with httpx.Client(base_url=srv.url, timeout=30) as c:
        view = c.get("/v1/runs/exp1").json()
        assert view["health"] == "finished"
        assert [r["last_step"] for r in view["ranks"]] == [49]
        snaps = c.get("/v1/runs/exp1/snapshots").json()["snapshots"]
        assert [s["label"] for s in snaps][-1] == "final"
        manual = snaps[0]
        (written,) = (tmp_path / "out").glob("*.safetensors")
        assert written.name == f"exp1-{manual['id']}-ema.safetensors"
        served = c.get(
            f"/v1/runs/exp1/snapshots/{manual['id']}/download", params={"profile": "ema"}
        )
        assert served.status_code == 200
        on_disk = safetensors.torch.load_file(written)
        want = safetensors.torch.load(served.content)
        assert set(on_disk) == set(want) and all(on_disk[k].equal(want[k]) for k in want)
