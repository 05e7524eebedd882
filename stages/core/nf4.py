"""QLoRA's base weights (`actor.lora.quantize: nf4`): which linear layers are stored 4-bit, what that
costs in bytes, and the NF4 round trip (quantize, then dequantize) that makes a plain model equal to
the one that trained. The record and the round trip also cover `q4_1` (GGUF's blocks, q4_1.py): one
place applies whichever a run used.

torchao's NF4 (`torchao...nf4_tensor.to_nf4`, the format torchtune's QLoRA uses): a weight of n
elements in blocks of `block_size` (64) holds n/2 bytes of 4-bit codes, one int8 scale per block,
and per `scaler_block_size` (256) blocks one factor in the weight's dtype that dequantizes those
scales, plus the scales' mean and the 16-entry NF4 table. Dequantized, a code is table[code] x its
block's scale, computed in the weight's dtype: a linear over an NF4 weight is exactly a linear over
`roundtrip` of the original weight (tests/test_quantize.py).

The rule of which layers (`quantized_linears`) is world-size free and shared by training (4-bit
weights), the export (the adapters merged into the round-tripped base) and anything else that
rebuilds a quantized run's model from its base (`roundtrip_nf4_` with `quantize_record`): every
`nn.Linear` but the output head and LoRA's own adapters, as QLoRA does; embeddings and norms are not
linear layers and stay in the training precision. torchao's layout needs whole scaler blocks: a
layer's scaler block is the largest divisor of its block count up to `scaler_block_size`
(`scaler_block`), so SmolLM2's 576-wide attention (5184 blocks: 216 a scaler block) is quantized
as its MLP is (smaller scaler blocks only store the scales more precisely). A layer whose size is
not a multiple of block_size stays in the training precision.

torch and torchao are imported inside the functions: core is imported by torch-free processes.
"""

from __future__ import annotations

from typing import Any

INSTALL = "pip install 'sftflow[qlora]' (torchao==0.18.0)"


def quantize_record(cfg) -> dict | None:
    """What a run's base weights were trained as, for whoever rebuilds its model from the base (the
    export, a version stored as adapters + base): None unless `actor.lora.quantize` is set."""
    lora = cfg.actor.lora
    if lora.r == 0 or lora.quantize == "none":
        return None
    if lora.quantize == "q4_1":
        return {"kind": "q4_1", "block_size": 32,
                "modules": "every nn.Linear but the output head and the adapters whose input width is a multiple of 32"}
    return {"kind": lora.quantize, "block_size": lora.quantize_block_size,
            "scaler_block_size": lora.quantize_scaler_block_size,
            "modules": "every nn.Linear but the output head and the adapters whose size is a multiple of block_size; "
                       "scaler_block_size at most: per layer the largest divisor of its block count"}


def scaler_block(numel: int, block_size: int, scaler_block_size: int) -> int | None:
    """The scaler block a weight of `numel` elements is quantized with: the largest divisor of its block
    count up to `scaler_block_size`; None when it is not quantized (not whole blocks)."""
    if numel <= 0 or numel % block_size:
        return None
    blocks = numel // block_size
    return next(s for s in range(min(scaler_block_size, blocks), 0, -1) if blocks % s == 0)


def quantizable(numel: int, block_size: int, scaler_block_size: int) -> bool:
    return scaler_block(numel, block_size, scaler_block_size) is not None


def nf4_bytes(numel: int, block_size: int = 64, scaler_block_size: int = 256, dtype_bytes: int = 4) -> int:
    """Bytes torchao's NF4Tensor holds for a weight of `numel` elements quantized from a `dtype_bytes`
    dtype: 4-bit codes (numel/2), int8 block scales (numel/block_size), one factor per scaler block
    (the weight's dtype), the scales' mean and the 16-entry NF4 table (the weight's dtype). A weight
    of a single scaler block keeps its factor as a view of the scaler_block_size factors torchao
    computed (its `.contiguous()` copies only a strided one): measured, tests/test_quantize.py."""
    blocks = numel // block_size
    scaler_block_size = scaler_block(numel, block_size, scaler_block_size) or scaler_block_size
    factors = blocks // scaler_block_size
    return numel // 2 + blocks + (factors if factors > 1 else scaler_block_size) * dtype_bytes + 17 * dtype_bytes


