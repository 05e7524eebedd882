"""evaluate: held-out prompts -> accuracy, loss and per-sample predictions.

For every val conversation, the prompt is the turns before its final assistant reply and
the reference is that reply. With `actor.nproc_per_node` > 1 the work runs under torchrun
(`python -m stages.evaluate spec.json`): each rank takes a contiguous, disjoint slice of the
samples and rank 0 sums the counts, so accuracy = correct / total over every sample, for any
world size (see runner.py and docs/evaluation.md). One process runs in the caller.

`eval.model` picks what is scored (default: the trained model). The reference stages score the
base model (`baseline`) and the registry's champion (`champion`) the same way, each in a folder of
its own (`run_reference`), so a sweep or a retrain on new data reuses them; evaluate then compares
its model with each item by item (`stages/core/paired.py`): `delta` = tuned - base accuracy with its 95%
interval, `vs_champion` likewise.

Named eval sets (`eval.sets`, each with its own files and scorer, or an lm-evaluation-harness task:
`mode: harness`, stages/runtime/harness.py) are each scored; the top-level
metrics are the primary set's (what promotion compares), and `metrics["sets"][name]` holds every
set's, with the comparisons and the guard (`max_drop`) verdict. Without named sets the val split
is the one set.

Output folder: metrics.json, predictions.jsonl (named sets: one row per sample of every set, with
its `set`), spec.json, eval.log (torchrun only), manifest.json.
Importing this module does not import torch.
"""

from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict

from stages.chatdata.readers import choices_of, prompt_and_reference
from stages.chatdata.shards import count_rows, read_shards
from stages.core.artifacts import StageBuild, canonical_json, read_manifest, sha256_text
from stages.core.config import SFTConfig, eval_split
from stages.models.refs import resolve_eval_model
from stages.runtime.launcher import run_torchrun, torchrun_command

from .errors import EvaluationError
from stages.core.paired import clears, compare_sets, read_predictions

BASE_KEYS = ("accuracy", "correct", "total", "eval_loss")  # what a reference contributes as `base_<key>`

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
        messages = json.loads(r["messages"])
        r["prompt"], r["reference"] = prompt_and_reference(messages)
        choice = choices_of(messages)
        if choice is not None:
            r["choices"], r["answer"] = choice
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


def compare_with_base(cfg: SFTConfig, metrics: dict, folder: Path, baseline: str | None) -> None:
    """Per set: the base model's numbers (from the baseline stage's folder) and the paired comparison
    with it (`delta` = tuned - base accuracy, `delta_low`/`delta_high` its 95% interval, `vs_base`
    with wins and losses), and the guard's verdict. Top-level keys stay the primary set's."""
    sets = metrics["sets"] if "sets" in metrics else {"val": metrics}
    if baseline is not None:
        manifest = read_manifest(Path(baseline))
        base_sets = manifest["metrics"].get("sets") or {"val": manifest["metrics"]}
        try:
            paired = compare_sets(read_predictions(folder), read_predictions(baseline), f"the baseline folder {baseline}")
        except ValueError as e:
            raise EvaluationError(f"evaluate: {e}; re-run it with `sftflow stage baseline --force -c <config>`") from None
        for name, m in sets.items():
            r, c = base_sets[name], paired.get(name)
            m.update({f"base_{k}": r[k] for k in BASE_KEYS if k in r})
            m["delta"] = m["accuracy"] - r["accuracy"]
            if c is not None:
                m.update(delta_low=c["delta_low"], delta_high=c["delta_high"], vs_base=c)
    guard_sets(cfg, sets)
    if "sets" in metrics:
        metrics.update(sets[cfg.eval.set_names[0]])


def guard_sets(cfg: SFTConfig, sets: dict[str, dict]) -> None:
    """For a named set with `max_drop`: whether the tuned model kept what the base model knew, judged
    per its `decide_on` (the estimate, or the interval's lower bound when there are per-item records)."""
    for name, m in sets.items():
        s = cfg.eval.sets.get(name)
        if s is None or s.max_drop is None or "delta" not in m:
            continue
        decided_on = s.decide_on if "vs_base" in m else "estimate"
        m.update(max_drop=s.max_drop, decided_on=decided_on,
                 guard_ok=clears(m.get("vs_base") or {"delta": m["delta"]}, s.max_drop, decided_on))


def prepared_sets(cfg: SFTConfig) -> list[str]:
    """The sets scored from prepared rows, in report order: every set but the harness sets (whose
    lm-eval task holds its own documents, stages/runtime/harness.py)."""
    return [n for n in cfg.eval.set_names if n not in cfg.eval.sets or not cfg.eval.sets[n].is_harness]


def _check_sets(cfg: SFTConfig, prepare_dir: str) -> None:
    for name in prepared_sets(cfg):
        try:  # an empty eval set would report accuracy 0/0 as a result
            count_rows(set_dir(prepare_dir, name), "held-out samples" if name == "val" else f"eval set '{name}' samples")
        except ValueError as e:
            raise EvaluationError(f"evaluate: {e}; rebuild them with `sftflow stage prepare --force -c <config>`") from None


