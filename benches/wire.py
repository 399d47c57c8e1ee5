"""Wire benchmark: the byte-grouped codec, XOR and quantised deltas, on the
weights of a small transformer trained in this script.

Every figure is a ratio against a baseline measured in the same run, printed
with its target and PASS/MISS (or ``reported``):

- codec: compressed size of plain zstd / byte-grouped zstd on the same bytes
  (bf16 weights; XOR deltas between consecutive pushes of fp32 weights);
- server decode rate / its validation rate of the uncompressed body;
- quantised deltas (fp8 e4m3, int8, bf16) with error feedback over the
  training loop: wire bytes per parameter per push, and the EMA's relative
  distance from the EMA of exact (uncompressed fp32) pushes;
- server apply rate of quantised deltas / of fp32 full pushes;
- the client's encode cost per push (sender-thread CPU time).

``python benches/wire.py --bin target/release/polyak`` (``--quick``: a few
steps, checks the script).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "clients" / "python"))
sys.path.insert(0, str(ROOT / "clients" / "python-testing"))
sys.path.insert(0, str(HERE))

from e2e import raw_tcp_rate  # noqa: E402
from polyak import Client  # noqa: E402
from polyak._push.mirror import DEFAULT_CODEC_LEVEL, MirrorEncoder, encode_bgz  # noqa: E402
from polyak.wire import HostBody, TensorSpec, WireLayout, read_safetensors  # noqa: E402
from polyak_testing import PolyakServer  # noqa: E402

MB = 1 << 20


class TinyLM(nn.Module):
    """A small decoder-only transformer (pre-norm, tied embeddings)."""

    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(64, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.blocks(self.emb(x) + self.pos[:t], mask=mask, is_causal=True)
        return self.head(self.norm(h))


def batches(vocab: int, seq: int, batch: int):
    """Text-like data: a fixed random bigram chain with a few likely successors."""
    g = torch.Generator().manual_seed(0)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    while True:
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for i in range(seq):
            pick = torch.randint(0, 4, (batch,), generator=g)
            x[:, i + 1] = succ[x[:, i], pick]
        yield x[:, :-1], x[:, 1:]


def trainer(steps: int, seed: int = 0):
    """Yields the model after each of ``steps`` AdamW steps."""
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    data = batches(256, 32, 16)
    for _ in range(steps):
        x, y = next(data)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield model, float(loss)


def body_of(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> bytes:
    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
        for k, v in state.items()
    }
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    body = HostBody(WireLayout(specs))
    body.fill([v.detach() for v in tensors.values()])
    return bytes(body.memory)


def zstd_size(data: bytes, level: int) -> int:
    import zstandard

    return len(zstandard.ZstdCompressor(level=level).compress(data))


def verdict(value: float, target: float, higher: bool) -> str:
    return "PASS" if (value >= target if higher else value <= target) else "MISS"


def put(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict) -> dict:
    conn.request(
        "PUT", path, body=body, headers={"Content-Type": "application/octet-stream", **headers}
    )
    r = conn.getresponse()
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {data[:300]!r}")
    return json.loads(data)


def histogram_sum(url: str, stage: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for line in text.splitlines():
        if line.startswith(f'polyak_push_seconds_sum{{stage="{stage}"}}'):
            return float(line.split()[-1])
    return 0.0


def exponent_bound(bf16_body: bytes) -> float:
    """Bytes per bf16 value that no lossless coder of independent values
    can go below: the order-0 entropy of the 8 exponent bits plus 8 bits of
    sign and mantissa (which trained weights leave all but random)."""
    import numpy as np

    n = int.from_bytes(bf16_body[:8], "little")
    u = np.frombuffer(bf16_body[8 + n :], dtype=np.uint16)
    counts = np.bincount((u >> 7) & 0xFF, minlength=256)
    p = counts[counts > 0] / len(u)
    return (float(-(p * np.log2(p)).sum()) + 8.0) / 8.0


def codec_rows(states: list[dict[str, torch.Tensor]], row, reported) -> None:
    """Compression ratios (raw bytes / encoded bytes) of the byte-grouped
    codec at the client's default level, beside plain zstd at the same
    level on the same bytes."""
    level = DEFAULT_CODEC_LEVEL
    last = states[-1]
    bf16 = body_of(last, torch.bfloat16)
    grouped = len(encode_bgz(bf16, level))
    plain = zstd_size(bf16, level)
    row(
        "codec on trained bf16 weights: raw bytes / byte-grouped zstd bytes",
        len(bf16) / grouped,
        ">= 1.3",
        True,
    )
    reported("same, plain zstd: raw bytes / zstd bytes (baseline)", f"{len(bf16) / plain:.2f}")
    values = (len(bf16) - 8 - int.from_bytes(bf16[:8], "little")) // 2
    reported(
        "bf16: plain zstd bytes / byte-grouped bytes (order-0 bound of any coder: "
        f"{plain / (values * exponent_bound(bf16)):.2f})",
        f"{plain / grouped:.2f}",
    )
    fp32 = body_of(last)
    reported(
        "fp32 weights: raw / byte-grouped (raw / plain zstd)",
        f"{len(fp32) / len(encode_bgz(fp32, level)):.2f} ({len(fp32) / zstd_size(fp32, level):.2f})",
    )
    prev = body_of(states[-2])
    n = int.from_bytes(fp32[:8], "little")
    a = torch.frombuffer(bytearray(fp32[8 + n :]), dtype=torch.int32)
    b = torch.frombuffer(bytearray(prev[8 + n :]), dtype=torch.int32)
    xor = fp32[: 8 + n] + (a ^ b).numpy().tobytes()
    xor_grouped = len(encode_bgz(xor, level))
    row(
        "codec on XOR deltas of consecutive fp32 pushes: raw bytes / byte-grouped bytes",
        len(xor) / xor_grouped,
        ">= 1.3",
        True,
    )
    reported(
        "same: raw / plain zstd (baseline); plain zstd / byte-grouped",
        f"{len(xor) / zstd_size(xor, level):.2f}; {zstd_size(xor, level) / xor_grouped:.2f}",
    )


def decode_rate(url: str, numel: int, pushes: int) -> tuple[float, float, float]:
    """Server decode rate / its validation rate of the uncompressed bodies:
    the same trained-like bodies pushed plain to one run and encoded to
    another; the validate stage's seconds (Prometheus) per byte. Also the
    two rates, decoded bytes per second and validated bytes per second."""
    c = Client(url)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16)
    bodies = []
    for _ in range(pushes):
        w = w + (torch.randn(numel, generator=g) * 1e-4).to(torch.bfloat16)
        bodies.append(body_of({"w": w}))
    encoded = [encode_bgz(b, DEFAULT_CODEC_LEVEL) for b in bodies]
    host, port = url.removeprefix("http://").split(":")
    rates = {}
    for name, payloads, headers in (
        ("plain", bodies, {}),
        ("bgz", encoded, {"Content-Encoding": "polyak-bgz"}),
    ):
        c.create_run(f"decode-{name}", persist_every_secs=0, drift_every=0)
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        put(conn, f"/v1/runs/decode-{name}/ranks/0/steps/0", payloads[0], headers)
        before = histogram_sum(url, "validate")
        for i, p in enumerate(payloads[1:], start=1):
            put(conn, f"/v1/runs/decode-{name}/ranks/0/steps/{i}", p, headers)
        rates[name] = histogram_sum(url, "validate") - before
        conn.close()
        c.delete_run(f"decode-{name}")
    c.close()
    # validate(bgz) = decode + validation; validate(plain) = validation.
    decode = max(rates["bgz"] - rates["plain"], 1e-9)
    size = sum(len(b) for b in bodies[1:])
    return rates["plain"] / decode, size / decode, size / max(rates["plain"], 1e-9)


def delta_rows(args, row, reported, url: str) -> list[dict[str, torch.Tensor]]:
    """Trains the model, pushing every step to an exact run and one run per
    delta format; compares the EMAs and the wire bytes."""
    c = Client(url)
    formats = {"fp8_e4m3": (256, 1.1, 1e-3), "int8": (256, 1.1, 1e-3), "bf16": (128, 2.05, 1e-5)}
    profiles = [{"name": "ema", "kind": "constant", "beta": 0.999}]
    exact = c.create_run("exact", profiles=profiles, persist_every_secs=0, drift_every=0)
    runs = {
        f: c.create_run(
            f"delta-{f}", profiles=profiles, mirror=True, persist_every_secs=0, drift_every=0
        )
        for f in formats
    }
    pushers = {"exact": exact.pusher(rank=0)}
    for f, (block, _, _) in formats.items():
        pushers[f] = runs[f].pusher(rank=0, delta=f, block=block)
    states: list[dict[str, torch.Tensor]] = []
    params = 0
    started = time.perf_counter()
    loss = 0.0
    for step, (model, step_loss) in enumerate(trainer(args.steps)):
        loss = step_loss
        sd = model.state_dict()
        params = sum(v.numel() for v in sd.values())
        for p in pushers.values():
            p.push(sd, step)
        for p in pushers.values():
            p.flush()
        if step >= args.steps - 2:
            states.append({k: v.detach().clone() for k, v in sd.items()})
    train_s = time.perf_counter() - started
    stats = {k: p.stats() for k, p in pushers.items()}
    for p in pushers.values():
        p.close()
    reported(
        f"training loop: {args.steps} AdamW steps of a {params / 1e6:.2f}M-parameter transformer, final loss",
        f"{loss:.3f} ({train_s:.0f} s)",
    )
    ref = read_safetensors(
        c.request("GET", "/v1/runs/exact/ranks/0/ema", params={"profile": "ema"}).content
    )[0]
    for f, (block, byte_target, ema_target) in formats.items():
        s = stats[f]
        per_param = s.bytes_sent / s.encoded / params
        row(
            f"{f} deltas (block {block}): wire bytes per parameter per push",
            per_param,
            f"<= {byte_target}",
            False,
            "{:.3f}",
        )
        got = read_safetensors(
            c.request("GET", f"/v1/runs/delta-{f}/ranks/0/ema", params={"profile": "ema"}).content
        )[0]
        num = sum(
            float((got[k].double() - ref[k].double()).norm() ** 2)
            for k in ref
            if ref[k].is_floating_point()
        )
        den = sum(float(ref[k].double().norm() ** 2) for k in ref if ref[k].is_floating_point())
        rel = (num / den) ** 0.5
        row(
            f"{f} deltas: EMA (beta 0.999, {args.steps} steps) relative distance from the exact EMA",
            rel,
            f"<= {ema_target:g}",
            False,
            "{:.2e}",
        )
        reported(
            f"{f} deltas: client encode CPU time per push (sender thread), ms",
            f"{1e3 * s.encode_seconds / max(s.encoded, 1):.2f}",
        )
    c.close()
    return states


def pipelined_ingest(url: str, numel: int, count: int, slots: int) -> float:
    """Bytes per second of ``count`` pushes of fp32 bodies from ``slots``
    connections, each push naming its predecessor (``Polyak-Prev-Step``),
    as a pipelining pusher sends them."""
    import threading

    c = Client(url)
    name = f"ingest-{slots}"
    c.create_run(name, persist_every_secs=0, drift_every=0)
    g = torch.Generator().manual_seed(5)
    bodies = [body_of({"w": torch.randn(numel, generator=g)}) for _ in range(2)]
    host, port = url.removeprefix("http://").split(":")
    first = http.client.HTTPConnection(host, int(port), timeout=600)
    put(first, f"/v1/runs/{name}/ranks/0/steps/0", bodies[0], {})  # registers the layout
    first.close()
    errors: list[BaseException] = []

    def sender(slot: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        try:
            for step in range(1 + slot, count + 1, slots):
                headers = {"Polyak-Prev-Step": str(step - 1)} if slots > 1 else {}
                ans = put(conn, f"/v1/runs/{name}/ranks/0/steps/{step}", bodies[step % 2], headers)
                assert ans["applied"], ans
        except BaseException as e:  # reported after the join
            errors.append(e)
        finally:
            conn.close()

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(slots)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    c.delete_run(name)
    c.close()
    return len(bodies[0]) * count / dt


def apply_rate(url: str, numel: int, pushes: int) -> dict[str, float]:
    """Median server apply seconds: fp32 full pushes and each delta format,
    on mirror runs of the same size."""
    c = Client(url)
    host, port = url.removeprefix("http://").split(":")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(numel, generator=g) * 0.02
    out = {}
    for fmt in ("full", "fp8_e4m3", "int8", "bf16"):
        c.create_run(
            f"apply-{fmt}", mirror=True, persist_every_secs=0, drift_every=0, keyframe_every=10_000
        )
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        enc = MirrorEncoder(None if fmt == "full" else fmt, block=256)
        layout = WireLayout([TensorSpec("w", torch.float32, (numel,))])
        body = HostBody(layout)
        times = []
        x = w.clone()
        for step in range(pushes):
            x.add_(torch.randn(numel, generator=g) * 1e-4)
            body.fill([x])
            e = enc.encode(layout, body.views, body.memory)
            ans = put(
                conn, f"/v1/runs/apply-{fmt}/ranks/0/steps/{step}", bytes(e.payload), e.headers
            )
            enc.commit(e)
            if step > 0:
                times.append(ans["apply_seconds"])
        out[fmt] = statistics.median(times)
        conn.close()
        c.delete_run(f"apply-{fmt}")
    c.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "polyak"))
    ap.add_argument("--steps", type=int, default=1000, help="training steps (pushes)")
    ap.add_argument("--quick", action="store_true", help="a few steps, small bodies")
    args = ap.parse_args()
    if args.quick:
        args.steps = 12
    table: list[tuple[str, str, str, str]] = []

    def row(figure: str, value: float, target: str, higher: bool, fmt: str = "{:.2f}") -> None:
        table.append(
            (figure, fmt.format(value), target, verdict(value, float(target.split()[-1]), higher))
        )

    def reported(figure: str, value: str) -> None:
        table.append((figure, value, "reported", "-"))

    tmp = Path(tempfile.mkdtemp(prefix="polyak-wire-"))
    with PolyakServer(tmp / "data", binary=args.bin) as srv:
        numel64 = (1 if args.quick else 16) * MB  # 64 MB of fp32
        count = 4 if args.quick else 12
        g = torch.Generator().manual_seed(6)
        raw = raw_tcp_rate(body_of({"w": torch.randn(numel64, generator=g)}), count)
        piped = pipelined_ingest(srv.url, numel64, count, 2)
        one = pipelined_ingest(srv.url, numel64, count, 1)
        row(
            "pipelined ingest, 64 MB fp32 bodies, 2 in flight: server / raw loopback TCP",
            piped / raw,
            ">= 0.9",
            True,
        )
        reported("same, one push at a time: server / raw loopback TCP", f"{one / raw:.2f}")
        reported(
            "raw loopback TCP; server, 2 in flight (GB/s)", f"{raw / 1e9:.2f}; {piped / 1e9:.2f}"
        )
        states = delta_rows(args, row, reported, srv.url)
        codec_rows(states, row, reported)
        numel = (4 if args.quick else 32) * MB  # bf16: 64 MB bodies in full mode
        ratio, decoded, validated = decode_rate(srv.url, numel, 3 if args.quick else 6)
        row(
            "server decode rate (polyak-bgz) / its validation rate of the same bodies uncompressed",
            ratio,
            ">= 0.8",
            True,
        )
        reported(
            "server decode; validation of the uncompressed body (GB/s)",
            f"{decoded / 1e9:.2f}; {validated / 1e9:.2f}",
        )
        applies = apply_rate(srv.url, (1 if args.quick else 16) * MB, 4 if args.quick else 8)
        for fmt in ("fp8_e4m3", "int8", "bf16"):
            row(
                f"server apply rate, {fmt} delta / fp32 full push (mirror runs)",
                applies["full"] / applies[fmt],
                ">= 0.8",
                True,
            )
    width = max(len(r[0]) for r in table)
    print(f"{'figure':<{width}}  measured  target     result")
    for figure, value, target, result in table:
        print(f"{figure:<{width}}  {value:>8}  {target:<9}  {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
