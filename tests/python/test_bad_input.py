"""Bad input gets its documented 4xx and a JSON error, and changes nothing.

Each case is sent to a run holding real EMA state; afterwards the EMA of
every profile and rank is byte-identical (sha256) and the ranks' steps are
unchanged.
"""

from __future__ import annotations

import hashlib
import json
import struct

import httpx
import pytest
import safetensors.torch
import torch

RUN = "battery"


def body(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return safetensors.torch.save(tensors, metadata=metadata)


def raw_safetensors(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def good(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(scale * 1000))
    return {
        "layer.weight": torch.randn(4, 3, generator=g) * scale,
        "layer.bias": torch.randn(4, generator=g),
        "bn.num_batches_tracked": torch.tensor(int(scale * 10)),
    }


@pytest.fixture()
def battery_server(fresh_server):
    fresh_server.args = ["--header-limit", "64KiB", "--push-body-limit", "1MiB"]
    fresh_server.start()
    with httpx.Client(base_url=fresh_server.url, timeout=30) as c:
        r = c.post(
            "/v1/runs",
            json={
                "name": RUN,
                "world_size": 2,
                "mirror": True,
                "profiles": [
                    {"name": "a", "kind": "constant", "beta": 0.9},
                    {"name": "b", "kind": "warmup", "update_after_step": 0},
                ],
            },
        )
        assert r.status_code == 201, r.text
        for step, scale in ((0, 1.0), (5, 2.0)):
            r = c.put(f"/v1/runs/{RUN}/ranks/0/steps/{step}", content=body(good(scale)))
            assert r.status_code == 200 and r.json()["applied"], r.text
        yield c


def fingerprint(c: httpx.Client) -> dict:
    out = {}
    for profile in ("a", "b"):
        r = c.get(f"/v1/runs/{RUN}/ranks/0/ema", params={"profile": profile})
        assert r.status_code == 200
        out[profile] = hashlib.sha256(r.content).hexdigest()
    ranks = c.get(f"/v1/runs/{RUN}/ranks").json()
    out["steps"] = [(r["rank"], r["last_step"], r["pushes"]) for r in ranks]
    return out


def cases() -> list[tuple[str, str, bytes, dict, int, str]]:
    """(label, url, body, headers, status, code)."""
    push6 = f"/v1/runs/{RUN}/ranks/0/steps/6"
    valid = body(good(3.0))
    header_len = struct.unpack("<Q", valid[:8])[0]
    past = struct.pack("<Q", len(valid) + 100) + valid[8:]
    overlapping = raw_safetensors(
        {
            "layer.weight": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]},
            "layer.bias": {"dtype": "F32", "shape": [4], "data_offsets": [40, 56]},
        },
        bytes(56),
    )
    out_of_range = raw_safetensors(
        {"layer.weight": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 480]}}, bytes(48)
    )
    unknown_dtype = raw_safetensors(
        {"layer.weight": {"dtype": "Q4_K", "shape": [4, 3], "data_offsets": [0, 48]}}, bytes(48)
    )
    fp8 = raw_safetensors(
        {"layer.weight": {"dtype": "F8_E4M3", "shape": [4, 3], "data_offsets": [0, 12]}}, bytes(12)
    )
    big_header = body(good(3.0), metadata={"pad": "x" * (100 << 10)})
    reshaped = good(3.0)
    reshaped["layer.weight"] = torch.randn(3, 4)
    extra = {**good(3.0), "extra": torch.zeros(2)}
    chunk_outside = body(
        good(3.0),
        metadata={
            "polyak.shards": json.dumps(
                {"layer.weight": {"global_shape": [5, 3], "offsets": [2, 0]}}
            )
        },
    )
    nan = good(3.0)
    nan["layer.bias"][1] = float("nan")
    inf = good(3.0)
    inf["layer.weight"][0, 0] = float("-inf")
    other_bytes_step5 = body(good(4.0))
    too_big = body({"x": torch.zeros(300_000)})  # 1.2 MB > 1 MiB
    delta = body(good(0.1), metadata={"polyak.kind": "delta"})
    return [
        ("truncated body", push6, valid[:-10], {}, 400, "invalid_safetensors"),
        ("shorter than the length prefix", push6, valid[:5], {}, 400, "invalid_safetensors"),
        ("header length past the body", push6, past, {}, 400, "invalid_safetensors"),
        ("header not JSON", push6, struct.pack("<Q", 4) + b"{{{{", {}, 400, "invalid_safetensors"),
        ("header over the limit", push6, big_header, {}, 413, "header_too_large"),
        ("overlapping offsets", push6, overlapping, {}, 400, "invalid_safetensors"),
        ("offsets out of range", push6, out_of_range, {}, 400, "invalid_safetensors"),
        ("unknown dtype", push6, unknown_dtype, {}, 422, "unsupported_dtype"),
        ("dtype polyak does not keep", push6, fp8, {}, 422, "unsupported_dtype"),
        ("layout change: shape", push6, body(reshaped), {}, 409, "layout_mismatch"),
        ("layout change: extra tensor", push6, body(extra), {}, 409, "layout_mismatch"),
        (
            "layout change: missing tensor",
            push6,
            body({"layer.bias": torch.zeros(4)}),
            {},
            409,
            "layout_mismatch",
        ),
        (
            "layout change: dtype",
            push6,
            body({k: v.double() if v.is_floating_point() else v for k, v in good(3.0).items()}),
            {},
            409,
            "layout_mismatch",
        ),
        ("chunk outside its global shape", push6, chunk_outside, {}, 422, "invalid_shards"),
        ("NaN", push6, body(nan), {}, 422, "nonfinite"),
        ("Inf", push6, body(inf), {}, 422, "nonfinite"),
        (
            "step older than the last",
            f"/v1/runs/{RUN}/ranks/0/steps/3",
            valid,
            {},
            409,
            "step_conflict",
        ),
        (
            "same step, other bytes",
            f"/v1/runs/{RUN}/ranks/0/steps/5",
            other_bytes_step5,
            {},
            409,
            "step_conflict",
        ),
        ("rank >= world_size", f"/v1/runs/{RUN}/ranks/2/steps/6", valid, {}, 404, "rank_not_found"),
        ("rank not a number", f"/v1/runs/{RUN}/ranks/x/steps/6", valid, {}, 400, "invalid_rank"),
        ("negative step", f"/v1/runs/{RUN}/ranks/0/steps/-1", valid, {}, 400, "invalid_step"),
        (
            "run name with /",
            "/v1/runs/bat%2Ftery/ranks/0/steps/6",
            valid,
            {},
            400,
            "invalid_run_name",
        ),
        ("run name ..", "/v1/runs/%2E%2E/ranks/0/steps/6", valid, {}, 400, "invalid_run_name"),
        (
            "run name of 200 characters",
            f"/v1/runs/{'r' * 200}/ranks/0/steps/6",
            valid,
            {},
            400,
            "invalid_run_name",
        ),
        ("unknown run", "/v1/runs/nosuchrun/ranks/0/steps/6", valid, {}, 404, "run_not_found"),
        ("body over the limit", push6, too_big, {}, 413, "body_too_large"),
        (
            "delta without a keyframe",
            f"/v1/runs/{RUN}/ranks/1/steps/6",
            delta,
            {},
            409,
            "needs_keyframe",
        ),
        (
            "unknown content encoding",
            push6,
            valid,
            {"Content-Encoding": "br"},
            415,
            "unsupported_encoding",
        ),
        (
            "corrupt zstd",
            push6,
            b"\x28\xb5\x2f\xfd garbage",
            {"Content-Encoding": "zstd"},
            400,
            "invalid_encoding",
        ),
        ("empty body", push6, b"", {}, 400, "invalid_safetensors"),
        (
            "bad polyak.kind",
            push6,
            body(good(3.0), metadata={"polyak.kind": "sparse"}),
            {},
            422,
            "invalid_metadata",
        ),
        ("header only, no data", push6, valid[: 8 + header_len], {}, 400, "invalid_safetensors"),
    ]


