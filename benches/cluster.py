"""Cluster benchmark: push latency on a service of three nodes against one
node, in the same process, and the catalog queries a push makes.

Both services run on a throwaway PostgreSQL and SeaweedFS (started here,
as the tests do). Each gets one run of ``--ranks`` ranks (placed over all
three nodes on the three-node service); one thread per rank pushes fp32
bodies to the node holding its rank (the run's placement, as the client
does) and times each push from request to answer. The figures:

- push latency p50, three nodes over one (target <= 1.1): routing costs
  nothing on the push path, a push goes straight to its owner;
- catalog queries made while answering pushes, per push (target 0): read
  from each node's ``polyak_catalog_queries_total{path="push"}``; the rank
  rows and events a push changes reach the catalog through the batched
  writer, whose flushes per push are shown beside it;
- failover time (target: within the lease plus 5 s): node b of the
  three-node service is killed once it persisted its rank's state; the
  seconds until a survivor acknowledges that rank's next push (placement
  read through node a, retried every 50 ms), and the steps lost.

Reported, never asserted. All nodes share this machine's cores, so the
three-node figure also pays for two more idle servers.

``python benches/cluster.py --bin target/release/polyak`` (``--quick``:
few small pushes and a 3 s lease, checks the script).
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "clients" / "python"))
sys.path.insert(0, str(ROOT / "clients" / "python-testing"))

from polyak.wire import HostBody, TensorSpec, WireLayout  # noqa: E402
from polyak_testing import Backends, PolyakServer  # noqa: E402


def body_of(t: torch.Tensor) -> bytes:
    body = HostBody(WireLayout([TensorSpec("w", t.dtype, tuple(t.shape))]))
    body.fill([t])
    return bytes(body.memory)


def counter(url: str, name: str, labels: str = "") -> float:
    """The sum of a Prometheus counter's samples matching ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def latencies(nodes: list[PolyakServer], name: str, ranks: int, bodies, pushes: int) -> dict:
    """Pushes ``pushes`` steps of every rank (one thread per rank, each to
    its owner); per-push seconds, and the catalog counters' increase."""
    entry = nodes[0].url
    with httpx.Client(base_url=entry, timeout=600) as c:
        r = c.post(
            "/v1/runs",
            json={
                "name": name,
                "world_size": ranks,
                "profiles": [{"name": "e", "kind": "constant", "beta": 0.99}],
                "drift_every": 0,
            },
        )
        r.raise_for_status()
        placement = c.get(f"/v1/runs/{name}/placement").json()
    owners = {int(rank): p["url"] for rank, p in placement.items()}

    def totals() -> tuple[float, float]:
        queries = sum(counter(n.url, "polyak_catalog_queries_total", 'path="push"') for n in nodes)
        flushes = sum(counter(n.url, "polyak_catalog_writer_flushes_total") for n in nodes)
        return queries, flushes

    before = totals()
    times: list[float] = []
    lock = threading.Lock()
    errors: list[str] = []

    def rank_loop(rank: int) -> None:
        parts = urlsplit(owners[rank])
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
        mine = []
        try:
            for step in range(pushes + 1):
                body = bodies[step % len(bodies)]
                started = time.perf_counter()
                conn.request(
                    "PUT",
                    f"/v1/runs/{name}/ranks/{rank}/steps/{step}",
                    body=body,
                    headers={"Content-Type": "application/octet-stream"},
                )
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    errors.append(f"rank {rank} step {step}: {resp.status}")
                    return
                if step > 0:  # step 0 registers the layout
                    mine.append(time.perf_counter() - started)
        finally:
            conn.close()
        with lock:
            times.extend(mine)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    time.sleep(1.5)  # the batched writer flushes what the pushes changed
    after = totals()
    n = ranks * (pushes + 1)
    return {
        "p50": statistics.median(times),
        "p90": statistics.quantiles(times, n=10)[-1],
        "queries_per_push": (after[0] - before[0]) / n,
        "flushes_per_push": (after[1] - before[1]) / n,
        "nodes": sorted({p["node"] for p in placement.values()}),
    }


