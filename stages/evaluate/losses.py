"""Teacher-forced loss on the held-out replies, as sums that add up exactly across ranks."""

from __future__ import annotations

import math

import torch

from stages.runtime.batches import collate_padded
from stages.runtime.loss import IGNORE_INDEX, token_loss_sum


@torch.no_grad()
def teacher_forced_sums(model, samples: list[dict], pad_id: int, batch_size: int) -> dict:
    """Sums over the trainable tokens of every sample: cross-entropy, token count, argmax hits.
    Sums (not means) so that ranks add up exactly; `loss_metrics` divides once."""
    loss_sum, tokens, correct = 0.0, 0, 0
    for i in range(0, len(samples), batch_size):
        batch = {k: v.to(model.device) for k, v in collate_padded(samples[i:i + batch_size], pad_id).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        ls, n = token_loss_sum(logits, batch["labels"])
        loss_sum += ls.item()
        tokens += n
        labels = batch["labels"][:, 1:]
        correct += int(((logits[:, :-1].argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum())
    return {"loss_sum": loss_sum, "tokens": tokens, "token_correct": correct}


def loss_metrics(sums: dict) -> dict:
    """eval_loss = sum of token losses / tokens over all samples; perplexity = exp(eval_loss)."""
    tokens = int(sums["tokens"])
    loss = sums["loss_sum"] / max(tokens, 1)
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "token_accuracy": sums["token_correct"] / max(tokens, 1), "eval_tokens": tokens}