def test_bad_input_battery(battery_server):
    c = battery_server
    before = fingerprint(c)
    for label, url, content, headers, status, code in cases():
        r = c.put(url, content=content, headers=headers)
        assert r.status_code == status, f"{label}: {r.status_code} {r.text}"
        err = r.json()["error"]
        assert err["code"] == code, f"{label}: {err}"
        assert err["message"], label
        assert fingerprint(c) == before, f"{label} changed the EMA"
    # The same step with identical bytes is an idempotent success.
    r = c.put(f"/v1/runs/{RUN}/ranks/0/steps/5", content=body(good(2.0)))
    assert r.status_code == 200 and r.json()["duplicate"] is True and r.json()["applied"] is False
    assert fingerprint(c) == before
    # Rejections are counted on the rank and shown as events.
    rank0 = c.get(f"/v1/runs/{RUN}/ranks/0").json()
    assert rank0["rejections"] >= 15
    events = c.get(
        f"/v1/runs/{RUN}/events",
        headers={"Accept": "application/json"},
        params={"kinds": "rejection"},
    ).json()
    assert {e["detail"]["code"] for e in events} >= {
        "nonfinite",
        "layout_mismatch",
        "step_conflict",
    }


def test_zstd_push_is_accepted(battery_server):
    zstd = pytest.importorskip("zstandard")
    c = battery_server
    raw = body(good(3.0))
    r = c.put(
        f"/v1/runs/{RUN}/ranks/0/steps/6",
        content=zstd.ZstdCompressor().compress(raw),
        headers={"Content-Encoding": "zstd"},
    )
    assert r.status_code == 200 and r.json()["applied"], r.text
    # Identical bytes (after decompression) are the same push.
    r = c.put(f"/v1/runs/{RUN}/ranks/0/steps/6", content=raw)
    assert r.json()["duplicate"] is True


