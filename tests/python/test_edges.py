"""Edges a new user and an adversarial run hit: stale-rank alerts on
finished runs, figures that read 0 after a restart, profile names that
collide with the mirror, steps past 2^53, conditional requests and codings
read as RFC 9110/9112 say, colour codes in a log file, and `hf` downloads
without the model's `config.json`."""

from __future__ import annotations

import io
import os
import pty
import select
import socket
import subprocess
import tarfile

import httpx
import pytest
import safetensors.torch
import torch
from polyak_testing import PolyakServer, wait_for

MAX_STEP = 2**53


def ema_of(states: list[dict[str, torch.Tensor]], beta: float) -> dict[str, torch.Tensor]:
    """torch's AveragedModel with get_ema_multi_avg_fn(beta): a copy at the
    first update, then ``ema += (1 - beta) * (x - ema)``."""
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    avg = get_ema_multi_avg_fn(beta)
    ema = {k: v.clone() for k, v in states[0].items()}
    for s in states[1:]:
        keys = list(ema)
        avg([ema[k] for k in keys], [s[k] for k in keys], torch.tensor(1))
    return ema


def state(step: int) -> dict[str, torch.Tensor]:
    return {
        "w": torch.linspace(-1, 1, 64).reshape(8, 8) * (step + 1),
        "b": torch.arange(8, dtype=torch.float32) / (step + 2),
    }


def create(c: httpx.Client, name: str, **extra) -> httpx.Response:
    body = {
        "name": name,
        "world_size": 1,
        "device": "cpu",
        "profiles": [{"name": "ema", "kind": "constant", "beta": 0.5}],
        **extra,
    }
    return c.post("/v1/runs", json=body)


def push(c: httpx.Client, run: str, step: int, body: bytes | None = None, **kw) -> httpx.Response:
    # Steps near 2^64 push the same small tensors (their values do not matter).
    content = body if body is not None else safetensors.torch.save(state(step % 1000))
    return c.put(f"/v1/runs/{run}/ranks/0/steps/{step}", content=content, **kw)


def complete_snapshot(c: httpx.Client, run: str, **body) -> dict:
    r = c.post(f"/v1/runs/{run}/snapshots", json=body)
    assert r.status_code == 202, r.text
    sid = r.json()["id"]

    def done():
        row = c.get(f"/v1/runs/{run}/snapshots/{sid}").json()
        return row if row["status"] == "complete" else None

    return wait_for(done, what=f"snapshot {sid}")


def stale_alerts(c: httpx.Client, run: str) -> list[dict]:
    alerts = c.get(f"/v1/runs/{run}/alerts").json()["alerts"]
    return [a for a in alerts if a["kind"] == "stale_rank"]


def test_finished_runs_never_alert_stale_even_after_a_restart(fresh_server):
    srv = fresh_server.start()
    c = httpx.Client(base_url=srv.url, timeout=30)
    # A nearly full disk would fire its own alert on every run: off here.
    rules = {"alerts": {"stale_after_seconds": 1, "disk_free_below": 0}}
    for name in ("done", "open"):
        assert create(c, name, **rules).status_code == 201
        assert push(c, name, 0).status_code == 200
    r = c.post("/v1/runs/done/finish", json={})
    assert r.status_code == 200, r.text

    def open_run_alerted():
        return [a for a in stale_alerts(c, "open") if a["state"] == "firing"]

    # The unfinished run's rank goes stale (the rule's window has passed for
    # both runs); the finished one's never does.
    wait_for(open_run_alerted, what="the unfinished run's stale_rank alert")
    assert stale_alerts(c, "done") == []
    srv.restart()
    c = httpx.Client(base_url=srv.url, timeout=30)
    wait_for(open_run_alerted, what="the unfinished run's stale_rank alert after the restart")
    assert stale_alerts(c, "done") == []
    listed = {r["name"]: r for r in c.get("/v1/runs").json()["runs"]}
    assert listed["done"]["alerts_firing"] == 0
    assert listed["done"]["health"] == "finished"
    assert listed["open"]["alerts_firing"] >= 1


