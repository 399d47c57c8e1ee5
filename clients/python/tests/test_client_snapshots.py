"""The client's snapshot side against the real server: consistent cuts under
FSDP2, ``full`` and ``sharded`` downloads (loaded by ``load_state_dict`` and
by ``torch.distributed.checkpoint`` into world sizes 1 and 3), compare,
resume after a trainer crash, post-hoc EMA, trainer metrics and the
download progress bar.

Every EMA is checked against ``AveragedModel`` + ``get_ema_multi_avg_fn``
computed in the same test (1e-6 relative); compare's numbers against torch
statistics of the downloaded tensors.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time

import httpx
import polyak
import pytest
import safetensors.torch
import torch
from polyak_testing import check_compare
from polyak_testing.refs import (
    TinyTransformer,
    Trainer,
    assert_state_close,
    averaged_state,
    rel_err,
    train_and_push,
)
from polyak_workers import dcp_loads, run_ranks, snapshot_worker
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

# Run on every catalog and store pair (see polyak_testing.plugin).
BACKEND_MATRIX = True

BETA = 0.9


def constant(name: str, beta: float) -> dict:
    return {"name": name, "kind": "constant", "beta": beta}


def anchor(model: torch.nn.Module, beta: float) -> AveragedModel:
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(beta), use_buffers=True)


@pytest.mark.slow
def test_fsdp2_snapshot_full_and_sharded_downloads(client, server, tmp_path, run_name):
    """FSDP2 on 2 gloo ranks (uneven shards; rank 1 holds no row of
    ``gate``), AdamW, ``attach``. The snapshot is asked for before the ranks
    reach its step; its ``full`` download loads into the unsharded model,
    and its ``sharded`` download into world sizes 1 and 3 through
    ``torch.distributed.checkpoint``; all equal the anchor at that step."""
    steps, snap_step = 16, 11
    run = client.create_run(run_name, world_size=2, profiles=[constant("c", BETA)])
    pending = run.snapshot(step=snap_step, label="fsdp2", wait=False)
    assert (pending["status"], pending["step"], pending["label"]) == ("pending", snap_step, "fsdp2")
    cfg = {
        "init": f"file://{tmp_path / 'store'}",
        "url": server.url,
        "run": run_name,
        "beta": BETA,
        "steps": steps,
        "snap_step": snap_step,
        "out": str(tmp_path),
    }
    run_ranks(snapshot_worker, 2, cfg)
    out = torch.load(tmp_path / "snapshot-rank0.pt", weights_only=False)
    want, online = out["avg"], out["online"]

    # Every parameter copy was deferred and ran only once the next
    # optimizer step waited for it (the last one when flush did).
    assert out["held"] == {"released": steps, "timed_out": 0}
    stats = out["stats"]
    assert (stats["deferred"], stats["waits"], stats["applied"]) == (steps, steps - 1, steps)
    assert stats["wait_seconds"] > 0

    snap = run.wait_snapshot(pending, timeout=60)
    assert snap["status"] == "complete" and snap["kind"] == "manual"
    assert {(f["rank"], f["part"], f["step"]) for f in snap["files"]} == {
        (0, "c", snap_step),
        (1, "c", snap_step),
    }
    assert snap["id"] in [s["id"] for s in run.snapshots()]

    # full: whole tensors, into the unsharded model.
    full = run.download(snap, "c", progress=False)
    assert_state_close(full, want, online, label="full")
    model = TinyTransformer()
    model.load_state_dict(full, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[k].to(v.dtype)), k
    path = run.download_to(snap, tmp_path / "dl", "c", layout="full", progress=False)
    assert path.name.endswith(".safetensors") and path.parent == tmp_path / "dl"
    from_file = safetensors.torch.load_file(path)
    assert set(from_file) == set(full)
    assert all(torch.equal(from_file[k], v) for k, v in full.items())

    # sharded: one file per rank; DCP reshards it.
    shard_dir = run.download_to(snap, tmp_path / "dl", "c", layout="sharded", progress=False)
    assert sorted(os.listdir(shard_dir)) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    # World size 1, no process group; world size 3: DTensors Shard(0) on a
    # 1-D mesh, then full_tensor().
    sd, got3, rows = dcp_loads(shard_dir, want, tmp_path)
    assert_state_close(sd, want, online, label="sharded into world size 1")
    assert_state_close(got3, want, online, label="sharded into world size 3")
    # Shard(0) splits as torch.chunk does: 37 rows -> 13, 13, 11.
    assert [r["tok.weight"] for r in rows] == [(13, 12), (13, 12), (11, 12)]
    assert [r["gate"] for r in rows] == [(1,), (0,), (0,)]

    # Downloaded again into the same place: unpacked beside it and renamed
    # over it, so nothing is left half-written or behind.
    first = {n: (shard_dir / n).read_bytes() for n in os.listdir(shard_dir)}
    (shard_dir / "rank-00001.safetensors").write_bytes(b"stale")
    again = run.download_to(snap, tmp_path / "dl", "c", layout="sharded", progress=False)
    assert again == shard_dir
    assert {n: (again / n).read_bytes() for n in os.listdir(again)} == first
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == sorted(
        [path.name, shard_dir.name]
    )


def test_compare_matches_torch(client, run_name):
    """Two ranks pushed from one process (each pushes its half of every
    tensor); compare two snapshots, a snapshot and the live EMA, two
    profiles of one snapshot."""
    run = client.create_run(
        run_name, world_size=2, profiles=[constant("ema", 0.8), constant("slow", 0.95)]
    )
    a = run.snapshot(step=4, wait=False)
    b = run.snapshot(step=9, wait=False)
    tr = Trainer(seed=21)
    train_and_push(tr, [run.pusher(rank=r) for r in (0, 1)], 12)
    a, b = run.wait_snapshot(a, timeout=30), run.wait_snapshot(b, timeout=30)
    dl = {(s["id"], p): run.download(s, p, progress=False) for s in (a, b) for p in ("ema", "slow")}

    result = run.compare(a, b, "ema")
    assert (result["a"], result["b"], result["profile"], result["profile_b"]) == (
        a["id"],
        b["id"],
        "ema",
        "ema",
    )
    check_compare(result, dl[(a["id"], "ema")], dl[(b["id"], "ema")])
    check_compare(run.compare(a, "live", "slow"), dl[(a["id"], "slow")], run.fetch_ema("slow"))
    both = run.compare(b["id"], b, "ema", profile_b="slow")
    check_compare(both, dl[(b["id"], "ema")], dl[(b["id"], "slow")])
    assert both["summary"]["rel_diff"] > 0
    assert run.compare(b, b, "slow")["summary"]["max_abs_diff"] == 0.0
    with pytest.raises(polyak.PolyakError) as e:
        run.compare("no-such-snapshot", "live")
    assert (e.value.status, e.value.code) == (404, "snapshot_not_found")


def test_refused_failed_and_deleted_snapshots(client, run_name):
    """A step a rank has passed is refused at once; one no rank reaches
    fails after the run's ``snapshot_timeout_secs`` and ``run.snapshot``
    raises the server's reason; a deleted snapshot is gone."""
    run = client.create_run(run_name, profiles=[constant("c", BETA)], snapshot_timeout_secs=1)
    tr = Trainer(seed=26)
    pusher = run.pusher()
    train_and_push(tr, [pusher], 3)
    with pytest.raises(polyak.PolyakError) as e:
        run.snapshot(step=1)
    assert (e.value.status, e.value.code) == (409, "snapshot_conflict")
    with pytest.raises(polyak.PolyakError) as e:
        run.snapshot(step=50, timeout=30)
    assert e.value.code == "snapshot_failed" and "did not reach" in e.value.message
    (failed,) = run.snapshots(status="failed")
    assert failed["step"] == 50
    with pytest.raises(polyak.PolyakError) as e:
        run.download(failed, "c", progress=False)
    assert (e.value.status, e.value.code) == (409, "snapshot_not_complete")
    run.delete_snapshot(failed)
    assert run.snapshots() == []
    with pytest.raises(polyak.PolyakError) as e:
        run.get_snapshot(failed["id"])
    assert (e.value.status, e.value.code) == (404, "snapshot_not_found")


