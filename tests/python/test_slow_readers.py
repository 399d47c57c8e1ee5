"""Downloads nobody reads cannot hold the server: they count against their
own budget (``--max-downloads``), so probes and control calls still get a
connection under ``--max-connections``; a response left unread past
``--send-timeout-secs`` is dropped; and every download layout (a casting
one, one that gathers a column-sharded tensor) holds about a chunk of
computed bytes, not the whole output.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from shardsim import push_ranks

STALLED = 8
#: A 16M-element float32 tensor: 32 MB once cast to bf16.
NUMEL = 16 << 20
OUTPUT = NUMEL * 2


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def gauge(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def wait_for(what, cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stalled_get(url: str, path: str) -> socket.socket:
    """Sends a GET, waits for the status line, and reads nothing more."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.settimeout(60)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    head = s.recv(12)
    assert head == b"HTTP/1.1 200", head
    return s


def create_quiet_run(c: httpx.Client, name: str, world_size: int) -> None:
    """A run of one constant profile and no periodic state snapshot: its
    capture of the EMA would land in the memory measured here."""
    r = c.post(
        "/v1/runs",
        json={
            "name": name,
            "world_size": world_size,
            "profiles": [{"name": "ema", "kind": "constant", "beta": 0.9}],
            "persist_every_secs": 0,
        },
    )
    assert r.status_code == 201, r.text


def big_snapshots(c: httpx.Client, n: int) -> list[str]:
    create_quiet_run(c, "slow", 1)
    body = safetensors.torch.save({"w": torch.randn(NUMEL)})
    assert c.put("/v1/runs/slow/ranks/0/steps/0", content=body, timeout=120).status_code == 200
    sids = []
    for _ in range(n):
        r = c.post("/v1/runs/slow/snapshots", json={})
        assert r.status_code == 202, r.text
        sids.append(r.json()["id"])
    for sid in sids:
        wait_for(
            "the snapshot",
            lambda sid=sid: c.get(f"/v1/runs/slow/snapshots/{sid}").json()["status"] == "complete",
        )
    return sids


