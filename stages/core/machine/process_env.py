"""The environment of every process sftflow starts, applied where it starts and never when a module
is imported: the CLI's entry (`flows/cli/__init__.py`, the app's callback), a flow run (`flows/sft.py`,
`flows/sweep.py`: a deployment's run starts in a process the CLI never saw), the torchrun tree
(`launch/launcher.py` `worker_env`: agent and ranks inherit it) and `python -m stages.export`.
Importing a module of flows/ or stages/ changes nothing (tests/test_threads.py,
tests/test_architecture.py), so a library user or a test importing them keeps its own environment.

Each is a default: a variable the user set wins. The libraries read some of them when they are
imported (OpenMP when torch loads, huggingface_hub its progress bars), so each caller applies the
policy before anything heavy is loaded in its process."""

from __future__ import annotations

from typing import MutableMapping

from .threads import wait_policy

__fingerprint__ = False  # telemetry, progress bars and thread waits never change a result

DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    # prepare runs its own worker processes over the rows; tokenizers' thread pool on top oversubscribes
    # the cores, and after a fork it warns that it disables itself
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    # weight-loading and artifact-download bars add noise, not information, to the flow's log
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}


def apply_process_policy(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """`env` (os.environ, or a child's environment being built) with sftflow's defaults and the
    OpenMP wait policy (core/machine/threads.py) added where it has no value of its own."""
    for key, value in DEFAULTS.items():
        env.setdefault(key, value)
    return wait_policy(env)


_quick_exit: list[bool] = []


def exit_without_full_collections() -> None:
    """At this process's exit the objects alive are frozen (`gc.freeze`, an atexit handler: atexit runs
    last in, first out, so it comes before the handlers registered earlier, which see the objects frozen,
    and after those registered later): Python's finalization then leaves them out of its full garbage
    collections, which over what torch, transformers, Prefect and MLflow built took 2-6 s of CPU per
    process on 2 cores (docs/benchmarks.md "A run's fixed cost"). Nothing is skipped: atexit handlers, flushes and the
    refcount-driven teardown of modules run as before. Called where a flow run or the CLI starts."""
    if _quick_exit:
        return
    import atexit
    import gc
    atexit.register(gc.freeze)
    _quick_exit.append(True)
