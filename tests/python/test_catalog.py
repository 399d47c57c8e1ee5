"""The catalog on each backend: a catalog written by the previous version is
read, snapshot ids are unique and ordered by creation time, a failed state
write is retried (and the newest EMA persisted at shutdown), and unreadable
catalog rows or part files answer 5xx with codes of their own."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from polyak_testing import wait_for

# Run on every catalog and store pair (see polyak_testing.plugin).
BACKEND_MATRIX = True

V0 = Path(__file__).resolve().parent / "data" / "catalog-v0"
ULID_CHARS = set("0123456789abcdefghjkmnpqrstvwxyz")


def constant_ema(states: list[dict[str, torch.Tensor]], beta: float) -> dict[str, torch.Tensor]:
    """torch's AveragedModel + get_ema_multi_avg_fn: copy, then lerp by 1 - beta."""
    ema = {k: v.clone() for k, v in states[0].items()}
    for s in states[1:]:
        for k in ema:
            ema[k].lerp_(s[k], 1 - beta)
    return ema


def v0_state(step: int) -> dict[str, torch.Tensor]:
    base = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7.0,
        "b": torch.tensor([1.5, -2.25, 0.125], dtype=torch.float32),
    }
    return {k: v * (step + 1) for k, v in base.items()}


def push(c: httpx.Client, run: str, step: int, state: dict[str, torch.Tensor], rank: int = 0):
    r = c.put(f"/v1/runs/{run}/ranks/{rank}/steps/{step}", content=safetensors.torch.save(state))
    assert r.status_code == 200, r.text
    return r.json()


def create(c: httpx.Client, run: str, **extra):
    cfg = {
        "name": run,
        "world_size": 1,
        "device": "cpu",
        "profiles": [{"name": "ema", "kind": "constant", "beta": 0.5}],
        **extra,
    }
    r = c.post("/v1/runs", json=cfg)
    assert r.status_code == 201, r.text


def snapshots(c: httpx.Client, run: str) -> list[dict]:
    r = c.get(f"/v1/runs/{run}/snapshots")
    assert r.status_code == 200, r.text
    return r.json()["snapshots"]


def live_ema(c: httpx.Client, run: str) -> dict[str, torch.Tensor]:
    r = c.get(f"/v1/runs/{run}/ranks/0/ema", params={"profile": "ema"})
    assert r.status_code == 200, r.text
    return safetensors.torch.load(r.content)


def test_a_catalog_written_by_the_previous_version_is_read(tmp_path, backend):
    """The SQLite data dir of a server from before ULID ids and the catalog
    backends: its runs, old-style ids, snapshots and state come back."""
    if not backend.startswith("sqlite"):
        pytest.skip("the previous version wrote SQLite only")
    from polyak_testing import PolyakServer

    data = tmp_path / "data"
    shutil.copytree(V0, data)
    with PolyakServer(data) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        runs = [r["name"] for r in c.get("/v1/runs").json()["runs"]]
        assert runs == ["catalog-v0"]
        snaps = {s["id"]: s for s in snapshots(c, "catalog-v0")}
        assert {s["kind"] for s in snaps.values()} == {"manual", "state"}
        manual = next(s for s in snaps.values() if s["kind"] == "manual")
        assert manual["id"].startswith("manual-2-") and manual["status"] == "complete"
        assert manual["label"] == "v0" and manual["step"] == 2
        got = safetensors.torch.load(
            c.get(
                f"/v1/runs/catalog-v0/snapshots/{manual['id']}/download", params={"profile": "ema"}
            ).content
        )
        want = constant_ema([v0_state(s) for s in range(3)], 0.5)
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
        # The state snapshot restored the rank at step 4 with its EMA.
        assert c.get("/v1/runs/catalog-v0/ranks/0").json()["last_step"] == 4
        want4 = constant_ema([v0_state(s) for s in range(5)], 0.5)
        live = live_ema(c, "catalog-v0")
        for k in want4:
            torch.testing.assert_close(live[k], want4[k], rtol=0, atol=0)
        # The run goes on; new snapshots get the new ids beside the old ones.
        push(c, "catalog-v0", 5, v0_state(5))
        r = c.post("/v1/runs/catalog-v0/snapshots", json={"step": 5})
        assert r.status_code == 202, r.text
        new_id = r.json()["id"]
        assert len(new_id) == 26 and set(new_id) <= ULID_CHARS, new_id
        wait_for(
            lambda: c.get(f"/v1/runs/catalog-v0/snapshots/{new_id}").json()["status"] == "complete",
            what="the new snapshot",
        )
        assert manual["id"] in {s["id"] for s in snapshots(c, "catalog-v0")}


