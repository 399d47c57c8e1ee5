"""One run's ranks spread over several CPU engines (``--engines 2``).

Eight ranks push FSDP2-style chunks of a real model's training steps; the
server holds four on each engine thread. Everything a run does across its
ranks must come out as with one engine, and is checked against
``AveragedModel`` references computed in the test: each rank's live EMA,
a requested cut and the periodic cuts (each engine joins the cut the other
opened), a restart restoring every rank onto its engine, and finishing
the run (no push past the final step on either engine).
"""

from __future__ import annotations

import json

import httpx
import safetensors.torch
import torch
from polyak import Client
from polyak_testing import PolyakServer
from polyak_testing.refs import EmaTrainer, rel_err
from shardsim import check_rank_emas, push_ranks, rank_chunks

WORLD = 8
BETAS = {"ema": 0.8, "slow": 0.95}


def wait_done(url: str, run: str, sid: str) -> dict:
    """The snapshot once complete (the client raises on failure or timeout)."""
    with Client(url) as pc:
        return pc.run(run).wait_snapshot(sid, timeout=30, poll=0.05)


def check_full(got: dict, want: dict, online: dict) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        if w.is_floating_point():
            assert rel_err(got[k], w) <= 1e-6, (k, rel_err(got[k], w))
        else:
            assert torch.equal(got[k], online[k]), k


def check_live(client: httpx.Client, run: str, want: dict, online: dict) -> None:
    """Every rank's live EMA, from its engine, equals its chunk of the reference."""
    check_rank_emas(client, run, WORLD, want, online)


def test_eight_ranks_over_two_cpu_engines(tmp_path):
    srv = PolyakServer(tmp_path / "data", "--engines", "2")
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            run = "spread"
            r = c.post(
                "/v1/runs",
                json={
                    "name": run,
                    "world_size": WORLD,
                    "snapshot_every": 5,
                    "persist_every_secs": 0,
                    "profiles": [
                        {"name": n, "kind": "constant", "beta": b} for n, b in BETAS.items()
                    ],
                },
            )
            assert r.status_code == 201, r.text

            # Placement: four ranks on each engine, all on this node.
            place = c.get(f"/v1/runs/{run}/placement").json()
            node = (tmp_path / "data" / "node-id").read_text().strip()
            assert sorted(place, key=int) == [str(r) for r in range(WORLD)]
            assert {p["node"] for p in place.values()} == {node}
            assert {p["url"] for p in place.values()} == {srv.url}
            assert {p["device"] for p in place.values()} == {"cpu"}
            assert {p["epoch"] for p in place.values()} == {1}
            engines = [place[str(r)]["engine"] for r in range(WORLD)]
            assert sorted(engines) == ["cpu#0"] * 4 + ["cpu#1"] * 4, engines
            ranks = c.get(f"/v1/runs/{run}/ranks").json()
            assert [v["engine"] for v in ranks] == engines
            with Client(srv.url) as pc:
                assert pc.run(run).placement() == {int(r): p for r, p in place.items()}
            metrics = c.get("/metrics").text
            for engine in ("cpu#0", "cpu#1"):
                assert f'polyak_engine_queue_depth{{device="{engine}"}}' in metrics
                # The same count per kind of command, every kind listed
                # (nothing waits now).
                for kind in ("push", "export", "schedule_cut", "restore", "ping"):
                    line = f'polyak_engine_queue_depth_by_kind{{device="{engine}",kind="{kind}"}} 0'
                    assert line in metrics, line

            tr = EmaTrainer(11, BETAS, vocab=64, dim=32, hidden=48)
            cut = c.post(f"/v1/runs/{run}/snapshots", json={"step": 7})
            assert cut.status_code == 202, cut.text
            seen = {}
            for step in range(1, 13):
                online = tr.step()
                push_ranks(c, run, step, online, WORLD)
                seen[step] = (tr.want(), online)

            # The requested cut: every rank's parts, both engines, step 7.
            s = wait_done(srv.url, run, cut.json()["id"])
            assert s["status"] == "complete", s
            assert {f["rank"] for f in s["files"]} == set(range(WORLD))
            for profile in BETAS:
                full = c.get(
                    f"/v1/runs/{run}/snapshots/{s['id']}/download", params={"profile": profile}
                )
                assert full.status_code == 200, full.text
                check_full(safetensors.torch.load(full.content), seen[7][0][profile], seen[7][1])

            # Periodic cuts at 5 and 10: one snapshot each, opened by one
            # engine and joined by the other, complete with all eight ranks.
            listed = c.get(f"/v1/runs/{run}/snapshots").json()["snapshots"]
            periodic = sorted(
                (x for x in listed if x["kind"] == "periodic"), key=lambda x: x["step"]
            )
            assert [x["step"] for x in periodic] == [5, 10], periodic
            for x in periodic:
                x = wait_done(srv.url, run, x["id"])
                assert x["status"] == "complete", x
                assert {f["rank"] for f in x["files"]} == set(range(WORLD))
            ten = c.get(
                f"/v1/runs/{run}/snapshots/{periodic[1]['id']}/download", params={"profile": "slow"}
            )
            check_full(safetensors.torch.load(ten.content), seen[10][0]["slow"], seen[10][1])
            check_live(c, run, *seen[12])

            # A cut one engine cannot take (its rank 1 is already past the
            # step) is refused as a whole: the other engine's part is withdrawn.
            online = tr.step()
            tensors, shards = rank_chunks(online, WORLD, 1)
            body = safetensors.torch.save(tensors, metadata={"polyak.shards": json.dumps(shards)})
            assert c.put(f"/v1/runs/{run}/ranks/1/steps/13", content=body).status_code == 200
            refused = c.post(f"/v1/runs/{run}/snapshots", json={"step": 12})
            assert refused.status_code == 409, refused.text
            listed = c.get(f"/v1/runs/{run}/snapshots").json()["snapshots"]
            assert not [x for x in listed if x["status"] == "pending"], listed
            push_ranks(c, run, 13, online, WORLD, ranks=[r for r in range(WORLD) if r != 1])
            seen[13] = (tr.want(), online)

        # Restart: each rank is restored onto its engine, and pushing goes on.
        srv.restart()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            place = c.get(f"/v1/runs/{run}/placement").json()
            assert sorted(p["engine"] for p in place.values()) == ["cpu#0"] * 4 + ["cpu#1"] * 4
            check_live(c, run, *seen[13])
            for step in (14, 15):
                online = tr.step()
                push_ranks(c, run, step, online, WORLD)
            # Finishing stops both engines at the furthest step; the final
            # snapshot holds every rank.
            fin = c.post(f"/v1/runs/{run}/finish", json={})
            assert fin.status_code == 200, fin.text
            assert fin.json()["run"]["finished"]["step"] == 15
            final = wait_done(srv.url, run, fin.json()["snapshot"]["id"])
            assert final["status"] == "complete" and final["step"] == 15
            for rank in (0, 1):  # one rank of each engine
                late = c.put(f"/v1/runs/{run}/ranks/{rank}/steps/16", content=body)
                assert late.status_code == 409 and late.json()["error"]["code"] == "run_finished"
            full = c.get(
                f"/v1/runs/{run}/snapshots/{final['id']}/download", params={"profile": "ema"}
            )
            check_full(safetensors.torch.load(full.content), tr.want()["ema"], online)
    finally:
        srv.stop()
