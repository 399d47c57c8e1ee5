"""The fault-schedule test's parts: a seeded schedule of faults, the
injectors that apply them to a three-node service, the catalog audit that
records every snapshot write as it commits, and the checker that reads
the recorded history afterwards (Jepsen's shape: run, record, check).

Everything random comes from one seed: the schedule (kinds, targets,
durations, pauses between faults) and every pushed tensor, so a failing
seed reruns the same schedule (``POLYAK_NEMESIS_SEED``). The timing of what
the service does in between is the machine's; the checker judges the
history, whatever it is, against invariants that hold for every timing.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from polyak_testing import Backends, LabHost, PolyakServer
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

#: Nodes of the service.
NODES = 3

#: Every kind of fault, in the order a bounded schedule takes them.
KINDS = ("kill", "pause", "link_cut", "postgres_restart", "s3_stall", "disk_full")

#: Elements of each rank's tensor (float32): large enough that a capture
#: held per second shows in the process's memory, small enough for two
#: shared cores.
NUMEL = 1 << 17

#: A snapshot counts as durable before a takeover when it completed this
#: long before the claim (the claim's time is taken before its transaction).
COMMIT_MARGIN_MS = 250

#: The live EMA (float32 on the server) against the anchor, relative to
#: the anchor's largest element.
EMA_TOLERANCE = 1e-5


@dataclass(frozen=True)
class Fault:
    kind: str
    #: Index of the node it hits (kinds that hit one node).
    node: int
    #: Seconds the fault is held past what it waits for (a lapse to be
    #: seen, a takeover), or its whole length for outages.
    hold: float
    #: Seconds of quiet pushing before it.
    gap: float

    def __str__(self) -> str:
        return f"{self.kind}(node-{'abc'[self.node]}, hold {self.hold:.1f}s, after {self.gap:.1f}s)"


def schedule(seed: int, faults: int, kinds: list[str]) -> list[Fault]:
    """``faults`` faults drawn from ``kinds`` by ``seed``: every kind once
    (in an order the seed shuffles) before any repeats, so even a short
    schedule covers them all."""
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < faults:
        batch = list(kinds)
        rng.shuffle(batch)
        order += batch
    out = []
    for kind in order[:faults]:
        hold = {
            "kill": rng.uniform(0.0, 1.5),
            "pause": rng.uniform(0.5, 2.0),
            "link_cut": rng.uniform(0.5, 2.0),
            "postgres_restart": rng.uniform(0.5, 2.0),
            "s3_stall": rng.uniform(3.0, 8.0),
            "disk_full": rng.uniform(2.0, 5.0),
        }[kind]
        out.append(Fault(kind, rng.randrange(3), hold, rng.uniform(1.0, 3.0)))
    return out


def tensor_name(rank: int) -> str:
    return f"stage{rank}.w"


def weights(seed: int, rank: int, step: int) -> torch.Tensor:
    """The tensor rank ``rank`` pushes at ``step``: a pure function of the
    seed, so the reference needs no stored history."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + rank * 100_003 + step) % 2**63)
    return torch.randn(NUMEL, generator=g) + step * 0.01


def reference_ema(seed: int, rank: int, steps: list[int], beta: float) -> torch.Tensor:
    """``AveragedModel`` (the constant profile's anchor) fed the weights of
    ``steps`` in order."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(NUMEL))
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(beta))
    for step in steps:
        with torch.no_grad():
            model.w.copy_(weights(seed, rank, step))
        avg.update_parameters(model)
    return avg.module.w.detach().clone()


# ---------------------------------------------------------------------------
# The catalog audit: triggers that copy every snapshot write as it commits
# ---------------------------------------------------------------------------

#: Copies each snapshot row change and each recorded part into audit tables
#: with the catalog's clock, so the checker sees snapshots that retention
#: deleted since, and the moment each one completed.
AUDIT_SQL = """
CREATE TABLE IF NOT EXISTS nemesis_snapshots (
    id TEXT, run TEXT, kind TEXT, status TEXT, step BIGINT, detail TEXT,
    completed_at_ms BIGINT, at_ms BIGINT);
