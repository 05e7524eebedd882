"""Teacher-forced loss on the held-out replies, as sums that add up exactly across ranks."""

from __future__ import annotations

import math

import torch

from stages.runtime.batches import collate_padded
from stages.runtime.loss import model_loss


@torch.no_grad()
def teacher_forced_sums(model, samples: list[dict], pad_id: int, batch_size: int) -> dict:
    """Sums over the trainable tokens of every sample: cross-entropy, token count, argmax hits.
    Sums (not means) so that ranks add up exactly; `loss_metrics` divides once. The output head
    runs on the trained positions only, in chunks, where the model allows it (runtime/loss.py)."""
    loss_sum, tokens, correct = 0.0, 0, 0
    # shortest first: a batch pads to its longest sample, so batches of like lengths compute few pads
    ordered = sorted(samples, key=lambda s: len(s["input_ids"]))
    for i in range(0, len(ordered), batch_size):
        batch = {k: v.to(model.device) for k, v in collate_padded(ordered[i:i + batch_size], pad_id).items()}
        sums = model_loss(model, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
                          batch["labels"], accuracy=True)
        loss_sum += sums.ce.item()
        tokens += sums.n_tokens
        correct += sums.correct
    return {"loss_sum": loss_sum, "tokens": tokens, "token_correct": correct}


def loss_metrics(sums: dict) -> dict:
    """eval_loss = sum of token losses / tokens over all samples; perplexity = exp(eval_loss)."""
    tokens = int(sums["tokens"])
    loss = sums["loss_sum"] / max(tokens, 1)
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "token_accuracy": sums["token_correct"] / max(tokens, 1), "eval_tokens": tokens}