def test_resume_after_a_trainer_crash_is_exact(client, run_name):
    """The trainer crashes after step 14 and restarts from its own
    checkpoint of step 10 (11 steps taken); ``run.resume(12)`` is refused
    (the snapshot of step 10 misses two updates), ``run.resume(10)``
    restores it, the trainer pushes on with ``attach(start_step=11)``, and
    the EMA is bit for bit that of a run that never crashed."""
    profiles = [constant("ema", 0.8), constant("slow", 0.95)]
    run = client.create_run(run_name, world_size=2, profiles=profiles)
    mid = run.snapshot(step=10, wait=False)
    end = run.snapshot(step=20, wait=False)
    straight = Trainer(seed=22)
    anchors = {p["name"]: anchor(straight.model, p["beta"]) for p in profiles}
    pushers = [run.pusher(rank=r) for r in (0, 1)]
    for p in pushers:
        p.attach(straight.opt, straight.model)
    ckpt = None
    for step in range(21):
        straight.step()
        for avg in anchors.values():
            avg.update_parameters(straight.model)
        if step == 10:
            ckpt = straight.checkpoint()
    for p in pushers:
        p.close()
    end = run.wait_snapshot(end, timeout=30)
    mid = run.wait_snapshot(mid, timeout=30)
    online = straight.state()
    want = {name: averaged_state(avg) for name, avg in anchors.items()}
    for name in want:
        assert_state_close(run.fetch_ema(name), want[name], online, label=name)

    with pytest.raises(polyak.PolyakError) as e:
        run.resume(5)  # no snapshot at or before step 5
    assert (e.value.status, e.value.code) == (404, "snapshot_not_found")
    # The checkpoint's last push was step 10; 12 would lose two updates.
    with pytest.raises(polyak.PolyakError) as e:
        run.resume(12)
    assert (e.value.status, e.value.code) == (409, "snapshot_older")
    older = run.resume(12, allow_older=True)
    assert (older["step"], older["older"], older["requested_step"]) == (10, True, 12)
    answer = run.resume(steps_taken=11)
    assert answer == {
        "snapshot": mid["id"],
        "step": 10,
        "rank_steps": {"0": 10, "1": 10},
        "requested_step": 10,
        "older": False,
    }
    assert [r["last_step"] for r in run.ranks()] == [10, 10]

    resumed = Trainer(seed=22)
    assert ckpt is not None
    resumed.restore(ckpt)
    pushers = [run.pusher(rank=r) for r in (0, 1)]
    for p in pushers:
        p.attach(resumed.opt, resumed.model, start_step=11)
    for _ in range(11, 21):
        resumed.step()
    for p in pushers:
        p.close()
    assert all(torch.equal(v, online[k]) for k, v in resumed.state().items())
    for name in want:
        assert run.compare(end, "live", name)["summary"]["max_abs_diff"] == 0.0
        live = run.fetch_ema(name)
        stored = run.download(end, name, progress=False)
        assert all(torch.equal(live[k], v) for k, v in stored.items()), name
        assert_state_close(live, want[name], online, label=f"resumed {name}")