CREATE TABLE IF NOT EXISTS nemesis_files (
    snapshot TEXT, rank BIGINT, part TEXT, path TEXT, sha256 TEXT, bytes BIGINT,
    step BIGINT, at_ms BIGINT);
CREATE OR REPLACE FUNCTION nemesis_snapshot() RETURNS trigger AS $$
BEGIN
  INSERT INTO nemesis_snapshots VALUES (NEW.id, NEW.run, NEW.kind, NEW.status, NEW.step,
    NEW.detail, NEW.completed_at_ms,
    (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT);
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE OR REPLACE FUNCTION nemesis_file() RETURNS trigger AS $$
BEGIN
  INSERT INTO nemesis_files VALUES (NEW.snapshot, NEW.rank, NEW.part, NEW.path, NEW.sha256,
    NEW.bytes, NEW.step, (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT);
  RETURN NEW;
END $$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS nemesis_snapshot ON snapshots;
CREATE TRIGGER nemesis_snapshot AFTER INSERT OR UPDATE ON snapshots
  FOR EACH ROW EXECUTE FUNCTION nemesis_snapshot();
DROP TRIGGER IF EXISTS nemesis_file ON snapshot_files;
CREATE TRIGGER nemesis_file AFTER INSERT OR UPDATE ON snapshot_files
  FOR EACH ROW EXECUTE FUNCTION nemesis_file();
"""


class Catalog:
    """The service's PostgreSQL catalog, read with ``psql`` (JSON rows)."""

    def __init__(self, backends: Backends, url: str) -> None:
        self.pg = backends.postgres()
        self.db = url.rpartition("/")[2]

    def execute(self, sql: str) -> str:
        return self.pg.psql(sql, self.db)

    def rows(self, sql: str) -> list[dict[str, Any]]:
        out = self.execute(f"SELECT COALESCE(json_agg(t), '[]') FROM ({sql}) t")
        return list(json.loads(out))

    def is_complete(self, snapshot: str) -> bool:
        q = snapshot.replace("'", "''")
        return bool(self.rows(f"SELECT id FROM snapshots WHERE id = '{q}' AND status = 'complete'"))

    def not_durable(self, run: str, last_steps: dict[int, int | None]) -> dict[int, int | None]:
        """The ranks whose last step no complete snapshot of ``run`` holds
        yet, with the newest step one holds (the state writes after the
        last pushes not done)."""
        q = run.replace("'", "''")
        held: dict[int, int] = {}
        for r in self.rows(
            f"SELECT detail FROM snapshots WHERE run = '{q}' AND status = 'complete'"
        ):
            for rank, step in json.loads(r["detail"]).get("rank_steps", {}).items():
                held[int(rank)] = max(held.get(int(rank), -1), int(step))
        return {
            rank: held.get(rank)
            for rank, step in last_steps.items()
            if step is not None and held.get(rank, -1) < step
        }


# ---------------------------------------------------------------------------
# The cluster under faults
# ---------------------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def mount_small_disk(path: Path, size_mib: int) -> str | None:
    """Mounts a tmpfs of ``size_mib`` at ``path`` (a node's data dir), so
    the disk can be filled; the reason when this machine cannot."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a small filesystem needs root"
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    return None if made.returncode == 0 else f"mount failed: {made.stderr.strip()}"


class Cluster:
    """Three nodes, the backends they share, and the faults applied to
    them; ``healed()`` undoes whatever is still applied."""

    def __init__(
        self,
        backends: Backends,
        nodes: list[PolyakServer],
        hosts: list[LabHost | None],
        small_disks: bool,
        lease: float,
        log,
    ) -> None:
        self.backends = backends
        self.nodes = nodes
        self.hosts = hosts
        self.small_disks = small_disks
        self.lease = lease
        self.log = log
        self.paused: set[int] = set()
        self.cut: set[int] = set()
        self.s3_stopped = False
        self.fillers: list[Path] = []
        #: Peak resident bytes per node: this schedule's, and the whole run's.
        self.rss_peak: dict[str, int] = {}
        self.rss_peak_all: dict[str, int] = {}
        self._sampling = threading.Event()
        self._sampler: threading.Thread | None = None

    # -- observation -----------------------------------------------------

    def name(self, i: int) -> str:
        return f"node-{'abc'[i]}"

    def url_of_any(self, but: int | None = None) -> str:
        """A node answering now (not ``but``, not paused or cut)."""
        for i, node in enumerate(self.nodes):
            if i == but or i in self.paused or i in self.cut or node.proc is None:
                continue
            return node.url
        raise AssertionError("no node to ask")

    def statuses(self, via: str) -> dict[str, str]:
        r = httpx.get(f"{via}/v1/nodes", timeout=5)
        return {n["node"]: n["status"] for n in r.json()["nodes"]}

    def placement(self, run: str, via: str) -> dict[int, str]:
        r = httpx.get(f"{via}/v1/runs/{run}/placement", timeout=5)
        return {int(k): v["node"] for k, v in r.json().items()}

    def start_sampling(self) -> None:
        """Samples every node's resident memory twice a second."""

        def sample() -> None:
            while not self._sampling.wait(0.5):
                for i, node in enumerate(self.nodes):
                    proc = node.proc
                    if proc is None or proc.poll() is not None:
                        continue
                    got = rss_bytes(proc.pid)
                    if got is not None:
                        key = self.name(i)
                        self.rss_peak[key] = max(self.rss_peak.get(key, 0), got)
                        self.rss_peak_all[key] = max(self.rss_peak_all.get(key, 0), got)

        self._sampler = threading.Thread(target=sample, daemon=True)
        self._sampler.start()

    def stop_sampling(self) -> None:
        self._sampling.set()
        if self._sampler is not None:
            self._sampler.join(5)

    def rss_now(self) -> dict[str, int]:
        out = {}
        for i, node in enumerate(self.nodes):
            if node.proc is not None and (got := rss_bytes(node.proc.pid)) is not None:
                out[self.name(i)] = got
        return out

    # -- waiting ---------------------------------------------------------

    def wait(self, check, timeout: float, what: str, seen=lambda: None) -> bool:
        """Polls ``check`` (errors count as not yet) until true; False and
        a log line (with what ``seen`` says is there) when it never is."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                got = check()
                if got:
                    return True
                last = got
            except (httpx.HTTPError, ValueError, KeyError, AssertionError) as e:
                last = e
            time.sleep(0.2)
        try:
            there = seen()
        except (httpx.HTTPError, ValueError, KeyError, AssertionError) as e:
            there = e
        self.log(f"  timed out after {timeout:.0f}s waiting for {what} (last: {last!r}; {there})")
        return False

    def serves_again(self, i: int, run: str, timeout: float) -> bool:
        """Node ``i`` is ready, takes a catalog write and completes a
        snapshot of ``run`` within ``timeout`` seconds."""
        url = self.nodes[i].url
        deadline = time.monotonic() + timeout

        def serving() -> bool:
            with httpx.Client(base_url=url, timeout=5) as c:
                if c.get("/readyz").status_code != 200:
                    return False
                r = c.post(f"/v1/runs/{run}/snapshots", json={})
                if r.status_code != 202:
                    return False
                sid = r.json()["id"]
                while time.monotonic() < deadline:
                    row = c.get(f"/v1/runs/{run}/snapshots/{sid}").json()
                    if row["status"] == "complete":
                        return True
                    if row["status"] == "failed":
                        return False
                    time.sleep(0.1)
                return False

        return self.wait(serving, timeout, f"node {self.name(i)} serving after its disk was freed")

    def wait_lapsed(self, i: int, run: str) -> bool:
        """Node ``i`` seen expired by the others, and none of ``run``'s
        ranks placed on it any more (taken over)."""
        name = self.name(i)

        def gone() -> bool:
            via = self.url_of_any(but=i)
            return self.statuses(via).get(name) in ("expired", "left") and name not in set(
                self.placement(run, via).values()
            )

        def seen() -> str:
            via = self.url_of_any(but=i)
            return f"nodes {self.statuses(via)}, placement {self.placement(run, via)}"

        return self.wait(
            gone, 6 * self.lease + 30, f"{name}'s lease to lapse and its ranks to move", seen
        )

    def wait_all_live(self) -> bool:
        want = {self.name(i) for i in range(len(self.nodes))}

        def live() -> bool:
            return all(
                {n for n, s in self.statuses(node.url).items() if s == "live"} >= want
                for node in self.nodes
            )

        return self.wait(live, 90, "every node to be live, as every node sees it")

    # -- faults ----------------------------------------------------------

    def apply(self, fault: Fault, run: str) -> bool:
        """Applies ``fault``, holds it, and lifts it; False when something
        it waits for never came (a liveness failure)."""
        i, node = fault.node, self.nodes[fault.node]
        ok = True
        if fault.kind == "kill":
            node.kill()
            ok = self.wait_lapsed(i, run)
            time.sleep(fault.hold)
            node.start(same_port=True)
        elif fault.kind == "pause":
            os.kill(node.pid, signal.SIGSTOP)
            self.paused.add(i)
            ok = self.wait_lapsed(i, run)
            time.sleep(fault.hold)
            os.kill(node.pid, signal.SIGCONT)
            self.paused.discard(i)
        elif fault.kind == "link_cut":
            host = self.hosts[i]
            assert host is not None
            host.cut()
            self.cut.add(i)
            ok = self.wait_lapsed(i, run)
            time.sleep(fault.hold)
            host.mend()
            self.cut.discard(i)
        elif fault.kind == "postgres_restart":
            pg = self.backends.postgres()
            pg.stop(keep_data=True)
            time.sleep(fault.hold)
            pg.start()
        elif fault.kind == "s3_stall":
            s3 = self.backends.s3()
            assert s3.proc is not None
            os.kill(s3.proc.pid, signal.SIGSTOP)
            self.s3_stopped = True
            time.sleep(fault.hold)
            os.kill(s3.proc.pid, signal.SIGCONT)
            self.s3_stopped = False
        elif fault.kind == "disk_full":
            filler = self.fill_disk(node.data_dir)
            time.sleep(fault.hold)
            filler.unlink()
            self.fillers.remove(filler)
            # Space is back: the node serves pushes and snapshots again
            # within 10 s, without a restart.
            ok = self.serves_again(i, run, 10.0)
        else:
            raise ValueError(fault.kind)
        return ok

    def fill_disk(self, data_dir: Path) -> Path:
        """Writes a file until the data dir's filesystem is full."""
        filler = data_dir / "nemesis-filler"
        self.fillers.append(filler)
        chunk = b"\0" * (1 << 20)
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(chunk)
                f.flush()
        return filler

    def healed(self) -> None:
        """Lifts every fault still applied (after a failure midway)."""
        for i in list(self.paused):
            with contextlib.suppress(OSError):
                os.kill(self.nodes[i].pid, signal.SIGCONT)
            self.paused.discard(i)
        for i in list(self.cut):
            host = self.hosts[i]
            if host is not None:
                host.mend()
            self.cut.discard(i)
        if self.s3_stopped:
            s3 = self.backends.s3()
            if s3.proc is not None:
                os.kill(s3.proc.pid, signal.SIGCONT)
            self.s3_stopped = False
        for filler in self.fillers:
            filler.unlink(missing_ok=True)
        self.fillers.clear()
        pg = self.backends.postgres()
        if pg.proc is None:
            pg.start()
        for node in self.nodes:
            if node.proc is None:
                node.start(same_port=True)


# ---------------------------------------------------------------------------
# The trainer: one thread per rank, pushing through the real client
# ---------------------------------------------------------------------------


@dataclass
class RankLog:
    rank: int
    #: Steps whose push the pusher queued (each is acknowledged or raised).
    pushed: list[int] = field(default_factory=list)
    #: Steps the server refused (the pusher raised them), with the code.
    refused: dict[int, str] = field(default_factory=dict)
    #: What ended the rank's training loop other than a stop: a server
    #: fault must never reach the trainer (it would have exited non-zero).
    crashed: str | None = None


class Trainer:
    """Four ranks pushing step after step (``pace`` seconds apart) until
    stopped; each rank is a thread of its own with its own pusher, as in a
    job whose ranks run on machines of their own."""

    def __init__(self, run, seed: int, world: int, pace: float, retry) -> None:
        self.seed = seed
        self.pace = pace
        self.logs = [RankLog(r) for r in range(world)]
        # Each rank holds tensors of its own (pipeline stages), pushed whole.
        self.pushers = [
            # `block`: the checker counts every queued step as applied or
            # refused, so none may be dropped while a node is away.
            run.pusher(rank=r, retry=retry, split_replicated=False, policy="block")
            for r in range(world)
        ]
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(r,), daemon=True) for r in range(world)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _loop(self, rank: int) -> None:
        try:
            self._train(rank)
        except BaseException as e:  # the trainer process would have died
            self.logs[rank].crashed = f"{type(e).__name__}: {e}"

    def _train(self, rank: int) -> None:
        from polyak.errors import PolyakError

        pusher, log = self.pushers[rank], self.logs[rank]
        step = 0
        while not self._stop.is_set():
            try:
                pusher.push({tensor_name(rank): weights(self.seed, rank, step)}, step)
            except PolyakError as e:
                # A refused push is raised from the next call: that step
                # was not applied; this one was not queued, so it goes again.
                log.refused[int(e.step) if e.step is not None else -1] = str(e.code)
                continue
            log.pushed.append(step)
            step += 1
            self._stop.wait(self.pace)

    def acked(self, rank: int) -> int | None:
        return self.pushers[rank].stats().last_step

    def stop(self, timeout: float) -> list[str]:
        """Stops pushing and waits until everything queued is acknowledged;
        what could not be, per rank."""
        from polyak.errors import PolyakError

        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        problems = []
        for rank, pusher in enumerate(self.pushers):
            try:
                pusher.close(timeout)
            except PolyakError as e:
                if e.code == "flush_timeout":
                    problems.append(f"rank {rank}: {e}")
                else:
                    self.logs[rank].refused[int(e.step) if e.step is not None else -1] = str(e.code)
        return problems


# ---------------------------------------------------------------------------
# The checker
# ---------------------------------------------------------------------------


@dataclass
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.detail}"


