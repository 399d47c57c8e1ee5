"""The catalog recovers by itself after a full disk.

SQLite: with the data dir on a small tmpfs filled to the last byte while
pushes apply and snapshots and state are written, SQLite's writes fail (its
WAL cannot grow). Once the space is freed the node serves pushes, snapshots
and every catalog read again within seconds, with no restart: a write that
failed rolled back, the connection that saw it is replaced, and the WAL is
checkpointed.

PostgreSQL: with its data directory on a small tmpfs, a full disk does one
of two things. A data file that cannot grow fails the statement (SQLSTATE
53100) and PostgreSQL goes on; a WAL segment that cannot be made is a
PANIC, and the crash recovery that follows needs a segment too, so the
postmaster exits and stays down until an operator starts it again. In both
the server answers 503 (never 500), `/readyz` says why, what it acknowledged
stays, and once space is back (and PostgreSQL, where it stopped) it serves
again within seconds without a restart of its own.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from polyak_testing import PolyakServer, PostgresService


def body(step: int) -> bytes:
    g = torch.Generator().manual_seed(step)
    return safetensors.torch.save({"w": torch.randn(256 * 1024, generator=g)})  # 1 MiB


@pytest.fixture()
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs for a real full disk")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"mount failed: {made.stderr!r}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> Path:
    """Writes a file on ``path``'s filesystem until it holds no more."""
    filler = path / "filler"
    chunk = b"\0" * (1 << 16)
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(chunk)
    return filler


def test_the_catalog_serves_again_once_space_is_freed(small_disk):
    srv = PolyakServer(small_disk / "data", "--disk-reserve", "0")
    srv.start()
    run = "full"
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = c.post("/v1/runs", json={"name": run, "world_size": 1, "persist_every_secs": 1})
            assert r.status_code == 201, r.text
            step = 0
            for _ in range(3):
                assert c.put(f"/v1/runs/{run}/ranks/0/steps/{step}", content=body(step)).is_success
                step += 1
            filler = fill(small_disk)
            # Work while the disk is full: pushes, snapshots, state writes,
            # events, annotations. Some fail; none may wedge the catalog.
            t0 = time.monotonic()
            while time.monotonic() - t0 < 6:
                c.put(f"/v1/runs/{run}/ranks/0/steps/{step}", content=body(step))
                step += 1
                c.post(f"/v1/runs/{run}/snapshots", json={})
                c.patch(f"/v1/runs/{run}", json={"note": f"full {step}"})
                time.sleep(0.2)
            ready = c.get("/readyz")
            assert (ready.status_code, code_of(ready)) == (200, "degraded"), ready.text
            filler.unlink()
            freed = time.monotonic()
            # Within 10 s of freeing: a push applies, a snapshot completes,
            # catalog reads and writes answer, readiness is ok.
            ok = False
            last = None
            while time.monotonic() - freed < 10 and not ok:
                try:
                    r = c.put(f"/v1/runs/{run}/ranks/0/steps/{step}", content=body(step))
                    step += 1
                    note = c.patch(f"/v1/runs/{run}", json={"note": "space again"})
                    snap = c.post(f"/v1/runs/{run}/snapshots", json={})
                    last = (r.status_code, note.status_code, snap.status_code, snap.text[:300])
                    if r.is_success and note.is_success and snap.status_code == 202:
                        sid = snap.json()["id"]
                        deadline = time.monotonic() + 5
                        while time.monotonic() < deadline:
                            got = c.get(f"/v1/runs/{run}/snapshots/{sid}")
                            last = (got.status_code, got.text[:300])
                            if got.is_success and got.json()["status"] == "complete":
                                ok = True
                                break
                            time.sleep(0.1)
                except httpx.HTTPError as e:
                    last = repr(e)
                if not ok:
                    time.sleep(0.5)
            assert ok, (
                f"not serving {time.monotonic() - freed:.1f} s after space came back: {last}\n"
                + "".join(srv.log[-40:])
            )
            ready = c.get("/readyz")
            assert ready.status_code == 200, ready.text
            # And it stays so: the catalog answers reads.
            assert c.get(
                f"/v1/runs/{run}/events", headers={"Accept": "application/json"}
            ).is_success
    finally:
        srv.stop()


# PostgreSQL's data directory on a filesystem of its own ---------------------