def _score(cfg: SFTConfig, build: StageBuild, base_model: str, model: dict, prepare_dir: str,
           on_line: Callable[[str], None]) -> dict:
    """Scores one resolved model on every eval set into `build.partial` (metrics.json, predictions.jsonl),
    in this process or under torchrun; returns the metrics."""
    spec = EvalSpec(config=cfg, prepare_dir=prepare_dir, out_dir=str(build.partial), base_model=base_model,
                    models={"model": model})
    spec_path = build.partial / "spec.json"
    spec_path.write_text(spec.model_dump_json(indent=2))
    if cfg.actor.world_size == 1:
        from .runner import evaluate_spec
        with _IN_PROCESS:
            evaluate_spec(spec)
    else:
        run_torchrun(torchrun_command(cfg, spec_path, module="stages.evaluate"), build.partial / "eval.log",
                     EvaluationError, "evaluation", on_line, cfg.actor.nproc_per_node)
    return json.loads((build.partial / "metrics.json").read_text())


def _set_fingerprints(cfg: SFTConfig, prepare_dir: str, mode: str | None, folder: Path) -> dict[str, str]:
    set_fps = {}
    scored = read_predictions(folder)
    for name in cfg.eval.set_names:
        s = cfg.eval.sets.get(name)
        if s is not None and s.is_harness:  # the documents and targets asked, and how they were put
            set_fps[name] = sha256_text(canonical_json([eval_set_fingerprint(scored.get(name, [])), s.task,
                                                        s.num_fewshot, s.uses_chat_template]))[:16]
            continue
        set_fps[name] = eval_set_fingerprint(eval_samples(prepare_dir, cfg.eval.max_samples, name))
        if mode == "worker":  # the worker's own data and counts: not comparable to prompt scoring
            set_fps[name] = sha256_text(f"{set_fps[name]}:{cfg.actor.worker}")[:16]
    return set_fps


def run_reference(cfg: SFTConfig, stage: str, fp: str, base_model: str, model_ref: str, identity: dict | None,
                  prepare_dir: str, on_line: Callable[[str], None] = print) -> dict:
    """A reference stage (`baseline`: the base model; `champion`: a registered version, `identity` as
    the plan saw it): the model scored on every eval set exactly as evaluate scores the trained one."""
    _check_sets(cfg, prepare_dir)
    build = StageBuild(cfg.artifacts_path, stage, fp)
    with tempfile.TemporaryDirectory(dir=build.partial, prefix=".download-") as tmp:  # models:/ downloads
        model = resolve_eval_model(cfg, model_ref, Path(tmp), base_model, identity)
        metrics = _score(cfg, build, base_model, model, prepare_dir, on_line)
    build.commit({"metrics": metrics, "eval_sets": _set_fingerprints(cfg, prepare_dir, metrics.get("mode"), build.partial),
                  "model": model_ref, "model_dir": model["source"], "model_kind": model["kind"],
                  **({"version": identity["version"], "model_name": identity["name"],
                      "train_fingerprint": identity.get("train_fingerprint", "")} if identity else {}),
                  "base_model": base_model, "prepare_dir": prepare_dir, "world_size": cfg.actor.world_size})
    return metrics


def run_evaluate(cfg: SFTConfig, fp: str, base_model: str, model_ref: str, prepare_dir: str,
                 model_identity: dict | None = None, baseline: str | None = None,
                 on_line: Callable[[str], None] = print) -> dict:
    """Scores `model_ref` (the train stage folder, or `eval.model`, whose plan-time identity is
    `model_identity`) and compares it item by item with the base model's scores (the baseline stage's
    folder, when the plan has one)."""
    _check_sets(cfg, prepare_dir)
    build = StageBuild(cfg.artifacts_path, "evaluate", fp)
    with tempfile.TemporaryDirectory(dir=build.partial, prefix=".download-") as tmp:  # models:/ downloads
        model = resolve_eval_model(cfg, model_ref, Path(tmp), base_model, model_identity)
        metrics = _score(cfg, build, base_model, model, prepare_dir, on_line)
    if cfg.eval.eval_base and cfg.eval.model == "base":  # the base model *is* the model
        for m in [metrics, *metrics.get("sets", {}).values()]:
            m.update({f"base_{k}": m[k] for k in BASE_KEYS if k in m}, delta=0.0)
    compare_with_base(cfg, metrics, build.partial, baseline)
    (build.partial / "metrics.json").write_text(json.dumps(metrics, indent=2))
    set_fps = _set_fingerprints(cfg, prepare_dir, metrics.get("mode"), build.partial)
    build.commit({"metrics": metrics, "eval_set_fingerprint": set_fps[cfg.eval.set_names[0]], "eval_sets": set_fps,
                  "model": cfg.eval.model or "trained", "model_dir": model["source"], "model_kind": model["kind"],
                  "baseline": baseline, "base_model": base_model, "prepare_dir": prepare_dir,
                  "world_size": cfg.actor.world_size})
    return metrics