def failover(nodes: list[PolyakServer], name: str, bodies, lease: float) -> dict:
    """Kills node b (SIGKILL) under a run with a rank on every node, once
    b persisted its rank's state, and pushes b's rank's next step the way
    a client does (the placement read through node a, the push sent to
    the owner, retried every 50 ms) until a survivor acknowledges it: the
    seconds from the kill to that acknowledgement, and the steps lost."""
    a, b = nodes[0], nodes[1]
    with httpx.Client(base_url=a.url, timeout=60) as c:
        c.post(
            "/v1/runs",
            json={
                "name": name,
                "world_size": len(nodes),
                "persist_every_secs": 1,
                "profiles": [{"name": "e", "kind": "constant", "beta": 0.99}],
            },
        ).raise_for_status()
        placement = c.get(f"/v1/runs/{name}/placement").json()
        rank = next(
            int(r)
            for r, p in placement.items()
            if p["node"] == b.args[b.args.index("--node-id") + 1]
        )

        def put(url: str, r: int, step: int) -> httpx.Response:
            return httpx.put(
                f"{url}/v1/runs/{name}/ranks/{r}/steps/{step}",
                content=bodies[step % len(bodies)],
                timeout=10,
            )

        for step in range(3):
            for r, p in placement.items():
                put(p["url"], int(r), step).raise_for_status()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            snaps = c.get(f"/v1/runs/{name}/snapshots", params={"kind": "state"}).json()
            if any(
                s["status"] == "complete" and s["detail"]["rank_steps"].get(str(rank)) == 2
                for s in snaps["snapshots"]
            ):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("b never persisted its rank's state")
        b.kill()
        killed = time.monotonic()
        while True:
            try:
                owner = c.get(f"/v1/runs/{name}/placement").json()[str(rank)]
                if put(owner["url"], rank, 3).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - killed > lease + 60:
                raise RuntimeError("no survivor took b's rank")
            time.sleep(0.05)
        took = time.monotonic() - killed
        lost = None
        while lost is None and time.monotonic() - killed < lease + 90:
            lost = (c.get(f"/v1/runs/{name}/ranks/{rank}").json().get("failover") or {}).get(
                "lost_steps"
            )
            time.sleep(0.1)
    return {"seconds": took, "owner": owner["node"], "lost": lost}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "polyak"))
    ap.add_argument("--ranks", type=int, default=6)
    ap.add_argument("--numel", type=float, default=2.5e5, help="fp32 values per rank")
    ap.add_argument("--pushes", type=int, default=60, help="pushes per rank and round")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds; medians taken")
    ap.add_argument(
        "--lease", type=float, default=10.0, help="the three-node service's --lease-secs"
    )
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.numel, args.pushes, args.repeats, args.lease = 1e4, 5, 1, 3.0
    g = torch.Generator().manual_seed(0)
    bodies = [body_of(torch.randn(int(args.numel), generator=g)) for _ in range(2)]
    tmp = Path(tempfile.mkdtemp(prefix="polyak-cluster-"))
    backends = Backends()
    services: dict[int, list[PolyakServer]] = {}
    results: dict[int, list[dict]] = {1: [], 3: []}
    try:
        for count in (1, 3):
            _, services[count] = backends.cluster(
                tmp / f"service-{count}",
                count,
                "--engines",
                "1",
                "--lease-secs",
                str(args.lease),
                binary=args.bin,
            )
            for node in services[count]:
                node.start()
        for rep in range(args.repeats):
            for count, nodes in services.items():
                out = latencies(nodes, f"b{rep}", args.ranks, bodies, args.pushes)
                results[count].append(out)
        # Last: it kills a node of the three-node service.
        failed = failover(services[3], "fo", bodies, args.lease)
    finally:
        for nodes in services.values():
            for node in nodes:
                node.stop()
        backends.close()

    def med(count: int, key: str) -> float:
        return statistics.median(r[key] for r in results[count])

    mib = len(bodies[0]) / 2**20
    print(
        f"{args.ranks} ranks pushing at once, fp32 bodies of {mib:.2f} MiB, {args.pushes} pushes "
        f"per rank, {os.cpu_count()} CPUs, medians of {args.repeats} alternating rounds; "
        f"the three-node run is placed on {', '.join(results[3][0]['nodes'])}"
    )
    rows = [
        (
            "push latency p50, 3 nodes / 1 node",
            f"{med(3, 'p50') / med(1, 'p50'):.2f}",
            "<= 1.1",
            "PASS" if med(3, "p50") / med(1, "p50") <= 1.1 else "MISS",
        ),
        (
            "catalog queries while answering a push, per push (3 nodes; 1 node)",
            f"{med(3, 'queries_per_push'):.3f}; {med(1, 'queries_per_push'):.3f}",
            "0",
            "PASS" if max(med(3, "queries_per_push"), med(1, "queries_per_push")) == 0 else "MISS",
        ),
        (
            "batched catalog writer flushes per push (3 nodes; 1 node)",
            f"{med(3, 'flushes_per_push'):.3f}; {med(1, 'flushes_per_push'):.3f}",
            "reported",
            "-",
        ),
    ]
    for count in (1, 3):
        rows.append(
            (
                f"{count} node(s): push latency p50; p90 (ms)",
                f"{1e3 * med(count, 'p50'):.2f}; {1e3 * med(count, 'p90'):.2f}",
                "reported",
                "-",
            )
        )
    rows.append(
        (
            f"failover: SIGKILL to a survivor's first ack (lease {args.lease:g} s)",
            f"{failed['seconds']:.2f} s",
            f"<= {args.lease + 5:g} s",
            "PASS" if failed["seconds"] <= args.lease + 5 else "MISS",
        )
    )
    rows.append(
        (
            "failover: steps lost (after b's last state snapshot)",
            f"{failed['lost']}",
            "reported",
            "-",
        )
    )
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'measured':>14}  target    result")
    for figure, value, target, result in rows:
        print(f"{figure:<{width}}  {value:>14}  {target:<8}  {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
