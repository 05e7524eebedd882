"""The validation loss of a training run (torchtitan's `Validator`): every rank scores its share
of the validation set with the worker's `get_eval_model_output`, and the sums add up across ranks."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from .contract import add_eval_output
from .sharding import reshard

SUMMED_FIRST = ["loss_sum", "n_tokens", "correct", "total"]  # then any other key of the outputs, sorted


def validate(model: torch.nn.Module, val_ds, score: Callable[[list], dict], hook: str, micro_batch_size: int,
             rank: int, world: int, device: torch.device, fsdp: bool) -> dict:
    """`val_loss` (= summed `loss_sum` / `n_tokens`), `val_tokens` and, when the outputs count
    `correct` / `total`, `val_accuracy`; {} without a validation set. `score(samples)` is the
    worker's output for a micro-batch of samples; every rank runs the same number of batches (the
    collectives inside the forward must match), an empty slot scoring sample 0 and adding nothing."""
    if val_ds is None or len(val_ds) == 0:
        return {}
    model.eval()
    mine = list(range(rank, len(val_ds), world))
    n_batches = math.ceil(math.ceil(len(val_ds) / world) / micro_batch_size)
    sums: dict[str, float] = {}
    with torch.no_grad():
        for k in range(n_batches):
            idx = mine[k * micro_batch_size: (k + 1) * micro_batch_size]
            out = score([val_ds[i] for i in (idx or [0])])
            if idx:
                add_eval_output(sums, out, hook)
    keys = SUMMED_FIRST + sorted(k for k in sums if k not in SUMMED_FIRST)
    stats = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64, device=device)
    if fsdp:
        reshard(model)
    dist.all_reduce(stats)
    model.train()
    total = dict(zip(keys, stats.tolist()))
    out = {"val_loss": total["loss_sum"] / max(total["n_tokens"], 1.0), "val_tokens": int(total["n_tokens"])}
    if total["total"] > 0:
        out["val_accuracy"] = total["correct"] / total["total"]
    return out
