"""Process trees: torchrun starts every worker in a session of its own, so killing torchrun's
process group alone would orphan the workers. These helpers find (psutil) and signal the
whole tree."""

from __future__ import annotations

import os
import signal

import psutil


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
