"""Whether a model may train on packed micro-batches: its logits for a sequence packed after another
must equal its logits for that sequence alone (the attention kernel keeps packed samples apart)."""

from __future__ import annotations

import numpy as np
import torch

from .batches import collate_packed
from .lora import unwrap

# bf16 rounds a layer's sums in the order of the micro-batch's layout, so a sequence packed after another
# differs from itself alone by rounding: on SmolLM2-135M, mean |logit change| 0.07-0.11 on logits of scale
# 33 (0.2-0.35%), the largest 0.5-0.75, too much for any elementwise tolerance (a 1e-2 one sent every bf16
# run to padded micro-batches). Attention leaking across the boundary moves them by 9-14% of the scale on
# average (3.0-4.6). The mean against 1% of the scale tells the two apart; fp32 stays elementwise at 1e-4.
BF16_SHARE = 0.01


def packs_exactly(model: torch.nn.Module, dataset, device: torch.device, precision: str) -> bool:
    """Checked once on two short sequences made of the first sample's `input_ids`, on every rank
    (under FSDP2 the forwards are collectives); False for a model that is not a Hugging Face
    PreTrainedModel, before its dataset is read (a custom worker's samples have their own keys)."""
    from transformers import PreTrainedModel
    if not isinstance(unwrap(model), PreTrainedModel):
        return False
    ids = dataset[0]["input_ids"][:12]
    a = {"input_ids": ids, "loss_mask": np.ones_like(ids)}
    b = {"input_ids": ids[::-1].copy(), "loss_mask": np.ones_like(ids)}
    with torch.no_grad():
        packed = model(**{k: v.to(device) for k, v in collate_packed([a, b]).items() if k != "labels"},
                       use_cache=False).logits[0].float()
        single = model(input_ids=torch.as_tensor(b["input_ids"], device=device)[None].long(),
                       use_cache=False).logits[0].float()
    if precision == "bf16":
        return bool((packed[len(ids):] - single).abs().mean() <= BF16_SHARE * single.abs().max())
    return bool(torch.allclose(packed[len(ids):], single, atol=1e-4, rtol=1e-4))