def test_invalid_run_configs_name_the_field(server):
    with httpx.Client(base_url=server.url) as c:
        for spec, field in [
            ({"name": "x", "world_size": 0}, "world_size"),
            ({"name": "a/b", "world_size": 1}, "name"),
            ({"name": "x", "world_size": 1, "update_every": 0}, "update_every"),
            (
                {
                    "name": "x",
                    "world_size": 1,
                    "profiles": [{"name": "e", "kind": "constant", "beta": 2}],
                },
                "profiles[0].beta",
            ),
            (
                {"name": "x", "world_size": 1, "profiles": [{"name": "e", "kind": "nope"}]},
                "profiles[0].kind",
            ),
            (
                {
                    "name": "x",
                    "world_size": 1,
                    "profiles": [{"name": "e", "kind": "power", "sigma_rel": 0.5}],
                },
                "profiles[0].sigma_rel",
            ),
            ({"name": "x", "world_size": 1, "device": "cuda:7"}, "device"),
            ({"name": "x", "world_size": 1, "nonfinite": "ignore"}, "nonfinite"),
            ({"name": "x", "world_size": 1, "ema_dtype": "int8"}, "ema_dtype"),
            ({"name": "x", "world_size": 1, "bogus": 1}, None),
            ({"name": "x", "world_size": "two"}, "world_size"),
        ]:
            r = c.post("/v1/runs", json=spec)
            assert r.status_code == 422, (spec, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_config"
            if field is not None:
                assert err["field"] == field, (spec, err)
        r = c.post("/v1/runs", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = c.post("/v1/runs", json={"name": "dup", "world_size": 1})
        assert r.status_code == 201
        r = c.post("/v1/runs", json={"name": "dup", "world_size": 1})
        assert r.status_code == 409 and r.json()["error"]["code"] == "run_exists"


def test_busy_answers_429_with_retry_after(fresh_server):
    """While one push holds the in-flight byte budget, another is refused
    with 429 and Retry-After; once it is released, the retry succeeds."""
    import socket
    import time

    fresh_server.args = ["--inflight-bytes", "1KiB", "--retry-after-secs", "2"]
    fresh_server.start()
    url = fresh_server.url
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.post("/v1/runs", json={"name": "busy", "world_size": 2}).status_code == 201
        slow = body({"w": torch.zeros(4096)})
        host, port = url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        head = (
            f"PUT /v1/runs/busy/ranks/0/steps/0 HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Length: {len(slow)}\r\nContent-Type: application/octet-stream\r\n\r\n"
        ).encode()
        # The 100 bytes that arrived take the budget (counted in KiB: all of it).
        sock.sendall(head + slow[:100])
        time.sleep(0.5)
        r = c.put("/v1/runs/busy/ranks/1/steps/0", content=body({"w": torch.ones(4096)}))
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "busy"
        assert r.headers["retry-after"] == "2"
        sock.sendall(slow[100:])
        reply = sock.recv(65536).decode()
        assert reply.startswith("HTTP/1.1 200"), reply
        sock.close()
        r = c.put("/v1/runs/busy/ranks/1/steps/0", content=body({"w": torch.ones(4096)}))
        assert r.status_code == 200 and r.json()["applied"], r.text
        assert c.get("/v1/runs/busy/ranks/1").json()["last_step"] == 0
