"""Builds the torchrun command for the worker and runs it as its own process group.

The child gets a new session so that a cancel, timeout or SIGTERM of the caller can take
down torchrun *and* every worker with one `killpg`. Output is streamed line by line to a
callback (Prefect's task logger, or stdout) and to `train.log` in the stage folder.

Why a rank failed comes from torch elastic's error files: each rank's entry (`rank_entry`) records
its exception in the file the agent gives it, under `--log-dir` (the stage folder's `elastic/`),
and `recorded_failure` reads them. Only a rank that left no file (killed by a signal, or dead
before its entry ran) falls back to the log's text.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

from stages.core.machine import cores
from stages.launch import ahead
from stages.core.config import SFTConfig
from stages.core.errors import ConfigError, StageError
from stages.core.machine.process_env import apply_process_policy

from stages.core.machine.proctree import descendants, signal_tree


def torchrun_command(cfg: SFTConfig, spec_path: Path, module: str) -> list[str]:
    """torchrun (for one machine through `local_torchrun`; one process through `one_process`, without an
    agent) `... -m <module> <spec_path>` for this node."""
    a = cfg.actor
    nproc = f"--nproc_per_node={a.nproc_per_node}"
    logs = f"--log-dir={elastic_dir(spec_path)}"
    if one_process(cfg):
        # one process: it is the rank itself, no agent to start (one_process.py)
        cmd = [sys.executable, "-m", "stages.launch.one_process", logs]
    elif a.nnodes == 1 and not a.rdzv_endpoint:
        # one machine: its stores and sockets on loopback only (torchrun --standalone binds `::`)
        cmd = [sys.executable, "-m", "stages.launch.local_torchrun", nproc, logs]
    else:
        # Every node runs this same command (only node_rank differs) and meets at node 0's endpoint.
        cmd = [sys.executable, "-m", "torch.distributed.run", nproc, logs, f"--nnodes={a.nnodes}",
               f"--node_rank={a.node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={a.rdzv_endpoint}",
               f"--rdzv-id=sftflow-{spec_path.parent.name}"]
    return cmd + ["-m", module, str(spec_path)]


def one_process(cfg: SFTConfig) -> bool:
    """Whether this node's ranks are a single process that `one_process` runs without an agent."""
    a = cfg.actor
    return a.nnodes == 1 and not a.rdzv_endpoint and a.nproc_per_node == 1


def start_ahead(cfg: SFTConfig, spec_path: Path, module: str, warm: list[str]) -> ahead.Ahead | None:
    """For a config trained on one process: the rank of `torchrun_command(cfg, spec_path, module)`,
    started now, importing `warm` (ahead.py) until `run_torchrun` takes it; None for any other launch."""
    if not one_process(cfg):
        return None
    return ahead.start(_guarded(torchrun_command(cfg, spec_path, module)), worker_env(1), warm)


def _guarded(cmd: list[str]) -> list[str]:
    """`cmd` through the parent-death guard (orphan_guard.py) when it is a Python module's."""
    return [cmd[0], "-m", "stages.launch.orphan_guard", *cmd[1:]] if cmd[0] == sys.executable else cmd


def elastic_dir(spec_path: Path) -> Path:
    """Where torchrun's agent puts each rank's error file: `<dir>/<run>/attempt_<n>/<local rank>/error.json`."""
    return spec_path.parent / "elastic"


def _project_errors() -> set[str]:
    """The names of the project's error types: their messages are already the line a user reads."""
    names, todo = set(), [ConfigError, StageError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


def recorded_failure(log_dir: Path, first_rank: int = 0) -> str | None:
    """The first failure torch elastic recorded under `log_dir` (the latest attempt, the error file
    written first, then the lowest rank): the project's own errors as their message alone, any other
    exception as "rank N: Type: message"; None when no rank left a file. `first_rank`: this node's
    first global rank (node_rank x nproc_per_node)."""
    attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda d: (d.stat().st_mtime_ns, d.name))
    failures = []
    for f in (attempts[-1].glob("*/error.json") if attempts else []):
        try:
            data = json.loads(f.read_text())
            message = data["message"]["message"] if isinstance(data["message"], dict) else data["message"]
            stamp = (int(data["message"].get("extraInfo", {}).get("timestamp", 0))
                     if isinstance(data["message"], dict) else 0)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        # written when the rank failed: finer than the file's own timestamp (seconds), where a rank
        # that fails because another one died (a closed connection) would tie with its cause
        failures.append((f.stat().st_mtime_ns, stamp, first_rank + int(f.parent.name), str(message)))
    if not failures:
        return None
    *_, rank, message = min(failures)
    kind, _, text = message.partition(": ")
    return text if kind in _project_errors() and text else f"rank {rank}: {message}"


