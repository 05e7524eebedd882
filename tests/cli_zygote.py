"""A warm start for the CLI in tests: a process that has imported the heavy libraries once (torch,
transformers, mlflow, datasets: ~6 s of CPU per CLI call on 2 cores) and forks a child per call,
which then runs `python -m flows.cli ARGS` as a fresh interpreter would: its own pid, working folder,
environment, stdin from /dev/null, stdout and stderr in files, atexit handlers and exit status.

What it cannot give is the import of those libraries under the call's environment, so conftest's
`sftflow` sends a call here only when the call's environment differs from this process's in
variables read at run time (PREFECT_*, MLFLOW_*, SFTFLOW_*, ...); any other difference, `fresh=True`,
or SFTFLOW_TEST_FORK=0 runs a real subprocess. Prefect is not preloaded: it builds its settings
from the environment when imported. Nor is anything of sftflow's own (stages, flows).

Protocol, one JSON line each way on stdin/stdout: {"argv" (after `-m flows.cli`), "cwd", "env", "stdout", "stderr"} ->
{"pid"} as soon as the child runs, then {"returncode"} when it has ended."""

import json
import os
import sys

# Imported before any fork; each takes seconds on a cold interpreter. Importing them starts no
# Python thread; the native threads some start (jemalloc's, torch's) are fork-safe by design
# (pthread_atfork), which is what a `forkserver` preloading torch relies on too.
import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
from transformers import activations, masking_utils, modeling_layers  # noqa: F401
from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
import mlflow
import mlflow.entities
import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
import datasets  # noqa: F401
import pandas  # noqa: F401
import pyarrow  # noqa: F401


def _reply(obj: dict) -> None:
    os.write(_out, (json.dumps(obj) + "\n").encode())


def _serve() -> dict:
    """Answers calls until stdin closes (then exits); returns only in a forked child, with its call."""
    for line in _requests:
        call = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return call
        _reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _reply({"returncode": os.waitstatus_to_exitcode(status)})
    os._exit(0)


# The protocol's own pipes, kept apart from fds 0/1/2 (a child's stdin, stdout and stderr).
_requests = os.fdopen(os.dup(0), "r")
_out = os.dup(1)
sys.stdout.flush()

call = _serve()
# The child: from here on it is `cd CWD && env -i ENV python -m flows.cli ARGV`.
_requests.close()
os.close(_out)
os.chdir(call["cwd"])
os.environ.clear()
os.environ.update(call["env"])
for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                        (1, call["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                        (2, call["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)
sys.argv = ["-m", *call["argv"]]
sys.path[0] = os.getcwd()  # as `python -m` puts it: modules next to the config (a custom worker) import
import runpy  # noqa: E402

runpy.run_module("flows.cli", run_name="__main__", alter_sys=True)
