"""Fewer bytes on the wire, end to end against the real server: the
byte-grouped zstd codec, XOR and quantised deltas with error feedback,
keyframe checksums, corrupted bodies, NaN/Inf in encoded pushes."""

from __future__ import annotations

import json
import struct

import httpx
import polyak
import pytest
import torch
from polyak._push.mirror import (
    MirrorEncoder,
    build_body,
    decode_bgz,
    dequantise,
    encode_bgz,
    quantise,
)
from polyak.wire import HostBody, TensorSpec, WireLayout, read_safetensors
from polyak_testing import check_wire_totals

pytest.importorskip("zstandard")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb.weight": torch.randn(37, 19, generator=g) * 0.02,
        "fc.weight": torch.randn(300, 129, generator=g) * 0.05,
        "fc.bias": torch.randn(129, generator=g) * 0.01,
        "empty": torch.zeros(0, 5),
        "norm.weight": torch.ones(7, dtype=torch.bfloat16),
        "steps": torch.tensor(3, dtype=torch.int64),
    }


def _walk(state: dict[str, torch.Tensor], step: int, scale: float = 1e-3) -> None:
    """One AdamW-like step: every float weight moves a little."""
    g = torch.Generator().manual_seed(1000 + step)
    for name, t in state.items():
        if t.is_floating_point() and t.numel():
            t.add_((torch.randn(t.shape, generator=g) * scale).to(t.dtype))
        elif name == "steps":
            t.add_(1)


def _body(state: dict[str, torch.Tensor]) -> bytes:
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
    body = HostBody(WireLayout(specs))
    body.fill(list(state.values()))
    return bytes(body.memory)


def _live_ema(client: polyak.Client, run: str, profile: str = "ema") -> dict[str, torch.Tensor]:
    r = client.request("GET", f"/v1/runs/{run}/ranks/0/ema", params={"profile": profile})
    return read_safetensors(r.content)[0]


def _put(server_url: str, run: str, step: int, body: bytes, **headers: str) -> httpx.Response:
    return httpx.put(
        f"{server_url}/v1/runs/{run}/ranks/0/steps/{step}",
        content=body,
        headers={"Content-Type": "application/octet-stream", **headers},
        timeout=60,
    )


def test_bgz_round_trips_odd_sizes_empty_shards_and_nonfinite_bits():
    state = _state(0)
    state["nan"] = torch.tensor([float("nan"), float("inf"), -0.0, 1.5])
    state["big"] = torch.randn(300_001)  # several frames, a partial last one
    body = _body(state)
    enc = encode_bgz(body, level=1)
    assert enc[:4] == b"PBG1"
    assert decode_bgz(enc) == body
    # Every tensor empty: no frames at all.
    empty = _body({"a": torch.zeros(0), "b": torch.zeros(0, 3, dtype=torch.bfloat16)})
    assert decode_bgz(encode_bgz(empty)) == empty