@dataclass
class History:
    """What the checker reads: the catalog (placement log, failover events,
    the audit of snapshot writes, the snapshots complete now), the
    trainer's logs, and the memory figures."""

    run: str
    seed: int
    world: int
    beta: float
    pushed: dict[int, list[int]]
    refused: dict[int, dict[int, str]]
    #: Per rank, what ended its training loop (``None``: it ran to the stop).
    crashed: dict[int, str | None]
    placement_log: list[dict]
    placements: list[dict]
    failovers: list[dict]
    snapshot_audit: list[dict]
    file_audit: list[dict]
    complete_now: list[dict]
    files_now: list[dict]


def read_history(catalog: Catalog, trainer: Trainer, run: str, seed: int, beta: float) -> History:
    q = run.replace("'", "''")
    return History(
        run=run,
        seed=seed,
        world=len(trainer.logs),
        beta=beta,
        pushed={log.rank: list(log.pushed) for log in trainer.logs},
        refused={log.rank: dict(log.refused) for log in trainer.logs},
        crashed={log.rank: log.crashed for log in trainer.logs},
        placement_log=catalog.rows(
            f"SELECT rank, epoch, node_id, at_ms FROM placement_log WHERE run = '{q}' "
            "ORDER BY rank, epoch"
        ),
        placements=catalog.rows(
            f"SELECT rank, epoch, node_id FROM placements WHERE run = '{q}' ORDER BY rank"
        ),
        failovers=[
            {**json.loads(e["detail"]), "rank": e["rank"], "id": e["id"], "event_at_ms": e["at_ms"]}
            for e in catalog.rows(
                f"SELECT id, rank, at_ms, detail FROM events WHERE run = '{q}' "
                "AND kind = 'failover' ORDER BY id"
            )
        ],
        snapshot_audit=catalog.rows(
            f"SELECT * FROM nemesis_snapshots WHERE run = '{q}' ORDER BY at_ms"
        ),
        file_audit=catalog.rows(
            "SELECT f.* FROM nemesis_files f WHERE f.snapshot IN "
            f"(SELECT id FROM nemesis_snapshots WHERE run = '{q}') ORDER BY f.at_ms"
        ),
        complete_now=catalog.rows(
            f"SELECT id, kind, step, detail FROM snapshots WHERE run = '{q}' "
            "AND status = 'complete'"
        ),
        files_now=catalog.rows(
            "SELECT snapshot, rank, part, path, sha256, bytes FROM snapshot_files WHERE snapshot IN "
            f"(SELECT id FROM snapshots WHERE run = '{q}' AND status = 'complete')"
        ),
    )


