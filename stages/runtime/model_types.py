"""Model types, registered by name (`actor.model.model_type`).

A builder takes the `actor.model` config section plus the resolved weights path and returns
an `nn.Module`. The worker shards whatever comes back with FSDP2; `fsdp_units` tells it
which sub-modules to shard individually (transformer blocks, usually).
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

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
    if name not in _MODEL_TYPES:
        raise UnknownModelType(f"actor.model.model_type: unknown '{name}'; registered: {', '.join(sorted(_MODEL_TYPES))} "
                               "(a custom type registers when the module named in actor.worker is imported)")
    return _MODEL_TYPES[name]


@register_model_type("causal_lm")
def build_causal_lm(model_cfg: dict, weights_path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(
        weights_path, trust_remote_code=model_cfg.get("trust_remote_code", False), dtype="float32",
    )


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
