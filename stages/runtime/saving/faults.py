"""A test hook, not a feature: `SFTFLOW_FAULT=<point>:<step>` makes rank 0 SIGKILL torchrun's agent
and every worker at that point of training, as an OOM killer or a lost node would. The resume tests
use it (tests/test_train_core.py, test_cancel.py, test_mixture.py). Points:

  save        a checkpoint's files are written but it is not marked complete yet
  after_save  the checkpoint is complete

Unset (always, outside tests), `inject` does nothing."""

from __future__ import annotations

import os
import signal

import torch.distributed as dist

from stages.core.machine.proctree import descendants

ENV = "SFTFLOW_FAULT"


def inject(point: str, step: int) -> None:
    """Kills the whole training tree here when `SFTFLOW_FAULT` names this point and step (rank 0 acts)."""
    want = os.environ.get(ENV, "")
    if want != f"{point}:{step}" or dist.get_rank() != 0:
        return
    # the launcher starts the tree in a session of its own: its leader is torchrun's agent, or this
    # rank itself when one process runs without one (launch/one_process.py)
    root = os.getsid(0)
    print(f"{ENV}: killing torchrun and its workers at {want}", flush=True)
    for pid in dict.fromkeys([root, *[p for p in descendants(root) if p != os.getpid()], os.getpid()]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
