"""One service over three nodes: servers sharing one PostgreSQL catalog and
one S3 store, a run's ranks placed over all of them.

FSDP2 on four ranks (gloo) trains for real and pushes through the client,
which sends each rank straight to the node holding it (the run's
placement). Every rank's EMA, read through a node that does not hold it
(forwarded to the owner), equals the in-test anchors: ``AveragedModel``
for a ``constant`` profile, ``ema_pytorch.EMA`` for a ``warmup`` one. A
push sent to the wrong node is answered ``307`` to the owner; every node
shows every run and rank; the catalog records one owner per rank and epoch.

A snapshot of a run spread over two of the nodes is one consistent cut:
asked for on the third node (which holds none of its ranks), each node
captures its own ranks at the step and the catalog completes it when the
last rank is recorded; it downloads from that third node (``full``, and
``sharded`` through DCP into world sizes 1 and 3) and equals the anchor.
Periodic cuts meet in one catalog row per step, whichever node opens them.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import polyak
import pytest
import safetensors.torch
import torch
from polyak.wire import ALIASES_KEY, SHARDS_KEY, read_safetensors
from polyak_testing import Backends, NetLab, TcpProxy, read_sse, wait_for
from polyak_testing.refs import assert_state_close
from polyak_workers import dcp_loads, run_ranks, snapshot_worker
from test_client_distributed import _check, _train
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


@pytest.fixture()
def cluster(tmp_path, backends: Backends, polyak_binary: str, lab):
    """Three nodes, each in a test host of its own where this machine can
    make them (see ``lab``), else on loopback ports."""
    catalog, nodes = backends.cluster(tmp_path / "nodes", 3, binary=polyak_binary, lab=lab)
    try:
        for node in nodes:
            node.start()
        yield catalog, nodes
    finally:
        for node in nodes:
            node.stop()


def _catalog_rows(backends: Backends, catalog: str, sql: str) -> list[list[str]]:
    out = backends.postgres().psql(sql, catalog.rpartition("/")[2])
    return [line.split("|") for line in out.splitlines() if line]


def _taken_over(backends: Backends, catalog: str, run_name: str) -> list[str] | None:
    """Who took rank 1 at epoch 2, and when (ms): the catalog's log."""
    rows = _catalog_rows(
        backends,
        catalog,
        f"SELECT node_id, at_ms FROM placement_log WHERE run = '{run_name}' "
        "AND rank = 1 AND epoch = 2",
    )
    return rows[0] if rows else None


def _assert_rank_1_moved_once(backends: Backends, catalog: str, run_name: str) -> None:
    """One owner per (rank, epoch) of a 2-rank run whose rank 1 changed
    hands once."""
    owners = _catalog_rows(
        backends,
        catalog,
        f"SELECT rank, epoch, COUNT(*) FROM placement_log WHERE run = '{run_name}' "
        "GROUP BY rank, epoch",
    )
    assert sorted((r, e, n) for r, e, n in owners) == [
        ("0", "1", "1"),
        ("1", "1", "1"),
        ("1", "2", "1"),
    ]


def _events(url: str, run_name: str, kind: str, **params) -> list[dict]:
    """A run's events of one kind as a node lists them (JSON)."""
    return httpx.get(
        f"{url}/v1/runs/{run_name}/events",
        params={"kinds": kind, **params},
        headers={"Accept": "application/json"},
        timeout=10,
    ).json()


