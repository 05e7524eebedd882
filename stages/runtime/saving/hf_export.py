"""The trained model out of a run: its weights gathered whole to rank 0 on CPU, written to `model/` as
a Hugging Face folder for models with a tokenizer, else as `model.safetensors` of the state dict.

LoRA: the adapters saved in peft's format to `adapter/`, with the tokenizer and generation config
beside them; a model with a tokenizer gets no `model/` (the train stage adds `adapter/base.json`, the
reference to the base it belongs to, stages/core/cache/bases.py: loaders merge in memory,
stages/inference/weights.py). A model without a tokenizer (a custom model type) still gets its
merged `model/model.safetensors`: no loader of ours reads its adapter alone."""

from __future__ import annotations

from pathlib import Path

import torch

from stages.core.config import SFTConfig

from ..distributed import log
from ..lora import lora_enabled
from ..model_types import WeightsLoadError, build_configured_model, load_state_checked


def full_state_dict(model: torch.nn.Module, cfg: SFTConfig, model_path: str | None, out: Path,
                    rank: int, merge: bool = True) -> dict | None:
    """`model`'s weights, gathered whole to rank 0 on CPU (LoRA: the adapters saved to `adapter/` and,
    with `merge`, merged in; without, None; the other ranks get their part of the collective's result,
    which they do not use)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    lora = lora_enabled(cfg)
    full = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora))
    if not lora or rank != 0:
        return full
    return _saved_adapters(full, cfg, model_path, out, merge)


def _saved_adapters(adapters: dict, cfg: SFTConfig, model_path: str | None, out: Path, merge: bool) -> dict | None:
    """A fresh base model (as training builds it, on CPU in fp32) with the trained adapters: saved in
    peft's format to `adapter/`; with `merge`, its plain state dict with them merged."""
    try:
        peft_model = build_configured_model(cfg, model_path, device="cpu", float32=True, lora=True,
                                            weights=adapters, where="the trained model")
    except WeightsLoadError as e:
        raise RuntimeError(f"export: {e}") from None
    peft_model.save_pretrained(out / "adapter")
    log(f"exported LoRA adapters to {out / 'adapter'}")
    return peft_model.merge_and_unload().state_dict() if merge else None


def export_model(model: torch.nn.Module, cfg: SFTConfig, model_path: str | None, out: Path, rank: int,
                 tokenizer) -> None:
    """`out/model`: a Hugging Face folder (weights, config, generation config, tokenizer) when there
    is a `tokenizer`, else `model.safetensors` of the full state dict. Every rank calls it (the
    gather is a collective); rank 0 writes."""
    adapter_only = lora_enabled(cfg) and tokenizer is not None
    full = full_state_dict(model, cfg, model_path, out, rank, merge=not adapter_only)
    if rank != 0:
        return
    if adapter_only:  # the base stays where it is, named by content (the train stage writes base.json)
        from transformers import GenerationConfig
        tokenizer.save_pretrained(out / "adapter")
        try:
            GenerationConfig.from_pretrained(model_path).save_pretrained(out / "adapter")
        except OSError:
            pass
        return
    dest = out / "model"
    dest.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in full.items()}, str(dest / "model.safetensors"))
        log(f"exported state dict to {dest / 'model.safetensors'}")
        return
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    trust = cfg.actor.model.trust_remote_code
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust)
    with torch.device("cpu"):
        plain = AutoModelForCausalLM.from_config(config, trust_remote_code=trust, dtype=torch.float32)
    try:
        load_state_checked(plain, full, "the trained model")
    except ValueError as e:
        raise RuntimeError(f"export: {e}") from None
    plain.tie_weights()
    try:
        plain.generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:
        pass
    plain.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    log(f"exported Hugging Face model to {dest}")
