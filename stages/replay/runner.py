"""One replay process; under torchrun, one rank of several: rank r answers the contiguous prompts
[r*n//W, (r+1)*n//W) and rank 0 gathers the answers in order (as evaluate's ranks do)."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from stages.runtime.distributed import gather, local_device, log, precision_why, rank_and_world
from stages.inference.generation import generate, load

from .spec import ReplaySpec


def answer_spec(spec: ReplaySpec) -> list[dict]:
    """The base model's greedy answer to every prompt, in order ({text, new_tokens, stopped})."""
    cfg = spec.config
    rank, world = rank_and_world()
    device = local_device(shared=True)
    model, tok = load(spec.model_path, cfg.actor.model.trust_remote_code, str(device), cfg.actor.precision)
    log(f"replay: precision {precision_why(cfg.actor.precision, device, model_dir=spec.model_path)}")
    n = len(spec.prompts)
    mine = spec.prompts[rank * n // world: (rank + 1) * n // world]
    answers = generate(model, tok, [p["prompt"] for p in mine], cfg.replay.max_new_tokens, cfg.replay.batch_size)
    out = [a for part in gather(answers) for a in part]
    log(f"replay: {len(out)} answers from {spec.model_path} on {world} process(es)")
    return out


def main(spec_path: str) -> None:
    """One rank's share of the work for the `spec.json` torchrun was given."""
    spec = ReplaySpec.model_validate_json(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    try:
        answers = answer_spec(spec)
        if dist.get_rank() == 0:
            with open(Path(spec.out_dir) / "generated.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(a, ensure_ascii=False) + "\n" for a in answers)
        dist.barrier()
    finally:
        dist.destroy_process_group()
