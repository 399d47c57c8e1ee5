"""Checks and reads over a running server (compare answers against torch,
wire totals, snapshots settling, event streams, state snapshot steps), a
wait on any condition, and a command's stderr as a terminal shows it."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx


def compare_stats(a: dict, b: dict) -> dict[str, dict]:
    """Per tensor what ``GET .../compare`` reports, computed with torch in
    float64 over whole tensors: norms, ``rel_diff = norm_diff / norm_a``,
    cosine, max abs diff (the anchor the compare tests check against)."""
    out: dict[str, dict] = {}
    for k in a:
        x, y = a[k].double().flatten(), b[k].double().flatten()
        na, nb, nd = x.norm().item(), y.norm().item(), (x - y).norm().item()
        out[k] = {
            "norm_a": na,
            "norm_b": nb,
            "norm_diff": nd,
            "rel_diff": nd / na if na > 0 else nd,
            "cosine": (x @ y).item() / (na * nb) if na > 0 and nb > 0 else None,
            "max_abs_diff": (x - y).abs().max().item() if x.numel() else 0.0,
        }
    return out


def wait_settled(client: Any, run: str, sid: str, timeout: float = 30.0) -> dict:
    """The catalog row of snapshot ``sid`` once it is no longer ``pending``
    (complete or failed: tests look at either), polled through an
    ``httpx.Client`` on the server."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = client.get(f"/v1/runs/{run}/snapshots/{sid}").json()
        if row["status"] != "pending":
            return row
        time.sleep(0.05)
    raise AssertionError(f"snapshot {sid} still pending after {timeout:g} s")


def check_wire_totals(wire: dict, ranks: list[dict]) -> None:
    """Asserts that a run's ``wire`` figures are its ranks' summed (bytes
    and mismatches exactly, seconds to rounding) and that its ratio is
    logical over wire bytes."""
    import pytest

    for key in ("wire_bytes", "logical_bytes", "mirror_mismatches"):
        assert wire[key] == sum(r[key] for r in ranks), key
    for key in ("encode_seconds", "decode_seconds"):
        assert wire[key] == pytest.approx(sum(r[key] for r in ranks), rel=1e-9, abs=1e-12)
    assert wire["ratio"] == pytest.approx(wire["logical_bytes"] / wire["wire_bytes"])


def check_compare(result: dict, a: dict, b: dict) -> None:
    """Asserts that a ``GET .../compare`` answer matches :func:`compare_stats`
    of the same tensors to 1e-6 relative, tensor by tensor (shapes too),
    and that its summary holds the count, the whole ``norm_a`` and the
    largest ``max_abs_diff``."""
    want = compare_stats(a, b)
    got = {t["name"]: t for t in result["tensors"]}
    assert set(got) == set(want), set(got) ^ set(want)
    for name, fields in want.items():
        assert got[name]["shape"] == list(a[name].shape), name
        for field, value in fields.items():
            if value is None:
                assert got[name][field] is None, (name, field)
                continue
            assert abs(got[name][field] - value) <= 1e-6 * abs(value) + 1e-12, (
                name,
                field,
                got[name][field],
                value,
            )
    summary = result["summary"]
    assert summary["tensors"] == len(a)
    norm_a = sum(v.double().square().sum().item() for v in a.values()) ** 0.5
    assert abs(summary["norm_a"] - norm_a) <= 1e-6 * norm_a
    assert summary["max_abs_diff"] == max(t["max_abs_diff"] for t in result["tensors"])


def read_sse(
    url: str, stop_after: int, timeout: float, headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Reads an event stream (``text/event-stream``) until ``stop_after``
    events came (or the stream ends): each as its JSON ``data`` with the
    SSE ``event`` and ``sse_id`` (the SSE ``id``, what ``Last-Event-ID``
    resumes after; ``None`` for a transient event, which has none)."""
    events: list[dict[str, Any]] = []
    with httpx.stream("GET", url, headers=headers or {}, timeout=timeout) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        block: dict[str, str] = {}
        for line in r.iter_lines():
            if not line:
                if "data" in block:
                    events.append(
                        {
                            "event": block["event"],
                            **json.loads(block["data"]),
                            "sse_id": int(block["id"]) if "id" in block else None,
                        }
                    )
                    if len(events) >= stop_after:
                        return events
                block = {}
                continue
            if line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            block[key] = value.lstrip()
    return events


def state_step(url: str, run: str, rank: int) -> int | None:
    """The rank's step in the newest complete ``state`` snapshot of ``run``
    that holds it, as the server at ``url`` lists them (``None``: none)."""
    snaps = httpx.get(f"{url}/v1/runs/{run}/snapshots", params={"kind": "state"}, timeout=10)
    steps = [
        s["detail"]["rank_steps"].get(str(rank))
        for s in snaps.json()["snapshots"]
        if s["status"] == "complete"
    ]
    return max((s for s in steps if s is not None), default=None)


def wait_for(
    cond: Callable[[], Any],
    timeout: float = 60.0,
    what: str = "condition",
    seen: Callable[[], Any] | None = None,
) -> Any:
    """Polls ``cond`` until it answers something true (returned), or fails
    naming ``what`` after ``timeout`` seconds (and, with ``seen``, what was
    there instead)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            instead = f": {seen()}" if seen is not None else ""
            raise AssertionError(f"timed out waiting for {what}{instead}")
        time.sleep(0.05)


def stderr_on_a_terminal(
    argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 180
) -> tuple[int, str]:
    """Runs ``argv`` with its stderr on a pseudo-terminal 200 columns wide
    (a new pty has none, and tqdm draws to fit); its exit status and what
    it showed there."""
    main, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=terminal,
            env=env,
        )
        os.close(terminal)
        terminal = -1
        chunks = []
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # EIO: the child's end is closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        status = proc.wait(timeout=timeout)
    finally:
        os.close(main)
        if terminal >= 0:
            os.close(terminal)
    return status, b"".join(chunks).decode(errors="replace")
