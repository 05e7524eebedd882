"""Under torchrun: each rank writes how it was started (forked from the agent or a fresh interpreter),
its torch threads and its arguments to <out>/rank<RANK>.json."""

import json
import multiprocessing
import os
import sys
from pathlib import Path

import torch

from stages.runtime.distributed import rank_entry

with rank_entry():
    out = Path(sys.argv[1])
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "forked": multiprocessing.parent_process() is not None,
        "threads": torch.get_num_threads(), "argv": sys.argv[1:], "main": __name__}))
