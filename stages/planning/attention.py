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


FLASH = ("flash_attention_3", "flash_attention_2")  # FA3's package builds for Hopper only, where it is faster
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
FLASH_MIN_CAPABILITY = (8, 0)  # flash-attn 2/3 kernels exist for Ampere and newer only


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


def installed_attn_implementations(device_type: str) -> list[str]:
    """`available_attn_implementations` guessed without importing torch or transformers (planning
    and `sftflow show` run in the CLI): the packages' presence only; the worker checks again with
    transformers' stricter test before it builds the model."""
    from importlib import metadata
    out = ["eager", "sdpa"]
    try:
        major, minor = (int(x) for x in metadata.version("torch").split(".")[:2])
        if (major, minor) >= (2, 5):  # flex_attention's BlockMask API as transformers uses it
            out.append("flex_attention")
    except (metadata.PackageNotFoundError, ValueError):
        pass
    if device_type == "cuda":
        out += [impl for impl in reversed(FLASH) if importlib.util.find_spec(FLASH_PACKAGES[impl]) is not None]
    return out


def choose_attn_implementation(requested: str, device_type: str, packing: bool, precision: str,
                               capability: tuple[int, int] | None, available: list[str]) -> str | None:
    """The one rule, shared by the worker (`resolve_attn_implementation`) and the memory plan /
    launch check (torch-free): what to hand `from_pretrained(attn_implementation=...)`; None keeps
    the model's own default.

    auto: on CUDA a flash-attention varlen kernel (FA3, then FA2; packed or not: it unpads padded
    batches too) when its package is installed, training runs in bf16/fp16 (flash-attn has no fp32
    kernel) and the GPU is Ampere or newer (`capability` None: not known, assumed so); else, when
    packing, flex_attention (block-sparse, no dense mask); else the model's default (sdpa for most).
    On CPU the model's default, as before this key existed: CPU kernels gain nothing from the
    others, and flex would compile for a minute.
    An explicit choice that is unknown or does not run here is a ConfigError naming the key."""
    if requested not in CHOICES:
        raise ConfigError(f"{KEY}: unknown '{requested}'; one of {', '.join(CHOICES)}")
    old_gpu = capability is not None and tuple(capability) < FLASH_MIN_CAPABILITY
    if requested != "auto":
        if requested not in available:
            if requested.startswith("flash") and device_type != "cuda":
                why = "needs CUDA"
            elif requested.startswith("flash"):
                why = f"its package ({FLASH_PACKAGES[requested]}) is not installed"
            else:
                why = "this torch has no flex_attention"
            raise ConfigError(f"{KEY}: '{requested}' is not available on {device_type} ({why}); "
                              f"available: {', '.join(available)}")
        if requested.startswith("flash") and precision == "fp32":
            raise ConfigError(f"{KEY}: '{requested}' has no fp32 kernel but actor.precision resolves to fp32 "
                              "here; set actor.precision=bf16 or another actor.attn_implementation")
        if requested.startswith("flash") and old_gpu:
            raise ConfigError(f"{KEY}: '{requested}' needs a GPU of compute capability >= 8.0, this one has "
                              f"{capability[0]}.{capability[1]}; choose sdpa or flex_attention")
        return requested
    if device_type != "cuda":
        return None
    if precision != "fp32" and not old_gpu:
        for impl in FLASH:
            if impl in available:
                return impl
    if packing and "flex_attention" in available:
        return "flex_attention"
    return None


def resolve_attn_implementation(requested: str, device_type: str, packing: bool, precision: str = "fp32",
                                capability: tuple[int, int] | None = None) -> str | None:
    """`choose_attn_implementation` with what this process really has (transformers' checks; on
    CUDA the device's compute capability when not given): the worker's call before it builds the model."""
    if requested not in CHOICES:
        raise ConfigError(f"{KEY}: unknown '{requested}'; one of {', '.join(CHOICES)}")
    if device_type == "cuda" and capability is None:
        import torch
        capability = torch.cuda.get_device_capability()
    return choose_attn_implementation(requested, device_type, packing, precision, capability,
                                      available_attn_implementations(device_type))


def effective_attn_implementation(model) -> str:
    """What the built model really runs (its config's `_attn_implementation`), for logs and MLflow;
    "n/a" for a model that is no transformers model."""
    from stages.runtime.lora import unwrap
    config = getattr(unwrap(model), "config", None)
    return str(getattr(config, "_attn_implementation", None) or "n/a")
