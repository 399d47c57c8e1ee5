"""The values the client compares against (``polyak.contract``) are the ones
the real server sends: every snapshot kind and status a run goes through,
and every event kind and snapshot-event status on its event stream."""

from __future__ import annotations

import httpx
import polyak
import pytest
import torch
from polyak.contract import (
    EventKind,
    SnapshotEventStatus,
    SnapshotKind,
    SnapshotStatus,
    snapshot_done,
)


def test_snapshot_done_knows_only_the_documented_statuses():
    assert snapshot_done({"id": "a", "status": "complete"}) is True
    assert snapshot_done({"id": "a", "status": SnapshotStatus.PENDING.value}) is False
    with pytest.raises(polyak.PolyakError) as failed:
        snapshot_done({"id": "a", "status": "failed", "reason": "rank 1 never reached step 7"})
    assert failed.value.code == "snapshot_failed"
    assert "rank 1 never reached step 7" in failed.value.message
    # Spellings the client once guessed are not the contract's.
    for guess in ("completed", "ready", "done", "error", "Complete", None):
        with pytest.raises(polyak.PolyakError) as odd:
            snapshot_done({"id": "a", "status": guess})
        assert odd.value.code == "unexpected_status", guess


def test_a_run_uses_every_documented_value_and_no_other(client, run_name):
    run = client.create_run(
        run_name,
        mirror=True,
        snapshot_every=2,
        profiles=[{"name": "edm", "kind": "power", "sigma_rel": 0.05}],
    )
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g)}
    with run.pusher() as pusher:
        for step in range(5):
            pusher.push({k: v + step for k, v in sd.items()}, step)
    with pytest.raises(polyak.PolyakError) as refused, run.pusher() as bad:
        bad.push({"w": torch.full((64, 8), float("nan")), "b": sd["b"]}, 6)
        bad.flush()
    assert refused.value.status == 422

    manual = run.snapshot()
    for periodic in run.snapshots(kind="periodic"):
        run.wait_snapshot(periodic)
    posthoc = run.posthoc(0.1)
    merged = run.merge(last=2)
    client.request("POST", f"{run.path}/persist")
    run.resume(step=4)
    run.annotate(note="contract values")
    run.delete_snapshot(merged)
    run.merge(last=2)
    final = run.finish()

    rows = run.snapshots()
    for row in rows:
        if row["kind"] == SnapshotKind.STATE:
            run.wait_snapshot(row)
    rows = run.snapshots()
    assert {r["kind"] for r in rows} == {k.value for k in SnapshotKind}
    assert {r["status"] for r in rows} == {SnapshotStatus.COMPLETE.value}
    assert all(snapshot_done(r) for r in rows)
    assert (manual["kind"], posthoc["kind"], final["snapshot"]["kind"]) == (
        SnapshotKind.MANUAL,
        SnapshotKind.POSTHOC,
        SnapshotKind.MANUAL,
    )

    events = httpx.get(
        f"{client.url}{run.path}/events", headers={"Accept": "application/json"}, timeout=30
    ).json()
    kinds = {e["kind"] for e in events}
    assert kinds <= {k.value for k in EventKind}, kinds
    assert kinds >= {
        "run_created",
        "rank_registered",
        "push",
        "rejection",
        "snapshot",
        "resumed",
        "annotated",
        "finished",
    }, kinds
    statuses = {e["detail"]["status"] for e in events if e["kind"] == EventKind.SNAPSHOT}
    assert statuses <= {s.value for s in SnapshotEventStatus}, statuses
    assert statuses >= {"pending", "complete", "deleted"}, statuses
