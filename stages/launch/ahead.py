"""A one-process rank started ahead: its interpreter imports torch, transformers and the loop while
the flow still prepares data, scores the baseline and opens the MLflow run, then waits to be let go.

A run of one process (`one_process.py`) spends 4-5 s of a short run importing before its first step;
the flow knows at its start that it will train and where (the plan: the stage's folder, so its spec's
path), so that time can overlap the stages before train instead of following them. The rank starts with
the command line a fresh start would have, plus `--ahead=<modules>` (so `ps` shows the stage's folder and
module either way), imports the modules, and waits on stdin. The launcher takes it when it starts that
command (`take`) and sends the environment; from then on it is the rank a fresh start would be: the
same session of its own, parent-death guard, output pipe and arguments.

Only what a library reads while it is imported must already be right when it waits: the environment is
compared, except for the variables the rank reads when it runs (`RUN_TIME_ENV`). Any other difference,
another command, a process that ended, or SFTFLOW_LAUNCH_AHEAD=0: the launcher starts the rank fresh.
One that no launch takes is stopped when its flow ends (`Ahead.close`), at this process's exit, or with
this process (its parent-death guard).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field

ENV_SWITCH = "SFTFLOW_LAUNCH_AHEAD"
# Read by the rank when it runs, not by a module it imports while it waits, so they may differ from the
# environment it was started with: its threads (set from OMP_NUM_THREADS once it is let go), its place in
# the ledger of cores and sftflow's other switches, MLflow's run and experiment (MLflow is not imported
# ahead), Prefect's API (a rank never imports Prefect; the CLI may start the rank before its server
# answers), and the compile cache folder torch writes into its caller's environment on first use.
RUN_TIME_ENV = ("OMP_NUM_THREADS", "SFTFLOW_", "MLFLOW_", "PREFECT_", "TORCHINDUCTOR_CACHE_DIR")
ENTRY = ("-m", "stages.launch.orphan_guard", "-m", "stages.launch.one_process")  # after sys.executable
FLAG = "--ahead="


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(RUN_TIME_ENV)}


@dataclass
class Ahead:
    """One waiting rank: taken by the launch of its command with an environment it fits, or closed."""

    proc: subprocess.Popen
    cmd: list[str]  # the guarded command it will run (without --ahead)
    env: dict[str, str]
    taken: bool = field(default=False)

    def fits(self, cmd: list[str], env: dict[str, str]) -> bool:
        return cmd == self.cmd and self.proc.poll() is None and _import_time(env) == _import_time(self.env)

    def close(self) -> None:
        """Stops it unless a launch took it (then the launcher owns the process)."""
        with _lock:
            if self in _waiting:
                _waiting.remove(self)
        if self.taken:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


_lock = threading.Lock()
_waiting: list[Ahead] = []
_at_exit: list[bool] = []


def guarded(cmd: list[str]) -> bool:
    """Whether `cmd` is a one-process launch through the parent-death guard (what can start ahead)."""
    return cmd[:len(ENTRY) + 1] == [sys.executable, *ENTRY]


def start(cmd: list[str], env: dict[str, str], warm: list[str]) -> Ahead | None:
    """The rank of the guarded one-process command `cmd`, started now: it imports `warm` and waits. One
    already waiting for the same command and environment is returned instead (the CLI starts it while a
    Prefect server starts; the flow then finds it). None when switched off."""
    if not enabled() or not guarded(cmd):
        return None
    with _lock:
        waiting = next((a for a in _waiting if a.cmd == cmd and a.proc.poll() is None
                        and _import_time(a.env) == _import_time(env)), None)
    if waiting is not None:
        return waiting
    if not _at_exit:
        import atexit
        atexit.register(_close_all)  # a process that ends before its flow does leaves none waiting
        _at_exit.append(True)
    at = len(ENTRY) + 1
    proc = subprocess.Popen([*cmd[:at], FLAG + ",".join(warm), *cmd[at:]], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                            start_new_session=True)
    ahead = Ahead(proc, list(cmd), dict(env))
    with _lock:
        _waiting.append(ahead)
    return ahead


def _close_all() -> None:
    for ahead in list(_waiting):
        ahead.close()


def take(cmd: list[str], env: dict[str, str]) -> subprocess.Popen | None:
    """The waiting rank of `cmd` (the guarded one-process command) if its environment fits `env`, let go
    with `env`; None when none fits (the caller starts one)."""
    with _lock:
        ahead = next((a for a in _waiting if a.fits(cmd, env)), None)
        if ahead is None:
            return None
        _waiting.remove(ahead)
    try:
        ahead.proc.stdin.write(json.dumps({"env": env}) + "\n")
        ahead.proc.stdin.close()
    except OSError:  # it ended meanwhile: start one fresh
        ahead.close()
        return None
    ahead.taken = True
    return ahead.proc


def wait_to_go(warm: list[str]) -> None:
    """In the waiting rank: imports `warm` (a failure is left for the real import to report), then takes
    its environment from stdin; exits quietly when stdin ends first (no launch took it)."""
    import importlib
    for name in warm:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the module the command runs imports it again and says why
            pass
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)
    env = json.loads(line)["env"]
    null = os.open(os.devnull, os.O_RDONLY)  # the rank reads nothing: as a fresh start's stdin
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