def test_unread_downloads_leave_room_for_probes_and_hold_a_chunk_each(fresh_server):
    """Eight bf16 downloads nobody reads, on a server of eight connections:
    probes and a DELETE still answer, and the server's anonymous memory
    grows by about a chunk per download, not by the 32 MB output."""
    srv = fresh_server.start("--max-connections", "8")
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        sid, other = big_snapshots(c, 2)
        assert srv.proc is not None
        pid = srv.proc.pid
        base = rss_anon(pid)
        peak = [base]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss_anon(pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        path = f"/v1/runs/slow/snapshots/{sid}/download?dtype=bf16"
        socks = []
        try:
            socks = [stalled_get(srv.url, path) for _ in range(STALLED)]
            # Probes and control calls still get a slot (a client timeout,
            # not a timed assertion: a hang fails the test).
            with httpx.Client(base_url=srv.url, timeout=10) as fresh:
                assert fresh.get("/livez").status_code == 200
                assert fresh.get("/readyz").status_code == 200
                assert fresh.delete(f"/v1/runs/slow/snapshots/{other}").status_code == 204
                wait_for(
                    "every download counted",
                    lambda: gauge(fresh, "polyak_downloads_open") == STALLED,
                )
                # Let the producers fill what they may hold.
                time.sleep(2)
        finally:
            done.set()
            sampler.join()
            for s in socks:
                s.close()
        growth = peak[0] - base
        print(
            f"\n{STALLED} stalled bf16 downloads of a {OUTPUT >> 20} MiB output: anonymous RSS "
            f"{base >> 20} MiB -> peak {peak[0] >> 20} MiB (+{growth / STALLED / 2**20:.1f} MiB "
            f"per download; the output is {OUTPUT >> 20} MiB)"
        )
        # About a chunk each (1 MiB converted, a few queued), far below the
        # whole output per connection.
        assert growth < STALLED * 14 * 2**20, growth


def test_an_unread_download_is_dropped_after_the_send_timeout(fresh_server):
    srv = fresh_server.start("--send-timeout-secs", "2", "--send-min-rate", "64MiB")
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        (sid,) = big_snapshots(c, 1)
        path = f"/v1/runs/slow/snapshots/{sid}/download?dtype=bf16"
        socks = [stalled_get(srv.url, path) for _ in range(2)]
        wait_for("the downloads counted", lambda: gauge(c, "polyak_downloads_open") == 2)
        wait_for("the unread downloads dropped", lambda: gauge(c, "polyak_downloads_open") == 0)
        for s in socks:
            got = 0
            while chunk := s.recv(1 << 20):
                got += len(chunk)
            s.close()
            # What the socket buffers held, then the end: never the whole body.
            assert got < OUTPUT, got
        # A download that is read is whole.
        r = c.get(f"/v1/runs/slow/snapshots/{sid}/download", params={"dtype": "bf16"}, timeout=120)
        assert r.status_code == 200 and len(r.content) > OUTPUT


#: A 4096 x 8192 float32 tensor (128 MiB) split along dim 1 over two ranks
#: (FSDP ``Shard(1)``, tensor parallel): `full` and `hf` gather it.
COLUMNS = (4096, 8192)
GATHERED = 4
GATHER_LAYOUTS = {
    "full": "layout=full",
    "hf": "layout=hf",
    "sharded": "layout=sharded",
    "rank": "layout=rank&rank=1",
    "full-bf16": "layout=full&dtype=bfloat16",
}


def column_sharded_snapshot(c: httpx.Client) -> str:
    create_quiet_run(c, "cols", 2)
    torch.manual_seed(3)
    push_ranks(c, "cols", 0, {"w": torch.randn(*COLUMNS)}, 2, dims={"w": 1})
    r = c.post("/v1/runs/cols/snapshots", json={})
    assert r.status_code == 202, r.text
    sid = r.json()["id"]
    wait_for(
        "the snapshot",
        lambda: c.get(f"/v1/runs/cols/snapshots/{sid}").json()["status"] == "complete",
        timeout=120,
    )
    return sid


@pytest.mark.slow
def test_unread_downloads_of_a_column_sharded_tensor_hold_a_chunk_each(fresh_server):
    """Four unread downloads of a 128 MiB tensor chunked along dim 1, in
    every layout: each grows the server's anonymous memory by about a chunk
    (the gather assembles a block of rows at a time), never by the tensor."""
    srv = fresh_server.start()
    assert srv.proc is not None
    pid = srv.proc.pid
    tensor = COLUMNS[0] * COLUMNS[1] * 4
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        sid = column_sharded_snapshot(c)
        # A download that is read is whole and holds the pushed tensor.
        r = c.get(f"/v1/runs/cols/snapshots/{sid}/download")
        assert r.status_code == 200
        torch.manual_seed(3)
        want = torch.randn(*COLUMNS)
        got = safetensors.torch.load(r.content)["w"]
        assert torch.equal(got, want)
        del r, got
        growth = {}
        for name, query in GATHER_LAYOUTS.items():
            wait_for("no download open", lambda: gauge(c, "polyak_downloads_open") == 0)
            base = rss_anon(pid)
            peak = [base]
            done = threading.Event()

            def sample(peak=peak, done=done):
                while not done.is_set():
                    peak[0] = max(peak[0], rss_anon(pid))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            path = f"/v1/runs/cols/snapshots/{sid}/download?{query}"
            socks = []
            try:
                socks = [stalled_get(srv.url, path) for _ in range(GATHERED)]
                wait_for(
                    "every download counted",
                    lambda: gauge(c, "polyak_downloads_open") == GATHERED,
                )
                # Let the producers fill what they may hold.
                time.sleep(2)
            finally:
                done.set()
                sampler.join()
                for s in socks:
                    s.close()
            growth[name] = (peak[0] - base) / GATHERED
        print(
            f"\n{GATHERED} stalled downloads of a {tensor >> 20} MiB column-sharded tensor, "
            "anonymous RSS growth per download: "
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in growth.items())
        )
        # About a chunk each (1 MiB computed, a few queued), never the tensor.
        assert all(v < 16 * 2**20 for v in growth.values()), growth