def test_quantisers_stay_within_half_a_step():
    g = torch.Generator().manual_seed(1)
    d = torch.randn(1000 + 77, generator=g) * torch.logspace(-6, 0, 1077)
    for fmt, block, top, bits in (("fp8_e4m3", 128, 448.0, 3), ("int8", 256, 127.0, None)):
        q, scales = quantise(d, fmt, block)
        assert scales is not None and scales.numel() == -(-d.numel() // block)
        back = dequantise(q, scales, block)
        pad = torch.nn.functional.pad(d, (0, scales.numel() * block - d.numel()))
        amax = pad.view(-1, block).abs().amax(1)
        assert torch.allclose(scales, amax / top)
        err = (back - d).abs().view(-1)
        per = torch.repeat_interleave(scales, block)[: d.numel()]
        if bits is None:
            bound = per / 2  # int8: half a step of the scale
        else:
            # fp8 e4m3: half an ulp of the value (3 mantissa bits), or half
            # the subnormal step.
            bound = torch.maximum(back.abs(), d.abs()) * 2.0**-4 + per * 2.0**-10
        assert (err <= bound * (1 + 1e-6)).all(), fmt
    q, none = quantise(d, "bf16")
    assert none is None and torch.equal(dequantise(q, None), d.to(torch.bfloat16).float())


def test_bgz_and_xor_pushes_give_the_exact_ema_of_plain_pushes(client, run_name):
    profiles = [{"name": "ema", "kind": "constant", "beta": 0.9}]
    plain = client.create_run(run_name + "-plain", profiles=profiles, mirror=True)
    coded = client.create_run(run_name + "-coded", profiles=profiles, mirror=True)
    state = _state(2)
    ref = {k: v.clone() for k, v in state.items()}
    with plain.pusher(rank=0) as p, coded.pusher(rank=0, codec="bgz", delta="xor") as c:
        for step in range(12):
            _walk(state, step)
            p.push(state, step)
            c.push(state, step)
            p.flush()
            c.flush()
            # The reference: AveragedModel's lerp in float32.
            for k, v in state.items():
                if step == 0 or not v.is_floating_point():
                    ref[k] = v.float().clone() if v.is_floating_point() else v.clone()
                else:
                    ref[k] = ref[k].lerp(v.float(), 0.1)
        stats = c.stats()
    a, b = _live_ema(client, plain.name), _live_ema(client, coded.name)
    for k in a:
        assert torch.equal(a[k], b[k]), k
        if a[k].is_floating_point() and a[k].numel():
            torch.testing.assert_close(b[k].float(), ref[k].float(), rtol=1e-6, atol=1e-7)
    assert stats.keyframes == 1 and stats.encoded == 12
    assert stats.bytes_sent < stats.logical_bytes
    view = coded.rank(0)
    wire = view["wire"]
    assert wire["last_kind"] == "xor" and wire["last_encoding"] == "polyak-bgz"
    assert wire["wire_bytes"] == stats.bytes_sent
    assert wire["ratio"] == pytest.approx(wire["logical_bytes"] / wire["wire_bytes"])
    assert wire["ratio"] > 1.0
    assert wire["decode_seconds"] > 0 and wire["encode_seconds"] > 0
    metrics = httpx.get(f"{client.url}/metrics").text
    assert f'polyak_push_logical_bytes_total{{run="{coded.name}"}}' in metrics
    assert f'polyak_push_codec_seconds_total{{run="{coded.name}",stage="decode"}}' in metrics


def _metric(text: str, name: str, run: str, extra: str = "") -> float:
    """One sample of the Prometheus text, by name and labels."""
    want = f'{name}{{run="{run}"{extra}}} '
    for line in text.splitlines():
        if line.startswith(want):
            return float(line[len(want) :])
    raise AssertionError(f"no {want!r} in /metrics")


def test_the_run_view_sums_the_ranks_wire_figures(client, run_name):
    run = client.create_run(run_name, world_size=3, mirror=True)
    state = _state(4)
    # Three ranks, three encodings (rank 2 never pushes).
    with (
        run.pusher(rank=0, codec="bgz", delta="fp8_e4m3") as a,
        run.pusher(rank=1, compress=3) as b,
    ):
        for step in range(5):
            _walk(state, step)
            a.push(state, step)
            b.push(state, step)
    view = run.refresh()
    ranks = [r["wire"] for r in view["ranks"]]
    assert len(ranks) == 3 and ranks[2]["wire_bytes"] == 0
    assert ranks[0]["wire_bytes"] > 0 and ranks[1]["wire_bytes"] > 0
    wire = view["wire"]
    check_wire_totals(wire, ranks)
    assert wire["decode_seconds"] > 0 and wire["encode_seconds"] > 0
    # The runs list carries the same object; a run with no push has ratio null.
    listed = {r["name"]: r for r in client.runs()}
    assert listed[run.name]["wire"] == wire
    idle = client.create_run(run_name + "-idle")
    assert idle.refresh()["wire"] == {
        "wire_bytes": 0,
        "logical_bytes": 0,
        "ratio": None,
        "encode_seconds": 0.0,
        "decode_seconds": 0.0,
        "mirror_mismatches": 0,
    }
    # Prometheus: the same sums by run.
    text = httpx.get(f"{client.url}/metrics").text
    assert _metric(text, "polyak_push_wire_bytes_total", run.name) == wire["wire_bytes"]
    assert _metric(text, "polyak_push_logical_bytes_total", run.name) == wire["logical_bytes"]
    decode = _metric(text, "polyak_push_codec_seconds_total", run.name, ',stage="decode"')
    assert decode == pytest.approx(wire["decode_seconds"], rel=1e-9)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8", "bf16"])
def test_quantised_deltas_keep_the_mirror_within_one_step_with_error_feedback(
    client, run_name, fmt
):
    steps = 1000 if fmt == "fp8_e4m3" else 200
    run = client.create_run(run_name, mirror=True, keyframe_every=10_000)
    state = {"w": torch.randn(4096) * 0.05, "b": torch.randn(129) * 0.01}
    worst_ratio = []
    errors = []
    with run.pusher(rank=0, delta=fmt, block=128) as p:
        enc = p._encoder
        assert enc is not None
        for step in range(steps):
            _walk(state, step, scale=1e-3)
            before = None if enc.mirror is None else [m.clone() for m in enc.mirror]
            p.push(state, step)
            p.flush()
            mirror = enc.mirror
            assert mirror is not None
            if before is None:
                continue
            # The client's copy after this push: within half a quantisation
            # step of the weights, the step being this delta's block scale.
            for (name, w), m, prev in zip(state.items(), mirror, before, strict=True):
                d = (w - prev).reshape(-1)
                err = (m - w).abs().reshape(-1)
                # float32 rounding of the mirror's add, on top.
                rounding = w.abs().reshape(-1) * 2.0**-23
                if fmt == "bf16":
                    bound = d.abs() * 2.0**-8 + rounding
                else:
                    pad = torch.nn.functional.pad(d, (0, -d.numel() % 128)).view(-1, 128)
                    amax = torch.repeat_interleave(pad.abs().amax(1), 128)[: d.numel()]
                    bound = amax / (28.0 if fmt == "fp8_e4m3" else 254.0) + rounding
                worst_ratio.append(float((err / bound.clamp_min(1e-30)).max()))
                if name == "w":
                    errors.append(float(err.norm()))
        stats = p.stats()
    # Within one (half) step at every push, and not drifting with the step
    # count: the error of the last pushes is no larger than that of the first.
    assert max(worst_ratio) <= 1.0 + 1e-4, max(worst_ratio)
    early = sum(errors[10:60]) / 50
    late = sum(errors[-50:]) / 50
    assert late < 2.0 * early, (early, late)
    # The server's mirror is the client's copy, bit for bit.
    snap = run.snapshot()
    online = run.download(snap, profile="online", progress=False)
    for (name, _), m in zip(state.items(), p._encoder.mirror, strict=True):
        assert torch.equal(online[name], m), name
    assert stats.keyframes == 1
    per_param = stats.bytes_sent / stats.encoded / sum(t.numel() for t in state.values())
    assert per_param < {"fp8_e4m3": 1.3, "int8": 1.3, "bf16": 2.3}[fmt]


def test_keyframe_checksum_reports_a_diverged_mirror_and_repairs_it(client, run_name, server):
    run = client.create_run(run_name, mirror=True, keyframe_every=3)
    state = _state(5)
    with run.pusher(rank=0, delta="fp8_e4m3") as p:
        for step in range(3):
            _walk(state, step)
            p.push(state, step)
            p.flush()
        # Silent divergence: the client's copy no longer matches the server's.
        p._encoder.mirror[1].view(-1)[0] += 0.5
        _walk(state, 3)
        p.push(state, 3)  # the keyframe (4th push: every 3 pushes after the first)
        p.flush()
        answer = p.last_response
    assert (
        answer is not None
        and answer["mirror_mismatch"]["client_crc32"] != (answer["mirror_mismatch"]["server_crc32"])
    )
    assert run.rank(0)["wire"]["mirror_mismatches"] == 1
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'polyak_mirror_mismatches_total{{run="{run.name}"}} 1' in metrics
    snap = run.snapshot()
    online = run.download(snap, profile="online", progress=False)
    for k, v in state.items():
        assert torch.equal(online[k], v), k  # repaired: the keyframe's weights
    # A keyframe whose checksum matches reports nothing.
    with run.pusher(rank=0, delta="fp8_e4m3", keyframe_every=2) as p:
        for step in (4, 5, 6):
            _walk(state, step)
            p.push(state, step)
            p.flush()
            assert "mirror_mismatch" not in (p.last_response or {})
    assert run.rank(0)["wire"]["mirror_mismatches"] == 1


def test_corrupted_and_truncated_encoded_bodies_are_refused(client, run_name, server):
    run = client.create_run(run_name, mirror=True)
    state = _state(7)
    body = _body(state)
    assert _put(server.url, run.name, 0, body).status_code == 200
    before = _live_ema(client, run.name)
    _walk(state, 1)
    enc = encode_bgz(_body(state))
    bad = bytearray(enc)
    bad[len(bad) // 2] ^= 0x40
    for payload in (enc[: len(enc) - 7], enc[:30], bytes(bad), b"PBG1" + b"\0" * 8):
        r = _put(server.url, run.name, 1, payload, **{"Content-Encoding": "polyak-bgz"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] in ("invalid_encoding", "invalid_safetensors")
    after = _live_ema(client, run.name)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert run.rank(0)["last_step"] == 0
    # The intact body applies.
    r = _put(server.url, run.name, 1, enc, **{"Content-Encoding": "polyak-bgz"})
    assert r.status_code == 200 and r.json()["applied"]


def test_deltas_need_a_keyframe_and_nonfinite_follows_the_run_policy(client, run_name, server):
    state = {"w": torch.randn(300) * 0.1, "i": torch.arange(4)}
    for policy in ("reject", "skip_tensor"):
        run = client.create_run(f"{run_name}-{policy}", mirror=True, nonfinite=policy)
        enc = MirrorEncoder("xor")
        layout = WireLayout([TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in state.items()])
        # A delta before any keyframe: 409 needs_keyframe.
        q, scales = quantise(state["w"], "fp8_e4m3")
        meta = {"polyak.kind": "delta", "polyak.quant": json.dumps({"format": "fp8_e4m3"})}
        delta_body = build_body([("w", q), ("w:scale", scales), ("i", state["i"])], meta)
        r = _put(server.url, run.name, 0, delta_body)
        assert r.status_code == 409 and r.json()["error"]["code"] == "needs_keyframe"
        host = HostBody(layout)
        host.fill(list(state.values()))
        first = enc.encode(layout, host.views, host.memory)
        assert _put(server.url, run.name, 0, bytes(first.payload)).status_code == 200
        enc.commit(first)
        ema = _live_ema(client, run.name)
        # An XOR push whose weights hold NaN; an fp8 delta with an Inf scale.
        bad = dict(state)
        bad["w"] = state["w"].clone()
        bad["w"][5] = float("nan")
        host.fill(list(bad.values()))
        xor = enc.encode(layout, host.views, host.memory)
        assert xor.kind == "xor"
        inf_scales = scales.clone()
        inf_scales[1] = float("inf")
        fp8_bad = build_body([("w", q), ("w:scale", inf_scales), ("i", state["i"])], meta)
        for step, payload in ((1, bytes(xor.payload)), (2, fp8_bad)):
            r = _put(server.url, run.name, step, payload)
            if policy == "reject":
                assert r.status_code == 422 and r.json()["error"]["code"] == "nonfinite"
            else:
                assert r.status_code == 200 and r.json()["skipped"] == ["w"], r.text
        now = _live_ema(client, run.name)
        assert torch.equal(now["w"], ema["w"])  # never averaged in


def test_malformed_quant_declarations_are_refused(client, run_name, server):
    run = client.create_run(run_name, mirror=True)
    w = torch.randn(300)
    assert _put(server.url, run.name, 0, _body({"w": w})).status_code == 200
    q, scales = quantise(w, "int8", 128)
    cases = [
        (
            {"polyak.kind": "delta", "polyak.quant": '{"format":"int4"}'},
            [("w", q), ("w:scale", scales)],
        ),
        ({"polyak.kind": "delta", "polyak.quant": '{"format":"int8","block":128}'}, [("w", q)]),
        (
            {"polyak.kind": "delta", "polyak.quant": '{"format":"int8","block":128}'},
            [("w", q), ("w:scale", scales[:-1])],
        ),
        (
            {"polyak.kind": "full", "polyak.quant": '{"format":"int8"}'},
            [("w", q), ("w:scale", scales)],
        ),
    ]
    for meta, entries in cases:
        r = _put(server.url, run.name, 1, build_body(entries, meta))
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_metadata", r.text
    assert run.rank(0)["last_step"] == 0
    # Sanity: the header of a quantised body declares F8_E4M3 for fp8.
    q8, s8 = quantise(w, "fp8_e4m3")
    raw = build_body([("w", q8), ("w:scale", s8)], {"polyak.kind": "delta"})
    (n,) = struct.unpack("<Q", raw[:8])
    assert json.loads(raw[8 : 8 + n])["w"]["dtype"] == "F8_E4M3"
