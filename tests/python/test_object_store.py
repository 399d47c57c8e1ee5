"""Snapshots in an S3-compatible object store (SeaweedFS's real S3 endpoint)
with the catalog on PostgreSQL: an outage of the store fails the snapshot
with its reason while pushes go on, and a server started with an empty data
dir on the same catalog and store restores every run and serves every
snapshot."""

from __future__ import annotations

import hashlib

import httpx
import safetensors.torch
import torch
from polyak_testing import Backends, wait_settled


def state(step: int, rank: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {
        "w": torch.randn(64, 33, generator=g),
        "b": torch.randn(33, generator=g),
    }


def exact_ema(steps: list[int], beta: float, rank: int = 0) -> dict[str, torch.Tensor]:
    """torch's AveragedModel with get_ema_multi_avg_fn (its first update copies)."""
    model = torch.nn.Module()
    first = state(steps[0], rank)
    for k, v in first.items():
        model.register_buffer(k, v.clone())
    avg = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(beta), use_buffers=True
    )
    for s in steps:
        for k, v in state(s, rank).items():
            getattr(model, k).copy_(v)
        avg.update_parameters(model)
    return {k: getattr(avg.module, k).clone() for k in first}


def push(c: httpx.Client, run: str, step: int, rank: int = 0) -> None:
    r = c.put(
        f"/v1/runs/{run}/ranks/{rank}/steps/{step}",
        content=safetensors.torch.save(state(step, rank)),
    )
    assert r.status_code == 200, r.text
    assert r.json()["applied"], r.text


def create(c: httpx.Client, run: str, world: int = 1, **extra) -> None:
    r = c.post(
        "/v1/runs",
        json={
            "name": run,
            "world_size": world,
            "device": "cpu",
            "profiles": [{"name": "ema", "kind": "constant", "beta": 0.9}],
            **extra,
        },
    )
    assert r.status_code == 201, r.text


def snapshot_at(c: httpx.Client, run: str, step: int) -> str:
    r = c.post(f"/v1/runs/{run}/snapshots", json={"step": step})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def download(c: httpx.Client, run: str, sid: str) -> dict[str, torch.Tensor]:
    r = c.get(f"/v1/runs/{run}/snapshots/{sid}/download", params={"profile": "ema"})
    assert r.status_code == 200, r.text
    return safetensors.torch.load(r.content)


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)


def test_store_outage_fails_the_snapshot_and_spares_pushes(tmp_path, backends: Backends):
    srv = backends.server("postgres-s3", tmp_path / "data")
    srv.start()
    try:
        s3 = backends.s3()
        run = "outage"
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            create(c, run)
            for step in range(3):
                push(c, run, step)
            assert c.get("/readyz").json()["store"] == "s3"
            assert c.get("/readyz").json()["status"] == "ok"
            s3.stop(keep_data=True)
            # The store is down: /readyz says so (the node still serves).
            ready = c.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert ready.json()["status"] == "degraded", ready.text
            assert "store" in ready.json()["detail"], ready.text
            sid = snapshot_at(c, run, 3)
            push(c, run, 3)
            failed = wait_settled(c, run, sid, timeout=120)
            assert failed["status"] == "failed", failed
            assert failed["reason"], failed
            # Pushes went on untouched: the live EMA is the exact EMA.
            for step in range(4, 6):
                push(c, run, step)
            live = safetensors.torch.load(
                c.get(f"/v1/runs/{run}/ranks/0/ema", params={"profile": "ema"}).content
            )
            assert_equal(live, exact_ema(list(range(6)), 0.9))
            # The store is back: the next snapshot completes, readyz is ok.
            s3.start()
            sid = snapshot_at(c, run, 6)
            push(c, run, 6)
            done = wait_settled(c, run, sid, timeout=120)
            assert done["status"] == "complete", done
            assert_equal(download(c, run, sid), exact_ema(list(range(7)), 0.9))
            assert c.get("/readyz").json()["status"] == "ok"
            # The failed snapshot left no object and no open upload.
            store = backends.store_of(srv)
            assert not [k for k in store.keys() if f"/{failed['id']}/" in k]
            assert store.open_uploads() == []
            metrics = c.get("/metrics").text
            assert 'polyak_store_errors_total{op="' in metrics
            assert "polyak_store_written_bytes_total" in metrics
    finally:
        srv.stop()


def test_an_empty_data_dir_restores_every_run_and_serves_every_snapshot(
    tmp_path, backends: Backends
):
    first = backends.server("postgres-s3", tmp_path / "first")
    first.start()
    try:
        runs = {"alpha": 1, "beta": 2}
        snaps: dict[str, list[tuple[str, int]]] = {}
        with httpx.Client(base_url=first.url, timeout=120) as c:
            for run, world in runs.items():
                create(c, run, world=world, mirror=True, persist_every_secs=0)
                snaps[run] = []
                for step in range(6):
                    if step in (2, 4):
                        snaps[run].append((snapshot_at(c, run, step), step))
                    for rank in range(world):
                        push(c, run, step, rank)
                for sid, _ in snaps[run]:
                    assert wait_settled(c, run, sid, timeout=120)["status"] == "complete"
            shas = {
                (run, sid): c.get(f"/v1/runs/{run}/snapshots/{sid}").json()["files"]
                for run in runs
                for sid, _ in snaps[run]
            }
    finally:
        first.stop()  # graceful: persists each run's newest state to the store
    # Same catalog and store, nothing in the data dir.
    args = list(first.args)
    second = type(first)(tmp_path / "second", *args, env=first.env)
    assert not (tmp_path / "second").exists()
    second.start()
    try:
        with httpx.Client(base_url=second.url, timeout=120) as c:
            for run, world in runs.items():
                ranks = c.get(f"/v1/runs/{run}/ranks").json()
                assert [r["last_step"] for r in ranks] == [5] * world, ranks
                for rank in range(world):
                    live = safetensors.torch.load(
                        c.get(f"/v1/runs/{run}/ranks/{rank}/ema", params={"profile": "ema"}).content
                    )
                    assert_equal(live, exact_ema(list(range(6)), 0.9, rank))
                for sid, step in snaps[run]:
                    for f in shas[(run, sid)]:
                        r = c.get(
                            f"/v1/runs/{run}/snapshots/{sid}/download",
                            params={"layout": "rank", "rank": f["rank"], "profile": f["part"]},
                        )
                        assert r.status_code == 200, r.text
                        assert hashlib.sha256(r.content).hexdigest() == f["sha256"]
                    if world == 1:
                        assert_equal(download(c, run, sid), exact_ema(list(range(step + 1)), 0.9))
                # The run goes on from the restored state.
                for rank in range(world):
                    push(c, run, 6, rank)
        # Nothing of the snapshots was written under the new data dir.
        assert not (tmp_path / "second" / "runs").exists() or not any(
            p.is_file() for p in (tmp_path / "second" / "runs").rglob("*")
        )
    finally:
        second.stop()
