"""docker/Dockerfile, replayed without Docker: its build stage in an empty
directory holding exactly what its `COPY` lines copy, its `RUN` cargo
commands run there, then the binary started as the runtime stage starts it
(its user, its `ENV`, its data volume, its entrypoint) and pushed to.

Two departures, each so nothing recompiles: cargo builds into the suite's
target directory (a tree of hard links to it, so the suite's own binary is
never replaced by the stage's stub), in the suite's profile (`--release`
dropped: the Dockerfile's failures are the manifest's and the copied
files', not the optimiser's). The server binds loopback, not 0.0.0.0."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import safetensors.torch
import torch
from polyak_testing import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Instructions per stage name, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        if op.upper() == "FROM":
            current = []
            out[rest.split()[-1]] = current
        else:
            current.append((op.upper(), rest.strip()))
    return out


def env_of(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for op, rest in instructions:
        if op == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def linked_target(src: Path, dst: Path) -> None:
    """``dst`` as a tree of hard links to ``src``'s debug profile: cargo
    reads every artifact in place and writes only new files there."""
    debug = src / "debug"
    for dirpath, _, files in os.walk(debug):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for f in files:
            os.link(Path(dirpath) / f, dst / rel / f)
    # The uplifted binary is the suite's: the stage makes its own.
    (dst / "debug" / "polyak").unlink(missing_ok=True)


def test_the_dockerfile_builds_and_its_image_serves(tmp_path):
    st = stages(DOCKERFILE.read_text())
    assert {"torch", "build", "runtime"} <= set(st)
    build = st["build"]
    workdir = next(rest for op, rest in build if op == "WORKDIR")
    ctx = tmp_path / "ctx" / workdir.lstrip("/")
    ctx.mkdir(parents=True)
    target = tmp_path / "target"
    linked_target(Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")), target)
    env = dict(os.environ, CARGO_TARGET_DIR=str(target))
    ran = 0
    for op, rest in build:
        if op == "COPY":
            *srcs, dest = shlex.split(rest)
            for s in srcs:
                src = ROOT / s
                to = ctx / dest if not dest.endswith("/") else ctx / dest / src.name
                if dest in ("./", "."):
                    to = ctx / src.name
                if src.is_dir():
                    shutil.copytree(src, to)
                else:
                    to.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, to)
        elif op == "RUN" and "cargo " in rest:
            cmd = rest.replace(" --release", "")
            done = subprocess.run(
                ["bash", "-c", cmd], cwd=ctx, env=env, capture_output=True, text=True
            )
            assert done.returncode == 0, f"RUN {rest}\n{done.stderr[-4000:]}"
            ran += 1
    assert ran == 2, "the build stage runs cargo twice (dependencies, then the binary)"

    runtime = st["runtime"]
    copied = next(rest for op, rest in runtime if op == "COPY" and "--from=build" in rest)
    src, dest = shlex.split(copied)[1:]
    assert src == f"{workdir}/target/release/polyak"
    root = Path(tempfile.mkdtemp(prefix="polyak-image-"))
    try:
        binary = root / dest.lstrip("/")
        binary.parent.mkdir(parents=True)
        shutil.copy2(target / "debug" / "polyak", binary)
        image_env = env_of(runtime)
        volume = next(rest for op, rest in runtime if op == "VOLUME")
        assert image_env["POLYAK_DATA_DIR"] == volume
        data = root / volume.lstrip("/")
        data.mkdir()
        user = next(rest for op, rest in runtime if op == "USER")
        uid = int(re.search(r"--uid (\d+)", dict(runtime)["RUN"]).group(1))
        prefix: list[str] = []
        if os.geteuid() == 0:
            # Root (CI): run as the image's user, as the PostgreSQL fixture
            # runs postgres; the data volume is that user's, as in the image.
            for p in (root, *[q for q in binary.parents if root in q.parents]):
                p.chmod(0o755)
            os.chown(data, uid, uid)
            prefix = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
            probe = subprocess.run([*prefix, str(binary), "--version"], capture_output=True)
            if probe.returncode != 0:
                # libtorch beside the suite's venv is not readable by that
                # user here: run as the caller (still the image's ENV).
                prefix = []
                os.chown(data, 0, 0)
        port = free_port()
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("POLYAK_")}
        run_env.update(image_env)
        run_env["POLYAK_DATA_DIR"] = str(data)
        run_env["POLYAK_BIND"] = f"127.0.0.1:{port}"
        entry = [a.replace(dest, str(binary)) for a in json.loads(dict(runtime)["ENTRYPOINT"])]
        proc = subprocess.Popen(
            [*prefix, *entry],
            env=run_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            # The image's HEALTHCHECK, pointed at this port.
            health = dict(runtime)["HEALTHCHECK"].split("CMD", 1)[1].strip()
            health = health.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
            deadline = time.monotonic() + 60
            while True:
                ok = subprocess.run(["bash", "-c", health], capture_output=True).returncode == 0
                if ok or proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert ok, f"the image's healthcheck never passed: {proc.poll()}"
            c = httpx.Client(base_url=base, timeout=30)
            r = c.post(
                "/v1/runs",
                json={
                    "name": "image",
                    "world_size": 1,
                    "profiles": [{"name": "ema", "kind": "constant", "beta": 0.5}],
                },
            )
            assert r.status_code == 201, r.text
            states = [{"w": torch.full((4,), float(i))} for i in range(2)]
            for step, s in enumerate(states):
                r = c.put(f"/v1/runs/image/ranks/0/steps/{step}", content=safetensors.torch.save(s))
                assert r.status_code == 200, r.text
            got = c.get("/v1/runs/image/ranks/0/ema?profile=ema")
            assert got.status_code == 200, got.text
            ema = safetensors.torch.load(got.content)["w"]
            torch.testing.assert_close(ema, torch.full((4,), 0.5), rtol=0, atol=0)
            # The run lives in the data volume, owned by the image's user.
            owned = {p.stat().st_uid for p in data.rglob("*")}
            if prefix:
                assert owned == {uid}, (user, owned)
            assert any(data.iterdir())
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        shutil.rmtree(root, ignore_errors=True)
