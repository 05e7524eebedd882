"""torchrun entry point: `python -m stages.train <spec.json>` runs one rank of the worker (the train
stage starts torchrun through launch/launcher.py; `load_worker` checks the worker class before
`fit` starts the process group).

A package entry (rather than `-m stages.runtime.worker`) keeps the worker module importable
under its real name, so `actor.worker` subclasses of `SFTWorker` are recognised as such.
"""

import sys

from stages.runtime.distributed import rank_entry
from stages.runtime.worker import load_worker

with rank_entry():
    load_worker(sys.argv[1]).fit()
