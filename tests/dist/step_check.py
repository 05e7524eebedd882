"""Under torchrun: for each spec given, a worker built from it takes one optimizer step (so LoRA's
B matrices are no longer zero and A gets gradients too), then the gradient of the second global
batch; all workers share one process group. Rank 0 saves, per spec: the full gradients, their
dtypes on the shards, the loop's stats, how often the blocks' MLPs ran in that forward_backward
(twice as often when activations are recomputed), and the (collective, dtype) pairs FSDP2 issued.
Each block's MLP is found by name: FSDP2 renames the blocks' classes.

    torchrun --nproc_per_node=2 tests/dist/step_check.py OUT.pt SPEC.json [SPEC.json ...]
"""

import json
import sys

import torch
import torch.distributed as dist

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


collectives: set = set()


def recording(name: str, collective):
    """`collective` (FSDP2 calls it through the module, `dist.<name>`), noting its input's dtype."""
    def wrapped(*args, **kwargs):
        tensor = kwargs["input"] if "input" in kwargs else args[1]
        collectives.add((name, str(tensor.dtype).removeprefix("torch.")))
        return collective(*args, **kwargs)
    return wrapped


def counting_calls(modules) -> list[int]:
    """[how many forwards of `modules` ran since], as the hooks it registers count them."""
    calls = [0]

    def count(*_) -> None:
        calls[0] += 1
    for m in modules:
        m.register_forward_pre_hook(count)
    return calls


for name in ("all_gather_single", "reduce_scatter_single"):
    setattr(dist, name, recording(name, getattr(dist, name)))

out_path, results = sys.argv[1], {}
for spec_path in sys.argv[2:]:
    worker = SharedGroup(json.loads(open(spec_path).read()))
    worker.setup()
    pos = DataPosition()
    first = worker.sampler.global_batch(pos)
    worker.forward_backward(first)
    worker.optimizer_step()
    calls = counting_calls([m for name, m in worker.model.named_modules() if name.endswith(".mlp")])
    collectives.clear()
    stats = worker.forward_backward(worker.sampler.global_batch(worker.sampler.advance(pos, len(first))))
    shard_dtypes = sorted({str(p.grad.dtype) for p in worker.model.parameters() if p.grad is not None})
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu()
             for n, p in worker.model.named_parameters() if p.grad is not None}
    results[spec_path] = {"grads": grads, "grad_dtypes": shard_dtypes, "stats": stats, "mlp_calls": calls[0],
                          "collectives": sorted(collectives), "precision": worker.precision}
    worker.model = worker.optimizer = None
if dist.get_rank() == 0:
    torch.save(results, out_path)
dist.barrier()
dist.destroy_process_group()
exit_skipping_finalization()  # as the stage entry points do
