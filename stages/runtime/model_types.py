"""Model types (`actor.model.model_type`): a name registered with `@register_model_type`, or the
import path of a builder, 'pkg.module:function', which registers it by configuration alone (no
custom worker needed to import its module).

A builder takes the `actor.model` config section plus the resolved weights path and returns
an `nn.Module`. The worker shards whatever comes back with FSDP2; `fsdp_units` tells it
which sub-modules to shard individually (transformer blocks, usually).

`build_configured_model` is the one way a configured model is made -- the builder, then LoRA
adapters and saved weights when asked -- for training, export and evaluation alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from stages.core.errors import ConfigError
from stages.core.cache.imports import import_object
from stages.core.nf4 import quantize_record, roundtrip_nf4_

from .lora import apply_lora, load_adapters_checked
from .qlora import quantize_base_

if TYPE_CHECKING:
    from stages.core.config import SFTConfig

_MODEL_TYPES: dict[str, Callable] = {}


def register_model_type(name: str):
    def deco(builder: Callable) -> Callable:
        _MODEL_TYPES[name] = builder
        return builder
    return deco


class UnknownModelType(KeyError):
    def __str__(self) -> str:
        return self.args[0]


def get_model_builder(name: str) -> Callable:
    """The builder `name` names: a registered name, or 'pkg.module:function' (imported; a ConfigError
    naming the key when it can't be, or is not callable)."""
    if ":" in name:
        builder = import_object(name, "actor.model.model_type")
        if not callable(builder):
            raise ConfigError(f"actor.model.model_type='{name}' is not callable (a model builder is a function "
                              "(model_cfg, weights_path) -> nn.Module)")
        return builder
    if name not in _MODEL_TYPES:
        raise UnknownModelType(f"actor.model.model_type: unknown '{name}'; "
                               f"registered: {', '.join(sorted(_MODEL_TYPES))} (name a builder as "
                               "'pkg.module:function', or register it with @register_model_type in a module that "
                               "actor.worker imports)")
    return _MODEL_TYPES[name]


@register_model_type("causal_lm")
def build_causal_lm(model_cfg: dict, weights_path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM
    # None leaves transformers' own choice (sdpa where the model supports it)
    return AutoModelForCausalLM.from_pretrained(
        weights_path, trust_remote_code=model_cfg.get("trust_remote_code", False), dtype="float32",
        attn_implementation=model_cfg.get("attn_implementation"),
    )


class WeightsLoadError(ValueError):
    """The weights given to `build_configured_model` could not be loaded into the model it built
    (they don't fit it, or reading them failed with a ValueError); the message is the original one.
    Errors of the builder itself are never wrapped."""


def build_configured_model(cfg: SFTConfig, weights_path: str | None, *, seed: int | None = None,
                           device: torch.device | str | None = None, float32: bool = False, lora: bool = False,
                           nf4: bool = False, weights: dict | Callable[[nn.Module], dict] | None = None,
                           where: str = "",
                           attn_implementation: str | None = None) -> nn.Module:
    """The model `cfg.actor.model` configures, built as training, export and evaluation all build it:

    1. `torch.manual_seed(seed)` when a seed is given, then the registered builder of
       `model_type` on `weights_path` (UnknownModelType when none is registered);
    2. moved to `device`, then cast to fp32 (`float32`), when asked;
    3. with `lora`: wrapped with fresh adapters as `cfg.actor.lora` describes (from torch's RNG);
       with `actor.lora.quantize` set, its base linear weights are then, with `nf4`, 4-bit NF4Tensors
       as training holds them (quantized on the CPU, then moved to `device`), else their NF4 round
       trip as plain tensors: the base the adapters trained over (export, evaluation);
    4. with `weights` (a state dict, or a function of the model built so far that reads one):
       loaded into it -- with `lora` the adapters, every trainable parameter required
       (`load_adapters_checked`), else the whole model, tied weights aside (`load_state_checked`).
       A misfit, or a ValueError while reading them, is a WeightsLoadError naming `where`.

    `attn_implementation` (resolved by `attention.resolve_attn_implementation`) reaches the builder
    as `model_cfg["attn_implementation"]`; builders of other model types may ignore it.

    A LoRA model comes back wrapped by peft, its adapters not merged (`merge_and_unload()` merges)."""
    mc = cfg.actor.model
    builder = get_model_builder(mc.model_type)
    if seed is not None:
        torch.manual_seed(seed)
    model = builder({**mc.model_dump(), "attn_implementation": attn_implementation}, weights_path)
    record = quantize_record(cfg) if lora else None
    # a 4-bit base is quantized before it reaches the device: its full weights never do
    late = record is not None and nf4 and device is not None
    if device is not None and not late:
        model.to(device)
    if float32:
        model.float()
    if lora:
        model = apply_lora(model, cfg.actor.lora)
    if record and nf4:
        quantize_base_(model, cfg.actor.lora)
    elif record:
        roundtrip_nf4_(model, record)
    if late:
        model.to(device)
    if weights is not None:
        try:
            state = weights(model) if callable(weights) else weights
            (load_adapters_checked if lora else load_state_checked)(model, state, where)
        except ValueError as e:
            raise WeightsLoadError(str(e)) from e
    return model


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """Transformer blocks: HF models list them in `_no_split_modules`; otherwise none (root only)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def tied_keys(model: nn.Module) -> set[str]:
    """Parameters that share storage with another (tied embeddings): absent from saved state dicts."""
    keys = getattr(model, "_tied_weights_keys", None) or []
    return set(keys.keys() if isinstance(keys, dict) else keys)


def load_state_checked(model: nn.Module, state: dict, where: str) -> None:
    """Loads `state` into `model`; anything missing (other than tied weights) or unexpected is a
    ValueError naming `where`, never a half-loaded model."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in tied_keys(model)]
    if unexpected or missing:
        raise ValueError(f"the weights in {where} do not fit {type(model).__name__} "
                         f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