@pytest.mark.slow
def test_fsdp2_over_three_nodes(cluster, backends: Backends, tmp_path, run_name):
    catalog, (a, b, c) = cluster
    ids = {a.url: "node-a", b.url: "node-b", c.url: "node-c"}
    with polyak.Client(a.url) as client:
        # The trainers are given node b's URL; the runs are created on a.
        out = _train("fsdp2", client, b, tmp_path, run_name, world=4)
        # (The deferred copies' accounting is the single server's test: here
        # the pushes cross a bridge, and a copy may be done before its wait.)
        _check(out, expect_chunks=True, deferred=None)
        c_stats = out["stats"][0]
        assert c_stats["deferred"] == out["steps"]
        assert 0 < c_stats["waits"] <= out["steps"] - 1
        runs = out["runs"]
        for run in runs.values():
            placement = run.placement()
            assert len(placement) == 4
            # Spread over every node, each named with its own URL.
            assert {p["node"] for p in placement.values()} == set(ids.values())
            assert all(ids[p["url"]] == p["node"] for p in placement.values())
            assert all(p["epoch"] == 1 and p["engine"] for p in placement.values())

        run_c = runs["constant"]
        placement = run_c.placement()
        steps = out["steps"]

        # Every node shows every rank at the last step (the ranks it does not
        # hold from the catalog), with the node holding each.
        for node in (a, b, c):
            with polyak.Client(node.url) as on_node:
                view = on_node.run(run_c.name)

                def caught_up(view=view):
                    ranks = view.refresh()["ranks"]
                    return all(r["last_step"] == steps - 1 for r in ranks) and ranks

                ranks = wait_for(
                    caught_up,
                    30,
                    f"{node.url} to show every rank",
                    lambda view=view: [
                        (r["rank"], r["node"], r["last_step"], r["status"])
                        for r in view.refresh()["ranks"]
                    ],
                )
                assert [r["node"] for r in ranks] == [placement[r]["node"] for r in range(4)]
                assert all(r["status"] == "live" for r in ranks), ranks

        # A rank's live EMA read through each node is the owner's, bytes for
        # bytes (forwarded by the nodes that do not hold it).
        for rank in range(4):
            owner = placement[rank]["url"]
            path = f"/v1/runs/{run_c.name}/ranks/{rank}/ema"
            want = httpx.get(owner + path, timeout=30)
            assert want.status_code == 200, want.text
            for node in (a, b, c):
                got = httpx.get(node.url + path, timeout=30)
                assert got.status_code == 200, got.text
                assert got.content == want.content, (rank, node.url)

        # A push to a node that does not hold the rank is redirected to the
        # owner, body and all; following the redirect applies it there.
        rank = 1
        stranger = next(n for n in (a, b, c) if n.url != placement[rank]["url"])
        got = httpx.get(f"{stranger.url}/v1/runs/{run_c.name}/ranks/{rank}/ema", timeout=30)
        tensors, metadata = read_safetensors(got.content)
        keep = {k: v for k, v in metadata.items() if k in (SHARDS_KEY, ALIASES_KEY)}
        body = safetensors.torch.save(tensors, metadata=keep)
        path = f"/v1/runs/{run_c.name}/ranks/{rank}/steps/{steps}"
        moved = httpx.put(stranger.url + path, content=body, timeout=30)
        assert moved.status_code == 307, moved.text
        assert moved.headers["location"] == placement[rank]["url"] + path
        assert moved.json()["error"]["code"] == "rank_elsewhere"
        assert moved.json()["node"] == placement[rank]["node"]
        followed = httpx.put(stranger.url + path, content=body, timeout=30, follow_redirects=True)
        assert followed.status_code == 200, followed.text
        assert followed.json()["applied"] is True
        assert str(followed.url).startswith(placement[rank]["url"])
        # Shown by every node once the owner's catalog row says so.
        wait_for(lambda: run_c.rank(rank)["last_step"] == steps, 30, "the redirected push to show")

    # No push asked the catalog anything while it was answered (rank rows and
    # events go through each node's batched writer), on any node.
    for node in (a, b, c):
        text = httpx.get(f"{node.url}/metrics", timeout=30).text
        applied = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("polyak_pushes_total{") and 'outcome="applied"' in line
        )
        assert applied > 0, node.url
        assert 'polyak_catalog_queries_total{path="push"} 0' in text, node.url
        assert "polyak_catalog_writer_flushes_total" in text

    # The catalog: one owner per rank, and one per (rank, epoch) ever.
    for run in runs.values():
        owners = _catalog_rows(
            backends,
            catalog,
            f"SELECT rank, node_id, epoch FROM placements WHERE run = '{run.name}'",
        )
        assert sorted(int(r) for r, _, _ in owners) == [0, 1, 2, 3]
        log = _catalog_rows(
            backends,
            catalog,
            f"SELECT rank, epoch, COUNT(*) FROM placement_log WHERE run = '{run.name}' "
            "GROUP BY rank, epoch",
        )
        assert all(n == "1" for _, _, n in log) and len(log) == 4


def test_runs_created_on_one_node_are_known_to_all(cluster):
    _, (a, b, c) = cluster
    with polyak.Client(a.url) as client:
        client.create_run(
            "everywhere", world_size=5, profiles=[{"name": "e", "kind": "constant", "beta": 0.9}]
        )
        for node in (b, c):
            # Told at creation: no wait for the periodic sync.
            with polyak.Client(node.url) as other:
                names = [r["name"] for r in other.runs()]
                assert "everywhere" in names
                placement = other.run("everywhere").placement()
                assert {p["node"] for p in placement.values()} == {"node-a", "node-b", "node-c"}

        # Ranks held per node, as the nodes renew their leases: 2, 2 and 1.
        def held():
            nodes = httpx.get(f"{a.url}/v1/nodes", timeout=10).json()["nodes"]
            counts = sorted(n["ranks"] for n in nodes)
            return counts if counts == [1, 2, 2] else None

        wait_for(held, 20, "the nodes to report the ranks they hold")
        # Deleted on b: gone from every node.
        with polyak.Client(b.url) as other:
            other.delete_run("everywhere")
        for node in (a, c):
            r = httpx.get(f"{node.url}/v1/runs/everywhere", timeout=10)
            assert r.status_code == 404, r.text
        # A push to a run a node never heard of is still a 404.
        r = httpx.put(f"{c.url}/v1/runs/everywhere/ranks/0/steps/0", content=b"x", timeout=10)
        assert r.status_code == 404


def test_a_single_node_holds_every_rank(tmp_path, backends: Backends, polyak_binary: str):
    """One node on the scale-out backends behaves as the embedded default:
    every rank here, epoch 1, and the client pushes to the URL it was
    given."""
    _, (only,) = backends.cluster(tmp_path / "one", 1, binary=polyak_binary)
    with only as srv, polyak.Client(srv.url) as client:
        run = client.create_run(
            "alone", world_size=3, profiles=[{"name": "e", "kind": "constant", "beta": 0.5}]
        )
        placement = run.placement()
        assert {p["node"] for p in placement.values()} == {"node-a"}
        assert {p["epoch"] for p in placement.values()} == {1}
        assert run.owner_url(2) == srv.url
        with run.pusher(rank=0) as pusher:
            pusher.push({"w": torch.ones(4)}, 0)
            pusher.flush()
        assert run.rank(0)["last_step"] == 0


