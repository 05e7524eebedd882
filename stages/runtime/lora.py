"""LoRA through `peft` (`actor.lora.r` > 0): the base weights are frozen and sharded like any
other parameter, only the adapters are trained, checkpointed and optimized.

What lands where: checkpoints hold the trainable parameters and their optimizer state (the
frozen base is rebuilt from `model_path`); the train stage exports `adapter/` (peft's format,
loadable with `PeftModel.from_pretrained`) and `model/`, the adapters merged into the base
weights, an ordinary model that evaluates, serves and chats like a fully fine-tuned one.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

import torch.nn as nn

from stages.core.config import LoraConfig
from stages.core.errors import ConfigError
from stages.core.nf4 import preimport_torchao


def lora_enabled(cfg) -> bool:
    return cfg.actor.lora.r > 0


def apply_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """`model` wrapped with fresh adapters (initialized from torch's RNG, so every rank agrees)."""
    preimport_torchao()  # before peft, which imports it noisily when installed
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    target = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    peft_cfg = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target,
                              bias="none", task_type="CAUSAL_LM" if hasattr(model, "generation_config") else None)
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question; not ours to fix
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(model, peft_cfg)
    except ValueError as e:  # target modules that the model doesn't have
        raise ConfigError(f"actor.lora.target_modules: {e}") from None


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a peft wrapper (itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Forwards inside run the frozen base alone. peft's own `disable_adapter()` also switches the
    adapters' requires_grad off and on, which FSDP2 (holding them sharded and gathered) doesn't follow,
    and which left them frozen here; this flips only the flag every LoRA layer's forward reads."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was


def trainable_names(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def load_adapters_checked(model: nn.Module, state: dict, where: str) -> None:
    """Loads adapter weights into a peft-wrapped `model`; every trainable parameter must be in `state`."""
    missing = sorted(trainable_names(model) - set(state))
    extra = sorted(set(state) - set(model.state_dict()))
    if missing or extra:
        raise ValueError(f"the adapters in {where} do not fit this LoRA model (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}); actor.lora must be what trained them")
    model.load_state_dict(state, strict=False)
