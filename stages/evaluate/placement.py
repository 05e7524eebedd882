"""Where an evaluation runs: in the stage's own process, or under torchrun with one rank per training process.

Ranks of an evaluation share no work (each holds the whole model and scores a slice of the samples), so
more processes only add throughput, and on CPU they pay for it first: torchrun's agent and every rank
import torch and transformers (6-8 s on 2 cores) before the first sample. For the demo's model that is
12x its whole evaluation in one process (docs/benchmarks.md, "Evaluation in the stage's process").
So `eval.launch: auto` scores in the stage's process on a machine without GPUs when the work is small,
and under torchrun otherwise (every GPU run, a large evaluation on CPU, several machines). The work is
weight bytes x samples x new tokens: a forward's cost grows with the weights, and a sample costs up
to `max_new_tokens` of them. The replies and the accuracy do not depend on the choice in fp32
(tests/test_evaluate.py); it is unhashed like the process count itself.

Torch-free: the stage decides before anything is imported or launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages.chatdata.shards import count_rows
from stages.core.config import SFTConfig

from .sets import prepared_sets, sample_indices, set_dir

__fingerprint__ = False  # where the scoring runs never changes a result (fp32; eval.launch is unhashed too)

# Below this much work (weight bytes x samples x max new tokens) one process on CPU is at least as fast as torchrun's
# ranks, whose start (6-8 s on 2 cores) it skips: SmolLM2-135M (540 MB in fp32) at 48 new tokens took
# 8.8 s in one process against 17.0 s for 2 ranks on 32 prompts (8.3e11), and 41.0 against 41.8 s on 128 (3.3e12),
# on a 2-core Xeon (docs/benchmarks.md, "Evaluation in the stage's process").
IN_PROCESS_WORK = 2e12

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".gguf")


@dataclass(frozen=True)
class Placement:
    processes: int  # 1: in the stage's process; more: torchrun ranks
    why: str

    @property
    def in_process(self) -> bool:
        return self.processes == 1


def weight_bytes(model: dict) -> int | None:
    """The bytes of the scored model's weight files (`resolve_eval_model`'s folder); None when it is not a
    local folder (a Hub id) or holds none."""
    folder = Path(model.get("path") or "")
    if not folder.is_dir():
        return None
    total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.suffix in WEIGHT_SUFFIXES)
    return total or None


def samples(cfg: SFTConfig, prepare_dir: str) -> int:
    """How many prepared samples the evaluation scores (each set after `eval.max_samples`); harness sets
    (lm-eval runs them on rank 0 alone) add nothing a second process could share."""
    named = bool(cfg.eval.sets)
    return sum(len(sample_indices(count_rows(set_dir(prepare_dir, n, named), f"eval set '{n}' samples"),
                                  cfg.eval.max_samples)) for n in prepared_sets(cfg))


def settled(cfg: SFTConfig, has_gpu: bool | None) -> tuple[bool, str] | None:
    """The rules that need neither the model nor the samples, in order: (in the stage's process?, why), or
    None when the size of the work decides. `place`, `describe` and `show`'s device list read them, so
    `sftflow show` words the rule the stage applies; `has_gpu=None` asks the machine only when a rule needs it."""
    a, how = cfg.actor, cfg.eval.launch
    if a.world_size == 1:
        return True, "one process"
    if how != "auto":
        return how == "in_process", f"eval.launch={how}"
    if a.nnodes > 1 or a.rdzv_endpoint:
        return False, "several machines"
    if has_gpu is None:
        from stages.core.machine.topology import inventory
        has_gpu = bool(inventory().gpus)
    if has_gpu:
        return False, "GPUs"
    if a.worker:  # a custom worker's own eval data: its size is unknown here
        return False, "actor.worker scores its own eval data"
    return None


def place(cfg: SFTConfig, model: dict, prepare_dir: str, has_gpu: bool | None = None) -> Placement:
    """Where `model` is scored on `cfg`'s eval sets (`eval.launch`; the module's docstring says why)."""
    n = cfg.actor.world_size
    if (rule := settled(cfg, has_gpu)) is not None:
        in_process, why = rule
        return Placement(1 if in_process else n, why)
    size = weight_bytes(model)
    if size is None:
        return Placement(n, "the model's size is unknown here")
    work = size * samples(cfg, prepare_dir) * cfg.eval.max_new_tokens
    if work < IN_PROCESS_WORK:
        return Placement(1, f"CPU, a small evaluation ({work:.1e} < {IN_PROCESS_WORK:.0e} weight bytes x samples "
                            f"x new tokens): torchrun's start would cost more than its {n} ranks save")
    return Placement(n, f"CPU, a large evaluation ({work:.1e} >= {IN_PROCESS_WORK:.0e} weight bytes x "
                        "samples x new tokens)")


def describe(cfg: SFTConfig, has_gpu: bool) -> str:
    """Where evaluations will run, as planning can tell before any model or sample exists (`sftflow show`)."""
    n, how = cfg.actor.world_size, cfg.eval.launch
    if (rule := settled(cfg, has_gpu)) is not None:
        in_process, why = rule
        where = "in the stage's process" if in_process else f"on {n} torchrun processes"
        return f"{where} ({why})" if how != "auto" or n == 1 else f"{where} (eval.launch=auto: {why})"
    return (f"in the stage's process when small, else on {n} torchrun processes (eval.launch=auto on CPU: "
            f"weight bytes x samples x eval.max_new_tokens under {IN_PROCESS_WORK:.0e}; the log says which)")
