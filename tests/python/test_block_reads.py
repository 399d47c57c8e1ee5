"""Every read of a stored part goes through one reader that checks each
block's recorded CRC-32 before handing its bytes on: a download reads each
stored byte once (``polyak_store_read_bytes_total`` against the bytes
served), a ``Range`` reads only the blocks it touches, a flipped bit ends
the body before any byte of its block leaves the server (and ``curl -C -``
cannot complete the file), and a part recorded before block checksums
existed still downloads and verifies, on files and in S3.
"""

from __future__ import annotations

import sqlite3
import subprocess
import time

import httpx
import pytest
import torch
from polyak_testing import StoreView
from shardsim import push_ranks

BACKEND_MATRIX = True

WORLD = 2
MiB = 1 << 20
BLOCK = MiB


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def make_run(client, run, rows):
    """A run of two ranks holding ``w`` (``rows`` x 2048 fp32, row blocks)
    and ``b`` (chunked along dim 1, assembled by gathering), one profile;
    returns the complete snapshot of step 1."""
    r = client.post(
        "/v1/runs",
        json={
            "name": run,
            "world_size": WORLD,
            "profiles": [{"name": "p", "kind": "power", "sigma_rel": 0.1}],
        },
    )
    assert r.status_code == 201, r.text
    torch.manual_seed(5)
    state = {"w": torch.randn(rows, 2048), "b": torch.randn(64, 64)}
    for step in (0, 1):
        state = {k: v + 0.01 for k, v in state.items()}
        push_ranks(client, run, step, state, WORLD, dims={"b": 1})
    r = client.post(f"/v1/runs/{run}/snapshots", json={"step": 1})
    assert r.status_code == 202, r.text
    sid = r.json()["id"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        row = client.get(f"/v1/runs/{run}/snapshots/{sid}").json()
        if row["status"] == "complete":
            return sid, row["files"]
        assert row["status"] != "failed", row
        time.sleep(0.05)
    raise AssertionError("snapshot not complete")


def read_bytes(client):
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("polyak_store_read_bytes_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no polyak_store_read_bytes_total")


def url(run, sid):
    return f"/v1/runs/{run}/snapshots/{sid}/download"


LAYOUTS = {
    "full": {"layout": "full"},
    "rank": {"layout": "rank", "rank": 1},
    "hf": {"layout": "hf"},
    "sharded": {"layout": "sharded"},
}


def received(client, path, params, headers=None):
    """``(status, bytes received, how it ended)``: ``clean`` or ``cut``."""
    got = bytearray()
    try:
        with client.stream("GET", path, params=params, headers=headers or {}) as r:
            if r.status_code >= 400:
                r.read()
                return r.status_code, r.json(), "refused"
            for chunk in r.iter_bytes():
                got += chunk
            assert len(got) == int(r.headers["content-length"])
            return r.status_code, bytes(got), "clean"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return r.status_code, bytes(got), "cut"


@pytest.mark.slow
def test_a_download_reads_each_stored_byte_once_and_a_range_its_blocks(client, backend):
    run = f"br-once-{backend}"
    sid, files = make_run(client, run, rows=16384)  # 64 MiB per rank's part
    part = next(f for f in files if f["rank"] == 1 and f["part"] == "p")
    assert part["bytes"] > 64 * MiB
    for name, params in LAYOUTS.items():
        before = read_bytes(client)
        r = client.get(url(run, sid), params={"profile": "p", **params})
        assert r.status_code == 200, r.text
        ratio = (read_bytes(client) - before) / len(r.content)
        print(f"{backend} {name}: {len(r.content)} bytes served, store read ratio {ratio:.4f}")
        assert 0.98 <= ratio <= 1.05, (name, ratio)
        if name == "rank":
            whole = r.content

    # A 1 MiB range in the middle of the 64 MiB part reads at most 3 MiB,
    # and is the same bytes as the whole download's.
    start = 20 * MiB + 12345
    before = read_bytes(client)
    r = client.get(
        url(run, sid),
        params={"profile": "p", **LAYOUTS["rank"]},
        headers={"range": f"bytes={start}-{start + MiB - 1}"},
    )
    assert r.status_code == 206, r.text
    assert r.content == whole[start : start + MiB]
    read = read_bytes(client) - before
    print(f"{backend} 1 MiB range: {read / MiB:.2f} MiB read")
    assert MiB <= read <= 3 * MiB, read
    # The same in the assembled file.
    before = read_bytes(client)
    r = client.get(
        url(run, sid),
        params={"profile": "p", "layout": "full"},
        headers={"range": f"bytes={start}-{start + MiB - 1}"},
    )
    assert r.status_code == 206 and len(r.content) == MiB, r.text
    read = read_bytes(client) - before
    assert read <= 3 * MiB + 2 * BLOCK, read  # plus the parts' tensor tables


def clean_downloads(client, run, sid, layouts):
    out = {}
    for name, params in layouts.items():
        r = client.get(url(run, sid), params={"profile": "p", **params})
        assert r.status_code == 200, r.text
        out[name] = r.content
    return out


FLIP_LAYOUTS = {**LAYOUTS, "full-bf16": {"layout": "full", "dtype": "bf16"}}


def corrupt_events(client, run, key, at_least):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        events = client.get(
            f"/v1/runs/{run}/events",
            params={"kinds": "snapshot_corrupt"},
            headers={"accept": "application/json"},
        ).json()
        if len(events) >= at_least:
            return events
        time.sleep(0.1)
    raise AssertionError(f"fewer than {at_least} snapshot_corrupt events: {events}")


@pytest.mark.slow
def test_no_byte_of_a_bad_block_leaves_the_server(client, server, backends, backend, tmp_path):
    run = f"br-flip-{backend}"
    sid, files = make_run(client, run, rows=4096)  # 16 MiB per rank's part
    key = next(f["path"] for f in files if f["rank"] == 1 and f["part"] == "p")
    view = StoreView(server, backends.s3() if backend.endswith("-s3") else None)
    good = view.read(key)
    clean = clean_downloads(client, run, sid, FLIP_LAYOUTS)

    flip = len(good) // 2 + 777
    block_start = flip // BLOCK * BLOCK
    bad = bytearray(good)
    bad[flip] ^= 0x04
    view.write(key, bytes(bad))

    for name, params in FLIP_LAYOUTS.items():
        status, got, how = received(client, url(run, sid), {"profile": "p", **params})
        assert (status, how) == (200, "cut"), (name, status, how)
        # Everything received is the clean file's beginning ...
        assert got == clean[name][: len(got)], name
        if name != "full-bf16":
            # ... and ends before the bad block's first byte.
            at = clean[name].find(good[block_start : block_start + 256])
            assert at > 0 and clean[name].find(good[block_start : block_start + 256], at + 1) < 0
            assert len(got) <= at, (name, len(got), at)

    # A range over the bad block: the bytes before it, then the cut.
    lo = block_start - BLOCK + 100
    status, got, how = received(
        client,
        url(run, sid),
        {"profile": "p", **LAYOUTS["rank"]},
        {"range": f"bytes={lo}-{block_start + 2 * BLOCK}"},
    )
    assert (status, how) == (206, "cut"), (status, how)
    assert len(got) <= block_start - lo and got == good[lo : lo + len(got)]
    # A range that starts in the bad block is refused before any byte.
    status, err, how = received(
        client,
        url(run, sid),
        {"profile": "p", **LAYOUTS["rank"]},
        {"range": f"bytes={block_start + 10}-{block_start + BLOCK + 10}"},
    )
    assert (status, how) == (500, "refused"), (status, how)
    assert err["error"]["code"] == "snapshot_corrupt" and key in err["error"]["message"], err

    # curl keeps what it received and resumes with -C -: the file never
    # completes, and holds no corrupt byte.
    out = tmp_path / "rank.safetensors"
    full_url = f"{server.url}{url(run, sid)}?profile=p&layout=rank&rank=1"
    first = subprocess.run(["curl", "-sS", "-o", str(out), full_url], capture_output=True)
    resumed = subprocess.run(
        ["curl", "-sS", "-C", "-", "-o", str(out), full_url], capture_output=True
    )
    assert first.returncode == 18, first.stderr
    assert resumed.returncode != 0, resumed.stderr
    kept = out.read_bytes()
    assert len(kept) <= block_start and kept == good[: len(kept)], len(kept)

    events = corrupt_events(client, run, key, at_least=len(FLIP_LAYOUTS) + 2)
    assert {e["detail"]["during"] for e in events} == {"download"}
    assert all(e["detail"]["part"] == key and e["detail"]["snapshot"] == sid for e in events)
    assert all(f"block {block_start // BLOCK} " in e["detail"]["reason"] for e in events), events

    # Put back, every layout reads whole again.
    view.write(key, good)
    assert clean_downloads(client, run, sid, FLIP_LAYOUTS) == clean


def forget_blocks(server, backends, backend, sid):
    """Makes the snapshot's rows what a server before block checksums
    wrote (no ``blocks``)."""
    sql = f"UPDATE snapshot_files SET blocks = NULL WHERE snapshot = '{sid}'"
    if backend.startswith("sqlite"):
        with sqlite3.connect(server.data_dir / "polyak.db") as db:
            assert db.execute(sql).rowcount == WORLD
    else:
        database = server.args[server.args.index("--catalog") + 1].rsplit("/", 1)[1]
        backends.postgres().psql(sql, database=database)


@pytest.mark.slow
def test_a_part_without_block_checksums_still_reads_and_verifies(client, server, backends, backend):
    run = f"br-old-{backend}"
    sid, files = make_run(client, run, rows=1024)  # 4 MiB per rank's part
    key = next(f["path"] for f in files if f["rank"] == 1 and f["part"] == "p")
    clean = clean_downloads(client, run, sid, FLIP_LAYOUTS)
    forget_blocks(server, backends, backend, sid)
    assert clean_downloads(client, run, sid, FLIP_LAYOUTS) == clean
    r = client.post("/v1/admin/verify", params={"run": run})
    assert r.status_code == 200 and r.json()["clean"] and r.json()["parts"] == WORLD, r.text
    assert client.post(f"/v1/runs/{run}/resume", json={"step": 1}).status_code == 200

    # Held to its whole sha256 before any byte of it goes out.
    view = StoreView(server, backends.s3() if backend.endswith("-s3") else None)
    good = view.read(key)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    view.write(key, bytes(bad))
    status, err, how = received(client, url(run, sid), {"profile": "p", **LAYOUTS["rank"]})
    assert (status, how) == (500, "refused"), (status, how)
    assert err["error"]["code"] == "snapshot_corrupt" and key in err["error"]["message"], err
    # (An assembled layout reads every part's tensor table first: refused.)
    status, err, how = received(client, url(run, sid), {"profile": "p", "layout": "full"})
    assert (status, how) == (500, "refused"), (status, how)
    r = client.post("/v1/admin/verify", params={"run": run})
    assert [b["key"] for b in r.json()["bad"]] == [key], r.text
