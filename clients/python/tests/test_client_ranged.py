"""Downloads by ranges over several connections, resumed, and checked end
to end against the digests the server states for the file it serves.

The server states the CRC-32 of every 8 MiB block of every layout
(``GET .../download/digests``); the client fetches pieces with ``Range``
and ``If-Range``, hashes what it wrote, and compares. An interrupted
download leaves ``NAME.part`` and ``NAME.part.json`` and the next attempt
fetches only the missing blocks; a block damaged on the way (a proxy
flips a bit) is fetched again, and one that stays damaged raises
``download_corrupt`` with nothing renamed into place; a stored part that
fails its checks raises ``snapshot_corrupt`` naming it.
"""

from __future__ import annotations

import io
import logging
import re
import tarfile
import threading
import time
import zlib
from pathlib import Path

import httpx
import polyak
import pytest
import torch
from polyak import PolyakError
from polyak_testing import StoreView
from polyak_testing.netlab import TcpProxy

#: The file store and S3 alike.
BACKEND_MATRIX = True

BLOCK = 8 << 20
MIB = 1 << 20


def _state(mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = mib * MIB // 4 // 4
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(4)}


def _snapshot(client, name: str, mib: int = 36):
    """A run of one rank holding ``mib`` MiB, and its complete snapshot."""
    run = client.create_run(name, profiles=[{"name": "c", "kind": "constant", "beta": 0.9}])
    pusher = run.pusher()
    pusher.push(_state(mib), 0)
    pusher.flush()
    pusher.close()
    return run, run.snapshot(step=0, timeout=60)


def _plain(server, run, snap, **params) -> httpx.Response:
    r = httpx.get(
        f"{server.url}/v1/runs/{run.name}/snapshots/{snap['id']}/download",
        params={"profile": "c", **params},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r


def _crcs(body: bytes) -> list[int]:
    return [zlib.crc32(body[i : i + BLOCK]) for i in range(0, len(body), BLOCK)]


def _tar_members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {
            m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile()
        }


def test_every_layout_states_its_digests_and_downloads_by_ranges(
    server, client, run_name, tmp_path
):
    run, snap = _snapshot(client, run_name)
    layouts = [
        {"layout": "full"},
        {"layout": "sharded"},
        {"layout": "hf", "max_shard_size": 20 * MIB},
        {"layout": "rank", "rank": 0},
        {"layout": "full", "dtype": "bf16"},
    ]
    for params in layouts:
        plain = _plain(server, run, snap, **params)
        stated = httpx.get(
            f"{server.url}/v1/runs/{run.name}/snapshots/{snap['id']}/download/digests",
            params={"profile": "c", **params},
            timeout=60,
        ).json()
        assert stated["etag"] == plain.headers["etag"], params
        assert stated["bytes"] == len(plain.content) and stated["block_bytes"] == BLOCK
        assert stated["algorithm"] == "crc32"
        assert stated["crc32"] == _crcs(plain.content), params
    assert len(_crcs(_plain(server, run, snap).content)) >= 4  # several blocks

    whole = _plain(server, run, snap).content
    for n in (1, 3):
        path = run.download_to(
            snap, tmp_path / f"full{n}", "c", progress=False, connections=n, fsync=False
        )
        assert path.read_bytes() == whole
        tensors = run.download(snap, "c", progress=False, connections=n)
        assert set(tensors) == {f"layer{i}.weight" for i in range(4)}
    for layout, extra in (("sharded", {}), ("hf", {})):
        members = _tar_members(_plain(server, run, snap, layout=layout, **extra).content)
        got = run.download_to(snap, tmp_path / layout, "c", layout=layout, progress=False)
        files = {
            p.relative_to(got).as_posix(): p.read_bytes() for p in got.rglob("*") if p.is_file()
        }
        assert files == members, layout


def test_an_interrupted_download_resumes_and_fetches_only_the_rest(
    server, client, run_name, tmp_path
):
    run, snap = _snapshot(client, run_name, mib=48)
    whole = _plain(server, run, snap).content
    total = len(whole)

    class Stop(Exception):
        pass

    def stop_at_half(done: int, _total: int | None) -> None:
        if done >= total // 2:
            raise Stop()

    with pytest.raises(Stop):
        run.download_to(
            snap, tmp_path, "c", progress=False, connections=1, on_progress=stop_at_half
        )
    (part,) = tmp_path.glob("*.part")
    assert (tmp_path / (part.name + ".json")).exists()
    assert not list(tmp_path.glob("*.safetensors")), "nothing looks complete"

    seen: list[tuple[int, int | None]] = []
    path = run.download_to(
        snap,
        tmp_path,
        "c",
        progress=False,
        connections=2,
        on_progress=lambda d, t: seen.append((d, t)),
    )
    assert path.read_bytes() == whole
    held = seen[0][0]
    fetched = seen[-1][0] - held
    # Every block whole before the interruption was kept (it came at half
    # the file, in the fourth block at the latest), and the second attempt
    # fetched only the rest.
    assert total // 2 - BLOCK <= held <= total // 2 + BLOCK and held % BLOCK == 0, (held, total)
    assert fetched == total - held
    assert not list(tmp_path.glob("*.part*"))


def test_a_block_damaged_on_the_way_is_fetched_again(server, client, run_name, tmp_path, caplog):
    run, snap = _snapshot(client, run_name)
    whole = _plain(server, run, snap).content
    host, port = server.url.removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port)))
    try:
        via = polyak.Run(polyak.Client(f"http://127.0.0.1:{proxy.port}"), run.info)
        # One answer damaged 3 MiB in: found against the digests, fetched again.
        proxy.garble_at, proxy.garble_left = 3 * MIB, 1
        caplog.set_level(logging.WARNING, logger="polyak")
        path = via.download_to(snap, tmp_path / "once", "c", progress=False, connections=2)
        assert proxy.garbled == 1
        assert path.read_bytes() == whole
        assert any("differ from the server's digests" in r.getMessage() for r in caplog.records)

        # Every answer damaged: the download raises, nothing is complete.
        proxy.garble_at, proxy.garble_left = 3 * MIB, 10_000
        with pytest.raises(PolyakError) as err:
            via.download_to(snap, tmp_path / "always", "c", progress=False, connections=2)
        assert err.value.code == "download_corrupt", err.value
        assert not list((tmp_path / "always").glob("*.safetensors"))
        with pytest.raises(PolyakError) as err:
            via.download(snap, "c", progress=False)
        assert err.value.code == "download_corrupt", err.value
    finally:
        proxy.close()