def failover_reports(h: History) -> dict[tuple[int, int], dict]:
    """Per (rank, epoch) the failover's report, its last event (the one
    with ``lost_steps`` once the trainer pushed again)."""
    out: dict[tuple[int, int], dict] = {}
    for e in h.failovers:
        out[(int(e["rank"]), int(e["epoch"]))] = e
    return out


def check(h: History, read_part, live_ema) -> list[Violation]:
    """Every invariant over one schedule's history. ``read_part(part)``
    reads a stored part's bytes (see ``check_parts``); ``live_ema(rank)`` the rank's live EMA
    (its step and tensor)."""
    reports = failover_reports(h)
    epochs: dict[int, list[dict]] = {r: [] for r in range(h.world)}
    for row in h.placement_log:
        epochs[int(row["rank"])].append(row)
    complete_at: dict[str, int] = {}
    for row in h.snapshot_audit:
        if row["status"] == "complete" and row["id"] not in complete_at:
            complete_at[row["id"]] = int(row["at_ms"])
    v = check_owners(h, epochs)
    # Every trainer exited 0: nothing the servers did reached a training step.
    v += [
        Violation("trainer_exited_0", f"rank {rank}'s training loop died: {why}")
        for rank, why in h.crashed.items()
        if why is not None
    ]
    v += check_stale_writes(h, epochs, reports, complete_at)
    applied: dict[int, list[int] | None] = {}
    for rank in range(h.world):
        applied[rank] = check_failovers(h, rank, epochs[rank], reports, complete_at, v)
    v += check_parts(h, read_part)
    v += check_live_ema(h, applied, live_ema)
    v += check_captures(h, NODES)
    return v


