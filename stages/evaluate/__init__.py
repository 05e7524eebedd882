"""evaluate: held-out prompts -> accuracy, loss and per-sample predictions.

For every val conversation, the prompt is the turns before its final assistant reply and
the reference is that reply. With `actor.nproc_per_node` > 1 the work runs under torchrun
(`python -m stages.evaluate spec.json`): each rank takes a contiguous, disjoint slice of the
samples and rank 0 sums the counts, so accuracy = correct / total over every sample, for any
world size (see runner.py and docs/evaluation.md). One process runs in the caller.

`eval.model` picks what is scored (default: the trained model); the untrained base model is
scored the same way (`base_accuracy`) so the report shows base -> tuned.

Named eval sets (`eval.sets`, each with its own files and scorer) are each scored for both
models; the top-level metrics are the primary set's (what promotion compares), and
`metrics["sets"][name]` holds every set's, with `delta` = tuned - base accuracy and the guard
(`max_drop`) verdict. Without named sets the val split is the one set.

Output folder: metrics.json, predictions.jsonl, base_predictions.jsonl (named sets: one row per
sample of every set, with its `set`), spec.json, eval.log (torchrun only), manifest.json.
Importing this module does not import torch.
"""

from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict

from stages.chatdata.readers import prompt_and_reference
from stages.chatdata.shards import count_rows, read_shards
from stages.core.artifacts import StageBuild, canonical_json, sha256_text
from stages.core.config import SFTConfig, eval_split
from stages.models.refs import resolve_eval_model
from stages.runtime.launcher import run_torchrun, torchrun_command

from .errors import EvaluationError

# One in-process evaluation at a time: transformers builds models under process-wide patches
# (meta-device init), so two threads loading at once (a sweep's parallel trials) break each other.
_IN_PROCESS = threading.Lock()


def set_dir(prepare_dir: str | Path, name: str) -> Path:
    """Where the prepare stage wrote eval set `name` ("val": the val split)."""
    return Path(prepare_dir) / ("val" if name == "val" else eval_split(name))


def sample_indices(n: int, max_samples: int) -> list[int]:
    """Which of a set's `n` rows `eval.max_samples` keeps: all of them, or that many spread evenly
    over the whole set in file order (the first N rows are often all one kind of prompt)."""
    if max_samples <= 0 or max_samples >= n:
        return list(range(n))
    return [i * n // max_samples for i in range(max_samples)]


def eval_samples(prepare_dir: str, max_samples: int = 0, set_name: str = "val") -> list[dict]:
    table = read_shards(set_dir(prepare_dir, set_name), ["input_ids", "loss_mask", "source", "messages"])
    rows = table.take(sample_indices(table.num_rows, max_samples)).to_pylist()
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


def guard_sets(cfg: SFTConfig, metrics: dict) -> None:
    """Per set: `delta` (tuned - base accuracy) and, for a set with `max_drop`, whether it held."""
    for name, m in metrics["sets"].items():
        if "base_accuracy" not in m:
            continue
        m["delta"] = m["accuracy"] - m["base_accuracy"]
        max_drop = cfg.eval.sets[name].max_drop
        if max_drop is not None:
            m["max_drop"] = max_drop
            m["guard_ok"] = m["delta"] >= -max_drop - 1e-12


def run_evaluate(cfg: SFTConfig, fp: str, base_model: str, model_ref: str, prepare_dir: str,
                 model_identity: dict | None = None, on_line: Callable[[str], None] = print) -> dict:
    """Scores `model_ref` (the train stage folder, or `eval.model`, whose plan-time identity is
    `model_identity`) and, with `eval.eval_base`, the base model."""
    for name in cfg.eval.set_names:
        try:  # an empty eval set would report accuracy 0/0 as a result
            count_rows(set_dir(prepare_dir, name), "held-out samples" if name == "val" else f"eval set '{name}' samples")
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
            with _IN_PROCESS:
                evaluate_spec(spec)
        else:
            run_torchrun(torchrun_command(cfg, spec_path, module="stages.evaluate"), build.partial / "eval.log",
                         EvaluationError, "evaluation", on_line, cfg.actor.nproc_per_node)
    metrics = json.loads((build.partial / "metrics.json").read_text())
    if cfg.eval.eval_base and "base" not in models:  # eval.model=base: the base model *is* the model
        for m in [metrics, *metrics.get("sets", {}).values()]:
            m.update({f"base_{k}": m[k] for k in ("accuracy", "correct", "total", "eval_loss") if k in m})
    if cfg.eval.sets:
        guard_sets(cfg, metrics)
    (build.partial / "metrics.json").write_text(json.dumps(metrics, indent=2))
    set_fps = {}
    for name in cfg.eval.set_names:
        set_fps[name] = eval_set_fingerprint(eval_samples(prepare_dir, cfg.eval.max_samples, name))
        if metrics.get("mode") == "worker":  # the worker's own data and counts: not comparable to prompt scoring
            set_fps[name] = sha256_text(f"{set_fps[name]}:{cfg.actor.worker}")[:16]
    eval_set = set_fps[cfg.eval.set_names[0]]
    build.commit({"metrics": metrics, "eval_set_fingerprint": eval_set, "eval_sets": set_fps,
                  "model": cfg.eval.model or "trained",
                  "model_dir": model["source"], "model_kind": model["kind"], "base_model": base_model,
                  "prepare_dir": prepare_dir, "world_size": cfg.actor.world_size})
    return metrics