@pytest.mark.slow
def test_a_cut_across_nodes_downloads_from_a_node_holding_none(cluster, tmp_path, run_name):
    """FSDP2 on 2 gloo ranks, the run placed on nodes a and b; the cut is
    asked for on node c before the ranks reach its step."""
    _, (a, b, c) = cluster
    steps, snap_step, beta = 16, 11, 0.9
    with polyak.Client(a.url) as on_a, polyak.Client(c.url) as on_c:
        on_a.create_run(
            run_name, world_size=2, profiles=[{"name": "c", "kind": "constant", "beta": beta}]
        )
        run = on_c.run(run_name)
        placement = run.placement()
        assert [placement[r]["node"] for r in (0, 1)] == ["node-a", "node-b"]
        pending = run.snapshot(step=snap_step, label="across", wait=False)
        assert (pending["status"], pending["step"]) == ("pending", snap_step)
        cfg = {
            "init": f"file://{tmp_path / 'store'}",
            "url": b.url,
            "run": run_name,
            "beta": beta,
            "steps": steps,
            "snap_step": snap_step,
            "out": str(tmp_path),
        }
        run_ranks(snapshot_worker, 2, cfg)
        out = torch.load(tmp_path / "snapshot-rank0.pt", weights_only=False)
        want, online = out["avg"], out["online"]

        snap = run.wait_snapshot(pending, timeout=60)
        assert snap["status"] == "complete" and snap["label"] == "across"
        assert {(f["rank"], f["part"], f["step"]) for f in snap["files"]} == {
            (0, "c", snap_step),
            (1, "c", snap_step),
        }
        # One row, the same on every node.
        for node in (a, b):
            with polyak.Client(node.url) as other:
                row = other.run(run_name).wait_snapshot(snap["id"], timeout=10)
                assert row["status"] == "complete" and row["bytes"] == snap["bytes"]
        assert [s["id"] for s in run.snapshots(kind="manual")] == [snap["id"]]

        # full, from node c.
        full = run.download(snap, "c", progress=False)
        assert_state_close(full, want, online, label="full across nodes")
        # sharded, from node c; DCP into world size 1 and 3.
        shard_dir = run.download_to(snap, tmp_path / "dl", "c", layout="sharded", progress=False)
        assert sorted(os.listdir(shard_dir)) == ["rank-00000.safetensors", "rank-00001.safetensors"]
        sd, got3, _ = dcp_loads(shard_dir, want, tmp_path)
        assert_state_close(sd, want, online, label="sharded into world size 1")
        assert_state_close(got3, want, online, label="sharded into world size 3")

        # A cut of "now", asked on c: every rank (on a and b) is at the last
        # step, read from the nodes holding them.
        now = run.snapshot(timeout=60)
        assert now["status"] == "complete" and now["step"] == steps - 1
        assert now["detail"]["cut"] == "current"
        # A step the ranks are past: refused by the nodes holding them, and
        # nothing is left behind.
        before = [s["id"] for s in run.snapshots()]
        with pytest.raises(polyak.PolyakError) as refused:
            run.snapshot(step=4, wait=False)
        assert refused.value.status == 409 and "past the snapshot step" in str(refused.value)
        assert [s["id"] for s in run.snapshots()] == before
        # Finishing the spread run, asked of node c: the nodes holding its
        # ranks hold at their furthest steps, the finish lands at the
        # furthest of all, and the final snapshot is a cut there.
        done = run.finish(timeout=60)
        final = done["snapshot"]
        assert final["status"] == "complete" and final["step"] == steps - 1, final
        assert final["detail"]["cut"] == "final"
        assert {(f["rank"], f["step"]) for f in final["files"]} == {(0, steps - 1), (1, steps - 1)}
        got = polyak.assemble(
            (t.tensors, t.chunks) for t in (run.rank_ema(r, "c") for r in range(2))
        )
        downloaded = run.download(final, "c")
        for name, t in got.items():
            assert torch.equal(downloaded[name], t), name
        # Every node refuses a later push of the ranks it holds, and shows
        # the run finished.
        body = safetensors.torch.save({"w": torch.ones(4)})
        for rank in (0, 1):
            owner = placement[rank]["url"]
            r = httpx.put(f"{owner}/v1/runs/{run_name}/ranks/{rank}/steps/{steps}", content=body)
            assert r.status_code == 409 and r.json()["error"]["code"] == "run_finished", r.text
        for node in (a, b, c):
            wait_for(
                lambda node=node: (
                    httpx.get(f"{node.url}/v1/runs/{run_name}").json().get("finished")
                ),
                10,
                f"{node.url} to show the run finished",
            )


