"""Hardening: what one client or a full disk must not be able to do.

Each test reproduces a defect found by an adversarial run against the real
server (a held connection starving every pusher, a promised body allocated
before it arrives, an empty token that is admin, a snapshot pending forever
on a full disk, ...) and checks the fix: statuses, error codes, bytes on
disk, the server still up.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from polyak_testing import PolyakServer, find_binary

ADMIN = "hardening-admin-token-0123456789"


def body(tensors: dict[str, torch.Tensor]) -> bytes:
    return safetensors.torch.save(tensors)


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def raw_head(url: str, method: str, path: str, headers: dict[str, str]) -> bytes:
    host, _ = host_port(url)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_reply(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Everything the server sends until it closes (or `timeout`)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


# --- per-connection limits -------------------------------------------------


def test_held_4gb_declaration_does_not_starve_other_pushers(fresh_server):
    """Defect 2: a connection that declares Content-Length 4.3 GB and sends
    nothing used to reserve the whole in-flight budget, so every other push
    answered 429 while it stayed open. The budget is now taken as bytes
    arrive: the second pusher is served."""
    fresh_server.start()
    url = fresh_server.url
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.post("/v1/runs", json={"name": "held", "world_size": 2}).status_code == 201
        sock = socket.create_connection(host_port(url))
        sock.sendall(
            raw_head(
                url,
                "PUT",
                "/v1/runs/held/ranks/0/steps/0",
                {"Content-Length": "4300000000", "Content-Type": "application/octet-stream"},
            )
            + b"\0" * 16
        )
        time.sleep(0.5)
        for step in range(3):
            r = c.put(f"/v1/runs/held/ranks/1/steps/{step}", content=body({"w": torch.ones(64)}))
            assert r.status_code == 200, r.text
            assert r.json()["applied"] is True
        metrics = c.get("/metrics").text
        # The held connection holds what it sent (16 bytes -> 1 KiB), not 4 GB.
        held = [ln for ln in metrics.splitlines() if ln.startswith("polyak_inflight_push_bytes ")]
        assert held and int(held[0].split()[1]) <= 1024, held
        sock.close()


def test_slow_body_is_cut_while_a_parallel_push_succeeds(fresh_server):
    """Slow-loris on the body: one byte a second is cut at the configured
    timeout with 408 `body_timeout`; a push on another connection
    meanwhile succeeds."""
    fresh_server.start("--body-timeout-secs", "2", "--body-min-rate", "1KiB")
    url = fresh_server.url
    payload = body({"w": torch.zeros(256)})
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.post("/v1/runs", json={"name": "loris", "world_size": 2}).status_code == 201
        sock = socket.create_connection(host_port(url))
        sock.sendall(
            raw_head(
                url,
                "PUT",
                "/v1/runs/loris/ranks/0/steps/0",
                {"Content-Length": str(len(payload))},
            )
        )
        reply = b""
        sent = 0
        started = time.monotonic()
        sock.settimeout(1.0)
        pushed = False
        while time.monotonic() - started < 30:
            try:
                sock.sendall(payload[sent : sent + 1])
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                break
            if not pushed:
                r = c.put("/v1/runs/loris/ranks/1/steps/0", content=body({"w": torch.ones(64)}))
                assert r.status_code == 200 and r.json()["applied"], r.text
                pushed = True
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            reply += chunk
            if not chunk or b"\r\n\r\n" in reply:
                break
        reply += read_reply(sock, timeout=5)
        sock.close()
        assert pushed
        assert sent < len(payload), "the slow body was read to its end"
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b'"body_timeout"' in reply
        # The slow rank changed nothing; the fast one applied.
        assert c.get("/v1/runs/loris/ranks/0").json()["last_step"] is None
        assert c.get("/v1/runs/loris/ranks/1").json()["last_step"] == 0


def test_slow_head_and_idle_connections_are_closed(fresh_server):
    """A request head trickled in is cut at --header-timeout-secs; an idle
    keep-alive connection is closed at --idle-timeout-secs; a fresh request on a
    new connection is served meanwhile."""
    fresh_server.start("--header-timeout-secs", "2", "--idle-timeout-secs", "2")
    url = fresh_server.url
    slow = socket.create_connection(host_port(url))
    slow.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
    idle = socket.create_connection(host_port(url))
    idle.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
    idle.settimeout(10)
    first = idle.recv(65536)
    assert first.startswith(b"HTTP/1.1 200"), first
    assert httpx.get(f"{url}/livez").json()["status"] == "ok"
    # Both are closed by the server (recv returns b"" on an orderly close).
    assert read_reply(slow, timeout=20) == b""
    assert read_reply(idle, timeout=20) == b""
    slow.close()
    idle.close()
    assert httpx.get(f"{url}/livez").status_code == 200


def test_connection_cap_queues_instead_of_refusing(fresh_server):
    """Past --max-connections a client waits in the backlog and is served
    when a slot frees."""
    fresh_server.start("--max-connections", "2", "--idle-timeout-secs", "2")
    url = fresh_server.url
    held = [socket.create_connection(host_port(url)) for _ in range(2)]
    time.sleep(0.3)
    # A third connection is accepted only once an idle one is closed
    # (idle timeout): it is answered, not refused.
    r = httpx.get(f"{url}/livez", timeout=30)
    assert r.status_code == 200
    for s in held:
        s.close()


def test_ten_gb_declared_body_under_an_address_space_limit(fresh_server, tmp_path):
    """Defect 3: the receive buffer was allocated from the declared length;
    under `ulimit -v` a 10 GB declaration aborted the process. Now the
    buffer grows with the data: the server stays up and serves others."""
    wrapper = tmp_path / "limited-polyak"
    wrapper.write_text(f'#!/bin/sh\nulimit -v {6 * 1024 * 1024}\nexec "{find_binary()}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    srv = PolyakServer(tmp_path / "data", "--device", "cpu", binary=str(wrapper))
    srv.start()
    try:
        url = srv.url
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.post("/v1/runs", json={"name": "huge", "world_size": 2}).status_code == 201
            sock = socket.create_connection(host_port(url))
            sock.sendall(
                raw_head(
                    url,
                    "PUT",
                    "/v1/runs/huge/ranks/0/steps/0",
                    {"Content-Length": str(10_000_000_000)},
                )
                + b"\0" * 65536
            )
            time.sleep(1.0)
            assert srv.proc is not None and srv.proc.poll() is None, "".join(srv.log[-20:])
            r = c.put("/v1/runs/huge/ranks/1/steps/0", content=body({"w": torch.ones(8)}))
            assert r.status_code == 200 and r.json()["applied"], r.text
            # The client gives up: its request is refused (body ended early)
            # or its connection cut; either way the server is still up.
            sock.shutdown(socket.SHUT_WR)
            reply = read_reply(sock, timeout=10)
            sock.close()
            assert reply == b"" or reply.startswith((b"HTTP/1.1 400", b"HTTP/1.1 413")), reply[:200]
            assert c.get("/livez").json()["status"] == "ok"
            assert srv.proc.poll() is None
    finally:
        srv.stop()


# --- tokens ------------------------------------------------------------------


@pytest.mark.parametrize("token", ["", "short-secret"])
def test_empty_or_short_tokens_are_refused_at_start(tmp_path, token, monkeypatch):
    """Defect 4: `--token ''` (or an empty POLYAK_TOKEN) passed the
    non-loopback check and made an empty `?access_token=` the admin."""
    srv = PolyakServer(tmp_path / "a", "--token", token)
    with pytest.raises(RuntimeError, match="shorter than 16"):
        srv.start()
    monkeypatch.setenv("POLYAK_TOKEN", token)
    srv = PolyakServer(tmp_path / "b")
    with pytest.raises(RuntimeError, match="shorter than 16"):
        srv.start()


# --- devices -----------------------------------------------------------------


def test_devices_that_are_not_there_are_refused_at_start(tmp_path):
    """`--devices` naming a GPU this machine lacks (the one past the last
    torch sees), or a CPU, stops the server at start with the reason; a
    run asking for a GPU the node does not offer is a 422 that says which
    it has."""
    missing = f"cuda:{torch.cuda.device_count()}"
    srv = PolyakServer(tmp_path / "a", "--devices", missing)
    with pytest.raises(RuntimeError, match="CUDA device"):
        srv.start()
    srv = PolyakServer(tmp_path / "b", "--devices", "cpu")
    with pytest.raises(RuntimeError, match="lists GPUs"):
        srv.start()
    srv = PolyakServer(tmp_path / "c", "--device", "cpu")
    srv.start()
    try:
        r = httpx.post(
            f"{srv.url}/v1/runs", json={"name": "far", "world_size": 1, "device": missing}
        )
        assert r.status_code == 422, r.text
        message = r.json()["error"]["message"]
        assert "no CUDA device" in message or "GPUs are cuda:" in message, r.text
        assert httpx.get(f"{srv.url}/v1/runs/far").status_code == 404
    finally:
        srv.stop()


@pytest.fixture()
def authed(fresh_server):
    fresh_server.start("--token", ADMIN)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=fresh_server.url, timeout=30) as c:
        r = c.post(
            "/v1/runs",
            json={"name": "sec", "world_size": 1, "mirror": True},
            headers=admin,
        )
        assert r.status_code == 201
        tokens = r.json()
        r = c.put(
            "/v1/runs/sec/ranks/0/steps/0",
            content=body({"w": torch.arange(4.0)}),
            headers={"Authorization": f"Bearer {tokens['write_token']}"},
        )
        assert r.status_code == 200, r.text
        yield fresh_server, c, admin, tokens


def test_query_tokens_only_on_browser_gets(authed):
    """Defect 5: `?access_token=` worked on every endpoint. Now only the
    GETs a browser opens by itself take it (events, downloads, a rank's
    EMA); everything else answers 401 as if no token was given."""
    _srv, c, admin, tokens = authed
    write, read = tokens["write_token"], tokens["read_token"]
    r = c.put(
        f"/v1/runs/sec/ranks/0/steps/1?access_token={write}",
        content=body({"w": torch.ones(4)}),
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    r = c.post(f"/v1/runs?access_token={ADMIN}", json={"name": "nope", "world_size": 1})
    assert r.status_code == 401
    assert c.delete(f"/v1/runs/sec?access_token={ADMIN}").status_code == 401
    assert c.get(f"/v1/runs?access_token={ADMIN}").status_code == 401
    assert c.get("/v1/runs/sec?access_token=").status_code == 401
    # The browser GETs work with a read token in the query.
    r = c.get(f"/v1/runs/sec/events?access_token={read}", headers={"Accept": "application/json"})
    assert r.status_code == 200 and isinstance(r.json(), list)
    r = c.get(f"/v1/runs/sec/ranks/0/ema?profile=ema&access_token={read}")
    assert r.status_code == 200
    assert safetensors.torch.load(r.content)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    snap = c.post("/v1/runs/sec/snapshots", json={"step": 0}, headers=admin)
    assert snap.status_code == 202, snap.text
    sid = snap.json()["id"]
    deadline = time.monotonic() + 60
    while c.get(f"/v1/runs/sec/snapshots/{sid}", headers=admin).json()["status"] != "complete":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r = c.get(f"/v1/runs/sec/snapshots/{sid}/download?profile=ema&access_token={read}")
    assert r.status_code == 200
    assert safetensors.torch.load(r.content)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    # The run is still there: the query-token DELETE did nothing.
    assert c.get("/v1/runs/sec", headers=admin).status_code == 200


def test_metrics_need_the_admin_token_and_unknown_tokens_are_401(authed):
    """Defect 6: /metrics was open to anonymous callers with auth on and
    names every run; an unknown token got 403 where 401 is due."""
    _srv, c, admin, tokens = authed
    r = c.get("/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    r = c.get("/metrics", headers={"Authorization": f"Bearer {tokens['read_token']}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = c.get("/metrics", headers=admin)
    assert r.status_code == 200 and 'polyak_pushes_total{outcome="applied",run="sec"} 1' in r.text
    assert "polyak_disk_free_bytes" in r.text
    bogus = {"Authorization": "Bearer not-a-token-anyone-holds"}
    for method, path in [
        ("GET", "/v1/runs"),
        ("GET", "/v1/runs/sec"),
        ("GET", "/metrics"),
        ("DELETE", "/v1/runs/sec"),
    ]:
        r = c.request(method, path, headers=bogus)
        assert r.status_code == 401, (method, path, r.text)
        assert r.json()["error"]["code"] == "invalid_token"
    # A real token without the right is still 403.
    r = c.delete("/v1/runs/sec", headers={"Authorization": f"Bearer {tokens['read_token']}"})
    assert r.status_code == 403


def test_metrics_bind_serves_metrics_without_a_token(fresh_server):
    """`--metrics-bind` serves /metrics on a separate loopback address, for
    scrapers that hold no token."""
    fresh_server.start("--token", ADMIN, "--metrics-bind", "127.0.0.1:0")
    assert fresh_server.proc is not None and fresh_server.proc.stdout is not None
    line = fresh_server.proc.stdout.readline()
    assert line.startswith("polyak metrics on "), line
    metrics_url = line.split(" on ", 1)[1].strip()
    r = httpx.get(metrics_url, timeout=30)
    assert r.status_code == 200 and "polyak_connections" in r.text
    assert httpx.get(metrics_url.replace("/metrics", "/v1/runs")).status_code == 404
    assert httpx.get(f"{fresh_server.url}/metrics").status_code == 401


def test_tokens_never_reach_the_log(tmp_path, monkeypatch):
    """Defect 5: with debug logging the whole URL, token included, was
    logged."""
    monkeypatch.setenv("RUST_LOG", "debug")
    srv = PolyakServer(tmp_path / "data", "--token", ADMIN)
    srv.start()
    try:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = httpx.post(
            f"{srv.url}/v1/runs", json={"name": "logged", "world_size": 1}, headers=admin
        )
        read = r.json()["read_token"]
        r = httpx.get(
            f"{srv.url}/v1/runs/logged/events?access_token={read}&tail=1",
            headers={"Accept": "application/json"},
        )
        assert r.status_code == 200
        r = httpx.get(f"{srv.url}/v1/runs?access_token={ADMIN}")
        assert r.status_code == 401
        time.sleep(0.5)
    finally:
        srv.stop()
    log = "".join(srv.log)
    assert "access_token=REDACTED" in log, log[-2000:]
    assert read not in log
    assert ADMIN not in log


# --- runs and disk -------------------------------------------------------------


def test_deleting_a_run_removes_its_files(fresh_server):
    """Defect 7: DELETE answered 204 but the run's snapshot files stayed on
    disk until the next start."""
    fresh_server.start()
    data = fresh_server.data_dir
    with httpx.Client(base_url=fresh_server.url, timeout=30) as c:
        assert c.post("/v1/runs", json={"name": "gone", "world_size": 1}).status_code == 201
        assert (
            c.put(
                "/v1/runs/gone/ranks/0/steps/0", content=body({"w": torch.ones(4096)})
            ).status_code
            == 200
        )
        sid = c.post("/v1/runs/gone/snapshots", json={"step": 0}).json()["id"]
        deadline = time.monotonic() + 60
        while c.get(f"/v1/runs/gone/snapshots/{sid}").json()["status"] != "complete":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        run_dir = Path(data) / "runs" / "gone"
        files = [p for p in run_dir.rglob("*") if p.is_file()]
        assert files and sum(p.stat().st_size for p in files) > 4096 * 4
        assert c.delete("/v1/runs/gone").status_code == 204
        assert not run_dir.exists(), list(run_dir.rglob("*"))
        assert c.get("/v1/runs/gone").status_code == 404


def test_disk_reserve_refuses_writes_early(fresh_server):
    """A snapshot or state write that would leave less than --disk-reserve
    free is refused before it starts, with a reason; the free space is a
    gauge."""
    fresh_server.start("--disk-reserve", "1000000TiB")
    with httpx.Client(base_url=fresh_server.url, timeout=30) as c:
        assert c.post("/v1/runs", json={"name": "full", "world_size": 1}).status_code == 201
        assert (
            c.put("/v1/runs/full/ranks/0/steps/0", content=body({"w": torch.ones(16)})).status_code
            == 200
        )
        r = c.post("/v1/runs/full/snapshots", json={"step": 1})
        assert r.status_code == 507, r.text
        err = r.json()["error"]
        assert err["code"] == "insufficient_storage"
        assert "--disk-reserve" in err["message"]
        r = c.post("/v1/runs/full/persist")
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage"
        assert c.get("/v1/runs/full/snapshots").json()["snapshots"] == []
        metrics = c.get("/metrics").text
        free = [ln for ln in metrics.splitlines() if ln.startswith("polyak_disk_free_bytes ")]
        assert free and int(float(free[0].split()[1])) > 0
        health = c.get("/livez").json()
        assert health["disk_free_bytes"] > 0
        assert health["disk_reserve_bytes"] == 1000000 * 2**40


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
    )
    return done.returncode == 0


@pytest.fixture()
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "24m"):
        pytest.skip("needs root and tmpfs (mount -t tmpfs) for a real full disk")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_snapshots_on_a_full_disk_fail_in_the_catalog(small_disk):
    """Defect 1: with the data dir on a small tmpfs, snapshots that hit
    ENOSPC stayed `pending` with no reason (the catalog update was dropped
    and ran before the partial files were removed, so SQLite found the disk
    full too). Now every snapshot ends `complete` or `failed` with a reason,
    in the API and after a restart, and the server keeps working once space
    is freed."""
    srv = PolyakServer(small_disk / "data", "--disk-reserve", "0")
    srv.start()
    try:
        c = httpx.Client(base_url=srv.url, timeout=60)
        spec = {"name": "tight", "world_size": 1, "snapshot_every": 1, "mirror": True}
        assert c.post("/v1/runs", json=spec).status_code == 201
        w = torch.randn(1 << 20)  # 4 MiB; EMA + mirror: 8 MiB a snapshot
        for step in range(6):
            r = c.put(f"/v1/runs/tight/ranks/0/steps/{step}", content=body({"w": w + step}))
            assert r.status_code == 200, r.text
        # Every snapshot settles: none stays pending.
        deadline = time.monotonic() + 60
        while True:
            rows = c.get("/v1/runs/tight/snapshots").json()["snapshots"]
            if rows and all(r["status"] != "pending" for r in rows):
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.2)
        failed = [r for r in rows if r["status"] == "failed"]
        assert failed, rows
        for r in failed:
            reason = r["reason"] or ""
            assert "No space left" in reason or "not enough disk space" in reason, r
        # No partial file of a failed snapshot is left behind.
        for r in failed:
            assert not (small_disk / "data" / "runs" / "tight" / "snapshots" / r["id"]).exists()
        # Freeing space (deleting snapshots) makes the next one complete.
        for r in rows:
            if r["status"] == "complete":
                assert c.delete(f"/v1/runs/tight/snapshots/{r['id']}").status_code == 204
        r = c.put("/v1/runs/tight/ranks/0/steps/6", content=body({"w": w}))
        assert r.status_code == 200
        deadline = time.monotonic() + 60
        while True:
            rows = c.get("/v1/runs/tight/snapshots").json()["snapshots"]
            last = [x for x in rows if x["step"] == 6]
            if last and last[0]["status"] != "pending":
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.2)
        assert last[0]["status"] == "complete", last
        before = {r["id"]: (r["status"], r["reason"]) for r in rows}
        c.close()
        srv.stop()
        srv.start()
        c = httpx.Client(base_url=srv.url, timeout=60)
        after = {
            r["id"]: (r["status"], r["reason"])
            for r in c.get("/v1/runs/tight/snapshots").json()["snapshots"]
        }
        for sid, (status, reason) in before.items():
            if status == "failed":
                assert after[sid] == (status, reason), (sid, after.get(sid))
        c.close()
    finally:
        srv.stop()


def test_body_timeout_on_json_bodies_too(fresh_server):
    """The body clock covers every request body, not only pushes."""
    fresh_server.start("--body-timeout-secs", "1", "--body-min-rate", "1KiB")
    url = fresh_server.url
    payload = b'{"name": "slowjson", "world_size": 1}'
    sock = socket.create_connection(host_port(url))
    sock.sendall(
        raw_head(
            url,
            "POST",
            "/v1/runs",
            {"Content-Length": str(len(payload)), "Content-Type": "application/json"},
        )
        + payload[:5]
    )
    reply = read_reply(sock, timeout=20)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"body_timeout"' in reply
    assert httpx.get(f"{url}/v1/runs/slowjson").status_code == 404


# --- connections ---------------------------------------------------------------


def _exchange(sock: socket.socket, head: str, body: bytes = b"") -> tuple[str, bytes]:
    """Sends one request and reads one whole response (its head and a
    body of ``content-length`` bytes)."""
    sock.sendall(head.encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {data!r}"
        data += chunk
    raw_head, rest = data.split(b"\r\n\r\n", 1)
    text = raw_head.decode().lower()
    length = next(
        int(line.split(":", 1)[1])
        for line in text.split("\r\n")
        if line.startswith("content-length:")
    )
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed mid-answer"
        rest += chunk
    return text, rest


def test_a_request_refused_before_its_body_was_read_closes_its_connection(fresh_server):
    """A push to a run that does not exist is refused before its body is
    read; hyper then closes the connection rather than read the rest. The
    answer says ``Connection: close``, so a client does not send its next
    request on it (before, nothing said so, and a client that reused the
    connection met "Server disconnected"). A request whose body was read
    keeps its connection."""
    fresh_server.start()
    host, port = fresh_server.url.rsplit("//", 1)[1].split(":")
    big = b"x" * 200_000
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head, _ = _exchange(
            sock,
            "PUT /v1/runs/nowhere/ranks/0/steps/1 HTTP/1.1\r\nHost: t\r\n"
            f"Content-Length: {len(big)}\r\n\r\n",
            big,
        )
        assert head.startswith("http/1.1 404"), head
        assert "\r\nconnection: close" in head, head
    # A body read to its end (a JSON body the server parses and refuses):
    # the connection stays open and answers the next request.
    bad = b'{"name": "' + b"y" * 200_000 + b'"}'
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head, _ = _exchange(
            sock,
            "POST /v1/runs HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(bad)}\r\n\r\n",
            bad,
        )
        assert head.startswith("http/1.1 4"), head
        assert "connection: close" not in head, head
        head, _ = _exchange(sock, "GET /livez HTTP/1.1\r\nHost: t\r\n\r\n")
        assert head.startswith("http/1.1 200"), head
