"""Under torchrun with LoRA: one optimizer step (so both adapter matrices are non-zero), then the
adapters as they are and the gradient of a second global batch; rank 0 saves both, whole."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from stages.runtime.batches import DataPosition
from stages.runtime.distributed import exit_skipping_finalization
from stages.runtime.worker import SFTWorker

spec_path, out_path = sys.argv[1], sys.argv[2]
worker = SFTWorker(json.loads(open(spec_path).read()))
worker.setup()
pos = DataPosition()
first = worker.sampler.global_batch(pos)
worker.forward_backward(first)
worker.optimizer_step()
pos = worker.sampler.advance(pos, len(first))
adapters = get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                       ignore_frozen_params=True))
batch = worker.sampler.global_batch(pos)
stats = worker.forward_backward(batch)
grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu()
         for n, p in worker.model.named_parameters() if p.grad is not None}
# the frozen weights this rank holds a shard of (FSDP2's DTensors split by rows), not the whole
sharded = {n: str(p.dtype) for n, p in worker.model.named_parameters()
           if not p.requires_grad and hasattr(p, "to_local") and p.to_local().shape[0] < p.shape[0]}
if dist.get_rank() == 0:
    torch.save({"adapters": adapters, "grads": grads, "stats": stats, "batch": batch.tolist(), "sharded": sharded},
               out_path)
dist.barrier()
dist.destroy_process_group()
exit_skipping_finalization()  # as the stage entry points do