def output_head(model) -> Any:
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    get = getattr(base, "get_output_embeddings", None)
    return get() if callable(get) else None


def quantized_linears(model, block_size: int, scaler_block_size: int, kind: str = "nf4") -> list[tuple[str, Any]]:
    """(name, module) of the linear layers whose weights a quantized run stores 4-bit (module docstring);
    `kind` q4_1: those whose input width is a multiple of its 32-weight blocks (stages/core/q4_1.py)."""
    import torch.nn as nn
    fits = ((lambda m: _q4_1().quantizable(m.in_features)) if kind == "q4_1" else
            (lambda m: quantizable(m.weight.numel(), block_size, scaler_block_size)))
    head = output_head(model)
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or m is head or any(p.startswith("lora_") for p in name.split(".")):
            continue
        if m.weight.dim() == 2 and fits(m):
            out.append((name, m))
    return out


def _q4_1():
    """stages/core/q4_1.py, also where this file ships alone beside it (register's code_paths)."""
    try:
        from . import q4_1
    except ImportError:
        import q4_1
    return q4_1


def _import_quietly(module: str):
    """Imports `module` (of torchao) with torchao's import-time warnings quieted: that this build lacks
    some CUDA kernels (none of them NF4's), no triton, and a torch deprecation; they would fill every
    rank's log. ImportError when it is not installed."""
    import importlib
    import logging
    quiet = [logging.getLogger(n) for n in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)


def preimport_torchao() -> None:
    """peft imports torchao whenever it is installed (to recognise its tensors): importing it first,
    quietly, keeps those warnings out of every LoRA run's log. Nothing when it is not installed."""
    try:
        _import_quietly("torchao.quantization")
    except ImportError:
        pass


def torchao_nf4():
    """torchao's NF4 module (to_nf4, NF4Tensor, linear_nf4); a one-line ConfigError naming the key
    when torchao is not installed."""
    try:
        from .errors import ConfigError
    except ImportError:  # shipped alone with a registered model (register's code_paths)
        ConfigError = RuntimeError
    try:
        return _import_quietly("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    except ImportError as e:
        raise ConfigError(f"actor.lora.quantize: nf4 needs torchao ({e}); {INSTALL}") from None


def to_nf4(weight, block_size: int, scaler_block_size: int):
    """`weight` as torchao's NF4Tensor, with this layer's scaler block (`scaler_block`)."""
    scaler = scaler_block(weight.numel(), block_size, scaler_block_size)
    return torchao_nf4().to_nf4(weight.detach(), block_size, scaler)


def roundtrip(weight, block_size: int, scaler_block_size: int):
    """`weight` quantized to NF4 and dequantized, in its own dtype: what a 4-bit linear computes with."""
    return to_nf4(weight, block_size, scaler_block_size).get_original_weight()


def roundtrip_nf4_(model, record: dict | None) -> list[str]:
    """Replaces in place every weight a run quantized (`record`: `quantize_record`'s) by its NF4 round
    trip, so that merging adapters into `model` gives the model that trained; the names changed.
    Nothing without a record."""
    if not record:
        return []
    if record["kind"] not in ("nf4", "q4_1"):
        raise ValueError(f"unknown base quantization {record['kind']!r} (this sftflow knows nf4 and q4_1)")
    import torch
    names = []
    with torch.no_grad():
        if record["kind"] == "q4_1":
            for name, m in quantized_linears(model, 0, 0, "q4_1"):
                m.weight.copy_(_q4_1().roundtrip(m.weight))
                names.append(name)
            return names
        for name, m in quantized_linears(model, record["block_size"], record["scaler_block_size"]):
            m.weight.copy_(roundtrip(m.weight, record["block_size"], record["scaler_block_size"]))
            names.append(name)
    return names
