"""Process trees: torchrun starts every worker in a session of its own, so killing torchrun's
process group alone would orphan the workers. These helpers find (psutil) and signal the
whole tree."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import psutil

_PR_SET_PDEATHSIG = 1


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_tree(pid: int, sig: signal.Signals, tree: list[int] | None = None) -> None:
    """Signals `pid`'s process group and every process in its tree (found now, or given)."""
    for target in [pid, *(tree if tree is not None else descendants(pid))]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (prctl PR_SET_PDEATHSIG), so a
    SIGKILLed parent (the CLI, torchrun's agent) leaves nothing training unsupervised; a no-op
    elsewhere. Called in the child (`preexec_fn`, or first thing in a worker)."""
    if not sys.platform.startswith("linux"):
        return
    ppid = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != ppid:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)
