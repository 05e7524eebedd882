"""Teacher-forced loss on the held-out replies, as sums that add up exactly across ranks."""

from __future__ import annotations

import math

import numpy as np
import torch

from stages.runtime.batches import collate_padded
from stages.inference.generation import cache_argument, prefix_cache, shared_prefix
from stages.runtime.loss import model_loss


@torch.no_grad()
def teacher_forced_sums(model, samples: list[dict], pad_id: int, batch_size: int) -> dict:
    """Sums over the trainable tokens of every sample: cross-entropy, token count, argmax hits.
    Sums (not means) so that ranks add up exactly; `loss_metrics` divides once. The output head
    runs on the trained positions only, in chunks, where the model allows it (runtime/loss.py).

    The tokens every sample starts with (the template's system prompt: 24 of a SmolLM2 prompt's 38
    tokens on the quickstart's sets) are computed once and every batch attends to their keys and
    values, as generation does; none of them is trained or predicts a trained token."""
    loss_sum, tokens, correct = 0.0, 0, 0
    # shortest first: a batch pads to its longest sample, so batches of like lengths compute few pads
    ordered = sorted(samples, key=lambda s: len(s["input_ids"]))
    arg = cache_argument(model)
    prefix = None
    if arg is not None and len(ordered) > 1:
        ids = [[int(t) for t in s["input_ids"]] for s in ordered]
        prefix = shared_prefix(model, ids, limit=min(_first_trained(s) for s in ordered) - 1)
    start = prefix[1] if prefix else 0
    for i in range(0, len(ordered), batch_size):
        batch = {k: v.to(model.device) for k, v in collate_padded(ordered[i:i + batch_size], pad_id).items()}
        inputs = {"input_ids": batch["input_ids"][:, start:], "attention_mask": batch["attention_mask"]}
        if prefix:
            rows, width = inputs["input_ids"].shape
            inputs[arg] = prefix_cache(model, prefix, rows)
            inputs["position_ids"] = torch.arange(start, start + width, device=model.device)[None].expand(rows, -1)
        sums = model_loss(model, inputs, batch["labels"][:, start:], accuracy=True)
        loss_sum += sums.ce.item()
        tokens += sums.n_tokens
        correct += sums.correct
    return {"loss_sum": loss_sum, "tokens": tokens, "token_correct": correct}


def _first_trained(sample: dict) -> int:
    """The position of a sample's first trained token (its length when none is)."""
    trained = np.flatnonzero(np.asarray(sample["loss_mask"]))
    return int(trained[0]) if len(trained) else len(sample["input_ids"])


def loss_metrics(sums: dict) -> dict:
    """eval_loss = sum of token losses / tokens over all samples; perplexity = exp(eval_loss)."""
    tokens = int(sums["tokens"])
    loss = sums["loss_sum"] / max(tokens, 1)
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "token_accuracy": sums["token_correct"] / max(tokens, 1), "eval_tokens": tokens}