def worker_env(nproc_per_node: int = 1, claim: cores.Claim | None = None) -> dict[str, str]:
    """The environment of a torchrun tree of `nproc_per_node` ranks on this machine. `claim`: the launch's
    place in the machine's ledger (core/machine/cores.py), which its ranks then follow while they train."""
    env = {k: v for k, v in os.environ.items() if k != cores.ENV_CLAIM}  # never a claim of the caller's own
    # Share the cores among the ranks of this node and of the other sftflow runs on this machine, or they
    # fight over them; a user's own OMP_NUM_THREADS wins, and then nothing adapts.
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(cores.share(nproc_per_node, claim.id if claim else None).threads)
        if claim is not None:
            env.update(claim.env())
    # set before torchrun's interpreter starts, so before any process of the tree loads torch; the
    # caller may be a library user's process that never applied the policy to itself
    apply_process_policy(env)
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# "[rank1]: KeyError: 'labels'" -- the line that says why a worker died.
_RANK_ERROR = re.compile(r"^\[rank(\d+)\]:\s*((?:[\w.]+)?(?:Error|Exception|Exit|Interrupt)\b.*)$")
_TORCHRUN_NOISE = re.compile(r"^(W|E|I)\d{4} |^\s*$|^\*+$|Setting OMP_NUM_THREADS")


_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")


def failure_reason(lines: list[str]) -> str:
    """The fallback when no rank left an error file (a signal killed it, or it died before its entry
    ran): the root cause in the crash log's text, the exception of the rank that failed first (torchrun's
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
                 env: dict[str, str] | None = None) -> float:
    """`env` is added to the workers' environment (e.g. MLFLOW_RUN_ID for live metrics); a failure
    raises `error` with "<what> failed (...): <root cause>". Returns the seconds the launch queued for the
    machine's cores before its tree started (`cores.claim`; said in the log), which are not its work."""
    if stop_requested():
        raise KeyboardInterrupt("stop requested")
    # the tree's ranks are in the machine's ledger of cores from before they start until it has stopped; a
    # node of a multi-machine run never queues (the other nodes would wait for it at the rendezvous)
    several_nodes = any(x.startswith("--nnodes=") and x != "--nnodes=1" for x in cmd)
    with open(log_path, "a", encoding="utf-8") as logf, \
            cores.claim(nproc_per_node, on_wait=lambda line: (logf.write(line + "\n"), on_line(line)),
                        stop=stop_requested, queue=not several_nodes) as claim:
        # its own session (one killpg stops the tree); through orphan_guard it dies with us
        guarded = _guarded(cmd)
        child_env = {**worker_env(nproc_per_node, claim), **(env or {})}
        if "OMP_NUM_THREADS" in (env or {}):  # the caller's own count: kept
            child_env.pop(cores.ENV_CLAIM, None)
        proc = ahead.take(guarded, child_env)
        if proc is not None:  # in the log only: the run's output is the same either way
            logf.write(f"launch: the rank (pid {proc.pid}) was started ahead of the stage (launch/ahead.py)\n")
        else:
            proc = subprocess.Popen(guarded, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, bufsize=1, env=child_env, start_new_session=True)
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
    logs = next((Path(x.split("=", 1)[1]) for x in cmd if x.startswith("--log-dir=")), None)
    if rc == 0:
        if logs is not None:  # the agent's per-rank folders hold nothing after a success
            shutil.rmtree(logs, ignore_errors=True)
        return claim.waited if claim is not None else 0.0
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"torchrun exit {rc}"
    node = next((int(x.split("=", 1)[1]) for x in cmd if x.startswith("--node_rank=")), 0)
    reason = (recorded_failure(logs, node * nproc_per_node) if logs else None) or failure_reason(lines)
    raise error(f"{what} failed ({how}): {reason}; full log: {log_path}")


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