def test_log_metrics_and_download_progress(client, server, run_name, tmp_path, capsys):
    """``run.log`` scalars come back from ``GET .../metrics``; a waiting
    ``run.snapshot`` completes while the trainer pushes; ``download_to``
    shows a progress bar (tqdm: on stderr, or on a given stream), calls
    ``on_progress``, and writes the bytes a direct download gets."""
    run = client.create_run(run_name, profiles=[constant("c", BETA)])
    tr = Trainer(seed=23)
    pusher = run.pusher()
    pusher.attach(tr.opt, tr.model)
    losses: list[float] = []

    def train() -> None:
        # Starts once the snapshot is asked for, so it cannot pass its step first.
        deadline = time.monotonic() + 30
        while not run.snapshots() and time.monotonic() < deadline:
            time.sleep(0.02)
        for step in range(8):
            losses.append(tr.step())
            run.log(step, loss=losses[-1], lr=0.02)
        pusher.flush()

    trainer = threading.Thread(target=train)
    trainer.start()
    snap = run.snapshot(step=5, timeout=60)  # waits until complete
    trainer.join(60)
    assert snap["status"] == "complete" and snap["step"] == 5
    run.log(3, rank=0, grad_norm=0.5)

    series = run.metrics(["loss", "lr"])
    assert set(series) == {"loss", "lr"}
    assert [s for s, _ in series["loss"]] == list(range(8))
    assert all(
        abs(v - w) <= 1e-9 * abs(w) for (_, v), w in zip(series["loss"], losses, strict=True)
    )
    raw = httpx.get(f"{server.url}/v1/runs/{run_name}/metrics", params={"names": "loss"}).json()
    assert [p[:2] for p in raw["series"][0]["points"]] == [[s, v] for s, v in series["loss"]]
    # The server samples its own per-rank series (`ingest/...`) every few
    # seconds; only what the client logged is compared here.
    logged = {k: v for k, v in run.metrics(rank=0).items() if not k.startswith("ingest/")}
    assert logged == {"grad_norm@0": [(3, 0.5)]}
    assert [s for s, _ in run.metrics(["loss"], since_step=6)["loss"]] == [6, 7]

    seen: list[tuple[int, int | None]] = []
    bar = io.StringIO()
    path = run.download_to(
        snap,
        tmp_path,
        "c",
        progress=bar,
        on_progress=lambda done, total: seen.append((done, total)),
    )
    body = path.read_bytes()
    direct = httpx.get(
        f"{server.url}/v1/runs/{run_name}/snapshots/{snap['id']}/download", params={"profile": "c"}
    )
    assert direct.status_code == 200
    assert hashlib.sha256(body).hexdigest() == hashlib.sha256(direct.content).hexdigest()
    assert seen and seen[-1] == (len(body), len(body))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    text = bar.getvalue()
    assert f"{run_name}/{snap['id']} c" in text and "100%" in text
    assert not list(tmp_path.glob("*.part"))

    capsys.readouterr()
    again = run.download_to(snap, tmp_path / "again", "c")  # the default bar: stderr
    assert "100%" in capsys.readouterr().err
    assert again.read_bytes() == body
    run.download_to(snap, tmp_path / "quiet", "c", progress=False)
    assert "100%" not in capsys.readouterr().err

    # A rank's stored file matches the sha256 the catalog recorded.
    (f,) = snap["files"]
    stored = httpx.get(
        f"{server.url}/v1/runs/{run_name}/snapshots/{snap['id']}/download",
        params={"layout": "rank", "rank": 0, "profile": "c"},
    ).content
    assert hashlib.sha256(stored).hexdigest() == f["sha256"] and len(stored) == f["bytes"]