def check_owners(h: History, epochs: dict[int, list[dict]]) -> list[Violation]:
    """The placement log: epochs 1, 2, ... of each rank, one owner each,
    the placement row its last."""
    v = []
    for rank, rows in epochs.items():
        numbers = [int(r["epoch"]) for r in rows]
        if numbers != list(range(1, len(numbers) + 1)):
            v.append(Violation("one_owner_per_epoch", f"rank {rank}: epochs {numbers} in the log"))
    for row in h.placements:
        rank, rows = int(row["rank"]), epochs[int(row["rank"])]
        last = (int(rows[-1]["epoch"]), rows[-1]["node_id"]) if rows else None
        if last != (int(row["epoch"]), row["node_id"]):
            v.append(
                Violation(
                    "one_owner_per_epoch",
                    f"rank {rank}: placed on {row['node_id']} at epoch {row['epoch']}, "
                    f"the log's last owner is {last}",
                )
            )
    return v


def check_stale_writes(
    h: History,
    epochs: dict[int, list[dict]],
    reports: dict[tuple[int, int], dict],
    complete_at: dict[str, int],
) -> list[Violation]:
    """A part recorded while epoch e > 1 is current must be its owner's,
    whose EMA of the rank holds the restored step and then every step from
    the first push after the failover on. A part at any other step was
    written by an owner of an earlier epoch: two owners wrote the rank in
    one epoch. One violation per (rank, epoch, step), naming the parts."""
    stale: dict[tuple[int, int, int], list[dict]] = {}
    for f in h.file_audit:
        rank, step, at = int(f["rank"]), int(f["step"]), int(f["at_ms"])
        current = [r for r in epochs[rank] if int(r["at_ms"]) <= at]
        if not current or int(current[-1]["epoch"]) == 1:
            continue
        epoch = int(current[-1]["epoch"])
        rep = reports.get((rank, epoch))
        if rep is None:
            continue  # reported as failover_reported
        restored, resumed = rep.get("restored_step"), rep.get("resumed_step")
        if step == restored or (resumed is not None and step >= resumed):
            continue
        stale.setdefault((rank, epoch, step), []).append(f)
    v = []
    for (rank, epoch, step), parts in sorted(stale.items()):
        owner, before = epochs[rank][epoch - 1], epochs[rank][epoch - 2]
        rep = reports[(rank, epoch)]
        ids = sorted({f["snapshot"] for f in parts})
        done = [i for i in ids if i in complete_at]
        after = [int(f["at_ms"]) - int(owner["at_ms"]) for f in parts]
        v.append(
            Violation(
                "one_owner_per_epoch",
                f"rank {rank} epoch {epoch} (owner {owner['node_id']} since "
                f"{owner['at_ms']} ms, restored at step {rep.get('restored_step')}, resumed at "
                f"{rep.get('resumed_step')}): {len(parts)} part(s) at step {step}, which only "
                f"an earlier owner held (epoch {epoch - 1}: {before['node_id']}), recorded "
                f"{min(after)}..{max(after)} ms after the takeover, in snapshots {ids} "
                f"({len(done)} of them completed)",
            )
        )
    return v


