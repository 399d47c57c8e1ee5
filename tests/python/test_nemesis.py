"""The nemesis: a seeded random schedule of faults against a three-node
service on PostgreSQL and SeaweedFS while four ranks push through the real
client, and a checker that reads the recorded history afterwards.

Faults: ``kill`` (SIGKILL, held until its ranks are taken over, then the
node restarts), ``pause`` (SIGSTOP past the lease, then SIGCONT),
``link_cut`` (the node's network namespace cut off, then mended; skipped,
with the reason, where namespaces cannot be made), ``postgres_restart``,
``s3_stall`` (SeaweedFS SIGSTOPped) and ``disk_full`` (the node's data dir,
a small tmpfs, filled; skipped where it cannot be mounted). One fault at a
time; after each, the test waits (generous timeouts, no fixed sleeps) until
every node is live and every rank acknowledges again.

Invariants, per schedule (see ``nemesis.check``):

- ``one_owner_per_epoch``: the catalog's placement log has one owner per
  (rank, epoch), epochs counting up from 1, the placement row its last; and
  no snapshot part was recorded for a rank, while a later epoch was current,
  at a step only an earlier owner held (a stale owner's durable write).
- ``failover_reported`` / ``lost_as_reported``: every change of hands has
  its failover report, whose ``lost_steps`` are exactly the acknowledged
  steps between the restored step and the first push after.
- ``restore_not_behind_durable``: no takeover restored a step older than a
  complete snapshot holding the rank before it, nor a step the rank's
  previous owner never held.
- ``live_ema``: every rank's live EMA equals ``AveragedModel`` fed the
  steps its history says were applied (every acknowledged step but the
  reported lost ones), at the last acknowledged step.
- ``parts_match_sha256``: every part of every complete snapshot, read back
  from the store, hashes to the sha256 the catalog recorded.
- ``memory``: no node's resident memory grew past its bound;
  ``bounded_captures``: no more ``state`` snapshots of the run pending at
  once than there are nodes (one capture in flight per node).
- ``acknowledged`` / ``liveness``: no push refused, everything queued
  acknowledged once the faults are lifted; a node whose full disk was
  freed is ready, records a catalog write and completes a snapshot within
  10 s, with no restart.
- ``trainer_exited_0``: no rank's training loop ended on an error: nothing
  the servers did reached a training step.

``POLYAK_NEMESIS_SEED`` picks the seed (printed at the start and in a
failure), ``POLYAK_NEMESIS_SCHEDULES`` how many schedules (seeds ``SEED``,
``SEED + 1``, ...), ``POLYAK_NEMESIS_FAULTS`` faults per schedule and
``POLYAK_NEMESIS_SECONDS`` a time budget: schedules go on until it is
spent. The suite runs one schedule of six faults, every kind once.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from collections import Counter

import polyak
import pytest
from nemesis import (
    AUDIT_SQL,
    KINDS,
    NUMEL,
    Catalog,
    Cluster,
    History,
    Trainer,
    Violation,
    check,
    mount_small_disk,
    read_history,
    reference_ema,
    schedule,
    tensor_name,
    weights,
)
from polyak import RetryPolicy
from polyak_testing import Backends, NetLab, wait_for

LEASE = 3.0
BETA = 0.9
#: Seconds between one rank's pushes.
PACE = 0.15
#: Resident memory a node may grow by over its own level before the faults.
MEMORY_SLACK = 256 << 20
#: The small data dirs' size; the reserve keeps state writes off a full one.
DISK_MIB = 64
DISK_RESERVE = "8MiB"

DEFAULT_SEED = 20261206


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


@pytest.fixture()
def lab():
    reason = NetLab.unavailable()
    if reason is not None:
        yield None, reason
        return
    net = NetLab().start()
    try:
        yield net, None
    finally:
        net.close()


@pytest.mark.slow
def test_invariants_hold_under_a_seeded_fault_schedule(tmp_path, backends: Backends, lab):
    seed = _env_int("POLYAK_NEMESIS_SEED", DEFAULT_SEED)
    schedules = _env_int("POLYAK_NEMESIS_SCHEDULES", 1)
    budget = _env_int("POLYAK_NEMESIS_SECONDS", 0)
    net, no_lab = lab
    print(f"\nnemesis seed={seed} (rerun: POLYAK_NEMESIS_SEED={seed})", flush=True)

    kinds = list(KINDS)
    skipped: dict[str, str] = {}
    if net is None:
        kinds.remove("link_cut")
        skipped["link_cut"] = no_lab or ""
    root = tmp_path / "nodes"
    disks = []
    for letter in "abc":
        reason = mount_small_disk(root / letter, DISK_MIB)
        if reason is not None:
            skipped["disk_full"] = reason
            break
        disks.append(root / letter)
    if "disk_full" in skipped:
        kinds.remove("disk_full")
    for kind, reason in skipped.items():
        print(f"nemesis: fault kind {kind} skipped: {reason}", flush=True)
    faults_each = _env_int("POLYAK_NEMESIS_FAULTS", len(kinds))

    catalog_url, nodes = backends.cluster(
        root, 3, "--lease-secs", str(LEASE), "--disk-reserve", DISK_RESERVE, lab=net
    )
    hosts = list(net.hosts) if net is not None else [None, None, None]
    cluster = Cluster(backends, nodes, hosts, bool(disks), LEASE, log=print)
    injected: Counter[str] = Counter()
    violations: list[tuple[int, Violation]] = []
    ran = 0
    started = time.monotonic()
    try:
        for node in nodes:
            node.start()
        catalog = Catalog(backends, catalog_url)
        catalog.execute(AUDIT_SQL)
        cluster.start_sampling()
        while True:
            this_seed = seed + ran
            found = _one_schedule(cluster, catalog, this_seed, faults_each, kinds, injected)
            violations += [(this_seed, x) for x in found]
            ran += 1
            if budget:
                if time.monotonic() - started >= budget:
                    break
            elif ran >= schedules:
                break
    finally:
        cluster.stop_sampling()
        cluster.healed()
        for node in nodes:
            node.stop()
        for disk in disks:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)

    print(
        f"nemesis summary: seed {seed}, schedules run {ran}, faults injected "
        f"{dict(sorted(injected.items()))} ({sum(injected.values())} in all), skipped kinds "
        f"{sorted(skipped)}, invariant violations {len(violations)} "
        f"{dict(sorted(Counter(x.invariant for _, x in violations).items()))}, peak resident memory "
        f"{ {k: f'{v / 2**20:.0f} MiB' for k, v in sorted(cluster.rss_peak_all.items())} }, "
        f"{time.monotonic() - started:.0f} s",
        flush=True,
    )
    for s, x in violations:
        print(f"  seed {s}: {x}", flush=True)
    assert not violations, (
        f"{len(violations)} invariant violation(s); rerun with POLYAK_NEMESIS_SEED={seed}"
        + (f" POLYAK_NEMESIS_SCHEDULES={ran}" if ran > 1 else "")
        + ":\n"
        + "\n".join(f"seed {s}: {x}" for s, x in violations)
    )


def _one_schedule(
    cluster: Cluster,
    catalog: Catalog,
    seed: int,
    faults: int,
    kinds: list[str],
    injected: Counter[str],
) -> list[Violation]:
    plan = schedule(seed, faults, kinds)
    print(f"nemesis schedule seed={seed}: " + ", ".join(map(str, plan)), flush=True)
    run_name = f"nemesis-{seed}"
    found: list[Violation] = []
    with polyak.Client(cluster.url_of_any()) as client:
        run = client.create_run(
            run_name,
            world_size=4,
            persist_every_secs=1,
            profiles=[{"name": "c", "kind": "constant", "beta": BETA}],
        )
        # Short request timeouts: a push to a paused or cut-off node must
        # give up and go to the rank's new owner, not wait minutes.
        retry = RetryPolicy(base_delay=0.05, max_delay=0.5, report_after=600, request_timeout=10)
        trainer = Trainer(run, seed, 4, PACE, retry)
        trainer.start()

        def progressed(since: list[int | None]) -> bool:
            now = [trainer.acked(r) for r in range(4)]
            return all(
                n is not None and (s is None or n > s) for n, s in zip(now, since, strict=True)
            )

        if not cluster.wait(lambda: progressed([None] * 4), 60, "every rank's first push"):
            found.append(Violation("liveness", "the ranks never acknowledged a first push"))
        # Let the first state snapshots land; the memory levels to bound.
        cluster.wait(lambda: _has_state(catalog, run_name), 30, "a first state snapshot")
        base = cluster.rss_now()
        cluster.rss_peak.clear()
        try:
            for fault in plan:
                time.sleep(fault.gap)
                since = [trainer.acked(r) for r in range(4)]
                print(f"  fault {fault}", flush=True)
                injected[fault.kind] += 1
                if not cluster.apply(fault, run_name):
                    found.append(Violation("liveness", f"{fault}: what it waits for never came"))
                if not cluster.wait_all_live():
                    found.append(Violation("liveness", f"after {fault}: not every node live"))
                if not cluster.wait(lambda s=since: progressed(s), 90, "every rank to push again"):
                    found.append(
                        Violation("liveness", f"after {fault}: a rank acknowledged nothing")
                    )
        finally:
            cluster.healed()
        cluster.wait_all_live()
        problems = trainer.stop(120)
        found += [Violation("liveness", p) for p in problems]
        # Every change of hands reported with its lost steps (the writer
        # stores events a moment after they happen).
        cluster.wait(lambda: _reports_complete(catalog, run_name), 60, "every failover's report")
        # The state writes of the last pushes land (and retention after
        # them) before the history is read.
        last = {r: trainer.acked(r) for r in range(4)}
        if not cluster.wait(
            lambda: not catalog.not_durable(run_name, last),
            60,
            "the last steps to be durable",
            lambda: f"newest durable steps {catalog.not_durable(run_name, last)}",
        ):
            found.append(
                Violation(
                    "liveness",
                    f"the last steps {last} not durable 60 s after the last push: newest "
                    f"complete {catalog.not_durable(run_name, last)}",
                )
            )
        history = read_history(catalog, trainer, run_name, seed, BETA)
        pending = catalog.rows(
            f"SELECT id FROM snapshots WHERE run = '{run_name}' AND status = 'pending'"
        )
        print(
            f"  history: {sum(len(p) for p in history.pushed.values())} pushes, "
            f"{len(history.placement_log) - 4} takeovers, "
            f"{len({a['id'] for a in history.snapshot_audit if a['status'] == 'complete'})} "
            f"snapshots completed, {len(history.files_now)} parts now, "
            f"{len(pending)} snapshots still pending",
            flush=True,
        )
        store = cluster.backends.store_of(cluster.nodes[0])

        def live_ema(rank: int):
            ema = run.rank_ema(rank, "c")
            return ema.step, ema.tensors[tensor_name(rank)]

        def read_part(part: dict) -> bytes | None:
            try:
                return store.read(part["path"])
            except Exception:
                if not catalog.is_complete(part["snapshot"]):
                    return None  # deleted since it was listed
                raise

        found += check(history, read_part, live_ema)
        # Later schedules start on a service without this run's ranks.
        client.delete_run(run_name)
    # Memory: each node within its bound over its own level before the
    # faults (a restarted node starts lower, so the highest level bounds).
    level = max(base.values(), default=0)
    for name, peak in cluster.rss_peak.items():
        if peak > level + MEMORY_SLACK:
            found.append(
                Violation(
                    "memory",
                    f"{name}: resident {peak / 2**20:.0f} MiB, over the bound "
                    f"{(level + MEMORY_SLACK) / 2**20:.0f} MiB (level before the faults "
                    f"{level / 2**20:.0f} MiB; a rank's EMA is {NUMEL * 4 / 2**20:.1f} MiB)",
                )
            )
    for x in found:
        print(f"  violation: {x}", flush=True)
    return found


def _has_state(catalog: Catalog, run: str) -> bool:
    rows = catalog.rows(
        f"SELECT id FROM snapshots WHERE run = '{run}' AND kind = 'state' AND status = 'complete'"
    )
    return bool(rows)


def _reports_complete(catalog: Catalog, run: str) -> bool:
    """Each rank's latest change of hands (epoch > 1) has a failover event
    whose ``lost_steps`` is set (an earlier one may have had no push before
    the next takeover)."""
    taken = catalog.rows(
        f"SELECT rank, MAX(epoch) AS epoch FROM placement_log WHERE run = '{run}' "
        "GROUP BY rank HAVING MAX(epoch) > 1"
    )
    reported = catalog.rows(
        f"SELECT rank, detail FROM events WHERE run = '{run}' AND kind = 'failover'"
    )
    done = set()
    for e in reported:
        detail = json.loads(e["detail"])
        if detail.get("lost_steps") is not None:
            done.add((int(e["rank"]), int(detail["epoch"])))
    return all((int(t["rank"]), int(t["epoch"])) in done for t in taken)


def test_the_checker_flags_each_invariant():
    """The checker against histories written by hand (no service): a clean
    one passes, and each kind of broken one is reported under its
    invariant, naming the rank, epoch and step."""
    seed, beta = 7, 0.9
    part = b"part bytes"
    digest = hashlib.sha256(part).hexdigest()

    def history(**change) -> History:
        fields = dict(
            run="r",
            seed=seed,
            world=1,
            beta=beta,
            pushed={0: list(range(10))},
            refused={0: {}},
            crashed={0: None},
            placement_log=[
                {"rank": 0, "epoch": 1, "node_id": "node-a", "at_ms": 1000},
                {"rank": 0, "epoch": 2, "node_id": "node-b", "at_ms": 5000},
            ],
            placements=[{"rank": 0, "epoch": 2, "node_id": "node-b"}],
            # node-a's state at step 4; steps 5..7 it acknowledged are lost.
            failovers=[
                {"rank": 0, "epoch": 2, "restored_step": 4, "resumed_step": None},
                {"rank": 0, "epoch": 2, "restored_step": 4, "resumed_step": 8, "lost_steps": 3},
            ],
            snapshot_audit=[
                {"id": "s1", "kind": "state", "status": "pending", "at_ms": 2900},
                {"id": "s1", "kind": "state", "status": "complete", "at_ms": 3000},
            ],
            file_audit=[{"snapshot": "s1", "rank": 0, "part": "c", "step": 4, "at_ms": 2990}],
            complete_now=[],
            files_now=[
                {"snapshot": "s1", "rank": 0, "part": "c", "path": "k", "sha256": digest,
                 "bytes": len(part)}
            ],
        )  # fmt: skip
        fields.update(change)
        return History(**fields)

    applied = [0, 1, 2, 3, 4, 8, 9]

    def run(h: History, stored: bytes = part, ema_steps=applied, ema_step: int = 9):
        ema = reference_ema(seed, 0, ema_steps, beta)
        return [str(x) for x in check(h, lambda part: stored, lambda rank: (ema_step, ema))]

    assert run(history()) == []

    def only(found: list[str], invariant: str, *words: str) -> None:
        assert found and all(f.startswith(f"[{invariant}]") for f in found), found
        assert all(w in found[0] for w in words), (found, words)

    # A restore older than a snapshot complete before the takeover.
    behind = history(
        failovers=[{"rank": 0, "epoch": 2, "restored_step": 2, "resumed_step": 8, "lost_steps": 5}]
    )
    only(run(behind, ema_steps=[0, 1, 2, 8, 9]), "restore_not_behind_durable", "epoch 2", "s1")
    # Lost steps that the report does not count.
    miscounted = history(
        failovers=[{"rank": 0, "epoch": 2, "restored_step": 4, "resumed_step": 8, "lost_steps": 2}]
    )
    only(run(miscounted), "lost_as_reported", "rank 0 epoch 2", "reported lost 2")
    # node-a writes step 6 after node-b took the rank (epoch 2).
    stale = history(
        file_audit=[
            {"snapshot": "s1", "rank": 0, "part": "c", "step": 4, "at_ms": 2990},
            {"snapshot": "s2", "rank": 0, "part": "c", "step": 6, "at_ms": 6000},
        ]
    )
    only(run(stale), "one_owner_per_epoch", "step 6", "epoch 2")
    # The placement row disagrees with the log.
    moved = history(placements=[{"rank": 0, "epoch": 2, "node_id": "node-c"}])
    only(run(moved), "one_owner_per_epoch", "node-c")
    # A server fault that reached a training step (the trainer died).
    died = history(crashed={0: "PolyakError: 409 predecessor_timeout"})
    only(run(died), "trainer_exited_0", "rank 0", "predecessor_timeout")
    # A change of hands without its report.
    only(run(history(failovers=[])), "failover_reported", "epoch 2")
    # The live EMA holds the lost steps after all (or stops short).
    only(run(history(), ema_steps=list(range(10))), "live_ema", "rank 0")
    only(run(history(), ema_step=8), "live_ema", "step 8")
    # A part whose bytes changed (same size).
    only(run(history(), stored=b"part bytez"), "parts_match_sha256", "s1")
    # State writes piling up: four pending at once on three nodes.
    piled = [
        {"id": f"p{i}", "kind": "state", "status": status, "at_ms": at}
        for i in range(4)
        for status, at in (("pending", 3100 + i), ("failed", 3200 + i))
    ]
    only(run(history(snapshot_audit=history().snapshot_audit + piled)), "bounded_captures", "4")
    # A refused push.
    only(run(history(refused={0: {9: "step_conflict"}}), ema_steps=applied[:-1], ema_step=8),
         "acknowledged", "step 9")  # fmt: skip


def test_pushes_during_a_stalled_state_write_are_persisted(tmp_path, backends: Backends):
    """Found by the nemesis (S3 stall): while the store hangs, the state
    write that captured step 1 cannot finish. Steps 2 and 3 arrive under it;
    the persists that fall due meanwhile are skipped (one write in flight per
    run, counted), so nothing piles up. Once the store is back, step 3 must
    still be written: the finished write of step 1 must not mark the run
    persisted, and the run's newest state snapshot reaches step 3 without
    another push."""
    s3 = backends.s3()
    srv = backends.server("sqlite-s3", tmp_path / "data")
    srv.start()
    stalled = False
    try:
        with polyak.Client(srv.url) as client:
            run = client.create_run(
                "overlap",
                persist_every_secs=1,
                profiles=[{"name": "c", "kind": "constant", "beta": BETA}],
            )
            rows = lambda: client.request(  # noqa: E731
                "GET", "/v1/runs/overlap/snapshots", params={"kind": "state"}
            ).json()["snapshots"]

            def newest_complete() -> int | None:
                done = [s["detail"]["rank_steps"]["0"] for s in rows() if s["status"] == "complete"]
                return max(done, default=None)

            def pending() -> int:
                return sum(s["status"] == "pending" for s in rows())

            def skipped() -> float:
                text = client.request("GET", "/metrics").text
                for line in text.splitlines():
                    if line.startswith('polyak_state_persist_skipped_total{run="overlap"}'):
                        return float(line.split()[-1])
                return 0.0

            with run.pusher(rank=0) as p:
                p.push({"w": weights(1, 0, 0)}, 0)
                p.flush()
                wait_for(lambda: newest_complete() == 0, 30, "step 0 persisted")
                assert s3.proc is not None
                os.kill(s3.proc.pid, signal.SIGSTOP)
                stalled = True
                p.push({"w": weights(1, 0, 1)}, 1)
                p.flush()
                wait_for(lambda: pending() == 1, 30, "the write of step 1")
                for step in (2, 3):
                    p.push({"w": weights(1, 0, step)}, step)
                    p.flush()
                before = skipped()
                wait_for(lambda: skipped() >= before + 2, 30, "due persists skipped")
                assert pending() == 1, "a second state write started under the stalled one"
                os.kill(s3.proc.pid, signal.SIGCONT)
                stalled = False
                wait_for(lambda: pending() == 0, 30, "the write to finish")
                # Several persist intervals: step 3 is written, or never.
                wait_for(lambda: newest_complete() == 3, 10, "step 3 persisted")
    finally:
        if stalled and s3.proc is not None:
            os.kill(s3.proc.pid, signal.SIGCONT)
        srv.stop()
