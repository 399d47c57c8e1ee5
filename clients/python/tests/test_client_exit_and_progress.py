"""What a user reads from the client around the edges of a run: the warning
of a trainer that exits without ``flush`` (pushes the server is still
answering are waited for, and what is left is "not yet acknowledged"),
download progress as a bar on a terminal and as a line per 10 % in a log,
and a script run again against a finished run being told so first."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import httpx
import polyak
import pytest
import safetensors.torch
import torch
from polyak_testing import stderr_on_a_terminal

# A trainer that pushes step 0 and returns without flushing. Its own exit
# handler, registered after the pusher's and so run before it, says when
# the interpreter is exiting.
EXITING_TRAINER = textwrap.dedent(
    """
    import atexit, logging, sys
    import polyak, polyak.pusher, torch

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    url, name, wait = sys.argv[1], sys.argv[2], float(sys.argv[3])
    polyak.pusher.EXIT_WAIT_SECONDS = wait
    pusher = polyak.Client(url).run(name).pusher()
    atexit.register(lambda: print("exiting", flush=True))
    print("ready", flush=True)
    sys.stdin.readline()
    pusher.push({"w": torch.arange(4.0)}, 0)
    print("pushed", flush=True)
    """
)


def start_trainer(url: str, run: str, wait: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", EXITING_TRAINER, url, run, str(wait)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n", proc.stderr.read() if proc.stderr else ""
    return proc


def test_exit_waits_for_pushes_in_flight(fresh_server, run_name):
    """The server is paused while the trainer pushes and exits; it resumes
    once the trainer is in its exit handlers. The push in flight is then
    acknowledged before the process ends, and nothing is reported lost."""
    srv = fresh_server.start()
    polyak.Client(srv.url).create_run(
        run_name, profiles=[{"name": "ema", "kind": "constant", "beta": 0.5}]
    )
    proc = start_trainer(srv.url, run_name, wait=120)
    assert srv.proc is not None and proc.stdin is not None and proc.stdout is not None
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "pushed\n"
        assert proc.stdout.readline() == "exiting\n"
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert "never delivered" not in err and "not yet acknowledged" not in err, err
    rank = httpx.get(f"{srv.url}/v1/runs/{run_name}/ranks/0").json()
    assert rank["last_step"] == 0


def test_exit_names_pushes_not_yet_acknowledged(fresh_server, run_name):
    """The server stays paused past the wait: the warning says the push is
    not yet acknowledged (it is in flight and may still be applied), not
    that it was never delivered."""
    srv = fresh_server.start()
    polyak.Client(srv.url).create_run(
        run_name, profiles=[{"name": "ema", "kind": "constant", "beta": 0.5}]
    )
    proc = start_trainer(srv.url, run_name, wait=0.5)
    assert srv.proc is not None and proc.stdin is not None
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        _, err = proc.communicate("go\n", timeout=180)
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert proc.returncode == 0, err
    assert "never delivered" not in err, err
    assert re.search(
        rf"1 push\(es\) of run {run_name} rank 0 not yet acknowledged at exit "
        r"\(steps 0; 1 in flight, which the server may still apply\)",
        err,
    ), err


DOWNLOAD = (
    "import sys, polyak; polyak.Client(sys.argv[1]).run(sys.argv[2]).download(sys.argv[3], 'ema')"
)


@pytest.fixture()
def big_snapshot(client, run_name):
    """A 24 MiB snapshot: three of the client's 8 MiB reads."""
    run = client.create_run(run_name, profiles=[{"name": "ema", "kind": "constant", "beta": 0.5}])
    with run.pusher() as pusher:
        pusher.push({"w": torch.zeros(6 << 20)}, 0)
    return run.snapshot()["id"]


def test_download_progress_in_a_log_is_a_line_per_tenth(server, run_name, big_snapshot):
    done = subprocess.run(
        [sys.executable, "-c", DOWNLOAD, server.url, run_name, big_snapshot],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr, repr(done.stderr[:400])
    lines = [
        ln for ln in done.stderr.splitlines() if ln.startswith(f"{run_name}/{big_snapshot} ema: ")
    ]
    percents = [int(re.search(r": (\d+)% \(", ln).group(1)) for ln in lines]
    assert percents and percents[-1] == 100, done.stderr
    assert percents == sorted(set(percents)) and all(p % 10 == 0 for p in percents), percents
    assert lines[-1].endswith("(24 MiB of 24 MiB)"), lines


def test_download_progress_on_a_terminal_is_a_bar(server, run_name, big_snapshot):
    status, shown = stderr_on_a_terminal(
        [sys.executable, "-c", DOWNLOAD, server.url, run_name, big_snapshot]
    )
    assert status == 0, shown[-400:]
    # tqdm redraws one line in place: carriage returns, a bar, a rate.
    assert "\r" in shown and "100%|" in shown and "B/s" in shown, repr(shown[-400:])
    assert f"{run_name}/{big_snapshot} ema" in shown


def test_a_finished_run_says_so_before_pointing_at_resume(client, server, run_name):
    """A script run again from step 0 against a run it finished: the answer
    is ``run_finished``, not a ``step_conflict`` suggesting ``resume``. The
    last step pushed again with its bytes is still a duplicate."""
    run = client.create_run(run_name, profiles=[{"name": "ema", "kind": "constant", "beta": 0.5}])
    bodies = [safetensors.torch.save({"w": torch.full((4,), float(s))}) for s in range(3)]
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for step, body in enumerate(bodies):
            assert (
                c.put(f"/v1/runs/{run_name}/ranks/0/steps/{step}", content=body).status_code == 200
            )
        run.finish()
        # The script's new initialisation: other bytes at step 0.
        rerun = safetensors.torch.save({"w": torch.full((4,), -1.0)})
        again = c.put(f"/v1/runs/{run_name}/ranks/0/steps/0", content=rerun)
        assert again.status_code == 409, again.text
        error = again.json()["error"]
        assert error["code"] == "run_finished", error
        # (The run's name says "resume": the hint's own words are looked for.)
        assert "finished at step 2" in error["message"] and "run.resume(" not in error["message"]
        other = c.put(f"/v1/runs/{run_name}/ranks/0/steps/2", content=rerun)
        assert (other.status_code, other.json()["error"]["code"]) == (409, "run_finished")
        same = c.put(f"/v1/runs/{run_name}/ranks/0/steps/2", content=bodies[2])
        assert same.status_code == 200 and same.json()["duplicate"] is True, same.text

    # Through the client, as the re-run script sees it.
    pusher = run.pusher()
    pusher.push({"w": torch.full((4,), 7.0)}, 0)
    with pytest.raises(polyak.PolyakError) as e:
        pusher.flush()
    assert e.value.code == "run_finished" and "run.resume(" not in e.value.message
    pusher.close(timeout=0)
