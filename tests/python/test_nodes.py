"""Nodes of one service: servers sharing a PostgreSQL catalog (and an S3
store) register themselves, renew their leases by the catalog's clock, and
each lists all of them. A graceful stop gives the lease up (`left`); a
killed node's lease runs out (`expired`); a restarted node rejoins under
the id it kept in its data dir."""

from __future__ import annotations

import time

import httpx
from polyak_testing import Backends, PolyakServer

LEASE = "1"


def nodes_of(srv: PolyakServer) -> dict[str, dict]:
    r = httpx.get(f"{srv.url}/v1/nodes", timeout=10)
    assert r.status_code == 200, r.text
    return {n["node"]: n for n in r.json()["nodes"]}


def wait_status(srv: PolyakServer, node: str, status: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = nodes_of(srv).get(node)
        if n and n["status"] == status:
            return n
        time.sleep(0.1)
    raise AssertionError(f"node {node} not {status}: {nodes_of(srv).get(node)}")


def test_nodes_share_a_catalog_and_keep_leases(tmp_path, backends: Backends):
    catalog = backends.postgres().new_database()
    s3 = backends.s3()
    store = s3.new_prefix()
    common = ["--catalog", catalog, "--store", store, "--s3-endpoint", s3.endpoint]
    common += ["--lease-secs", LEASE]
    servers = {
        name: PolyakServer(tmp_path / name, *common, "--node-id", f"node-{name}", env=s3.env())
        for name in ("a", "b")
    }
    c = PolyakServer(tmp_path / "c", *common, env=s3.env())
    try:
        for srv in servers.values():
            srv.start()
        c.start()
        c_id = (tmp_path / "c" / "node-id").read_text().strip()
        a, b = servers["a"], servers["b"]
        for srv in (a, b, c):
            seen = nodes_of(srv)
            assert set(seen) == {"node-a", "node-b", c_id}
            assert all(n["status"] == "live" for n in seen.values()), seen
            assert [n["node"] for n in seen.values() if n["this"]] == [
                {a: "node-a", b: "node-b", c: c_id}[srv]
            ]
        assert nodes_of(b)["node-a"]["url"] == a.url
        assert nodes_of(a)["node-b"]["engines"], "a node lists its engines"
        assert nodes_of(a)["node-b"]["memory_budget"] > 0

        # Leases are renewed: after three lease spans everyone is still live.
        time.sleep(3 * float(LEASE))
        assert all(n["status"] == "live" for n in nodes_of(a).values())

        # A run created on b is placed over the three nodes, b first (the
        # creating node wins ties); each shows its rank in its renewals.
        with httpx.Client(base_url=b.url) as hb:
            assert hb.post("/v1/runs", json={"name": "on-b", "world_size": 4}).status_code == 201
            place = hb.get("/v1/runs/on-b/placement").json()
        urls = {"node-a": a.url, "node-b": b.url, c_id: c.url}
        assert place["0"]["node"] == "node-b" and place["3"]["node"] == "node-b"
        assert {p["node"] for p in place.values()} == set(urls)
        assert all(p["url"] == urls[p["node"]] for p in place.values())
        deadline = time.monotonic() + 10
        while [nodes_of(a)[n]["ranks"] for n in ("node-a", "node-b", c_id)] != [1, 2, 1]:
            assert time.monotonic() < deadline, nodes_of(a)
            time.sleep(0.1)

        # A graceful stop gives the lease up at once.
        b.stop()
        assert nodes_of(a)["node-b"]["status"] == "left"

        # A killed node keeps its row, and its lease runs out.
        c.kill()
        gone = wait_status(a, c_id, "expired")
        assert gone["lease_age_seconds"] > gone["lease_seconds"]

        # Restarted with its data dir, it rejoins under the same id.
        c.start()
        back = wait_status(a, c_id, "live")
        assert back["url"] == c.url
        assert nodes_of(c)[c_id]["this"]
    finally:
        for srv in (*servers.values(), c):
            srv.stop()