def test_resident_and_wire_figures_survive_a_restart(fresh_server):
    zstd = pytest.importorskip("zstandard")
    srv = fresh_server.start()
    c = httpx.Client(base_url=srv.url, timeout=30)
    assert create(c, "figures").status_code == 201
    for step in range(3):
        raw = safetensors.torch.save(state(step))
        body = zstd.ZstdCompressor().compress(raw) if step % 2 else raw
        headers = {"Content-Encoding": "zstd"} if step % 2 else {}
        assert push(c, "figures", step, body, headers=headers).status_code == 200
    before = c.get("/v1/runs/figures").json()
    assert before["resident_bytes"] > 0
    assert before["wire"]["wire_bytes"] > 0
    assert before["wire"]["logical_bytes"] > before["wire"]["wire_bytes"] / 2
    srv.restart()
    c = httpx.Client(base_url=srv.url, timeout=30)
    after = c.get("/v1/runs/figures").json()
    assert after["last_step"] == 2
    assert after["resident_bytes"] == before["resident_bytes"]
    assert after["wire"] == before["wire"]
    rank = c.get("/v1/runs/figures/ranks/0").json()
    assert rank["resident_bytes"] == before["resident_bytes"]
    assert rank["wire"]["last_encoding"] == "identity"
    # The EMA itself came back too, equal to torch's.
    got = safetensors.torch.load(c.get("/v1/runs/figures/ranks/0/ema").content)
    want = ema_of([state(s) for s in range(3)], 0.5)
    for k in want:
        torch.testing.assert_close(got[k], want[k])


def test_profile_names_online_and_mirror_are_reserved(fresh_server):
    srv = fresh_server.start()
    c = httpx.Client(base_url=srv.url, timeout=30)
    for name in ("online", "__mirror__"):
        r = create(c, "reserved", profiles=[{"name": name, "kind": "constant", "beta": 0.5}])
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == "profiles[0].name"
    # Derived outputs cannot take the name either.
    profiles = [
        {"name": "p05", "kind": "power", "sigma_rel": 0.05},
        {"name": "p10", "kind": "power", "sigma_rel": 0.10},
    ]
    assert create(c, "derived", profiles=profiles).status_code == 201
    for step in range(4):
        assert push(c, "derived", step).status_code == 200
        complete_snapshot(c, "derived")
    r = c.post("/v1/runs/derived/posthoc", json={"sigma_rel": 0.07, "name": "online"})
    assert r.status_code == 422, r.text
    assert "reserved" in r.json()["error"]["message"]
    r = c.post("/v1/runs/derived/merge", json={"last": 2, "name": "online"})
    assert r.status_code == 422, r.text
    assert "reserved" in r.json()["error"]["message"]
    # `online` means the mirror: on a run without one it names nothing.
    snap = c.get("/v1/runs/derived/snapshots").json()["snapshots"][-1]["id"]
    first = c.get("/v1/runs/derived/snapshots").json()["snapshots"][0]["id"]
    r = c.get(f"/v1/runs/derived/snapshots/{snap}/download", params={"profile": "online"})
    assert r.status_code == 404, r.text
    r = c.get("/v1/runs/derived/compare", params={"a": first, "b": snap, "profile": "online"})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "not_in_snapshot"
    # With a mirror, `online` is the online weights, and the EMA its own.
    assert create(c, "mirrored", mirror=True).status_code == 201
    for step in range(2):
        assert push(c, "mirrored", step).status_code == 200
    sid = complete_snapshot(c, "mirrored")["id"]
    online = c.get(f"/v1/runs/mirrored/snapshots/{sid}/download", params={"profile": "online"})
    ema = c.get(f"/v1/runs/mirrored/snapshots/{sid}/download", params={"profile": "ema"})
    torch.testing.assert_close(safetensors.torch.load(online.content)["w"], state(1)["w"])
    want = ema_of([state(0), state(1)], 0.5)
    torch.testing.assert_close(safetensors.torch.load(ema.content)["w"], want["w"])


