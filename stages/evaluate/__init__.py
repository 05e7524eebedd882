"""evaluate: held-out prompts -> accuracy, loss and per-sample predictions.

For every val conversation, the prompt is the turns before its final assistant reply and
the reference is that reply. With `actor.nproc_per_node` > 1 the work runs under torchrun
(`python -m stages.evaluate spec.json`): each rank takes a contiguous, disjoint slice of the
samples and rank 0 sums the counts, so accuracy = correct / total over every sample, for any
world size (see runner.py and docs/evaluation.md). One process runs in the caller.

`eval.model` picks what is scored (default: the trained model); the untrained base model is
scored the same way (`base_accuracy`) so the report shows base -> tuned.

Output folder: metrics.json, predictions.jsonl, base_predictions.jsonl, spec.json,
eval.log (torchrun only), manifest.json. Importing this module does not import torch.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict

from stages.chatdata.readers import prompt_and_reference
from stages.chatdata.shards import count_rows, read_shards
from stages.core.artifacts import StageBuild, canonical_json, sha256_text
from stages.core.config import SFTConfig
from stages.models.refs import resolve_eval_model
from stages.runtime.launcher import run_torchrun, torchrun_command

from .errors import EvaluationError


def eval_samples(prepare_dir: str, max_samples: int = 0) -> list[dict]:
    table = read_shards(Path(prepare_dir) / "val", ["input_ids", "loss_mask", "source", "messages"])
    rows = table.to_pylist()
    rows = rows[:max_samples] if max_samples > 0 else rows
    for r in rows:
        r["prompt"], r["reference"] = prompt_and_reference(json.loads(r["messages"]))
    return rows


class EvalSpec(BaseModel):
    """What the evaluation processes are given (`spec.json`): models are `resolve_eval_model` results."""

    model_config = ConfigDict(extra="forbid")

    config: SFTConfig
    prepare_dir: str
    out_dir: str
    base_model: str
    models: dict[str, dict]


def eval_set_fingerprint(rows: list[dict]) -> str:
    """Identifies *what* was asked, independent of tokenizer and model: accuracies are comparable iff equal."""
    return sha256_text(canonical_json([[r["prompt"], r["reference"]] for r in rows]))[:16]


def run_evaluate(cfg: SFTConfig, fp: str, base_model: str, model_ref: str, prepare_dir: str,
                 model_identity: dict | None = None, on_line: Callable[[str], None] = print) -> dict:
    """Scores `model_ref` (the train stage folder, or `eval.model`, whose plan-time identity is
    `model_identity`) and, with `eval.eval_base`, the base model."""
    try:  # an empty eval set would report accuracy 0/0 as a result
        count_rows(Path(prepare_dir) / "val", "held-out samples")
    except ValueError as e:
        raise EvaluationError(f"evaluate: {e}; rebuild them with `sftflow stage prepare --force -c <config>`") from None
    build = StageBuild(cfg.artifacts_path, "evaluate", fp)
    with tempfile.TemporaryDirectory(dir=build.partial, prefix=".download-") as tmp:  # models:/ downloads
        model = resolve_eval_model(cfg, model_ref, Path(tmp), base_model, model_identity)
        models = {"model": model}
        if cfg.eval.eval_base and cfg.eval.model != "base":
            models["base"] = resolve_eval_model(cfg, base_model, Path(tmp), base_model)
        spec = EvalSpec(config=cfg, prepare_dir=prepare_dir, out_dir=str(build.partial), base_model=base_model,
                        models=models)
        spec_path = build.partial / "spec.json"
        spec_path.write_text(spec.model_dump_json(indent=2))
        if cfg.actor.world_size == 1:
            from .runner import evaluate_spec
            evaluate_spec(spec)
        else:
            run_torchrun(torchrun_command(cfg, spec_path, module="stages.evaluate"), build.partial / "eval.log",
                         EvaluationError, "evaluation", on_line, cfg.actor.nproc_per_node)
    metrics = json.loads((build.partial / "metrics.json").read_text())
    if cfg.eval.eval_base and "base" not in models:  # eval.model=base: the base model *is* the model
        metrics.update({f"base_{k}": metrics[k] for k in ("accuracy", "correct", "total", "eval_loss") if k in metrics})
        (build.partial / "metrics.json").write_text(json.dumps(metrics, indent=2))
    rows = eval_samples(prepare_dir, cfg.eval.max_samples)
    eval_set = eval_set_fingerprint(rows)
    if metrics.get("mode") == "worker":  # the worker's own data and counts: not comparable to prompt scoring
        eval_set = sha256_text(f"{eval_set}:{cfg.actor.worker}")[:16]
    build.commit({"metrics": metrics, "eval_set_fingerprint": eval_set, "model": cfg.eval.model or "trained",
                  "model_dir": model["source"], "model_kind": model["kind"], "base_model": base_model,
                  "prepare_dir": prepare_dir, "world_size": cfg.actor.world_size})
    return metrics
