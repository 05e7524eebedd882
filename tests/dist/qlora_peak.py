"""Run by tests/test_gpu.py's QLoRA case as one rank (torchrun's environment set by the caller): the
real SFTWorker, 3 optimizer steps, then as JSON the device's peak allocated bytes (CUDA's allocator;
None on CPU), how it ran, and the rank's measured base bytes (`qlora.base_bytes_line`)."""

import json
import sys

import torch

from stages.runtime.batches import DataPosition
from stages.runtime.qlora import base_bytes_line
from stages.runtime.worker import SFTWorker, WorkerSpec

w = SFTWorker(WorkerSpec.read(sys.argv[1]))
w.setup()
pos = DataPosition()
for _ in range(3):
    batch = w.sampler.global_batch(pos)
    w.forward_backward(batch)
    w.optimizer_step()
    pos = w.sampler.advance(pos, len(batch))
peak = torch.cuda.max_memory_allocated(w.device) if w.device.type == "cuda" else None
print(json.dumps({"peak": peak, "device": str(w.device), "precision": w.precision, "packing": w.packing,
                  "attn": w.attn_implementation, "base": base_bytes_line(w.model)}))