@pytest.fixture()
def postgres_on_small_disk():
    """A throwaway PostgreSQL whose data directory is on a 96 MiB tmpfs (a
    cluster with one database and two 16 MiB WAL segments takes about 65
    MiB), with the tmpfs's mount point."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs for a real full disk")
    # PostgreSQL runs as an unprivileged user: the path to the mount point
    # is one it may walk.
    base = Path(tempfile.mkdtemp(prefix="polyak-catalog-disk-"))
    base.chmod(0o755)
    mnt = base / "disk"
    mnt.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(mnt)], capture_output=True
    )
    if made.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"mount failed: {made.stderr!r}")
    pg = None
    try:
        try:
            pg = PostgresService(data_root=mnt)
        except FileNotFoundError as e:
            pytest.skip(str(e))
        pg.start()
        yield pg, mnt
    finally:
        if pg is not None:
            pg.stop()
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        shutil.rmtree(base, ignore_errors=True)


def pg_log(pg: PostgresService) -> str:
    assert pg.dir is not None
    return (pg.dir / "postgres.log").read_text(errors="replace")[-4000:]


def code_of(r: httpx.Response) -> str | None:
    """An error answer's code, or a health answer's status."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        doc = r.json()
        return doc.get("error", {}).get("code") or doc.get("status")
    return None