def check_failovers(
    h: History,
    rank: int,
    rows: list[dict],
    reports: dict[tuple[int, int], dict],
    complete_at: dict[str, int],
    v: list[Violation],
) -> list[int] | None:
    """Each change of hands of ``rank``: reported, restored no older than
    the durable state before it and from its previous owner's history,
    its lost steps as reported. Returns the steps the rank's EMA applied
    (``None`` when the history cannot say)."""
    refused = set(h.refused[rank])
    acked = [s for s in h.pushed[rank] if s not in refused]
    for s, code in sorted(h.refused[rank].items()):
        v.append(Violation("acknowledged", f"rank {rank}: step {s} refused ({code})"))
    durable = [
        (complete_at[f["snapshot"]], int(f["step"]), f["snapshot"])
        for f in h.file_audit
        if int(f["rank"]) == rank and f["snapshot"] in complete_at
    ]
    taken = rows[1:]
    # Each epoch's first push; the steps between two are the earlier's.
    starts: list[int | None] = []
    for row in taken:
        rep = reports.get((rank, int(row["epoch"])))
        if rep is None:
            v.append(Violation("failover_reported", f"rank {rank} epoch {row['epoch']}: no event"))
            return None
        starts.append(rep.get("resumed_step"))
    first_end = next((s for s in starts if s is not None), None)
    history = [s for s in acked if first_end is None or s < first_end]
    for k, row in enumerate(taken):
        epoch, taken_at = int(row["epoch"]), int(row["at_ms"])
        rep = reports[(rank, epoch)]
        restored, resumed, lost = (
            rep.get(x) for x in ("restored_step", "resumed_step", "lost_steps")
        )
        # (Completed a moment before the claim: its commit may not be what
        # the claimer read.)
        done = [d for d in durable if d[0] < taken_at - COMMIT_MARGIN_MS]
        if done:
            at, best, sid = max(done, key=lambda d: d[1])
            if restored is None or restored < best:
                v.append(
                    Violation(
                        "restore_not_behind_durable",
                        f"rank {rank} epoch {epoch} (taken by {row['node_id']} at {taken_at} "
                        f"ms): restored step {restored} from {rep.get('snapshot')}, but "
                        f"snapshot {sid} holding step {best} completed at {at} ms, before "
                        "the takeover",
                    )
                )
        if restored is not None and restored not in history:
            v.append(
                Violation(
                    "restore_not_behind_durable",
                    f"rank {rank} epoch {epoch}: restored step {restored} "
                    f"({rep.get('snapshot')}), which the EMA of epoch {epoch - 1} never held "
                    "(a stale owner's write)",
                )
            )
        history = [s for s in history if restored is not None and s <= restored]
        if resumed is None:
            if k == len(taken) - 1:
                v.append(
                    Violation(
                        "failover_reported",
                        f"rank {rank} epoch {epoch}: the first push after the failover "
                        "never reported (resumed_step, lost_steps unset)",
                    )
                )
                return None
            continue  # taken again before any push reached it
        gap = [s for s in acked if (restored is None or s > restored) and s < resumed]
        if lost is None or int(lost) != len(gap):
            v.append(
                Violation(
                    "lost_as_reported",
                    f"rank {rank} epoch {epoch}: {len(gap)} acknowledged steps between "
                    f"restored {restored} and resumed {resumed}, reported lost {lost}",
                )
            )
        later = next((s for s in starts[k + 1 :] if s is not None), None)
        history += [s for s in acked if s >= resumed and (later is None or s < later)]
    return history


