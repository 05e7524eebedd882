"""QLoRA's second 4-bit format (`actor.lora.quantize: q4_1`): GGUF's Q4_1 blocks, in torch.

A row of a weight is cut in blocks of 32 consecutive weights; a block keeps its minimum m and its step
d = (max - min) / 15, each as fp16, and 32 4-bit codes q (two a byte, element j in the low nibble of
byte j, element j + 16 in its high one); a weight is d x q + m, computed in fp32. 20 bytes a block:
0.625 bytes a weight, 0.156x fp32. The bytes are llama.cpp's own layout (gguf's `Q4_1`), so gguf's
numpy implementation is an independent reference for both directions (tests/test_q4_1.py).

Why a second format beside NF4: an affine block (a minimum and a step) represents exactly a weight
that already is a 4-bit affine grid, and models are often shipped as one (the quickstart's SmolLM2 is
a Q4_1 GGUF). Quantizing such a base again with NF4's fixed normal-quantile table moves every weight
(docs/models.md measures what that costs); Q4_1 of it gives back the same weights, bit for bit. On a
full-precision base NF4 is the better 4 bits for normally distributed weights (the QLoRA paper).

Only torch: the round trip ships with a registered model (register's code_paths) and needs no torchao.
"""

from __future__ import annotations

BLOCK = 32
BLOCK_BYTES = 20  # fp16 step, fp16 minimum, 16 bytes of codes


def quantizable(in_features: int) -> bool:
    return in_features > 0 and in_features % BLOCK == 0


def q4_1_bytes(numel: int) -> int:
    return numel // BLOCK * BLOCK_BYTES


def quantize(weight):
    """A 2-D weight (rows x cols, cols a multiple of 32) as Q4_1 bytes: uint8, rows x (cols / 32 x 20).
    The arithmetic is gguf's (`gguf.quants.Q4_1.quantize_blocks`), in fp32, so the bytes are the same."""
    import torch
    rows, cols = weight.shape
    b = weight.detach().float().reshape(rows, cols // BLOCK, BLOCK)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((b - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
    codes = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return torch.cat([d.half().view(torch.uint8), lo.half().view(torch.uint8), codes], -1).reshape(rows, -1)


def dequantize(packed, cols: int, dtype=None):
    """The weight Q4_1 bytes stand for (rows x cols), computed in fp32 (d x q + m, as gguf's reference
    does), then cast to `dtype` once (none: fp32)."""
    import torch
    rows = packed.shape[0]
    b = packed.reshape(rows, cols // BLOCK, BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    c = b[..., 4:]
    q = torch.cat([c & 15, c >> 4], -1).float()
    w = (d * q + m).reshape(rows, cols)
    return w if dtype is None or dtype == torch.float32 else w.to(dtype)


def roundtrip(weight):
    """`weight` quantized to Q4_1 and back, in its own dtype: what a 4-bit linear computes with."""
    return dequantize(quantize(weight), weight.shape[1], weight.dtype)