def test_posthoc_from_power_profile_snapshots(client, run_name):
    """``run.posthoc``: a ``posthoc`` snapshot whose tensors are the
    weighted sum (the server's EDM2 least-squares weights) of the source
    snapshots it lists; asking for a tracked ``sigma_rel`` gives that
    profile back."""
    run = client.create_run(
        run_name,
        world_size=2,
        snapshot_every=5,
        profiles=[
            {"name": "p05", "kind": "power", "sigma_rel": 0.05},
            {"name": "p10", "kind": "power", "sigma_rel": 0.10},
            {"name": "p15", "kind": "power", "sigma_rel": 0.15},
        ],
    )
    tr = Trainer(seed=24)
    train_and_push(tr, [run.pusher(rank=r) for r in (0, 1)], 21)
    periodic: list[dict] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        periodic = run.snapshots(kind="periodic")
        if len(periodic) == 5 and all(s["status"] == "complete" for s in periodic):
            break
        time.sleep(0.05)
    assert [s["step"] for s in periodic] == [0, 5, 10, 15, 20]

    snap = run.posthoc(0.10, step=20, profiles=["p05", "p15"], name="synth")
    assert (snap["kind"], snap["status"], snap["profiles"], snap["step"]) == (
        "posthoc",
        "complete",
        ["synth"],
        20,
    )
    sources = snap["detail"]["sources"]
    assert {s["profile"] for s in sources} == {"p05", "p15"}
    inputs = [run.download(s["snapshot"], s["profile"], progress=False) for s in sources]
    synth = run.download(snap, "synth", progress=False)
    for name, value in synth.items():
        if not value.is_floating_point():
            continue
        want = sum(
            float(s["weight"]) * inp[name].double() for s, inp in zip(sources, inputs, strict=True)
        )
        assert rel_err(value, want) <= 1e-5, name
    tracked = run.download(periodic[-1], "p10", progress=False)
    pending = run.posthoc(0.10, step=20, name="again", wait=False)
    assert pending["kind"] == "posthoc"
    again = run.download(run.wait_snapshot(pending, timeout=30), "again", progress=False)
    assert max(rel_err(again[k], v) for k, v in tracked.items() if v.is_floating_point()) < 1e-5
    with pytest.raises(polyak.PolyakError) as e:
        run.posthoc(0.5)
    assert e.value.status == 422 and "sigma_rel" in e.value.message


