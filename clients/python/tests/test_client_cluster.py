"""One service over three nodes: servers sharing one PostgreSQL catalog and
one S3 store, a run's ranks placed over all of them.

FSDP2 on four ranks (gloo) trains for real and pushes through the client,
which sends each rank straight to the node holding it (the run's
placement). Every rank's EMA, read through a node that does not hold it
(forwarded to the owner), equals the in-test anchors: ``AveragedModel``
for a ``constant`` profile, ``ema_pytorch.EMA`` for a ``warmup`` one. A
push sent to the wrong node is answered ``307`` to the owner; every node
shows every run and rank; the catalog records one owner per rank and epoch.
"""

from __future__ import annotations

import time

import httpx
import polyak
import pytest
import safetensors.torch
import torch
from polyak.testing import Backends
from polyak.wire import ALIASES_KEY, SHARDS_KEY, read_safetensors
from test_client_distributed import _check, _train


@pytest.fixture()
def cluster(tmp_path, backends: Backends, polyak_binary: str):
    catalog, nodes = backends.cluster(tmp_path / "nodes", 3, binary=polyak_binary)
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


def _wait(check, timeout: float, what, seen=lambda: None):
    """Polls ``check`` until it answers something true; ``seen`` says what
    was there instead when it never does."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {seen()}"
        time.sleep(0.1)


@pytest.mark.slow
def test_fsdp2_over_three_nodes(cluster, backends: Backends, tmp_path, run_name):
    catalog, (a, b, c) = cluster
    ids = {a.url: "node-a", b.url: "node-b", c.url: "node-c"}
    with polyak.Client(a.url) as client:
        # The trainers are given node b's URL; the runs are created on a.
        out = _train("fsdp2", client, b, tmp_path, run_name, world=4)
        _check(out, expect_chunks=True)
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

                ranks = _wait(
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
        _wait(lambda: run_c.rank(rank)["last_step"] == steps, 30, "the redirected push to show")

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

        _wait(held, 20, "the nodes to report the ranks they hold")
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
