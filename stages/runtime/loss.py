"""The token loss every stage agrees on: summed next-token cross-entropy over trainable tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of cross-entropy over the trainable tokens, their number); `labels` are unshifted
    (position t predicts labels[t+1]) with IGNORE_INDEX where nothing is trained. Sums, not means,
    so micro-batches and ranks add up exactly and the caller divides once."""
    labels = labels[:, 1:]
    loss_sum = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, int((labels != IGNORE_INDEX).sum())


def kl_sum(logits: torch.Tensor, ref_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over the trainable positions of KL(ref || model) between next-token distributions; the
    same positions, and so the same count, as `token_loss_sum`."""
    keep = labels[:, 1:] != IGNORE_INDEX
    logp = F.log_softmax(logits[:, :-1][keep].float(), dim=-1)
    ref_logp = F.log_softmax(ref_logits[:, :-1][keep].float(), dim=-1)
    return F.kl_div(logp, ref_logp, log_target=True, reduction="sum")