def test_steps_past_2_53_are_refused_everywhere(fresh_server):
    srv = fresh_server.start()
    c = httpx.Client(base_url=srv.url, timeout=30)
    profiles = [
        {"name": "p05", "kind": "power", "sigma_rel": 0.05},
        {"name": "p10", "kind": "power", "sigma_rel": 0.10},
    ]
    assert create(c, "big", profiles=profiles).status_code == 201
    too_big = MAX_STEP + 1

    def refused(r: httpx.Response) -> None:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_step", err
        assert str(MAX_STEP) in err["message"]

    for step in (too_big, 2**64 - 1):
        refused(push(c, "big", step))
    assert c.get("/v1/runs/big").json()["last_step"] is None
    assert push(c, "big", 0).status_code == 200
    complete_snapshot(c, "big")
    # The largest step is taken, and the rank goes on from it.
    assert push(c, "big", MAX_STEP).status_code == 200
    assert c.get("/v1/runs/big").json()["last_step"] == MAX_STEP
    complete_snapshot(c, "big")
    refused(c.post("/v1/runs/big/snapshots", json={"step": too_big}))
    refused(c.post("/v1/runs/big/resume", json={"step": too_big}))
    refused(c.post("/v1/runs/big/posthoc", json={"sigma_rel": 0.07, "step": too_big}))
    refused(c.get("/v1/runs/big/posthoc/plan", params={"sigma_rel": 0.07, "step": too_big}))
    refused(c.post("/v1/runs/big/metrics", json={"step": too_big, "values": {"loss": 1.0}}))
    r = create(c, "big-cfg", update_every=too_big)
    assert r.status_code == 422 and r.json()["error"]["field"] == "update_every", r.text
    # Sources 2^53 steps apart: whatever the solver makes of them, its own
    # words (torch, LAPACK) never reach the answer.
    plan = c.get("/v1/runs/big/posthoc/plan", params={"sigma_rel": 0.07, "step": MAX_STEP})
    assert plan.status_code in (200, 422), plan.text
    for word in ("torch", "assert", "lapack", "linalg", "aten"):
        assert word.lower() not in plan.text.lower(), plan.text


def raw_request(url: str, head: str, body: bytes) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def test_conditional_requests_and_codings_follow_the_rfcs(fresh_server):
    zstd = pytest.importorskip("zstandard")
    srv = fresh_server.start()
    c = httpx.Client(base_url=srv.url, timeout=30)
    assert create(c, "http").status_code == 201
    assert push(c, "http", 0).status_code == 200
    sid = complete_snapshot(c, "http")["id"]
    url = f"/v1/runs/http/snapshots/{sid}/download"
    full = c.get(url)
    etag = full.headers["etag"]
    assert etag.startswith('"')
    # If-None-Match: weak comparison, over lists and lines.
    for value in (etag, f"W/{etag}", f'"other", {etag}', f'"other", W/{etag}'):
        r = c.get(url, headers={"If-None-Match": value})
        assert r.status_code == 304, value
    r = c.get(url, headers=[("If-None-Match", '"other"'), ("If-None-Match", f"W/{etag}")])
    assert r.status_code == 304
    assert c.get(url, headers={"If-None-Match": '"other"'}).status_code == 200
    # If-Range: strong comparison; a weak or other validator sends it all.
    r = c.get(url, headers={"Range": "bytes=0-9", "If-Range": etag})
    assert r.status_code == 206 and r.content == full.content[:10]
    for validator in ('"other"', f"W/{etag}", "Sun, 06 Nov 1994 08:49:37 GMT"):
        r = c.get(url, headers={"Range": "bytes=0-9", "If-Range": validator})
        assert r.status_code == 200, validator
        assert r.content == full.content
    # Content-Encoding: one list whether in one line or two; identity is
    # no coding; two real codings are refused alike.
    packed = zstd.ZstdCompressor().compress(safetensors.torch.save(state(1)))
    r = push(c, "http", 1, packed, headers={"Content-Encoding": "identity, zstd"})
    assert r.status_code == 200, r.text
    packed = zstd.ZstdCompressor().compress(safetensors.torch.save(state(2)))
    r = push(
        c,
        "http",
        2,
        packed,
        headers=[("Content-Encoding", "identity"), ("Content-Encoding", "zstd")],
    )
    assert r.status_code == 200, r.text
    got = safetensors.torch.load(c.get("/v1/runs/http/ranks/0/ema").content)
    want = ema_of([state(s) for s in range(3)], 0.5)
    torch.testing.assert_close(got["w"], want["w"])
    twice = zstd.ZstdCompressor().compress(packed)
    one = push(c, "http", 3, twice, headers={"Content-Encoding": "zstd, zstd"})
    two = push(
        c, "http", 3, twice, headers=[("Content-Encoding", "zstd"), ("Content-Encoding", "zstd")]
    )
    assert one.status_code == two.status_code == 415
    assert one.json()["error"]["code"] == two.json()["error"]["code"] == "unsupported_encoding"
    # Transfer-Encoding: a coding the server does not apply is refused
    # (RFC 9112 §6.1), not taken as plain chunked.
    body = safetensors.torch.save(state(3))
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    head = (
        "PUT /v1/runs/http/ranks/0/steps/3 HTTP/1.1\r\n"
        f"Host: {srv.url.removeprefix('http://')}\r\n"
        "Transfer-Encoding: gzip, chunked\r\n"
        "Connection: close\r\n\r\n"
    )
    status, answer = raw_request(srv.url, head, chunked)
    assert status == 501, answer[:400]
    assert c.get("/v1/runs/http").json()["last_step"] == 2


