"""Under torchrun: one global batch through SFTWorker.forward_backward; rank 0 saves the full gradients."""

import sys

import numpy as np
import torch
import torch.distributed as dist

from stages.runtime.distributed import exit_skipping_finalization
from stages.runtime.worker import SFTWorker

spec_path, out_path = sys.argv[1], sys.argv[2]
indices = [int(i) for i in sys.argv[3].split(",")] if len(sys.argv) > 3 else None
import json  # noqa: E402
worker = SFTWorker(json.loads(open(spec_path).read()))
worker.setup()
# a full global batch, or fewer samples: an epoch's short last batch (some ranks get empty micro-batches)
batch_idx = np.asarray(indices) if indices else np.arange(worker.cfg.actor.global_batch_size)
stats = worker.forward_backward(batch_idx)
grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu()
         for n, p in worker.model.named_parameters() if p.grad is not None}
if dist.get_rank() == 0:
    torch.save({"grads": grads, "stats": stats, "batch": batch_idx.tolist()}, out_path)
dist.barrier()
dist.destroy_process_group()
exit_skipping_finalization()  # as the stage entry points do
