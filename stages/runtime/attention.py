"""`actor.attn_implementation`: which transformers attention kernel a causal LM trains with.

Packed micro-batches (`batches.collate_packed`) are one row of concatenated samples whose
`position_ids` restart at 0 per sample, with no attention_mask; transformers finds the sample
boundaries from them (transformers 5.x, forward with `use_cache=False`, as the worker calls it):

  * eager, sdpa       `masking_utils.find_packed_sequence_indices` -> a dense block-diagonal
                      (1, 1, L, L) mask: isolated, but memory quadratic in the packed length, and
                      SDPA can't use its flash kernel with an explicit mask;
  * flex_attention    the same boundaries as a `BlockMask`: isolated, blocks across samples are
                      skipped, no dense mask (compiled by torch.compile on first use: seconds on a
                      GPU, about a minute on a CPU);
  * flash_attention_2/3  `modeling_flash_attention_utils._is_packed_sequence` -> cu_seqlens, the
                      varlen kernel: isolated, linear memory; needs the flash_attn package
                      (flash_attn_interface for 3) and CUDA.

tests/test_attention.py holds packed logits == unpacked logits for every implementation that
`available_attn_implementations` lists here, so one that lets samples see each other fails there.
"""

from __future__ import annotations

import importlib.util

from stages.core.errors import ConfigError

KEY = "actor.attn_implementation"
CHOICES = ("auto", "eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


def _flash_available(version: int) -> bool:
    """transformers' own check (package installed, right distribution and version, CUDA present),
    without its fallback to hub kernels: nothing is downloaded at training time."""
    from transformers.utils import import_utils
    check = {2: import_utils.is_flash_attn_2_available, 3: import_utils.is_flash_attn_3_available}[version]
    return bool(check())


def _flex_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def available_attn_implementations(device_type: str) -> list[str]:
    """The implementations that run on `device_type` ("cpu" / "cuda") here, fastest for packing last."""
    out = ["eager", "sdpa"]
    if _flex_available():
        out.append("flex_attention")
    if device_type == "cuda":
        out += [f"flash_attention_{v}" for v in (2, 3) if _flash_available(v)]
    return out


def resolve_attn_implementation(requested: str, device_type: str, packing: bool) -> str | None:
    """What to hand `from_pretrained(attn_implementation=...)`; None keeps the model's own default.

    auto: on CUDA a flash-attention varlen kernel when its package is installed (packed or not:
    it unpads padded batches too); else, when packing, flex_attention (block-sparse, no dense
    mask); else the model's default (sdpa for most). On CPU the model's default, as before this
    key existed: CPU kernels gain nothing from the others, and flex would compile for a minute.
    An explicit choice that is unknown or does not run here is a ConfigError naming the key."""
    if requested not in CHOICES:
        raise ConfigError(f"{KEY}: unknown '{requested}'; one of {', '.join(CHOICES)}")
    available = available_attn_implementations(device_type)
    if requested != "auto":
        if requested not in available:
            why = ("needs CUDA" if device_type != "cuda" and requested.startswith("flash")
                   else f"its package ({'flash_attn' if requested == 'flash_attention_2' else 'flash_attn_interface'}) "
                        "is not installed" if requested.startswith("flash") else "this torch has no flex_attention")
            raise ConfigError(f"{KEY}: '{requested}' is not available on {device_type} ({why}); "
                              f"available: {', '.join(available)}")
        return requested
    if device_type != "cuda":
        return None
    for impl in ("flash_attention_3", "flash_attention_2"):  # FA3's package builds for Hopper only, where it is faster
        if impl in available:
            return impl
    if packing and "flex_attention" in available:
        return "flex_attention"
    return None


def effective_attn_implementation(model) -> str:
    """What the built model really runs (its config's `_attn_implementation`), for logs and MLflow;
    "n/a" for a model that is no transformers model."""
    from .lora import unwrap
    config = getattr(unwrap(model), "config", None)
    return str(getattr(config, "_attn_implementation", None) or "n/a")
