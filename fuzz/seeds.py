"""Writes the fuzz targets' seed corpora: for the push parser
(fuzz/corpus/push), real pushes as trainers send them, full and delta,
whole and sharded, every dtype the server keeps, and a few near misses; for
the codec (fuzz/corpus/codec), those pushes encoded with ``polyak-bgz``
(mode byte 0: decode), a tensor spec with data (mode 1: round trip) and
fp8 bytes (mode 2). Run it again if the wire format grows.

    python fuzz/seeds.py
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch

OUT = Path(__file__).parent / "corpus" / "push"
CODEC = Path(__file__).parent / "corpus" / "codec"


def save(
    name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    (OUT / name).write_bytes(safetensors.torch.save(tensors, metadata=metadata))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(18)
    save(
        "plain-f32",
        {"layer.weight": torch.randn(4, 3, generator=g), "layer.bias": torch.randn(4, generator=g)},
    )
    save(
        "mixed-dtypes",
        {
            "a.f64": torch.randn(3, dtype=torch.float64, generator=g),
            "a.f16": torch.randn(5, generator=g).half(),
            "a.bf16": torch.randn(6, generator=g).bfloat16(),
            "bn.num_batches_tracked": torch.tensor(7),
            "mask": torch.tensor([True, False, True]),
            "idx": torch.arange(4, dtype=torch.int32),
            "small": torch.arange(3, dtype=torch.int16),
            "bytes": torch.arange(5, dtype=torch.uint8),
            "signed": torch.arange(-2, 2, dtype=torch.int8),
        },
    )
    shards = {"w": {"global_shape": [8, 3], "offsets": [4, 0]}}
    save("sharded", {"w": torch.randn(4, 3, generator=g)}, {"polyak.shards": json.dumps(shards)})
    save("delta", {"w": torch.randn(4, 3, generator=g) * 1e-3}, {"polyak.kind": "delta"})
    save("nonfinite", {"w": torch.tensor([1.0, float("nan"), float("inf")])})
    save("scalar-and-empty", {"s": torch.tensor(2.5), "e": torch.zeros(0, 3)})
    bad_shards = {"w": {"global_shape": [2, 3], "offsets": [4, 0]}}
    save(
        "shards-out-of-range",
        {"w": torch.randn(4, 3, generator=g)},
        {"polyak.shards": json.dumps(bad_shards)},
    )
    save("unknown-kind", {"w": torch.ones(2)}, {"polyak.kind": "sideways"})
    codec_seeds()


def codec_seeds() -> None:
    from polyak._push.mirror import encode_bgz

    CODEC.mkdir(parents=True, exist_ok=True)
    for body in sorted(OUT.iterdir()):
        if body.name not in ("shards-out-of-range", "unknown-kind"):
            (CODEC / f"decode-{body.name}").write_bytes(b"\0" + encode_bgz(body.read_bytes()))
    g = torch.Generator().manual_seed(19)
    data = torch.randn(64, generator=g).bfloat16().view(torch.uint8).numpy().tobytes()
    # Mode 1: three tensors (F32 x 37, BF16 x 0, I8 x 74), then their data.
    (CODEC / "round-trip").write_bytes(b"\1\3" + bytes([0, 1, 1, 0, 6, 2]) + data)
    (CODEC / "fp8").write_bytes(b"\2" + bytes(range(256)))


if __name__ == "__main__":
    main()
