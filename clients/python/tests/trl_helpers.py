"""What the TRL drop-in test and its DDP workers share: a tiny GPT-2 (tied
embeddings, no dropout), its data and the Trainer's arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments


def tiny_model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=16,
        n_positions=8,
        n_embd=8,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def dataset(n: int = 48, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 16, (n, 8), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def arguments(out: Path, steps: int, **kw: Any) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        **kw,
    )