def test_snapshot_ids_are_unique_and_ordered_by_creation_across_runs(server):
    """Hundreds of snapshots over three runs, requested in an interleaved
    order: every id is a ULID, all differ, and sorting the ids sorts them by
    the order they were created in."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        runs = [f"ids-{i}" for i in range(3)]
        for run in runs:
            create(c, run)
            push(c, run, 0, v0_state(0))
        made = []
        for i in range(150):
            run = runs[i % 3]
            r = c.post(f"/v1/runs/{run}/snapshots", json={"step": 0, "label": str(i)})
            assert r.status_code == 202, r.text
            made.append(r.json()["id"])
        assert len(set(made)) == len(made)
        assert all(len(i) == 26 and set(i) <= ULID_CHARS for i in made)
        assert sorted(made) == made
        listed = [s for run in runs for s in snapshots(c, run)]
        by_time = sorted(listed, key=lambda s: (s["created_at_ms"], s["id"]))
        assert [s["id"] for s in by_time] == sorted(s["id"] for s in listed)


class WriteBlocker:
    """Makes a run's snapshot writes fail, and lets them through again: on
    files, a regular file where the run's snapshot directory belongs (it
    fails even for root); on S3, the S3 service stopped (an outage; its
    data and ports are kept for the restart)."""

    def __init__(self, srv, backends, backend: str, run: str) -> None:
        self.path = srv.data_dir / "runs" / run / "snapshots"
        self.s3 = backends.s3() if backend.endswith("-s3") else None

    def block(self) -> None:
        if self.s3 is not None:
            self.s3.stop(keep_data=True)
        else:
            self.path.parent.mkdir(parents=True)
            self.path.write_text("in the way")

    def unblock(self) -> None:
        if self.s3 is not None:
            self.s3.start()
        else:
            self.path.unlink()


def test_a_failed_state_write_is_retried_and_the_newest_ema_persisted_at_shutdown(
    fresh_server, backends, backend
):
    """A state write made to fail (see :class:`WriteBlocker`). The run
    stays due: once the way is clear the write is retried without a new
    push; and a failed forced write still leaves the newest EMA to the
    graceful stop."""
    srv = fresh_server.start()
    run = "persist-retry"
    blocker = WriteBlocker(srv, backends, backend, run)
    states = [v0_state(s) for s in range(6)]
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        create(c, run, persist_every_secs=1)
        blocker.block()
        for step in range(4):
            push(c, run, step, states[step])
        failed = wait_for(
            lambda: [
                s for s in snapshots(c, run) if s["kind"] == "state" and s["status"] == "failed"
            ],
            what="a failed state snapshot",
        )
        assert failed[0]["reason"], failed
        blocker.unblock()
        done = wait_for(
            lambda: [
                s
                for s in snapshots(c, run)
                if s["kind"] == "state" and s["status"] == "complete" and s["step"] == 3
            ],
            what="the retried state snapshot",
        )
        assert done
        # A run persisted only on demand and at shutdown: the forced write
        # fails, and the graceful stop still writes the newest EMA.
        create(c, "persist-at-stop", persist_every_secs=0)
        stop_blocker = WriteBlocker(srv, backends, backend, "persist-at-stop")
        stop_blocker.block()
        for step in range(6):
            push(c, "persist-at-stop", step, states[step])
        r = c.post("/v1/runs/persist-at-stop/persist")
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "snapshot_write_failed", r.text
        stop_blocker.unblock()
    srv.stop()
    srv.start()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/v1/runs/persist-at-stop/ranks/0").json()["last_step"] == 5
        want = constant_ema(states, 0.5)
        live = live_ema(c, "persist-at-stop")
        for k in want:
            torch.testing.assert_close(live[k], want[k], rtol=0, atol=0)


def corrupt_catalog_row(srv, backends, backend: str, sql: str) -> None:
    if backend.startswith("postgres"):
        catalog = srv.args[srv.args.index("--catalog") + 1]
        backends.postgres().psql(sql, database=catalog.rsplit("/", 1)[1])
    else:
        db = sqlite3.connect(srv.data_dir / "polyak.db", timeout=30)
        db.execute(sql)
        db.commit()
        db.close()


def test_corrupt_part_file_and_catalog_row_answer_5xx_with_their_codes(
    fresh_server, backends, backend
):
    srv = fresh_server.start()
    run = "faults"
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        create(c, run)
        push(c, run, 0, v0_state(0))
        ids = []
        for step in (1, 2):
            r = c.post(f"/v1/runs/{run}/snapshots", json={"step": step})
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        for step in (1, 2):
            push(c, run, step, v0_state(step))
        for i in ids:
            wait_for(
                lambda i=i: c.get(f"/v1/runs/{run}/snapshots/{i}").json()["status"] == "complete",
                what="snapshots",
            )
        # A part file cut short: resuming from it cannot read it back.
        files = c.get(f"/v1/runs/{run}/snapshots/{ids[0]}").json()["files"]
        store = backends.store_of(srv)
        key = files[0]["path"]
        store.write(key, store.read(key)[:40])
        r = c.post(f"/v1/runs/{run}/resume", json={"step": 1})
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "snapshot_corrupt", r.text
        # The part file gone: its download is a server fault too.
        store.delete(key)
        r = c.get(
            f"/v1/runs/{run}/snapshots/{ids[0]}/download", params={"layout": "rank", "rank": 0}
        )
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "snapshot_part_missing", r.text
        # A catalog row whose JSON does not parse.
        corrupt_catalog_row(
            srv,
            backends,
            backend,
            f"UPDATE snapshots SET profiles = '[not json' WHERE id = '{ids[1]}'",
        )
        r = c.get(f"/v1/runs/{run}/snapshots")
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "catalog_corrupt", r.text
        # The caller's mistakes stay 4xx.
        r = c.get(f"/v1/runs/{run}/snapshots/no-such-id")
        assert r.status_code == 404, r.text


def test_catalog_outage_on_postgres(tmp_path, backend):
    """PostgreSQL stops under a running server: /readyz answers 503 naming
    the catalog, catalog reads answer 503 catalog_unavailable, pushes go on
    (their bookkeeping is batched); once it is back everything answers again."""
    if not backend.startswith("postgres") or os.environ.get("POLYAK_TEST_DATABASE_URL"):
        pytest.skip("needs a PostgreSQL of its own to stop")
    from polyak_testing import PolyakServer, PostgresService

    pg = PostgresService().start()
    srv = PolyakServer(tmp_path / "data", "--catalog", pg.new_database())
    try:
        srv.start()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            ready = c.get("/readyz")
            assert ready.status_code == 200 and ready.json()["catalog"] == "postgres", ready.text
            create(c, "outage")
            push(c, "outage", 0, v0_state(0))
            pg.stop(keep_data=True)
            ready = c.get("/readyz")
            assert ready.status_code == 503, ready.text
            assert ready.json()["detail"].startswith("catalog (postgres)"), ready.text
            r = c.get("/v1/runs/outage/snapshots")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "catalog_unavailable", r.text
            assert r.headers["retry-after"] == "1"
            for step in (1, 2):
                assert push(c, "outage", step, v0_state(step))["applied"] is True
            pg.start()
            wait_for(lambda: c.get("/readyz").status_code == 200, what="ready again")
            assert c.get("/v1/runs/outage/snapshots").status_code == 200
            want = constant_ema([v0_state(s) for s in range(3)], 0.5)
            live = live_ema(c, "outage")
            for k in want:
                torch.testing.assert_close(live[k], want[k], rtol=0, atol=0)
    finally:
        srv.stop()
        pg.stop()