def test_the_event_stream_of_any_node_carries_every_nodes_events(cluster, run_name):
    """Node c's event stream (SSE) shows the pushes every node applied,
    each once, relayed from the catalog as the writers store them (in the
    catalog's order, woken by LISTEN/NOTIFY); a reconnect with
    ``Last-Event-ID`` resumes exactly after the last event seen, though
    ids do not grow along that order."""
    _, (a, _b, c) = cluster
    with polyak.Client(a.url) as client:
        run = client.create_run(
            run_name, world_size=3, profiles=[{"name": "e", "kind": "constant", "beta": 0.9}]
        )
        placement = run.placement()
    assert {p["node"] for p in placement.values()} == {"node-a", "node-b", "node-c"}
    got: list[dict] = []
    url = f"{c.url}/v1/runs/{run_name}/events?kinds=push"
    reader = threading.Thread(target=lambda: got.extend(read_sse(url, 6, timeout=30)))
    reader.start()
    time.sleep(1.0)  # the stream is open: these come live, not from history
    body = safetensors.torch.save({"w": torch.ones(4)})
    for step in (0, 1):
        for rank, p in placement.items():
            r = httpx.put(f"{p['url']}/v1/runs/{run_name}/ranks/{rank}/steps/{step}", content=body)
            assert r.status_code == 200, r.text
    reader.join(40)
    assert sorted((e["rank"], e["step"]) for e in got) == [(r, s) for r in range(3) for s in (0, 1)]
    assert len({e["id"] for e in got}) == 6
    # Each rank's own pushes arrive in step order.
    for rank in range(3):
        assert [e["step"] for e in got if e["rank"] == rank] == [0, 1]
    # The stream is in the catalog's order, and its SSE ids are the ids.
    assert [e["seq"] for e in got] == sorted(e["seq"] for e in got)
    assert all(e["sse_id"] == e["id"] for e in got)

    # Three more steps with no stream open, each stored on its own (the
    # writers batch for 200 ms): in the catalog's order the nodes'
    # events interleave, and their ids (reserved in blocks per node) do not
    # grow along it.
    for step in (2, 3, 4):
        for rank, p in placement.items():
            r = httpx.put(f"{p['url']}/v1/runs/{run_name}/ranks/{rank}/steps/{step}", content=body)
            assert r.status_code == 200, r.text
        time.sleep(0.5)
    listed = _events(a.url, run_name, "push")
    assert [e["seq"] for e in listed] == sorted(e["seq"] for e in listed)
    assert sorted((e["rank"], e["step"]) for e in listed) == [
        (r, s) for r in range(3) for s in range(5)
    ]
    ids = [e["id"] for e in listed]
    assert ids != sorted(ids), "the nodes' events did not interleave"

    # A reconnect to node c after the third event (what EventSource does
    # with Last-Event-ID) replays exactly the events after it, each once,
    # in the catalog's order; so does a listing after it on node a.
    resumed = read_sse(
        url, len(listed) - 3, timeout=30, headers={"Last-Event-ID": str(got[2]["id"])}
    )
    assert [e["id"] for e in resumed] == ids[ids.index(got[2]["id"]) + 1 :]
    after = _events(a.url, run_name, "push", since=got[2]["id"])
    assert [e["id"] for e in after] == [e["id"] for e in resumed]


def test_periodic_cuts_meet_in_one_row(cluster, run_name):
    """snapshot_every = 4 on a run spread over nodes a, b and c: each node
    opens the cut for its own ranks, under the same id; each periodic
    snapshot is one row, complete with every rank, and equals the EMA of
    the pushed values (``AveragedModel``)."""
    _, (a, b, c) = cluster
    beta, steps = 0.8, 10
    gen = torch.Generator().manual_seed(7)
    # The same (replicated) tensors on every rank: each pushes its part.
    values = [
        {"w": torch.randn(7, generator=gen), "v": torch.randn(3, 4, generator=gen)}
        for _ in range(steps)
    ]
    with polyak.Client(a.url) as client:
        run = client.create_run(
            run_name,
            world_size=3,
            snapshot_every=4,
            profiles=[{"name": "e", "kind": "constant", "beta": beta}],
        )
        assert {p["node"] for p in run.placement().values()} == {"node-a", "node-b", "node-c"}
        pushers = [run.pusher(rank=r) for r in range(3)]
        params = torch.nn.ParameterDict({k: torch.zeros_like(v) for k, v in values[0].items()})
        avg = AveragedModel(params, multi_avg_fn=get_ema_multi_avg_fn(beta))
        anchors = {}
        for step in range(steps):
            for pusher in pushers:
                pusher.push(values[step], step)
            with torch.no_grad():
                for k, v in values[step].items():
                    params[k].copy_(v)
            avg.update_parameters(params)
            if step % 4 == 0:
                anchors[step] = {
                    k.removeprefix("module."): v.detach().clone()
                    for k, v in avg.state_dict().items()
                    if k != "n_averaged"
                }
        for pusher in pushers:
            pusher.flush()
            pusher.close()

        def periodic():
            rows = run.snapshots(kind="periodic")
            done = [s for s in rows if s["status"] == "complete"]
            return rows if len(done) == len(anchors) else None

        rows = wait_for(periodic, 60, "the periodic snapshots", lambda: run.snapshots())
        assert [s["step"] for s in rows] == sorted(anchors)
        for row in rows:
            full = run.download(run.wait_snapshot(row["id"]), "e", progress=False)
            want = anchors[row["step"]]
            assert set(full) == set(want)
            for k, v in want.items():
                torch.testing.assert_close(full[k], v, rtol=1e-6, atol=1e-6)
        # Every node shows the same rows.
        for node in (b, c):
            with polyak.Client(node.url) as other:
                ids = [s["id"] for s in other.run(run_name).snapshots(kind="periodic")]
                assert ids == [s["id"] for s in rows]


