"""Under torchrun: two optimizer steps, logits of the sharded model on one sample, then export."""

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from stages.runtime.batches import DataPosition
from stages.runtime.distributed import exit_skipping_finalization
from stages.runtime.worker import SFTWorker

spec = json.loads(open(sys.argv[1]).read())
worker = SFTWorker(spec)
worker.setup()
pos = DataPosition()
for _ in range(2):
    batch = worker.sampler.global_batch(pos)
    worker.forward_backward(batch)
    worker.optimizer_step()
    pos = worker.sampler.advance(pos, len(batch))
ids = torch.as_tensor(np.asarray(worker.train_ds[0]["input_ids"]), dtype=torch.long)[None]
with torch.no_grad():
    logits = worker.model(input_ids=ids, use_cache=False).logits
worker.export()
if dist.get_rank() == 0:
    torch.save({"input_ids": ids, "logits": logits}, sys.argv[2])
dist.barrier()
dist.destroy_process_group()
exit_skipping_finalization()  # as the stage entry points do
