"""docker/compose.yaml's three-node service (profiles postgres, s3 and
cluster), run here without Docker: each polyak service of the file is
started as the real binary with the environment the file gives it (its
`${VAR:-default}` values resolved as compose does), pointed at this test's
PostgreSQL and S3 in place of the compose network's. The three register as
one service under the ids and URLs the file names, a run is placed over all
of them, and a push sent to the wrong node reaches the owner by its 307."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import safetensors.torch
import torch
import yaml
from polyak_testing import Backends, PolyakServer, free_port

COMPOSE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"
TOKEN = "compose-token-0123456789"


def resolve(value: str, env: dict[str, str]) -> str:
    """Compose's interpolation: ``${V}``, ``${V:-default}``, ``${V:?error}``."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        got = env.get(name, "")
        if op == ":?" and not got:
            raise AssertionError(f"{name} must be set: {arg}")
        return got or (arg if op == ":-" else "")

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", one, str(value))


def test_compose_runs_three_nodes_of_one_service(tmp_path, backends: Backends):
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    profiles = {"postgres", "s3", "cluster"}
    up = [n for n, s in services.items() if set(s.get("profiles", [])) <= profiles]
    nodes = [n for n in up if services[n].get("image") == "polyak:latest"]
    assert nodes == ["polyak", "polyak-b", "polyak-c"]
    assert {"postgres", "s3", "s3-bucket"} <= set(up)
    # One data volume each, one published port each.
    volumes = [services[n]["volumes"][0].split(":")[0] for n in nodes]
    ports = [services[n]["ports"][0].rsplit(":", 2)[1] for n in nodes]
    assert len(set(volumes)) == 3 and ports == ["8080", "8081", "8082"]

    s3 = backends.s3()
    bound = {n: free_port() for n in nodes}
    env = {
        "POLYAK_TOKEN": TOKEN,
        "POLYAK_DEVICE": "cpu",
        "POLYAK_CATALOG": backends.postgres().new_database(),
        "POLYAK_STORE": s3.new_prefix(),
        "POLYAK_S3_ENDPOINT": s3.endpoint,
        # The URLs the nodes advertise: here, where this test bound them.
        "POLYAK_URL_A": f"http://127.0.0.1:{bound['polyak']}",
        "POLYAK_URL_B": f"http://127.0.0.1:{bound['polyak-b']}",
        "POLYAK_URL_C": f"http://127.0.0.1:{bound['polyak-c']}",
    }
    servers = []
    for n in nodes:
        given = {k: resolve(v, env) for k, v in services[n]["environment"].items()}
        given.update(s3.env())  # this test's S3 credentials
        srv = PolyakServer(tmp_path / n, env={k: v for k, v in given.items() if v})
        srv._port = bound[n]
        servers.append(srv)
    try:
        for srv in servers:
            srv.start(same_port=True)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        a = servers[0]
        listed = httpx.get(f"{a.url}/v1/nodes", headers=auth, timeout=10).json()["nodes"]
        by_url = {n["url"]: n for n in listed}
        assert set(by_url) == {s.url for s in servers}
        assert all(n["status"] == "live" for n in listed)
        assert by_url[servers[1].url]["node"] == "node-b"
        assert by_url[servers[2].url]["node"] == "node-c"
        assert by_url[a.url]["node"].startswith("node-")  # generated, kept in its volume

        spec = {
            "name": "composed",
            "world_size": 3,
            "profiles": [{"name": "e", "kind": "constant", "beta": 0.5}],
        }
        r = httpx.post(f"{a.url}/v1/runs", json=spec, headers=auth, timeout=10)
        assert r.status_code == 201, r.text
        placement = httpx.get(
            f"{a.url}/v1/runs/composed/placement", headers=auth, timeout=10
        ).json()
        owners = {p["url"] for p in placement.values()}
        assert owners == {s.url for s in servers}
        rank = next(int(r) for r, p in placement.items() if p["url"] != a.url)
        body = safetensors.torch.save({"w": torch.ones(4)})
        path = f"/v1/runs/composed/ranks/{rank}/steps/0"
        moved = httpx.put(a.url + path, content=body, headers=auth, timeout=10)
        assert moved.status_code == 307, moved.text
        # Resent to the owner (with the token, which a redirect to another
        # origin does not carry by itself).
        assert moved.headers["location"] == placement[str(rank)]["url"] + path
        pushed = httpx.put(moved.headers["location"], content=body, headers=auth, timeout=10)
        assert pushed.status_code == 200, pushed.text
        assert pushed.json()["applied"] is True
    finally:
        for srv in servers:
            srv.stop()