def test_a_node_cut_off_from_the_catalog_stops_acknowledging(
    tmp_path, backends: Backends, run_name
):
    """Node b reaches the catalog through a proxy; cutting it leaves b
    serving but unable to renew its lease. b stops acknowledging pushes
    (``503 lease_lost``) before its lease runs out; a takes its rank over
    only after that, so no two nodes ever apply one rank's pushes. Once the
    link is back b renews, finds its rank taken and sends its pushes on to
    a. The catalog keeps one owner per rank and epoch throughout."""
    lease = 3.0
    catalog, (a, b) = backends.cluster(tmp_path / "nodes", 2, "--lease-secs", str(lease))
    host, _, rest = catalog.rpartition("@")[2].partition(":")
    port = rest.partition("/")[0]
    proxy = TcpProxy((host, int(port)))
    i = b.args.index("--catalog")
    b.args[i + 1] = catalog.replace(f"{host}:{port}/", f"127.0.0.1:{proxy.port}/")
    try:
        a.start()
        b.start()
        with polyak.Client(a.url) as client:
            client.create_run(
                run_name, world_size=2, profiles=[{"name": "e", "kind": "constant", "beta": 0.9}]
            )
            assert client.run(run_name).placement()[1]["node"] == "node-b"
        path = f"{b.url}/v1/runs/{run_name}/ranks/1/steps"
        body = safetensors.torch.save({"w1": torch.ones(8)})
        step = 0

        def push() -> httpx.Response:
            nonlocal step
            r = httpx.put(f"{path}/{step}", content=body, timeout=10)
            if r.status_code == 200:
                step += 1
            return r

        # b knows of a (its renewals list the nodes) and acknowledges.
        wait_for(lambda: push().status_code == 200, 10, "b to acknowledge")
        time.sleep(lease / 3 + 0.5)
        assert push().status_code == 200

        last_ack_ms = time.time() * 1000
        cut_at = time.monotonic()
        proxy.cut()
        first_cut_step = step
        acked, refused = [], []
        expired_at = None
        while time.monotonic() - cut_at < lease + 3:
            r = push()
            at = time.monotonic() - cut_at
            if r.status_code == 200:
                acked.append(at)
                last_ack_ms = time.time() * 1000
            else:
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "lease_lost", r.text
                assert r.headers["retry-after"] == "1"
                refused.append(at)
            if expired_at is None:
                nodes = httpx.get(f"{a.url}/v1/nodes", timeout=10).json()["nodes"]
                if next(n for n in nodes if n["node"] == "node-b")["status"] == "expired":
                    expired_at = time.monotonic() - cut_at
            time.sleep(0.05)
        assert refused, "b never stopped acknowledging"
        cut_steps = set(range(first_cut_step, step))
        assert len(cut_steps) == len(acked)
        assert expired_at is not None, "a never saw b's lease expire"
        # Every acknowledgement came before b stopped, and b stopped before
        # the others could see its lease expire.
        assert max(acked, default=0.0) < min(refused) < expired_at, (acked, refused, expired_at)
        assert min(refused) < lease
        metrics = httpx.get(f"{b.url}/metrics", timeout=10).text
        fenced = re.search(r"^polyak_pushes_fenced_total (\d+)", metrics, re.M)
        assert fenced and int(fenced.group(1)) == len(refused), metrics
        age = re.search(r"^polyak_lease_age_milliseconds (\d+)", metrics, re.M)
        assert age and int(age.group(1)) > lease * 1000

        # a took b's rank over once b's lease expired (epoch 2), after b's
        # last acknowledgement.
        node, at_ms = wait_for(
            lambda: _taken_over(backends, catalog, run_name), 15, "a to take b's rank over"
        )
        assert node == "node-a" and int(at_ms) > last_ack_ms, (at_ms, last_ack_ms)
        # The link is back: b renews, finds its rank taken and lets it go
        # before acknowledging anything; its pushes are sent on to a.
        proxy.mend()

        def sent_on():
            r = push()
            assert r.status_code in (503, 307), r.text
            return r if r.status_code == 307 else None

        moved = wait_for(sent_on, 15, "b to send its rank's pushes on to a")
        assert moved.json()["error"]["code"] == "rank_elsewhere"
        assert moved.headers["location"].startswith(a.url)
        r = httpx.put(moved.headers["location"], content=body, timeout=10)
        assert r.status_code == 200 and r.json()["applied"], r.text

        # What b did while it could not reach the catalog is stored once it
        # can: the push events of the steps it acknowledged during the cut
        # (its writer kept them and wrote them again), each once. The rank's
        # row stays a's, its holder's.
        def pushed() -> list[int]:
            return [e["step"] for e in _events(a.url, run_name, "push") if e["rank"] == 1]

        wait_for(lambda: cut_steps <= set(pushed()), 20, "b's events of the cut", pushed)
        steps = pushed()
        assert len(steps) == len(set(steps)) == step + 1, steps
        metrics = httpx.get(f"{b.url}/metrics", timeout=10).text
        failures = re.search(r"^polyak_catalog_write_failures_total (\d+)", metrics, re.M)
        assert failures and int(failures.group(1)) > 0, metrics
        held = re.search(r"^polyak_catalog_writer_held (\d+)", metrics, re.M)
        dropped = re.search(r"^polyak_catalog_events_dropped_total (\d+)", metrics, re.M)
        assert held and dropped and int(dropped.group(1)) == 0, metrics
        wait_for(
            lambda: (
                _catalog_rows(
                    backends,
                    catalog,
                    f"SELECT last_step FROM ranks WHERE run = '{run_name}' AND rank = 1",
                )
                == [[str(step)]]
            ),
            10,
            "rank 1's row at a's step",
        )

        _assert_rank_1_moved_once(backends, catalog, run_name)
    finally:
        b.stop()
        a.stop()
        proxy.close()


