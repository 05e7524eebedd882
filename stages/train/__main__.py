"""torchrun entry point: `python -m stages.train <spec.json>` runs one rank of the worker.

A package entry (rather than `-m stages.runtime.worker`) keeps the worker module importable
under its real name, so `actor.worker` subclasses of `SFTWorker` are recognised as such.
"""

from stages.runtime.worker import main
from stages.runtime.distributed import run_rank

run_rank(main)
