"""Builds the torchrun command for the worker and runs it as its own process group.

The child gets a new session so that a cancel, timeout or SIGTERM of the caller can take
down torchrun *and* every worker with one `killpg`. Output is streamed line by line to a
callback (Prefect's task logger, or stdout) and to `train.log` in the stage folder.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

from stages.core.config import SFTConfig
from stages.core.errors import StageError

from .proctree import descendants, signal_tree


def torchrun_command(cfg: SFTConfig, spec_path: Path, module: str) -> list[str]:
    """torchrun (for one machine through `local_torchrun`) `... -m <module> <spec_path>` for this node."""
    a = cfg.actor
    nproc = f"--nproc_per_node={a.nproc_per_node}"
    if a.nnodes == 1 and not a.rdzv_endpoint:
        # one machine: its stores and sockets on loopback only (torchrun --standalone binds `::`)
        cmd = [sys.executable, "-m", "stages.runtime.local_torchrun", nproc]
    else:
        # Every node runs this same command (only node_rank differs) and meets at node 0's endpoint.
        cmd = [sys.executable, "-m", "torch.distributed.run", nproc, f"--nnodes={a.nnodes}",
               f"--node_rank={a.node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={a.rdzv_endpoint}",
               f"--rdzv-id=sftflow-{spec_path.parent.name}"]
    return cmd + ["-m", module, str(spec_path)]


def worker_env(nproc_per_node: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    # Share the cores among the ranks of this node, or they fight over them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# "[rank1]: KeyError: 'labels'" -- the line that says why a worker died.
_RANK_ERROR = re.compile(r"^\[rank(\d+)\]:\s*((?:[\w.]+)?(?:Error|Exception|Exit|Interrupt)\b.*)$")
_TORCHRUN_NOISE = re.compile(r"^(W|E|I)\d{4} |^\s*$|^\*+$|Setting OMP_NUM_THREADS")


_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")


def failure_reason(lines: list[str]) -> str:
    """The root cause in a worker crash log: the exception of the rank that failed first (torchrun's
    "Root Cause (first observed failure)", else the first rank to print one; the others usually
    only report the lost connection), else the last plain line printed before torchrun's failure
    report (a SystemExit message, or where a kill struck)."""
    errors: dict[str, str] = {}  # rank -> its last exception line (the final one of a chained traceback)
    for line in lines:
        m = _RANK_ERROR.match(line)
        if m:
            errors.setdefault(m.group(1), "")
            errors[m.group(1)] = m.group(2)
    if errors:
        first = next(iter(errors))
        at = next((i for i, x in enumerate(lines) if "Root Cause (first observed failure)" in x), None)
        if at is not None:
            m = next((_ROOT_CAUSE_RANK.match(x) for x in lines[at:] if _ROOT_CAUSE_RANK.match(x)), None)
            if m and m.group(1) in errors:
                first = m.group(1)
        return f"rank {first}: {errors[first]}"
    plain = []
    for line in lines:
        if line.startswith("Traceback") or "ChildFailedError" in line:
            break
        if not _TORCHRUN_NOISE.search(line):
            plain.append(line.strip())
    if plain:
        return plain[-1]
    return "see the log"


# A stop request (Ctrl-C, SIGTERM) must reach torchrun even when the KeyboardInterrupt that the
# signal handler raises is lost: Python reports an exception raised while a finalizer (`__del__`, a
# weakref callback) runs as "Exception ignored in ..." and carries on, and then the CLI would keep
# waiting on a training that nobody stops (seen in CI). So the handler also calls `request_stop`.
_stop_requested = threading.Event()
_running: set[subprocess.Popen] = set()


def request_stop() -> None:
    """Safe to call from a signal handler: every torchrun tree running now gets SIGTERM, and
    `run_torchrun` raises KeyboardInterrupt when its tree has stopped (or at once, if none runs)."""
    _stop_requested.set()
    for proc in list(_running):
        signal_tree(proc.pid, signal.SIGTERM, [])


def stop_requested() -> bool:
    return _stop_requested.is_set()


def run_torchrun(cmd: list[str], log_path: Path, error: type[StageError], what: str,
                 on_line: Callable[[str], None] = print, nproc_per_node: int = 1,
                 env: dict[str, str] | None = None) -> None:
    """`env` is added to the workers' environment (e.g. MLFLOW_RUN_ID for live metrics); a failure
    raises `error` with "<what> failed (...): <root cause>"."""
    if stop_requested():
        raise KeyboardInterrupt("stop requested")
    with open(log_path, "a", encoding="utf-8") as logf:
        # its own session (one killpg stops the tree); through orphan_guard it dies with us
        guarded = [cmd[0], "-m", "stages.runtime.orphan_guard", *cmd[1:]] if cmd[0] == sys.executable else cmd
        proc = subprocess.Popen(guarded, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env={**worker_env(nproc_per_node), **(env or {})}, start_new_session=True)
        lines: list[str] = []
        _running.add(proc)
        try:
            if stop_requested():  # the request came between the check above and Popen
                raise KeyboardInterrupt("stop requested")
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                logf.write(line + "\n")
                lines.append(line)
                on_line(line)
            rc = proc.wait()
            if stop_requested():
                raise KeyboardInterrupt("stop requested")
        except BaseException:  # cancelled, timed out, Ctrl-C: no orphaned workers
            kill_group(proc)
            raise
        finally:
            _running.discard(proc)
    if rc != 0:
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"torchrun exit {rc}"
        raise error(f"{what} failed ({how}): {failure_reason(lines)}; full log: {log_path}")


def kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM lets torchrun stop its workers cleanly; whatever is left after `grace` is SIGKILLed,
    workers included (they live in sessions of their own)."""
    tree = descendants(proc.pid)
    signal_tree(proc.pid, signal.SIGTERM, [])
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    signal_tree(proc.pid, signal.SIGKILL, tree + descendants(proc.pid))
    proc.wait()