def test_pushes_resent_side_by_side_after_a_failover_apply_in_step_order(
    tmp_path, backends: Backends, run_name
):
    """Node b holds rank 1, which a cut at step 2 holds; b applies steps 3
    and 4 and is killed, and a takes the rank over (restored at step 2).
    The trainer resends steps 5 and 6 side by side, step 5's body arriving
    slowly: step 6 names step 5 as its predecessor, and waits for it (its
    push has begun on a) rather than taking it as lost with b. Both apply,
    in step order: the failover reports steps 3 and 4 lost and resumption
    at step 5, and the EMA equals an ``AveragedModel`` fed steps 0, 1, 2, 5
    and 6."""
    beta = 0.7
    catalog, (a, b) = backends.cluster(tmp_path / "nodes", 2, "--lease-secs", "3")
    try:
        a.start()
        b.start()
        with polyak.Client(a.url) as client:
            client.create_run(
                run_name, world_size=2, profiles=[{"name": "e", "kind": "constant", "beta": beta}]
            )
            run = client.run(run_name)
            assert run.placement()[1]["node"] == "node-b"
            weights = {s: torch.linspace(-1, 1, 4096) * (s + 1) + s for s in range(7)}

            def put(url: str, rank: int, step: int, body=None, **headers) -> httpx.Response:
                data = safetensors.torch.save({"w": weights[step]})
                return httpx.put(
                    f"{url}/v1/runs/{run_name}/ranks/{rank}/steps/{step}",
                    content=data if body is None else body(data),
                    headers={"Content-Length": str(len(data)), **headers},
                    timeout=30,
                )

            for step in range(3):
                for rank, url in ((0, a.url), (1, b.url)):
                    assert put(url, rank, step).status_code == 200
            assert run.snapshot()["step"] == 2
            for step in (3, 4):
                assert put(b.url, 1, step, **{"Polyak-Prev-Step": str(step - 1)}).status_code == 200
            # The catalog has seen b apply step 4 (a shows b's ranks from it).
            wait_for(
                lambda: httpx.get(f"{a.url}/v1/runs/{run_name}/ranks/1").json()["last_step"] == 4,
                10,
                "the catalog to see step 4",
            )
            b.kill()
            wait_for(
                lambda: run.placement()[1]["node"] == "node-a",
                20,
                "a to take rank 1 over",
            )

            def slow(data: bytes):
                yield data[:64]
                time.sleep(0.6)
                yield data[64:]

            answers: dict[int, httpx.Response] = {}
            five = threading.Thread(
                target=lambda: answers.__setitem__(
                    5, put(a.url, 1, 5, slow, **{"Polyak-Prev-Step": "4"})
                )
            )
            five.start()
            time.sleep(0.2)
            answers[6] = put(a.url, 1, 6, **{"Polyak-Prev-Step": "5"})
            five.join()
            for step in (5, 6):
                assert answers[step].status_code == 200, answers[step].text
                assert answers[step].json()["applied"], answers[step].text
            view = httpx.get(f"{a.url}/v1/runs/{run_name}/ranks/1").json()
            failover = view["failover"]
            assert (failover["restored_step"], failover["last_seen_step"]) == (2, 4), failover
            assert (failover["resumed_step"], failover["lost_steps"]) == (5, 2), failover
            assert view["last_step"] == 6, view

            model = torch.nn.Module()
            model.w = torch.nn.Parameter(torch.zeros(4096))
            anchor = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(beta))
            for step in (0, 1, 2, 5, 6):
                with torch.no_grad():
                    model.w.copy_(weights[step])
                anchor.update_parameters(model)
            got = run.rank_ema(1, "e").tensors["w"]
            torch.testing.assert_close(got, anchor.module.w.detach(), rtol=1e-5, atol=1e-5)
        _assert_rank_1_moved_once(backends, catalog, run_name)
    finally:
        b.stop()
        a.stop()


