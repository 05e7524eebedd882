"""Process trees on Linux: torchrun starts every worker in a session of its own, so killing
torchrun's process group alone would orphan the workers. These helpers find and signal
the whole tree."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (via /proc; empty where /proc is absent)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


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
