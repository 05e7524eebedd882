"""How a built model is made ready to train on this rank (torchtitan's `parallelize_fn`):
activation checkpointing, compilation, then FSDP2 (`fully_shard`) block by block and the root."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from stages.core.config import ActorConfig
from stages.core.errors import ConfigError

from .lora import unwrap
from .model_types import fsdp_units
from .qlora import unshardable


@dataclass(frozen=True)
class Sharding:
    """How `parallelize` wrapped the model with FSDP2."""

    fsdp: bool           # sharded at all (one fp32 process is not: nothing to shard, reduce or cast)
    keep_gathered: bool  # gathered weights stay until a step's last backward (`reshard_after_forward` off)


def parallelize(model: torch.nn.Module, actor: ActorConfig, device: torch.device, world: int,
                precision: str) -> Sharding:
    """Applies `actor`'s activation checkpointing and compilation to `model` in place and wraps it
    with FSDP2 unless one fp32 process has nothing to shard; how it was wrapped."""
    units = fsdp_units(unwrap(model))  # the blocks themselves: peft swaps layers inside them, not the blocks
    if actor.activation_checkpointing:
        # transformers renamed gradient_checkpointing_enable (5.24 warns that the alias goes in v6);
        # older transformers and custom models may have only the old name
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            raise ConfigError("actor.activation_checkpointing needs a model with activation_checkpointing_enable() "
                              "or gradient_checkpointing_enable()")
    if actor.compile:
        for unit in units or [model]:
            unit.compile()
    # One fp32 process has nothing to shard, reduce or cast: FSDP would only add per-layer hooks.
    # DCP checkpoints stay interchangeable with sharded runs (they reshard on load).
    if not (world > 1 or precision == "bf16"):
        return Sharding(fsdp=False, keep_gathered=False)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if precision == "bf16" else MixedPrecisionPolicy())
    # gloo on a few cores is bound by collectives, not memory: gathering each layer once per
    # step instead of twice per micro-batch is most of what FSDP costs there
    reshard = actor.reshard_after_forward
    keep_gathered = not (reshard if reshard is not None else device.type != "cpu")
    # QLoRA: 4-bit weights torchao can't split evenly over the ranks stay whole on each (frozen: nothing to reduce)
    whole = unshardable(model, world)
    for unit in units:
        fully_shard(unit, mp_policy=mp, reshard_after_forward=not keep_gathered, ignored_params=whole)
    fully_shard(model, mp_policy=mp, reshard_after_forward=not keep_gathered, ignored_params=whole)
    return Sharding(fsdp=True, keep_gathered=keep_gathered)


def reshard(model: torch.nn.Module) -> None:
    """After a no-grad forward no backward frees gathered weights: the root's always stay
    gathered, and every block's too when they are kept (`reshard_after_forward` off). Resharding
    them makes checkpoint loads, state dicts and the optimizer meet sharded parameters only."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