def test_posthoc_sweep_plan_and_merge(client, run_name):
    """``run.posthoc_plan`` previews the weights; ``run.posthoc([...])``
    writes one snapshot per length (a progress bar on a stream), each equal
    to the single-length call; ``run.merge`` averages the online weights
    of the newest snapshots."""
    run = client.create_run(
        run_name,
        world_size=2,
        snapshot_every=5,
        mirror=True,
        profiles=[
            {"name": "p05", "kind": "power", "sigma_rel": 0.05},
            {"name": "p10", "kind": "power", "sigma_rel": 0.10},
        ],
    )
    tr = Trainer(seed=31)
    train_and_push(tr, [run.pusher(rank=r) for r in (0, 1)], 21)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        periodic = run.snapshots(kind="periodic", status="complete")
        if len(periodic) == 5:
            break
        time.sleep(0.05)
    plan = run.posthoc_plan([0.06, 0.08], step=15)
    assert plan["step"] == 15 and plan["usable_steps"] == [0, 5, 10, 15, 20]
    assert [s["step"] for s in plan["sources"]] == [0, 0, 5, 5, 10, 10, 15, 15]
    for target in plan["targets"]:
        assert abs(sum(target["weights"]) - 1) < 1e-12 and target["residual"] > 0
    bar = io.StringIO()
    swept = run.posthoc([0.06, 0.08], step=15, progress=bar)
    assert [s["status"] for s in swept] == ["complete", "complete"]
    assert "100%" in bar.getvalue()
    for snap, target in zip(swept, plan["targets"], strict=True):
        # The plan's weights (solved on the request thread; the sweep's on
        # the job's, whose BLAS may sum in another order: equal to rounding).
        got = [s["weight"] for s in snap["detail"]["sources"]]
        assert len(got) == len(target["weights"])
        assert all(abs(g - w) <= 1e-12 for g, w in zip(got, target["weights"], strict=True))
        single = run.posthoc(target["sigma_rel"], step=15)
        a = run.download(snap, "posthoc", progress=False)
        b = run.download(single, "posthoc", progress=False)
        assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(polyak.PolyakError) as e:
        run.posthoc(0.07, step=12)
    assert e.value.status == 422 and "usable steps: [0, 5, 10, 15, 20]" in e.value.message

    last = run.snapshots(kind="periodic", status="complete")[-2:]
    online = [run.download(s, "online", progress=False) for s in last]
    merged_row = run.merge(last=2, weights="exp", alpha=0.25)
    assert merged_row["kind"] == "merge" and merged_row["step"] == 20
    merged = run.download(merged_row, "merged", progress=False)
    for k, v in merged.items():
        if v.is_floating_point():
            want = (0.25 * online[0][k].double() + online[1][k].double()) / 1.25
            assert rel_err(v, want) <= 1e-6, k
        else:
            assert torch.equal(v, online[1][k]), k


