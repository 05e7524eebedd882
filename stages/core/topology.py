"""The GPUs this machine's torch can train on, and how many processes a node runs when
`actor.nproc_per_node: auto`, and why.

On GPUs: one process per visible GPU that the batch sizes can use (FSDP2 shards over them; a
global batch of 32 in micro-batches of 16 keeps 2 of 8 GPUs busy, and says so). On CPU:
`actor.cpu_nproc_per_node` processes (default 1, whose torch threads use every core). FSDP2 over
gloo processes on one machine splits the same cores between ranks and adds the collectives on
top: on 2 cores the SmolLM2 quickstart (LoRA r=16) trains at 0.66x the tokens/s of one process
(docs/benchmarks.md, "Quickstart topology"); the demo asks for 2 to show torchrun + FSDP2.
A number in `actor.nproc_per_node` is obeyed on CPU; on GPUs a training count above the visible
GPUs is refused before launch (`pipeline.check_launch`).

Torch-free: the config is resolved in the CLI before any stage imports torch, on the machine that
launches torchrun. The GPUs come from nvidia-smi; where it is missing or lists none and the
installed torch is a CUDA or ROCm build (read from torch's own version.py, not imported), torch
itself is asked in a subprocess, so a machine whose torch sees a GPU never takes the CPU branch.
A CPU build of torch sees no GPU whatever nvidia-smi lists. The simulated GPU machine of the tests
(tests/fake_gpu.py) is a fake nvidia-smi on PATH plus `torch_build` answering "cuda".
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__fingerprint__ = False  # how the work is spread never changes a result (unhashed in the config)


@dataclass(frozen=True)
class GPU:
    index: str  # as CUDA_VISIBLE_DEVICES names it
    name: str
    bytes: int
    capability: tuple[int, int] | None = None  # compute capability; None: unknown (an old driver)


@dataclass(frozen=True)
class Inventory:
    """The GPUs visible to this process (CUDA_VISIBLE_DEVICES applied), where that came from, and
    a note when nvidia-smi and torch disagree."""

    gpus: tuple[GPU, ...]
    source: str  # "nvidia-smi" | "torch" | "none"
    note: str | None = None


def torch_build() -> str | None:
    """"cuda", "rocm" or "cpu": which build of torch is installed, read from its version.py
    without importing it (seconds of CPU); None without torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None

    def field(name: str) -> str | None:
        m = re.search(rf"^{name}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        return m.group(1) if m else None
    return "rocm" if field("hip") else "cuda" if field("cuda") else "cpu"


def _capability(text: str) -> tuple[int, int] | None:
    parts = text.strip().split(".")
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 and all(p.isdigit() for p in parts) else None


@lru_cache(maxsize=None)
def _smi_gpus(path: str | None = None) -> tuple[GPU, ...]:
    """Every GPU nvidia-smi lists (index, name, memory, compute capability), CUDA_VISIBLE_DEVICES not applied."""
    smi = shutil.which("nvidia-smi", path=path)
    if not smi:
        return ()
    # compute_cap needs a driver from 2021 or later: without it, the same query less that field
    for fields in ("index,name,memory.total,compute_cap", "index,name,memory.total"):
        try:
            out = subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        n = fields.count(",")
        rows = [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.count(",") == n]
        rows = [r for r in rows if r[2].isdigit()]
        if rows:
            return tuple(GPU(r[0], r[1], int(r[2]) * 1024 ** 2, _capability(r[3]) if n == 3 else None) for r in rows)
    return ()


_PROBE = ("import json, torch\n"
          "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
          "ps = [torch.cuda.get_device_properties(i) for i in range(n)]\n"
          "print(json.dumps([[str(i), p.name, p.total_memory, [p.major, p.minor]] for i, p in enumerate(ps)]))\n")


@lru_cache(maxsize=None)
def _torch_gpus(visible: str | None) -> tuple[GPU, ...]:
    """The GPUs torch itself sees (CUDA_VISIBLE_DEVICES applied by torch), asked in a subprocess so that
    the CLI never imports torch or initializes CUDA; only where nvidia-smi can't tell."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120).stdout
        rows = json.loads(out.strip().splitlines()[-1]) if out.strip() else []
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return ()
    return tuple(GPU(str(i), name, int(mem), (cap[0], cap[1])) for i, name, mem, cap in rows)


def _visible(gpus: tuple[GPU, ...], visible: str | None) -> tuple[GPU, ...]:
    if visible is None:
        return gpus
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    if wanted and all(v.isdigit() for v in wanted):
        by_index = {g.index: g for g in gpus}
        return tuple(by_index[v] for v in wanted if v in by_index)
    return gpus[:len(wanted)]  # UUIDs or MIG names: as many as named


def inventory() -> Inventory:
    """The GPUs this process may train on."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return Inventory((), "none")
    build = torch_build()
    smi = _visible(_smi_gpus(os.environ.get("PATH")), visible)
    if build == "cpu":
        note = (f"nvidia-smi lists {len(smi)} GPU{'s' if len(smi) > 1 else ''}, but the installed torch is a "
                "CPU build: training runs on the CPU; install a CUDA build of torch to use them") if smi else None
        return Inventory((), "none", note)
    if smi:
        return Inventory(smi, "nvidia-smi")
    if build in ("cuda", "rocm"):
        found = _torch_gpus(visible)
        if found:
            return Inventory(found, "torch")
    return Inventory((), "none")


def visible_gpus() -> int:
    """How many GPUs this process may use."""
    return len(inventory().gpus)


def usable_gpus(gpus: int, micro_batch_size: int, global_batch_size: int, nnodes: int = 1) -> int:
    """The most of `gpus` processes per node whose micro-batches split a global batch evenly:
    every process runs the same number of micro-batches per step."""
    return max([n for n in range(1, gpus + 1) if global_batch_size % (micro_batch_size * n * nnodes) == 0] or [1])


def auto_nproc(micro_batch_size: int = 1, global_batch_size: int = 1, nnodes: int = 1,
               cpu_nproc: int = 1) -> tuple[int, str]:
    """(processes per node, the reason shown by `sftflow show` and written to train.log)."""
    gpus = visible_gpus()
    if gpus:
        n = usable_gpus(gpus, micro_batch_size, global_batch_size, nnodes)
        if n == gpus:
            return gpus, f"auto: one process per visible GPU ({gpus}), FSDP2 over them"
        return n, (f"auto: {n} of {gpus} visible GPUs, one process each: actor.global_batch_size="
                   f"{global_batch_size} in micro-batches of {micro_batch_size} splits evenly over at most {n} "
                   f"process{'es' if n > 1 else ''}{f' per node x {nnodes} nodes' if nnodes > 1 else ''} "
                   "(a smaller actor.micro_batch_size uses more GPUs)")
    cores = os.cpu_count() or 1
    if cpu_nproc > 1:
        return cpu_nproc, (f"auto: no GPU visible, actor.cpu_nproc_per_node={cpu_nproc} processes on CPU "
                           f"(FSDP2 over gloo), sharing {cores} cores")
    return 1, (f"auto: one process on CPU, its torch threads on all {cores} cores (FSDP2 over gloo processes "
               "would split the same cores and add collectives; set actor.nproc_per_node to choose)")


def backend(device_kind: str) -> str:
    """The process group's backend: NCCL between GPUs, gloo on CPU (the worker's and the plan's rule)."""
    return "nccl" if device_kind == "cuda" else "gloo"


def rank_gpu(local_rank: int, gpus: int, shared: bool = False) -> int:
    """The GPU index of a node's `local_rank`: its own (training: FSDP2 over NCCL needs distinct
    devices, and a count above the GPUs is refused before launch); with `shared` (evaluation and
    replay ranks hold whole models and talk over gloo) ranks may share them, round robin."""
    return local_rank % gpus if shared else local_rank


def describe(nproc_per_node: int, nnodes: int, reason: str | None) -> str:
    """One line: how many processes train, and why."""
    world = nproc_per_node * nnodes
    what = f"{world} process{'es' if world > 1 else ''}" + (f" ({nproc_per_node} per node x {nnodes} nodes)"
                                                             if nnodes > 1 else "")
    return f"{what}: {reason or f'actor.nproc_per_node={nproc_per_node} (set in the config)'}"
