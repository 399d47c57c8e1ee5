"""Tied weights: a HuggingFace GPT-2 (built from a tiny config, nothing
downloaded) whose ``lm_head.weight`` is ``transformer.wte.weight``. The
tensor travels once; every download layout and ``load_ema_into`` give both
names back, strict loading and ``from_pretrained`` work, and the tie holds."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import transformers
from polyak_testing.refs import averaged_state
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

BETA = 0.8
STEPS = 6


def tiny_gpt2(seed: int):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=97,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def tied(model) -> bool:
    return model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def test_gpt2_tied_weights_travel_once_and_load_everywhere(client, run_name, tmp_path):
    model = tiny_gpt2(40)
    assert tied(model)
    run = client.create_run(run_name, profiles=[{"name": "ema", "kind": "constant", "beta": BETA}])
    anchor = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(BETA), use_buffers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(41)
    pusher = run.pusher()
    pusher.attach(opt, model)
    for _ in range(STEPS):
        idx = torch.randint(0, 97, (4, 12), generator=gen)
        model(input_ids=idx, labels=idx).loss.backward()
        opt.step()
        opt.zero_grad()
        anchor.update_parameters(model)
    pusher.flush()

    # Pushed once: the wire layout and the server's rank hold one copy.
    sd = model.state_dict()
    unique = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    layout = pusher._layout
    assert layout is not None
    assert [s.name for s in layout.specs] == list(unique)
    assert layout.nbytes == layout.data_start + sum(v.nbytes for v in unique.values())
    assert pusher.stats().bytes_sent == STEPS * layout.nbytes
    rank = run.rank(0, layout=True)
    assert rank["tensors"] == len(unique) and rank["numel"] == sum(
        v.numel() for v in unique.values()
    )
    assert rank["layout"]["aliases"] == {"lm_head.weight": "transformer.wte.weight"}

    want = averaged_state(anchor)
    snap = run.snapshot()

    def check(loaded, label: str) -> None:
        assert tied(loaded), label
        got = loaded.state_dict()
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=0, atol=1e-6), (label, k)

    # layout=full: strict load_state_dict, and from_pretrained of the file.
    full = run.download(snap, progress=False)
    assert set(full) == set(sd)
    m = tiny_gpt2(0)
    m.load_state_dict(full, strict=True)
    check(m, "full")
    d = tmp_path / "full"
    path = run.download_to(snap, d / "model.safetensors", progress=False)
    assert path == d / "model.safetensors"
    model.config.save_pretrained(d)
    check(transformers.GPT2LMHeadModel.from_pretrained(d), "full from_pretrained")
    # layout=hf: shards and index, from_pretrained.
    hf = run.download_to(snap, tmp_path / "hf", layout="hf", progress=False)
    model.config.save_pretrained(hf)
    check(transformers.GPT2LMHeadModel.from_pretrained(hf), "hf from_pretrained")
    # layout=sharded: torch.distributed.checkpoint into a strict state dict.
    sharded = run.download_to(snap, tmp_path / "dcp", layout="sharded", progress=False)
    m = tiny_gpt2(0)
    target = {k: v.clone() for k, v in m.state_dict().items()}
    dcp.load(target, storage_reader=dcp.HuggingFaceStorageReader(str(sharded)), no_dist=True)
    m.load_state_dict(target, strict=True)
    check(m, "sharded")
    # load_ema_into: both names restored, the tie kept.
    m = tiny_gpt2(0)
    pusher.load_ema_into(m)
    check(m, "load_ema_into")
    pusher.close()