def test_download_paths_agree_and_a_cut_stream_is_refused(client, run_name, tmp_path, monkeypatch):
    """``download_to`` writes each ranged answer through ``splice`` where
    it can (Linux, plain HTTP), else into the mapped file, over one
    connection or several: all give the bytes of an in-memory download. A
    response cut short by a server that serves no ranges raises
    ``incomplete_download`` and leaves no file."""
    import socket

    from polyak import _ranged, _transport

    run = client.create_run(run_name, profiles=[constant("c", BETA)])
    g = torch.Generator().manual_seed(5)
    # Several MB: far more than http.client buffers past the headers.
    sd = {f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(8)}
    pusher = run.pusher()
    pusher.push(sd, 0)
    pusher.flush()
    snap = run.snapshot(step=0, timeout=60)
    expected = run.download(snap, "c", progress=False)
    for name, t in sd.items():
        assert torch.equal(expected[name], t), name  # the first push copies
    whole = httpx.get(
        f"{client.url}/v1/runs/{run_name}/snapshots/{snap['id']}/download", params={"profile": "c"}
    ).content

    spliced: list[int] = []
    real_splice = _ranged.splice_at

    def counting(r, fd, offset, length, timeout):
        sp = real_splice(r, fd, offset, length, timeout)
        spliced.append(length if sp is not None else -1)
        return sp

    monkeypatch.setattr(_ranged, "splice_at", counting)
    path = run.download_to(snap, tmp_path / "splice", "c", progress=False)
    assert path.read_bytes() == whole
    if hasattr(os, "splice"):
        assert spliced and sum(spliced) == len(whole), spliced
    monkeypatch.setattr(_ranged, "splice_at", lambda *a: None)
    assert run.download_to(snap, tmp_path / "mapped", "c", progress=False).read_bytes() == whole
    for n in (1, 3):
        got = run.download_to(snap, tmp_path / f"n{n}", "c", progress=False, connections=n)
        assert got.read_bytes() == whole
    monkeypatch.setattr(_ranged, "splice_at", counting)

    # Over TLS the socket carries ciphertext: never spliced.
    import ssl
    import types

    ctx = ssl.create_default_context()
    with ctx.wrap_socket(socket.socket(), server_hostname="polyak.invalid") as tls:
        fake = types.SimpleNamespace(fp=types.SimpleNamespace(raw=types.SimpleNamespace(_sock=tls)))
        with open(tmp_path / "tls.part", "w+b") as f:
            assert _transport.splice_at(fake, f.fileno(), 0, 1 << 20, 5.0) is None

    # A peer that promises more bytes than it sends, then hangs up.
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)  # never left waiting if the client fails first
    port = listener.getsockname()[1]

    def cut_short() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                + f"Content-Length: {len(whole)}\r\n\r\n".encode()
                + whole[: len(whole) // 3]
            )

    server = threading.Thread(target=cut_short, daemon=True)
    server.start()
    cut = polyak.Run(polyak.Client(f"http://127.0.0.1:{port}"), run.info)
    with pytest.raises(polyak.PolyakError) as err:
        cut.download_to(snap, tmp_path / "cut", "c", progress=False)
    server.join(10)
    listener.close()
    assert err.value.code == "incomplete_download", err.value
    assert not list((tmp_path / "cut").iterdir())
    if hasattr(os, "splice"):
        assert spliced[-1] == len(whole), "the cut stream went through splice"
