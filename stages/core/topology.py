"""How many processes a node runs when `actor.nproc_per_node: auto`, and why.

On GPUs: one process per visible GPU (FSDP2 shards over them). On CPU: one process, whose torch
threads use every core. FSDP2 over gloo processes on one machine splits the same cores between
ranks and adds the collectives on top: on 2 cores the SmolLM2 quickstart (LoRA r=16) trains at
0.66x the tokens/s of one process (docs/benchmarks.md, "Quickstart topology"). A number in the
config is always obeyed.

Torch-free (nvidia-smi, as the memory plan asks it): the config is resolved in the CLI before any
stage imports torch, on the machine that launches torchrun.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache

__fingerprint__ = False  # how the work is spread never changes a result (unhashed in the config)


@lru_cache(maxsize=None)
def _smi_gpus() -> int:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def visible_gpus() -> int:
    """GPUs this process may use: nvidia-smi's, narrowed by CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    n = _smi_gpus()
    if visible is not None and n:
        return min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


def auto_nproc() -> tuple[int, str]:
    """(processes per node, the reason shown by `sftflow show` and written to train.log)."""
    gpus = visible_gpus()
    if gpus:
        return gpus, f"auto: one process per visible GPU ({gpus}), FSDP2 over them"
    cores = os.cpu_count() or 1
    return 1, (f"auto: one process on CPU, its torch threads on all {cores} cores (FSDP2 over gloo processes "
               "would split the same cores and add collectives; set actor.nproc_per_node to choose)")


def describe(nproc_per_node: int, nnodes: int, reason: str | None) -> str:
    """One line: how many processes train, and why."""
    world = nproc_per_node * nnodes
    what = f"{world} process{'es' if world > 1 else ''}" + (f" ({nproc_per_node} per node x {nnodes} nodes)"
                                                             if nnodes > 1 else "")
    return f"{what}: {reason or f'actor.nproc_per_node={nproc_per_node} (set in the config)'}"
