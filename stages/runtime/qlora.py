"""QLoRA inside a rank (`actor.lora.quantize: nf4 | q4_1`): the frozen base linear weights become torchao
NF4Tensors (4-bit codes + int8 block scales), or GGUF Q4_1 bytes as a plain uint8 parameter
(stages/core/q4_1.py), after the adapters are in place and before FSDP2
shards the model; the adapters and every other weight stay in the training precision.

torchao's NF4Tensor dequantizes inside `F.linear` (its `__torch_function__`, to the input's dtype)
and shards under FSDP2 (`fsdp_pre_all_gather`: the codes and scales travel, never a dequantized
weight). Which layers, and the plain-tensor equivalent the export merges into, are
stages/core/nf4.py's; the tests hold the two equal (tests/test_quantize.py).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from stages.core import q4_1
from stages.core.nf4 import quantized_linears, to_nf4


class _Linear4bit(torch.autograd.Function):
    """F.linear over a frozen 4-bit weight that `dequantize(weight, dtype)` turns into the input's dtype,
    the bias added inside the matmul as for a plain weight (torchao's own `linear_nf4` adds it after a
    rounded product: one more bf16 rounding, Qwen2's q/k/v biases). Only the 4-bit weight is kept for
    backward, which dequantizes again: nothing dense lives between the two."""

    @staticmethod
    def forward(ctx, x, weight, bias, dequantize):
        ctx.save_for_backward(weight)
        ctx.dequantize = dequantize
        ctx.bias_grad = bias is not None and bias.requires_grad
        return F.linear(x, dequantize(weight, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias_grad else None
        return grad @ ctx.dequantize(weight, grad.dtype), None, grad_bias, None


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # NF4Tensor.to(dtype) dequantizes
    return _Linear4bit.apply(x, self.weight, self.bias, lambda w, dtype: w.to(dtype))


def _forward_q4_1(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # in fp32, then to the input's dtype: the weight the export's round trip gives
    cols = self.in_features
    return _Linear4bit.apply(x, self.weight, self.bias, lambda w, dtype: q4_1.dequantize(w, cols, dtype))


def quantize_base_(model: nn.Module, lora) -> list[str]:
    """Replaces, in place, the weight of every layer `quantized_linears` names by its NF4Tensor
    (frozen); the names. `lora`: the `actor.lora` section. The weights are quantized where they are
    (call it before moving a big model to a GPU: the full weights never reach it)."""
    names = []
    if lora.quantize == "q4_1":
        # a plain uint8 parameter (rows x blocks x 20 bytes): FSDP2 shards it by rows like any weight and
        # leaves it out of mixed precision (not floating point); the Linear keeps its in/out features
        for name, m in quantized_linears(model, 0, 0, "q4_1"):
            m.weight = nn.Parameter(q4_1.quantize(m.weight), requires_grad=False)
            m.forward = types.MethodType(_forward_q4_1, m)
            names.append(name)
        return names
    for name, m in quantized_linears(model, lora.quantize_block_size, lora.quantize_scaler_block_size):
        w = m.weight.detach()
        m.weight = nn.Parameter(to_nf4(w, lora.quantize_block_size, lora.quantize_scaler_block_size),
                                requires_grad=False)
        m.forward = types.MethodType(_forward, m)
        del w
        names.append(name)
    return names


def is_nf4(t: torch.Tensor) -> bool:
    return type(t).__name__ == "NF4Tensor"


def unshardable(model: nn.Module, world: int) -> set[nn.Parameter]:
    """The 4-bit weights FSDP2 cannot split evenly over `world` ranks: torchao splits the codes, the
    block scales and the second-level factors by rows, so each must divide by the world size. They
    stay whole on every rank (`fully_shard(ignored_params=...)`): frozen, they have no gradient to
    reduce, and a rank computes with the same bytes as it would gathered. On one rank (bf16 on one
    GPU) all of them: torch 2.13's FSDP2 skips the all-gather there and hands a tensor subclass's
    `fsdp_post_all_gather` one input where NF4 returned three (a ValueError in the first forward)."""
    out = set()
    for p in model.parameters():
        if is_nf4(p) and (world == 1 or p.shape[0] % world or any(getattr(p, a).numel() % world for a in
                                                      ("quantized_data", "quantized_scalers", "quantization_factor"))):
            out.add(p)
    return out


def resident_bytes(tensors) -> int:
    """Bytes the storages behind `tensors` occupy in this process, each storage once: an NF4Tensor's
    are its inner tensors (codes, scales, factors, mean, table); a DTensor's its local shard."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        if hasattr(t, "to_local"):
            t = t.to_local()
        if is_nf4(t):
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
            return
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()

    for t in tensors:
        add(t.detach() if isinstance(t, nn.Parameter) else t)
    return sum(seen.values())


def base_bytes_line(model: nn.Module) -> str:
    """What this rank's frozen base weights occupy, measured (`resident_bytes`), against the same
    weights in fp32: the 4-bit ones, and the whole base (embeddings and norms stay full)."""
    def local(p):
        return p.to_local() if hasattr(p, "to_local") else p
    def weights(p):  # how many weights a parameter stands for: Q4_1's bytes hold 32 in 20
        p = local(p)
        return p.numel() * q4_1.BLOCK // q4_1.BLOCK_BYTES if p.dtype == torch.uint8 else p.numel()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    nf4 = [p for p in frozen if is_nf4(local(p)) or local(p).dtype == torch.uint8]
    q, q32 = resident_bytes(nf4), 4 * sum(weights(p) for p in nf4)
    b, b32 = resident_bytes(frozen), 4 * sum(weights(p) for p in frozen)
    mib = 2 ** 20
    return (f"QLoRA: {len(nf4)} base weights 4-bit: {q / mib:.1f} MiB on this rank ({q / max(q32, 1):.3f}x their "
            f"fp32 {q32 / mib:.1f} MiB); whole frozen base {b / mib:.1f} MiB ({b / max(b32, 1):.3f}x fp32)")