#: Pushes one rank to one URL every 50 ms until a deadline, numbering steps
#: on from each acknowledgement, and prints one JSON line per answer (wall
#: time in ms, status, error code). Runs inside a test host's namespace.
_PUSHER = """
import json, sys, time, httpx
url, body_file, until = sys.argv[1], sys.argv[2], float(sys.argv[3])
body = open(body_file, "rb").read()
step = 0
while time.time() < until:
    try:
        r = httpx.put(f"{url}/{step}", content=body, timeout=5)
        code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
        print(json.dumps({"at_ms": time.time() * 1000, "status": r.status_code, "code": code}))
        if r.status_code == 200:
            step += 1
    except httpx.HTTPError as e:
        print(json.dumps({"at_ms": time.time() * 1000, "status": 0, "code": type(e).__name__}))
    sys.stdout.flush()
    time.sleep(0.05)
"""


@pytest.mark.slow
def _in_a_test_host(lab: NetLab, node):
    """Runs ``node`` (not started yet) in a test host of its own, reaching
    PostgreSQL and S3 (on this machine's loopback) through the lab's
    proxies on the bridge."""
    host = lab.host()
    for flag in ("--catalog", "--s3-endpoint"):
        i = node.args.index(flag)
        node.args[i + 1] = lab.reach_url(node.args[i + 1])
    host.run_in(node)
    return host


