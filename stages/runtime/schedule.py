"""The learning-rate schedule (`actor.optim.scheduler`, `warmup`, `min_lr_ratio`).

After warmup it is transformers' schedule: `cosine` equals
`get_cosine_with_min_lr_schedule_with_warmup(min_lr_rate=min_lr_ratio)`, `linear` decays
linearly to `min_lr_ratio` (transformers' `get_linear_schedule_with_warmup` when it is 0),
`constant` stays at 1 (tests/test_worker_contract.py checks all three against transformers).
Warmup differs on purpose: transformers starts at lr 0 (step / warmup), so the first step
trains nothing; here step k of warmup uses (k + 1) / (warmup + 1), never 0.
"""

from __future__ import annotations

import math


def lr_lambda(total_steps: int, warmup: float, scheduler: str, min_ratio: float):
    """LambdaLR factor for step k: `warmup` < 1 is a fraction of `total_steps`, >= 1 a step count."""
    warm = int(warmup) if warmup >= 1 else math.ceil(warmup * total_steps)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        if scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if scheduler == "cosine" else 1 - progress
        return min_ratio + (1 - min_ratio) * decay
    return f