class Ledger:
    """What the server acknowledged, and every answer it gave, while a test
    works against it."""

    def __init__(self, c: httpx.Client, run: str):
        self.c = c
        self.run = run
        self.step = 0
        self.pushed: int | None = None  # the last push answered 2xx
        self.accepted: list[str] = []  # snapshots answered 202
        self.complete: set[str] = set()  # snapshots seen complete
        self.note: str | None = None  # the last note answered 200
        self.notes_since: list[str] = []  # notes tried after it (not acknowledged)
        self.answers: collections.Counter[tuple[str, int, str | None]] = collections.Counter()
        self.n = 0

    def _answer(self, what: str, r: httpx.Response) -> httpx.Response:
        self.answers[(what, r.status_code, code_of(r))] += 1
        return r

    def push(self) -> httpx.Response:
        step = self.step
        self.step += 1
        r = self._answer(
            "push", self.c.put(f"/v1/runs/{self.run}/ranks/0/steps/{step}", content=body(step))
        )
        if r.is_success:
            self.pushed = step
        return r

    def snapshot(self) -> httpx.Response:
        r = self._answer("snapshot", self.c.post(f"/v1/runs/{self.run}/snapshots", json={}))
        if r.status_code == 202:
            self.accepted.append(r.json()["id"])
        return r

    def set_note(self) -> httpx.Response:
        self.n += 1
        note = f"note {self.n}"
        r = self._answer("note", self.c.patch(f"/v1/runs/{self.run}", json={"note": note}))
        if r.is_success:
            self.note, self.notes_since = note, []
        else:
            self.notes_since.append(note)
        return r

    def ready(self) -> httpx.Response:
        return self._answer("readyz", self.c.get("/readyz"))

    def work(self, seconds: float) -> None:
        """Pushes, snapshots, notes, catalog reads and probes for ``seconds``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            self.push()
            self.snapshot()
            self.set_note()
            self._answer(
                "events",
                self.c.get(f"/v1/runs/{self.run}/events", headers={"Accept": "application/json"}),
            )
            self.ready()
            time.sleep(0.1)

    def snapshot_status(self, sid: str) -> str | None:
        r = self.c.get(f"/v1/runs/{self.run}/snapshots/{sid}")
        if r.status_code == 404:
            return "missing"
        if not r.is_success:
            return None
        status = r.json()["status"]
        if status == "complete":
            self.complete.add(sid)
        return status

    def serves_again(self, within: float) -> tuple[bool, object]:
        """Whether, within ``within`` seconds, a push applies, a note is
        stored, a snapshot completes and readiness is ok."""
        t0 = time.monotonic()
        last: object = None
        while time.monotonic() - t0 < within:
            try:
                r, note, snap = self.push(), self.set_note(), self.snapshot()
                last = (r.status_code, note.status_code, snap.status_code, snap.text[:300])
                if r.is_success and note.is_success and snap.status_code == 202:
                    sid = snap.json()["id"]
                    deadline = time.monotonic() + 5
                    while time.monotonic() < deadline and self.snapshot_status(sid) != "complete":
                        time.sleep(0.1)
                    ready = self.ready()
                    last = (sid, self.snapshot_status(sid), ready.status_code, ready.text[:300])
                    if sid in self.complete and code_of(ready) == "ok":
                        return True, last
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.3)
        return False, last


def postgres_panics(pg: PostgresService) -> bool:
    """Makes PostgreSQL's WAL need a new segment now (a busier catalog
    gets there by itself): with no space for it, the write PANICs. True
    once the server has gone down."""
    for _ in range(3):
        try:
            # The switch ends the segment; the commit of the transaction id
            # is the next WAL record, in a segment the disk has no room for.
            pg.psql("SELECT pg_switch_wal(), txid_current()")
        except subprocess.CalledProcessError:
            break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            pg.psql("SELECT 1")
        except subprocess.CalledProcessError:
            return True
        time.sleep(0.2)
    return False


def test_a_postgres_catalog_serves_again_once_space_is_back(postgres_on_small_disk, tmp_path):
    pg, disk = postgres_on_small_disk
    catalog = pg.new_database()
    # A fresh WAL segment, and the last one kept for reuse, while there is
    # room: the episodes of full data files leave the WAL room to grow in.
    pg.psql("SELECT pg_switch_wal()")
    pg.psql("CHECKPOINT")
    srv = PolyakServer(tmp_path / "data", "--catalog", catalog, "--catalog-timeout-secs", "1")
    srv.start()
    run = "full"

    def logs() -> str:
        return "".join(srv.log[-40:]) + pg_log(pg)

    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = c.post("/v1/runs", json={"name": run, "world_size": 1, "persist_every_secs": 1})
            assert r.status_code == 201, r.text
            book = Ledger(c, run)
            for _ in range(3):
                assert book.push().is_success
            assert book.set_note().is_success

            # 1, 2. Data files cannot grow: statements fail with 53100 and
            # PostgreSQL goes on. Twice: what the first episode's recovery
            # wrote leaves some tables room and not others.
            for episode in (1, 2):
                filler = fill(disk)
                book.work(4)
                assert pg.proc is not None and pg.proc.poll() is None, pg_log(pg)
                ready = book.ready()
                assert (ready.status_code, code_of(ready)) == (200, "degraded"), ready.text
                assert "catalog" in ready.json()["detail"], ready.text
                filler.unlink()
                ok, last = book.serves_again(10)
                assert ok, (
                    f"episode {episode}: not serving 10 s after space came back: {last}\n"
                    + (logs())
                )
            refused = [a for a in book.answers if a[0] == "snapshot" and a[1] == 503]
            assert refused, dict(book.answers)

            # 3. The WAL cannot grow: PostgreSQL PANICs, and its crash
            # recovery, which needs a new segment too, fails, so the
            # postmaster exits until an operator starts it again.
            filler = fill(disk)
            down = postgres_panics(pg)
            book.work(3)
            ready = book.ready()
            if down:
                assert (ready.status_code, code_of(ready)) == (503, "unavailable"), ready.text
            else:
                assert (ready.status_code, code_of(ready)) == (200, "degraded"), ready.text
            assert "catalog" in ready.json()["detail"], ready.text
            filler.unlink()
            if pg.proc is None or pg.proc.poll() is not None:
                # What an operator does once there is space again.
                pg.stop(keep_data=True)
                pg.start()
            ok, last = book.serves_again(10)
            assert ok, f"not serving 10 s after space and PostgreSQL came back: {last}\n" + logs()

            # Never a 500; what could not be done answered 503 with its code.
            answers = dict(book.answers)
            assert not [a for a in answers if a[1] >= 500 and a[1] != 503], answers
            assert all(
                a[2] in ("catalog_unavailable", "unavailable") for a in answers if a[1] == 503
            ), answers
            # Pushes never waited on the catalog.
            assert all(a[1] < 300 for a in answers if a[0] == "push"), answers
            # Nothing acknowledged is lost: every snapshot answered 202 is
            # there and ends complete or failed (never left pending); every
            # one seen complete stays complete; the note stored is the last
            # one acknowledged (or one tried after it); the live EMA is at
            # the last push.
            seen_complete = set(book.complete)
            status: dict[str, str | None] = {}
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                status = {sid: book.snapshot_status(sid) for sid in book.accepted}
                if all(s in ("complete", "failed", "missing") for s in status.values()):
                    break
                time.sleep(0.2)
            unsettled = {sid: s for sid, s in status.items() if s not in ("complete", "failed")}
            assert not unsettled, (unsettled, logs())
            assert all(status[sid] == "complete" for sid in seen_complete), status
            # A complete snapshot's files are all there.
            for sid in (sid for sid, s in status.items() if s == "complete"):
                part = c.get(
                    f"/v1/runs/{run}/snapshots/{sid}/download", params={"layout": "rank", "rank": 0}
                )
                assert part.status_code == 200, (sid, part.status_code, part.text[:300])
            info = c.get(f"/v1/runs/{run}")
            assert info.is_success, info.text
            assert info.json()["note"] in [book.note, *book.notes_since], (
                info.json()["note"],
                book.note,
            )
            rank = c.get(f"/v1/runs/{run}/ranks/0")
            assert rank.is_success, rank.text
            assert rank.json()["last_step"] == book.pushed, rank.text
    finally:
        srv.stop()
