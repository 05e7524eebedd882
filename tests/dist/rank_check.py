"""Under torchrun: each rank writes how it was started (a fresh interpreter, or forked), how it
handles SIGTERM,,
its torch threads and its arguments to <out>/rank<RANK>.json."""

import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path

import torch

from stages.runtime.distributed import rank_entry

with rank_entry():
    out = Path(sys.argv[1])
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "forked": multiprocessing.parent_process() is not None,
        "sigterm": "default" if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else "handled",
        "threads": torch.get_num_threads(), "argv": sys.argv[1:], "main": __name__}))
