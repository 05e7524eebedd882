"""Rank-0 logging, device and precision choice, exact cross-rank sums, and a rank's entry and clean exit."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from stages.core.machine import precision
from stages.core.machine.topology import rank_gpu

from stages.core.machine.proctree import die_with_parent


def log(msg: str) -> None:
    """Printed once per run (rank 0), whether or not a process group is up."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def rank_slice(n: int, rank: int, world: int) -> range:
    """The contiguous share of rank `rank`: sizes differ by at most one, together exactly range(n)."""
    return range(rank * n // world, (rank + 1) * n // world)


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def local_device(shared: bool = False) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK when there is a GPU (with `shared`, ranks may share GPUs:
    nothing is sharded, e.g. 2 evaluation processes on 1 GPU), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", rank_gpu(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count(), shared))
    torch.cuda.set_device(device)
    return device


def choose_precision(requested: str, device: torch.device, model_dir=None, key: str = "actor.precision") -> str:
    """`actor.precision` (or `key`) on this rank's device, by the one rule (core/machine/precision.py): `auto` is bf16
    where the device computes it natively (capability >= 8.0, ROCm) or, on a CPU, where bf16 was measured
    faster at the shapes of the model in `model_dir` (the cached calibration the plan read); else fp32."""
    return precision.on_device(requested, device, dims_of(model_dir), key)


def precision_why(requested: str, device: torch.device, key: str = "actor.precision", model_dir=None) -> str:
    """The line the stage logs say: which precision runs here and why."""
    if requested != "auto":
        return precision.why(requested, device.type, key=key)
    return precision.why(requested, *precision.device_facts(device, dims_of(model_dir)), key=key)


def dims_of(model_dir):
    """The shapes a CPU's bf16 is measured at: the model folder's config.json (None: the default class)."""
    from stages.core.machine.bf16_speed import dims_of as read
    return read(model_dir) if model_dir is not None else None


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def add_up(parts: list[dict]) -> dict:
    """Key-wise sums of dicts of numbers (counts and loss sums add up exactly across ranks)."""
    total: dict = {}
    for part in parts:
        for k, v in part.items():
            total[k] = total.get(k, 0) + v
    return total


@contextmanager
def rank_entry() -> Iterator[None]:
    """The body of a torchrun rank's module (`python -m stages.train|evaluate|replay`), which then calls
    the stage's work itself: `with rank_entry(): load_worker(spec).fit()`. The rank dies with torchrun's
    agent. An exception is recorded as torch elastic's `@record` records it (the error file the agent
    gives each rank, which the launcher reads to name the failing rank and cause); one of the project's
    own errors (a config or stage problem, phrased for the user) is then printed as its one line,
    without a traceback. A rank that finished its work exits without interpreter finalization."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from stages.core.errors import ConfigError, StageError
    die_with_parent(signal.SIGKILL)  # torchrun's agent supervises the ranks: killed, they stop too
    handler = get_error_handler()
    handler.initialize()
    try:
        yield
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    except (ConfigError, StageError) as e:
        handler.record_exception(e)
        print(e, file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except Exception as e:
        handler.record_exception(e)
        raise
    exit_skipping_finalization()


def exit_skipping_finalization(code: int = 0) -> None:
    """Ends a torchrun worker whose work is done, written and whose process group is destroyed,
    without Python's interpreter finalization: gloo's C++ threads can abort the process there
    (SIGABRT, "terminate called without an active exception"; seen after complete trainings),
    and torchrun would report finished work as a failed stage."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
