"""torchrun entry point: `python -m stages.train <spec.json>` runs one rank of the worker.

A package entry (rather than `-m stages.runtime.worker`) keeps the worker module importable
under its real name, so `actor.worker` subclasses of `SFTWorker` are recognised as such.
"""

from stages.runtime.distributed import exit_skipping_finalization
from stages.runtime.worker import main

main()
exit_skipping_finalization()  # only reached when the rank finished its work