def check_live_ema(h: History, applied: dict[int, list[int] | None], live_ema) -> list[Violation]:
    """Each rank's live EMA at its last acknowledged step, equal to
    ``AveragedModel`` fed the steps its history applied."""
    v = []
    for rank, steps in applied.items():
        if steps is None:
            continue
        got_step, got = live_ema(rank)
        last = max((s for s in h.pushed[rank] if s not in h.refused[rank]), default=None)
        if got_step != last:
            v.append(
                Violation(
                    "live_ema", f"rank {rank}: live EMA at step {got_step}, last acked {last}"
                )
            )
        want = reference_ema(h.seed, rank, steps, h.beta).double()
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        if err > EMA_TOLERANCE:
            v.append(
                Violation(
                    "live_ema",
                    f"rank {rank}: live EMA differs from the reference fed {len(steps)} steps "
                    f"(max rel err {err:.3g}; gaps at {_gaps(steps)})",
                )
            )
    return v


def check_captures(h: History, nodes: int) -> list[Violation]:
    """Background work is bounded: each node has at most one ``state``
    snapshot of the run being written at a time, so the run never has
    more than ``nodes`` pending at once (a capture per second piling up
    while the store hangs holds a copy of the EMA each). Counted over the
    snapshots whose write ended (complete or failed)."""
    spans: dict[str, list[int | None]] = {}
    for row in h.snapshot_audit:
        if row["kind"] != "state":
            continue
        span = spans.setdefault(row["id"], [None, None])
        if row["status"] == "pending" and span[0] is None:
            span[0] = int(row["at_ms"])
        elif row["status"] in ("complete", "failed") and span[1] is None:
            span[1] = int(row["at_ms"])
    edges = []
    for sid, (start, end) in spans.items():
        if start is not None and end is not None:
            edges += [(start, 1, sid), (end, -1, sid)]
    open_now: set[str] = set()
    worst: tuple[int, int, list[str]] = (0, 0, [])
    for at, delta, sid in sorted(edges):
        if delta > 0:
            open_now.add(sid)
            if len(open_now) > worst[0]:
                worst = (len(open_now), at, sorted(open_now))
        else:
            open_now.discard(sid)
    if worst[0] > nodes:
        return [
            Violation(
                "bounded_captures",
                f"{worst[0]} state snapshots of the run pending at once at {worst[1]} ms "
                f"(at most {nodes}, one per node): {worst[2]}",
            )
        ]
    return []


def check_parts(h: History, read_part) -> list[Violation]:
    """Every part of every complete snapshot, read back from the store,
    has the size and sha256 the catalog recorded. ``read_part(part)``
    answers its bytes, or ``None`` when its snapshot is no longer complete
    in the catalog (retention deleted it since the listing)."""
    v = []
    for f in h.files_now:
        try:
            data = read_part(f)
        except Exception as e:  # listed and unreadable: as broken as a wrong hash
            v.append(Violation("parts_match_sha256", f"{f['snapshot']} {f['path']}: {e!r}"))
            continue
        if data is None:
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest != f["sha256"] or len(data) != int(f["bytes"]):
            v.append(
                Violation(
                    "parts_match_sha256",
                    f"snapshot {f['snapshot']} rank {f['rank']} part {f['part']}: "
                    f"{len(data)} bytes sha256 {digest}, recorded {f['bytes']} {f['sha256']}",
                )
            )
    return v


def _gaps(steps: list[int]) -> str:
    gaps = [f"{a + 1}..{b - 1}" for a, b in itertools.pairwise(steps) if b > a + 1]
    return ", ".join(gaps) or "none"
