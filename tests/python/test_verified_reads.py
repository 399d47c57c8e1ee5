"""Stored parts are held to the size, block checksums and sha256 recorded
when they were written: a part with one flipped bit (same size) or a part
cut short fails every read of it (downloads in every layout, compare,
resume, post-hoc), is reported (event, alert, ``polyak_snapshot_corrupt_total``), and ``polyak
verify`` (and ``POST /v1/admin/verify``) finds it, on files and in S3.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import pytest
import torch
from polyak_testing import StoreView
from polyak_testing.refs import SmallNet
from shardsim import push_ranks

BACKEND_MATRIX = True

WORLD = 2
SIGMAS = {"p05": 0.05, "p10": 0.10}


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def wait_complete(client, run, sid, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = client.get(f"/v1/runs/{run}/snapshots/{sid}").json()
        if row["status"] == "complete":
            return row
        assert row["status"] != "failed", row
        time.sleep(0.05)
    raise AssertionError(f"snapshot {sid} not complete")


def make_run(client, run):
    """A run of two ranks (one tensor chunked along dim 1) with two power
    profiles, snapshots at steps 4 and 9; returns the step-9 snapshot."""
    r = client.post(
        "/v1/runs",
        json={
            "name": run,
            "world_size": WORLD,
            "profiles": [{"name": n, "kind": "power", "sigma_rel": s} for n, s in SIGMAS.items()],
        },
    )
    assert r.status_code == 201, r.text
    torch.manual_seed(3)
    model = SmallNet()
    sids = []
    for step in range(10):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        push_ranks(client, run, step, model.state_dict(), WORLD, dims={"fc1.weight": 1})
        if step in (4, 9):
            r = client.post(f"/v1/runs/{run}/snapshots", json={"step": step})
            assert r.status_code == 202, r.text
            sids.append(wait_complete(client, run, r.json()["id"])["id"])
    return sids[-1]


def part_key(client, run, sid, rank, part="p05"):
    files = client.get(f"/v1/runs/{run}/snapshots/{sid}").json()["files"]
    (f,) = [f for f in files if f["rank"] == rank and f["part"] == part]
    return f["path"]


def fetch(client, run, sid, **params):
    """How a download ended: ``refused`` (500 snapshot_corrupt before the
    body), ``cut`` (the body broke off), or ``clean <status>``."""
    url = f"/v1/runs/{run}/snapshots/{sid}/download"
    try:
        with client.stream("GET", url, params=params) as r:
            if r.status_code == 500:
                r.read()
                assert r.json()["error"]["code"] == "snapshot_corrupt", r.text
                return "refused"
            got = b"".join(r.iter_bytes())
            assert len(got) == int(r.headers["content-length"])
            return f"clean {r.status_code}"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "cut"


LAYOUTS = [
    {"layout": "full"},
    {"layout": "full", "dtype": "bf16"},
    {"layout": "sharded"},
    {"layout": "hf"},
    {"layout": "rank", "rank": 1},
]


def refused(r, key):
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "snapshot_corrupt" and key in err["message"], err
    return err


def metric(client, run):
    text = client.get("/metrics").text
    for line in text.splitlines():
        if line.startswith("polyak_snapshot_corrupt_total") and f'run="{run}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def verify_cli(server, backends, backend, run):
    """``polyak verify --run RUN`` against the server's catalog and store."""
    env = {**os.environ, **backends.server_env(backend)}
    out = subprocess.run(
        [server.binary, "verify", "--run", run, "--data-dir", str(server.data_dir), *server.args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.returncode, json.loads(out.stdout)


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_a_damaged_part_fails_every_read(client, server, backends, backend, damage):
    run = f"vr-{damage}-{backend}"
    sid = make_run(client, run)
    view = StoreView(server, backends.s3() if backend.endswith("-s3") else None)
    key = part_key(client, run, sid, rank=1)
    good = view.read(key)
    # Every layout reads back whole and clean first.
    assert [fetch(client, run, sid, profile="p05", **p) for p in LAYOUTS] == ["clean 200"] * 5

    if damage == "flip":
        bad = bytearray(good)
        bad[len(bad) - 3] ^= 0x10  # one bit of tensor data, same size
        view.write(key, bytes(bad))
    else:
        view.write(key, good[:-100])
    before = metric(client, run)

    # A cut part is refused before the first byte (its size is checked);
    # so is a flipped bit in the first block a response reads (these parts
    # are one block each: every layout reads it before its first byte).
    # test_block_reads.py has the bodies cut before a later bad block.
    got = [fetch(client, run, sid, profile="p05", **p) for p in LAYOUTS]
    assert got == ["refused"] * len(LAYOUTS), got
    # The other rank's part still downloads.
    r = client.get(
        f"/v1/runs/{run}/snapshots/{sid}/download",
        params={"layout": "rank", "rank": 0, "profile": "p05"},
    )
    assert r.status_code == 200, "the other rank's part is intact"

    refused(
        client.get(f"/v1/runs/{run}/compare", params={"a": sid, "b": "live", "profile": "p05"}), key
    )
    refused(client.post(f"/v1/runs/{run}/resume", json={"step": 9}), key)
    refused(client.post(f"/v1/runs/{run}/posthoc", json={"sigma_rel": 0.07, "step": 9}), key)
    # Nothing derived was recorded for the refused post-hoc.
    kinds = [s["kind"] for s in client.get(f"/v1/runs/{run}/snapshots").json()["snapshots"]]
    assert "posthoc" not in kinds, kinds

    wanted = {"download", "compare", "resume", "posthoc"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        events = client.get(
            f"/v1/runs/{run}/events",
            params={"kinds": "snapshot_corrupt"},
            headers={"accept": "application/json"},
        ).json()
        during = {e["detail"]["during"] for e in events}
        if wanted <= during:
            break
        time.sleep(0.1)
    assert wanted <= during, during
    assert all(e["detail"]["part"] == key and e["detail"]["snapshot"] == sid for e in events)
    assert metric(client, run) >= before + len(LAYOUTS) + 3
    deadline = time.monotonic() + 30
    alerts = []
    while time.monotonic() < deadline:
        alerts = client.get(f"/v1/runs/{run}/alerts").json()["alerts"]
        if any(a["key"] == f"snapshot_corrupt:{sid}" for a in alerts):
            break
        time.sleep(0.1)
    (alert,) = [a for a in alerts if a["kind"] == "snapshot_corrupt"]
    assert alert["state"] == "firing" and key in alert["message"], alert

    # The store-wide check names the part, from the command line and the API.
    code, report = verify_cli(server, backends, backend, run)
    assert code == 1 and not report["clean"], report
    (found,) = report["bad"]
    assert (found["key"], found["snapshot"], found["rank"], found["problem"]) == (
        key,
        sid,
        1,
        "mismatch",
    ), found
    r = client.post("/v1/admin/verify", params={"run": run})
    assert r.status_code == 200 and [b["key"] for b in r.json()["bad"]] == [key], r.text

    # Put back, every read is whole again and the store is reported clean.
    view.write(key, good)
    assert [fetch(client, run, sid, profile="p05", **p) for p in LAYOUTS] == ["clean 200"] * 5
    assert client.post(f"/v1/runs/{run}/resume", json={"step": 9}).status_code == 200
    code, report = verify_cli(server, backends, backend, run)
    assert code == 0 and report["clean"] and report["parts"] == 8 and not report["bad"], report
    assert report["snapshots"] == 2 and report["bytes"] > 0, report
    r = client.post("/v1/admin/verify", params={"run": run})
    assert r.status_code == 200 and r.json()["clean"] and r.json()["parts"] == 8, r.text