def log_of(binary: str, data_dir, stderr, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [binary, "serve", "--bind", "127.0.0.1:0", "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "RUST_LOG": "polyak=info", **env},
    )


def started(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("polyak listening on "), line


def test_logs_are_coloured_only_on_a_terminal(tmp_path):
    binary = PolyakServer(tmp_path).binary
    # To a file: plain text.
    with open(tmp_path / "log.txt", "w") as f:
        proc = log_of(binary, tmp_path / "a", f, {"NO_COLOR": ""})
        started(proc)
        proc.terminate()
        proc.wait(30)
    text = (tmp_path / "log.txt").read_text()
    assert "INFO" in text
    assert "\x1b[" not in text

    def on_a_terminal(extra: dict[str, str], data_dir) -> bytes:
        master, slave = pty.openpty()
        proc = log_of(binary, data_dir, slave, extra)
        os.close(slave)
        started(proc)
        proc.terminate()
        out = b""
        while True:
            ready, _, _ = select.select([master], [], [], 10)
            if not ready:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        proc.wait(30)
        os.close(master)
        return out

    assert b"\x1b[" in on_a_terminal({"NO_COLOR": ""}, tmp_path / "b")
    plain = on_a_terminal({"NO_COLOR": "1"}, tmp_path / "c")
    assert b"INFO" in plain and b"\x1b[" not in plain


def test_hf_downloads_carry_the_models_config(fresh_server, tmp_path):
    transformers = pytest.importorskip("transformers")
    import polyak

    srv = fresh_server.start()
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32, n_inner=64
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    client = polyak.Client(srv.url)
    run = client.create_run(
        "gpt", profiles=[{"name": "ema", "kind": "constant", "beta": 0.5}], device="cpu"
    )
    pusher = run.pusher(0)
    states = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 97, (2, 16))
    for step in range(3):
        pusher.push(model, step)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    pusher.close()
    snap = run.snapshot()
    out = run.download_to(snap, tmp_path / "hf", layout="hf", progress=False)
    assert (out / "config.json").exists()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    sent, back = model.config.to_dict(), loaded.config.to_dict()
    # Bookkeeping from_pretrained fills in itself.
    for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        sent.pop(k, None)
        back.pop(k, None)
    assert back == sent
    assert loaded.config.n_layer == 2 and loaded.config.vocab_size == 97
    want = ema_of(states, 0.5)
    got = loaded.state_dict()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=k)
    # The tar as served holds it too, beside the index.
    r = httpx.get(
        f"{srv.url}/v1/runs/gpt/snapshots/{snap['id']}/download",
        params={"layout": "hf"},
        timeout=30,
    )
    names = tarfile.open(fileobj=io.BytesIO(r.content)).getnames()
    assert "config.json" in names and "model.safetensors.index.json" in names
