"""The typed answers of ``polyak.Run`` (``polyak.views``): each field is one
the real server's OpenAPI schema names, with the contract's enum where the
schema has one; the values read the same as attributes and as the JSON
mapping they came from; and a run's answers come back typed end to end."""

from __future__ import annotations

import dataclasses
import json
import typing
from enum import Enum

import httpx
import pytest
import torch
from polyak import views
from polyak.contract import CandidateKind, RankStatus, RunHealth, SnapshotKind, SnapshotStatus

#: Each view and the server's schema it reads.
SCHEMAS = {
    views.RunInfo: "RunView",
    views.RankInfo: "RankView",
    views.SnapshotInfo: "SnapshotView",
    views.Evaluation: "Evaluation",
    views.Best: "Best",
}


def _properties(spec: dict, name: str) -> dict:
    """A schema's properties, those of the schemas it flattens in too."""
    schema = spec["components"]["schemas"][name]
    props = dict(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        if "$ref" in part:
            props.update(_properties(spec, part["$ref"].rsplit("/", 1)[1]))
        props.update(part.get("properties", {}))
    return props


def test_every_field_is_one_the_server_documents(server):
    spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    for view, schema in SCHEMAS.items():
        props = _properties(spec, schema)
        assert props, schema
        hints = typing.get_type_hints(view)
        for f in dataclasses.fields(view):
            if f.name == "raw":
                continue
            assert f.name in props, f"{view.__name__}.{f.name} is not in the server's {schema}"
            # A field typed with a contract enum reads a property the server
            # types with the enum of the same name.
            enums = [
                a
                for a in typing.get_args(hints[f.name])
                if isinstance(a, type) and issubclass(a, Enum)
            ]
            for enum in enums:
                ref = json.dumps(props[f.name])
                assert f"#/components/schemas/{enum.__name__}" in ref, (view, f.name, ref)


def test_a_views_fields_and_its_mapping_read_the_same():
    data = {
        "id": "s1",
        "run": "r",
        "step": 7,
        "kind": "posthoc",
        "status": "pending",
        "label": None,
        "profiles": ["posthoc"],
        "reason": None,
        "created_at_ms": 1,
        "completed_at_ms": None,
        "deadline_ms": None,
        "bytes": 0,
        "detail": {"residual": 0.01},
        "progress": {"done": 3, "total": 9},
        "newer_key": "kept",
    }
    snap = views.SnapshotInfo.from_json(data)
    assert snap.kind is SnapshotKind.POSTHOC and snap["kind"] == "posthoc"
    assert snap.status == SnapshotStatus.PENDING == "pending"
    assert snap.progress == views.Progress(done=3, total=9)
    assert snap.step == snap["step"] == 7
    # The whole answer, keys no field names included; equal to the dict.
    assert snap["newer_key"] == "kept" and dict(snap) == data and snap == data
    assert "files" not in snap and snap.get("files") is None and snap.files == ()
    assert json.loads(json.dumps(views.plain({"rows": [snap]}))) == {"rows": [data]}
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.step = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap["step"] = 8  # type: ignore[index]
    # A value this client does not know stays the server's string.
    odd = views.SnapshotInfo.from_json({**data, "status": "archived"})
    assert odd.status == "archived" and not isinstance(odd.status, SnapshotStatus)


def test_a_runs_answers_come_back_typed(client, run_name):
    run = client.create_run(
        run_name,
        world_size=2,
        profiles=[{"name": "edm", "kind": "power", "sigma_rel": 0.05}],
        snapshot_every=2,
    )
    assert run.refresh().health is RunHealth.IDLE
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(16, 4, generator=g)}
    with run.pusher(rank=0) as pusher:
        for step in range(4):
            pusher.push({k: v + step for k, v in sd.items()}, step)
    info = run.refresh()
    assert isinstance(info, views.RunInfo)
    assert (info.name, info.health, info.last_step) == (run_name, RunHealth.WAITING, 3)
    ranks = {r.rank: r for r in info.ranks or ()}
    assert ranks[0].status is RankStatus.LIVE and ranks[0].last_step == 3
    assert ranks[1].status is RankStatus.NEVER_SEEN and ranks[1].last_step is None
    assert run.rank(0).pushes == 4 and [r.rank for r in run.ranks()] == [0, 1]
    listed = next(r for r in client.runs() if r.name == run_name)
    assert isinstance(listed, views.RunInfo) and listed.ranks is None

    with run.pusher(rank=1) as pusher:
        for step in range(4):
            pusher.push({k: v - step for k, v in sd.items()}, step)
    snap = run.snapshot()
    assert isinstance(snap, views.SnapshotInfo)
    assert (snap.kind, snap.status, snap.step) == (SnapshotKind.MANUAL, SnapshotStatus.COMPLETE, 3)
    assert sorted((f.rank, f.part) for f in snap.files) == [(0, "edm"), (1, "edm")]
    assert all(len(f.sha256) == 64 and f.bytes > 0 for f in snap.files)
    assert [s.id for s in run.snapshots(kind="manual")] == [snap.id]

    posthoc = run.posthoc(0.1)
    assert isinstance(posthoc, views.SnapshotInfo) and posthoc.kind is SnapshotKind.POSTHOC
    assert posthoc.detail["residual"] == pytest.approx(posthoc["detail"]["residual"])

    evaluation = run.post_eval(snap, "edm", {"loss": 0.5})
    assert isinstance(evaluation, views.Evaluation)
    assert (evaluation.kind, evaluation.step, evaluation.metrics) == (
        CandidateKind.EMA,
        3,
        {"loss": 0.5},
    )
    run.post_eval(posthoc, "posthoc", {"loss": 0.25})
    by_kind = {e.kind: e for e in run.evals(metric="loss")}
    assert set(by_kind) == {CandidateKind.EMA, CandidateKind.POSTHOC}
    assert by_kind[CandidateKind.POSTHOC].sigma_rel == pytest.approx(0.1)
    assert by_kind[CandidateKind.POSTHOC].sources
    assert by_kind[CandidateKind.POSTHOC].residual is not None
    best = run.best("loss")
    assert isinstance(best, views.Best) and best.value == 0.25
    assert best.evaluation.snapshot == posthoc.id and posthoc.id in best.download

    finished = run.finish()
    assert finished["run"].health is RunHealth.FINISHED
    assert isinstance(finished["snapshot"], views.SnapshotInfo)
    assert finished["snapshot"].status is SnapshotStatus.COMPLETE
