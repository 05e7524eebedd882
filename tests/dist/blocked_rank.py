"""Under torchrun: rank 0 blocks in an all_reduce that rank 1 never joins (rank 1 sleeps); each
writes <out>/rank<RANK>.ready with its pid once it is there."""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from stages.runtime.distributed import rank_entry

with rank_entry():
    dist.init_process_group("gloo")
    out, rank = Path(sys.argv[1]), dist.get_rank()
    (out / f"rank{rank}.ready").write_text(str(os.getpid()))
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # blocked: rank 1 never joins
    else:
        time.sleep(3600)