def test_a_node_whose_link_is_cut_stops_before_its_rank_is_taken(
    tmp_path, backends: Backends, run_name, lab
):
    """Node b runs in a test host of its own (a network namespace on a
    bridge); its trainer pushes from inside that host. Its link is cut (the
    host's interface set down) without stopping it: b answers its trainer
    ``503 lease_lost`` before its lease could have expired, a takes the
    rank over only after b's last acknowledgement, and once the link is
    back b sends the rank's pushes on to a (``307``) and acknowledges none.
    One owner per (rank, epoch) in the catalog."""
    if lab is None:
        pytest.skip(f"no test hosts: {NetLab.unavailable()}")
    lease = 3.0
    catalog, (a, b) = backends.cluster(tmp_path / "nodes", 2, "--lease-secs", str(lease))
    try:
        host = _in_a_test_host(lab, b)
        a.start()
        b.start()
        assert b.url.startswith(f"http://{host.ip}:")
        with polyak.Client(a.url) as client:
            client.create_run(
                run_name, world_size=2, profiles=[{"name": "e", "kind": "constant", "beta": 0.9}]
            )
            assert client.run(run_name).placement()[1]["node"] == "node-b"
        body = tmp_path / "body"
        body.write_bytes(safetensors.torch.save({"w1": torch.ones(8)}))
        until = time.time() + 5 * lease + 10
        pusher = subprocess.Popen(
            [
                "ip", "netns", "exec", host.ns, sys.executable, "-c", _PUSHER,
                f"{b.url}/v1/runs/{run_name}/ranks/1/steps", str(body), str(until),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        answers: list[dict] = []
        threading.Thread(
            target=lambda: answers.extend(json.loads(line) for line in pusher.stdout),
            daemon=True,
        ).start()
        # b acknowledges, and has renewed with a live (fencing applies).
        wait_for(lambda: sum(x["status"] == 200 for x in answers) >= 5, 20, "b to acknowledge")
        time.sleep(lease / 3 + 0.5)
        cut_ms = time.time() * 1000
        host.cut()

        node, at_ms = wait_for(
            lambda: _taken_over(backends, catalog, run_name), 20, "a to take b's rank over"
        )
        taken_ms = int(at_ms)
        assert node == "node-a"
        time.sleep(1.0)
        host.mend()
        wait_for(lambda: any(x["status"] == 307 for x in answers), 20, "b to send the rank on to a")
        pusher.wait(timeout=until - time.time() + 10)

        acked = [x["at_ms"] for x in answers if x["status"] == 200]
        fenced = [x["at_ms"] for x in answers if x["code"] == "lease_lost"]
        assert fenced, answers[-5:]
        # b stopped before its lease could have expired (a whole lease after
        # its last renewal, which came before the cut), and acknowledged
        # nothing from then on: the last acknowledgement precedes the
        # takeover, and after it b only ever refuses or redirects.
        assert min(fenced) - cut_ms < lease * 1000, (min(fenced) - cut_ms, lease)
        assert max(acked) < min(fenced) < taken_ms, (max(acked), min(fenced), taken_ms)
        after = [x for x in answers if x["at_ms"] > taken_ms]
        assert after and all(x["status"] in (0, 503, 307) for x in after), after[-5:]
        moved = [x for x in answers if x["status"] == 307]
        assert all(x["code"] == "rank_elsewhere" for x in moved)

        _assert_rank_1_moved_once(backends, catalog, run_name)
    finally:
        b.stop()
        a.stop()


def test_a_peer_cut_off_mid_connection_holds_no_request(
    tmp_path, backends: Backends, run_name, lab
):
    """Node b runs in a test host; a has told it of a run, so a keeps an
    idle keep-alive connection to b. b's link is then cut: packets to it
    vanish, no reset comes. Creating a run on a tells the peers again, over
    that connection while b's lease is still live: a's answer must not wait
    on a peer that cannot answer (before, it waited for the peer client's
    300 s limit), and a still takes b's rank over and shows it as its own."""
    if lab is None:
        pytest.skip(f"no test hosts: {NetLab.unavailable()}")
    lease = 6.0
    _, (a, b) = backends.cluster(tmp_path / "nodes", 2, "--lease-secs", str(lease))
    host = _in_a_test_host(lab, b)
    try:
        a.start()
        b.start()
        profiles = [{"name": "e", "kind": "constant", "beta": 0.9}]
        with polyak.Client(a.url, timeout=60) as client:
            client.create_run(run_name, world_size=2, profiles=profiles)
            assert client.run(run_name).placement()[1]["node"] == "node-b"
            host.cut()
            started = time.monotonic()
            client.create_run(f"{run_name}-2", world_size=1, profiles=profiles)
            waited = time.monotonic() - started
            # Told within the control calls' limit, not the 300 s of a read.
            assert waited < 30, waited
            wait_for(
                lambda: client.run(run_name).placement()[1]["node"] == "node-a",
                60,
                "a to take b's rank over",
            )
    finally:
        host.mend()
        b.stop()
        a.stop()


def test_a_stale_rank_is_alerted_once_by_its_owner(cluster, run_name):
    """Every node judges the staleness of the ranks it holds only: ranks
    that stop pushing fire one ``stale_rank`` alert each over the service
    (from the owner, not once per node), and their next push resolves it.
    Any node lists every node's alerts and takes an acknowledgement of
    any of them."""
    _, (a, _b, c) = cluster
    with polyak.Client(a.url) as client:
        # The disk rule off: a nearly full disk's own alert is not counted.
        client.create_run(
            run_name, world_size=3, alerts={"stale_after_seconds": 1, "disk_free_below": 0}
        )
    placement = httpx.get(f"{a.url}/v1/runs/{run_name}/placement").json()
    assert {p["node"] for p in placement.values()} == {"node-a", "node-b", "node-c"}
    body = safetensors.torch.save({"w": torch.ones(4)})

    def push(step: int) -> None:
        for rank, p in placement.items():
            r = httpx.put(f"{p['url']}/v1/runs/{run_name}/ranks/{rank}/steps/{step}", content=body)
            assert r.status_code == 200, r.text

    def transitions() -> list[tuple[str, str]]:
        events = _events(a.url, run_name, "alert")
        return [(e["detail"]["key"], e["detail"]["state"]) for e in events]

    keys = [f"stale_rank:{r}" for r in range(3)]
    push(0)
    wait_for(
        lambda: all((k, "firing") in transitions() for k in keys),
        20,
        "every rank's stale alert",
        transitions,
    )
    time.sleep(2.5)  # every node's alert tick has seen the ranks by now
    fired = transitions()
    assert sorted(fired) == sorted((k, "firing") for k in keys), fired
    # Every node lists every node's alerts, each once, marked with the
    # node that judged it (the rank's owner); ids are unique over the
    # service.
    want = sorted((f"stale_rank:{rank}", p["node"], "firing") for rank, p in placement.items())
    for p in placement.values():
        listed = httpx.get(f"{p['url']}/v1/runs/{run_name}/alerts").json()
        got = sorted((x["key"], x["node"], x["state"]) for x in listed["alerts"])
        assert got == want, (p["node"], listed)
        assert (listed["firing"], listed["nodes"], listed["unreachable"]) == (3, 3, []), listed
        assert len({x["id"] for x in listed["alerts"]}) == 3, listed
    push(1)
    wait_for(
        lambda: all((k, "resolved") in transitions() for k in keys),
        20,
        "every rank's stale alert resolved",
        transitions,
    )
    # One judge per rank: each key alternates firing and resolved (the
    # ranks go stale again a second after their last push).
    got = transitions()
    for k in keys:
        states = [state for key, state in got if key == k]
        assert states[:2] == ["firing", "resolved"], (k, got)
        assert all(x != y for x, y in itertools.pairwise(states)), (k, got)
    # An alert judged on node-b is acknowledged through node-a (which
    # passes it on), and node-c lists it acknowledged; an id no node has
    # is 404 from any node.
    rank_b = next(rank for rank, p in placement.items() if p["node"] == "node-b")
    listed = httpx.get(f"{a.url}/v1/runs/{run_name}/alerts").json()["alerts"]
    alert = next(x for x in listed if x["key"] == f"stale_rank:{rank_b}" and x["node"] == "node-b")
    r = httpx.post(f"{a.url}/v1/runs/{run_name}/alerts/{alert['id']}/ack")
    assert r.status_code == 200, r.text
    assert (r.json()["id"], r.json()["node"], r.json()["acknowledged"]) == (
        alert["id"],
        "node-b",
        True,
    )
    listed = httpx.get(f"{c.url}/v1/runs/{run_name}/alerts").json()["alerts"]
    acked = {(x["node"], x["key"]) for x in listed if x["acknowledged"]}
    assert acked == {("node-b", f"stale_rank:{rank_b}")}, listed
    assert [x["acknowledged"] for x in listed if x["id"] == alert["id"]] == [True], listed
    missing = max(x["id"] for x in listed) + 10**9
    r = httpx.post(f"{c.url}/v1/runs/{run_name}/alerts/{missing}/ack")
    assert r.status_code == 404 and r.json()["error"]["code"] == "alert_not_found", r.text
