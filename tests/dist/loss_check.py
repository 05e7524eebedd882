"""Under torchrun: for each spec given, a worker built from it takes one optimizer step (so LoRA's
B matrices are no longer zero and the tuned model is away from the base), then the gradient of the
second global batch; all workers share one process group. Rank 0 saves, per spec: the trained
parameters after the step (whole), the gradients (whole), the loop's stats and that batch's indices.

    torchrun --nproc_per_node=2 tests/dist/loss_check.py OUT.pt SPEC.json [SPEC.json ...]
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from stages.runtime.batches import DataPosition
from stages.runtime.distributed import choose_precision, exit_skipping_finalization, local_device
from stages.runtime.worker import SFTWorker


class SharedGroup(SFTWorker):
    """Joins the process group the first worker started: one torchrun launch for all the specs."""

    def init_distributed(self):
        if not dist.is_initialized():
            return super().init_distributed()
        device = local_device()
        return device, dist.get_rank(), dist.get_world_size(), choose_precision(self.cfg.actor.precision, device)


out_path, results = sys.argv[1], {}
for spec_path in sys.argv[2:]:
    worker = SharedGroup(json.loads(open(spec_path).read()))
    worker.setup()
    pos = DataPosition()
    first = worker.sampler.global_batch(pos)
    worker.forward_backward(first)
    worker.optimizer_step()
    trained = get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                          ignore_frozen_params=True))
    batch = worker.sampler.global_batch(worker.sampler.advance(pos, len(first)))
    stats = worker.forward_backward(batch)
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu()
             for n, p in worker.model.named_parameters() if p.grad is not None}
    results[spec_path] = {"trained": trained, "grads": grads, "stats": stats, "batch": batch.tolist(),
                          "fsdp": worker.fsdp, "keep_gathered": worker.keep_gathered}
    worker.model = worker.optimizer = None
if dist.get_rank() == 0:
    torch.save(results, out_path)
dist.barrier()
dist.destroy_process_group()
exit_skipping_finalization()  # as the stage entry points do