def test_a_corrupt_stored_part_raises_and_leaves_no_complete_file(
    server, client, run_name, tmp_path, backends, backend
):
    run, snap = _snapshot(client, run_name)
    (f,) = [f for f in run.get_snapshot(snap).files if f.part == "c"]
    view = StoreView(server, backends.s3() if backend.endswith("-s3") else None)
    key = f.path
    bad = bytearray(view.read(key))
    bad[len(bad) * 2 // 3] ^= 0x04
    view.write(key, bytes(bad))
    for layout in ("full", "sharded"):
        with pytest.raises(PolyakError) as err:
            run.download_to(snap, tmp_path / layout, "c", layout=layout, progress=False)
        assert err.value.code == "snapshot_corrupt", err.value
        assert Path(key).name in str(err.value) or key in str(err.value), err.value
        done = [p for p in (tmp_path / layout).iterdir() if not p.name.endswith((".part", ".json"))]
        assert not done, done
    with pytest.raises(PolyakError) as err:
        run.download(snap, "c", progress=False)
    assert err.value.code == "snapshot_corrupt"


def test_answers_cut_before_their_first_byte_name_the_corrupt_part(
    server, client, run_name, tmp_path, backends, backend
):
    """A stored block past the first ones an answer checks fails: the
    server can only break the answer, and one may break before any byte
    left it (here a proxy ends every 206 right after its headers). The
    client then asks the digests, which read the block through the same
    checks: ``snapshot_corrupt`` naming the part, not a bare
    ``incomplete_download``; with every part intact, the latter."""
    intact_run, intact = _snapshot(client, f"{run_name}-intact")
    run, snap = _snapshot(client, run_name)
    host, port = server.url.removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port)))
    try:
        proxy.cut_partial_bodies = True
        via = polyak.Run(polyak.Client(f"http://127.0.0.1:{proxy.port}"), intact_run.info)
        with pytest.raises(PolyakError) as err:
            via.download_to(intact, tmp_path / "intact", "c", progress=False, connections=1)
        assert err.value.code == "incomplete_download", err.value
        via = polyak.Run(polyak.Client(f"http://127.0.0.1:{proxy.port}"), run.info)
        (f,) = [f for f in run.get_snapshot(snap).files if f.part == "c"]
        view = StoreView(server, backends.s3() if backend.endswith("-s3") else None)
        bad = bytearray(view.read(f.path))
        bad[len(bad) * 2 // 3] ^= 0x04
        view.write(f.path, bytes(bad))
        cut = proxy.bodies_cut
        with pytest.raises(PolyakError) as err:
            via.download_to(snap, tmp_path / "corrupt", "c", progress=False, connections=1)
        assert proxy.bodies_cut > cut
        assert err.value.code == "snapshot_corrupt", err.value
        assert Path(f.path).name in str(err.value) or f.path in str(err.value), err.value
    finally:
        proxy.close()


def _store_read_bytes(server) -> int:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return int(re.search(r"^polyak_store_read_bytes_total (\d+)", text, re.M).group(1))


def test_digests_asked_at_once_read_the_file_once(server, client, run_name):
    """Digests no response carried are produced from the store, one
    computation per file at a time: requests that arrive together (or a
    client's retry while the first still runs) wait for it and find what it
    recorded, instead of each reading the whole file again."""
    run, snap = _snapshot(client, run_name, mib=96)
    url = f"{server.url}/v1/runs/{run.name}/snapshots/{snap['id']}/download/digests"
    # What the server reads of its own accord after a write settles first.
    before = _store_read_bytes(server)
    while True:
        time.sleep(0.5)
        now, before = before, _store_read_bytes(server)
        if now == before:
            break
    start = threading.Barrier(4)
    answers: list[httpx.Response] = []

    def ask() -> None:
        start.wait()
        answers.append(httpx.get(url, params={"profile": "c"}, timeout=120))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    stated = {tuple(a.json()["crc32"]) for a in answers}
    assert len(stated) == 1, "every request states the same digests"
    size = answers[0].json()["bytes"]
    read = _store_read_bytes(server) - before
    assert read < 1.5 * size, f"{read} bytes read from the store for a {size}-byte file"
    plain = _plain(server, run, snap).content
    want = [zlib.crc32(plain[i : i + BLOCK]) for i in range(0, len(plain), BLOCK)]
    assert list(stated.pop()) == want
