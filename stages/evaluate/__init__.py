"""evaluate: held-out prompts -> accuracy, loss and per-sample predictions.

For every val conversation, the prompt is the turns before its final assistant reply and
the reference is that reply. With `actor.nproc_per_node` > 1 the work runs under torchrun
(`python -m stages.evaluate spec.json`): each rank takes a contiguous, disjoint slice of the
samples and rank 0 sums the counts, so accuracy = correct / total over every sample, for any
world size (see runner.py and docs/evaluation.md). One process runs in the caller.

`eval.model` picks what is scored (default: the trained model). The reference stages score the
base model (`baseline`) and the registry's champion (`champion`) the same way, each in a folder of
its own (`run_reference`), so a sweep or a retrain on new data reuses them; evaluate then compares
its model with each item by item (`stages/core/stats/paired.py`): `delta` = tuned - base accuracy with its 95%
interval, `vs_champion` likewise. The champion was scored by its own evaluate stage once: the champion
stage copies the sets that evaluation scored as today's plan would (each set's scoring key, which
evaluate records with the numbers it scored) and scores only the others (reuse.py).

Named eval sets (`eval.sets`, each with its own files and scorer, or an lm-evaluation-harness task:
`mode: harness`, stages/inference/harness.py) are each scored; without named sets the val split is
the one set ("val"). Metrics are always per set (`stages/core/stats/scores.py`): `metrics["sets"][name]`
holds every set's numbers with the comparisons and the guard (`max_drop`) verdict, and the top
level repeats the primary set's (what promotion compares).

Output folder: metrics.json, predictions.jsonl (named sets: one row per sample of every set, with
its `set`), spec.json, eval.log (torchrun only), manifest.json.
Importing this module does not import torch.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable

from stages.chatdata.shards import count_rows
from stages.core.machine import cores
from stages.core.cache.artifacts import StageBuild, read_manifest
from stages.core.config import SFTConfig
from stages.core.narrow import with_sets
from stages.core.stats.paired import clears, compare_sets, read_predictions
from stages.core.stats.scores import by_set
from stages.models.refs import resolve_eval_model
from stages.launch.launcher import run_torchrun, torchrun_command

from . import pieces, reuse
from .errors import EvaluationError
from .placement import place
from .sets import BASE_KEYS, EvalSpec, eval_samples, prepared_sets, set_dir, set_fingerprint

__all__ = ["BASE_KEYS", "EvalSpec", "EvaluationError", "compare_with_base", "eval_samples", "guard_sets",
           "run_evaluate", "run_reference"]

# One in-process evaluation at a time: transformers builds models under process-wide patches
# (meta-device init), so two threads loading at once (a sweep's parallel trials) break each other.
_IN_PROCESS = threading.Lock()


def compare_with_base(cfg: SFTConfig, sets: dict[str, dict], folder: Path, baseline: str | None) -> None:
    """Adds to each set's numbers the base model's (from the baseline stage's folder) and the paired
    comparison with it (`delta` = tuned - base accuracy, `delta_low`/`delta_high` its 95% interval,
    `vs_base` with wins and losses), and the guard's verdict."""
    if baseline is not None:
        base_sets = read_manifest(Path(baseline))["metrics"]["sets"]
        try:
            paired = compare_sets(read_predictions(folder), read_predictions(baseline),
                                  f"the baseline folder {baseline}")
        except ValueError as e:
            raise EvaluationError(f"evaluate: {e}; re-run it with "
                                  "`sftflow stage baseline --force -c <config>`") from None
        for name, m in sets.items():
            r, c = base_sets[name], paired.get(name)
            m.update({f"base_{k}": r[k] for k in BASE_KEYS if k in r})
            m["delta"] = m["accuracy"] - r["accuracy"]
            if c is not None:
                m.update(delta_low=c["delta_low"], delta_high=c["delta_high"], vs_base=c)
    guard_sets(cfg, sets)


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


def _check_sets(cfg: SFTConfig, prepare_dir: str) -> None:
    named = bool(cfg.eval.sets)
    stage = "prepare_eval" if named else "prepare"
    for name in prepared_sets(cfg):
        try:  # an empty eval set would report accuracy 0/0 as a result
            count_rows(set_dir(prepare_dir, name, named),
                       f"eval set '{name}' samples" if named else "held-out samples")
        except ValueError as e:
            raise EvaluationError(f"evaluate: {e}; rebuild them with "
                                  f"`sftflow stage {stage} --force -c <config>`") from None


def _score(cfg: SFTConfig, out: Path, base_model: str, model: dict, prepare_dir: str,
           on_line: Callable[[str], None]) -> tuple[dict, int]:
    """Scores one resolved model on every eval set into `out` (metrics.json, predictions.jsonl),
    in this process or under torchrun (placement.py); returns each set's numbers and how many processes
    scored them."""
    spec = EvalSpec(config=cfg, prepare_dir=prepare_dir, out_dir=str(out), base_model=base_model,
                    models={"model": model})
    spec_path = out / "spec.json"
    spec_path.write_text(spec.model_dump_json(indent=2))
    where = place(cfg, model, prepare_dir)
    if cfg.actor.world_size > 1:  # why the actor's processes are or are not used: worth a line
        on_line(f"scoring {'in this process' if where.in_process else f'on {where.processes} torchrun processes'} "
                f"({where.why})")
    if where.in_process:
        import torch

        from .runner import evaluate_spec
        # the machine's cores are shared with the other sftflow runs on it, as a launch's are
        with _IN_PROCESS, cores.in_this_process(torch.set_num_threads, torch.get_num_threads(), on_line):
            evaluate_spec(spec)
    else:
        run_torchrun(torchrun_command(cfg, spec_path, module="stages.evaluate"), out / "eval.log",
                     EvaluationError, "evaluation", on_line, cfg.actor.nproc_per_node)
    return json.loads((out / "metrics.json").read_text())["sets"], where.processes


def _set_fingerprints(cfg: SFTConfig, prepare_dir: str, sets: dict[str, dict], folder: Path) -> dict[str, str]:
    scored = read_predictions(folder)
    return {name: set_fingerprint(cfg, prepare_dir, name, sets[name], scored.get(name, []))
            for name in cfg.eval.set_names}


def _score_missing(cfg: SFTConfig, stage: str, build: StageBuild, base_model: str, model_ref: str,
                   identity: dict | None, prepare_dir: str, set_keys: dict[str, str] | None,
                   scoring: dict[str, str] | None,
                   on_line: Callable[[str], None]) -> tuple[dict, dict, int | None, dict]:
    """(each set's numbers, the model scored: kind and source, how many processes scored (None: none did),
    where each set's scores came from), the predictions in `build.partial`: sets with a piece (pieces.py)
    from it; for the champion, sets its own evaluation scored as today's plan would (`scoring`: each set's
    scoring key, reuse.py) copied from there; the others scored (narrowed to them); all kept as pieces."""
    root, names = cfg.artifacts_path, cfg.eval.set_names
    found = {n: pieces.read(root, stage, (set_keys or {}).get(n)) for n in names}
    sources = {n: {"from": "piece", "folder": str(pieces.folder(root, stage, set_keys[n]))}
               for n in names if found[n] is not None}
    todo = [n for n in names if found[n] is None]
    if set_keys and len(todo) < len(names):
        on_line(f"{stage}: {', '.join(n for n in names if n not in todo)} scored before (same model, files and "
                f"scoring); scoring {', '.join(todo) or 'nothing'}")
    if todo and stage == "champion" and scoring and identity and identity.get("train_fingerprint") \
            and reuse.enabled():
        copied = reuse.reusable(cfg, prepare_dir, identity["train_fingerprint"], scoring, todo, on_line)
        for n, (numbers, lines, folder, kind) in copied.items():
            model = {"kind": kind, "source": model_ref}
            found[n] = (numbers, lines, model)
            sources[n] = {"from": "evaluate", "folder": str(folder)}
            if set_keys:
                pieces.write(root, stage, set_keys[n], n, numbers, lines, model)
        todo = [n for n in todo if n not in copied]
        for folder in sorted({sources[n]["folder"] for n in copied}):
            mine = [n for n in copied if sources[n]["folder"] == folder]
            on_line(f"{stage}: reused {len(mine)} set(s) from {folder} ({', '.join(mine)}: v{identity['version']}'s "
                    f"own evaluation, same rows, scoring and precision), scored {len(todo)}"
                    + (f" ({', '.join(todo)})" if todo else ""))
    model = next((f[2] for f in found.values() if f is not None), None)
    processes = None
    if todo:
        sources.update({n: {"from": "scored"} for n in todo})
        out = build.partial / ".scoring" if set_keys else build.partial
        out.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=build.partial, prefix=".download-") as tmp:  # models:/ downloads
            model = resolve_eval_model(cfg, model_ref, Path(tmp), base_model, identity)
            scored, processes = _score(with_sets(cfg, todo) if set_keys else cfg, out, base_model, model,
                                       prepare_dir, on_line)
        if not set_keys:
            return scored, model, processes, sources
        lines = pieces.lines_by_set(out / "predictions.jsonl")
        for n in todo:
            pieces.write(root, stage, set_keys[n], n, scored[n], lines.get(n, []), model)
            found[n] = (scored[n], lines.get(n, []), model)
        for f in ("eval.log", "spec.json"):
            if (out / f).is_file():
                (out / f).replace(build.partial / f)
        shutil.rmtree(out)
    with open(build.partial / "predictions.jsonl", "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for n in names for line in found[n][1])
    return {n: found[n][0] for n in names}, model, processes, sources


def run_reference(cfg: SFTConfig, stage: str, fp: str, base_model: str, model_ref: str, identity: dict | None,
                  prepare_dir: str, on_line: Callable[[str], None] = print,
                  set_keys: dict[str, str] | None = None, scoring: dict[str, str] | None = None) -> dict:
    """A reference stage (`baseline`: the base model; `champion`: a registered version, `identity` as
    the plan saw it): the model scored on every eval set exactly as evaluate scores the trained one.
    With `set_keys` (named sets: what each set's score depends on), a set scored before by the same
    model the same way is read from its piece rather than scored again (pieces.py); with `scoring` (each
    set's scoring key), the champion's sets its own evaluation scored the same way are copied from it
    (reuse.py). The manifest's `set_sources` says where each set's scores came from."""
    _check_sets(cfg, prepare_dir)
    build = StageBuild(cfg.artifacts_path, stage, fp)
    sets, model, processes, sources = _score_missing(cfg, stage, build, base_model, model_ref, identity,
                                                     prepare_dir, set_keys, scoring, on_line)
    metrics = by_set(sets, cfg.eval.set_names[0])
    build.commit({"metrics": metrics, "eval_sets": _set_fingerprints(cfg, prepare_dir, sets, build.partial),
                  "model": model_ref, "model_dir": model["source"], "model_kind": model["kind"],
                  **({"version": identity["version"], "model_name": identity["name"],
                      "train_fingerprint": identity.get("train_fingerprint", "")} if identity else {}),
                  "base_model": base_model, "prepare_dir": prepare_dir, "world_size": processes,
                  "set_sources": sources})
    return metrics


def run_evaluate(cfg: SFTConfig, fp: str, base_model: str, model_ref: str, prepare_dir: str,
                 model_identity: dict | None = None, baseline: str | None = None,
                 on_line: Callable[[str], None] = print, train_fingerprint: str | None = None,
                 scoring: dict[str, str] | None = None) -> dict:
    """Scores `model_ref` (the train stage folder, the training `train_fingerprint`, or `eval.model`, whose
    plan-time identity is `model_identity`) and compares it item by item with the base model's scores (the
    baseline stage's folder, when the plan has one). The manifest keeps each set's numbers as scored with
    its scoring key (`scoring`), which the champion stage reuses once this training is the champion."""
    _check_sets(cfg, prepare_dir)
    build = StageBuild(cfg.artifacts_path, "evaluate", fp)
    with tempfile.TemporaryDirectory(dir=build.partial, prefix=".download-") as tmp:  # models:/ downloads
        model = resolve_eval_model(cfg, model_ref, Path(tmp), base_model, model_identity)
        sets, processes = _score(cfg, build.partial, base_model, model, prepare_dir, on_line)
    scored = reuse.scoring_record(scoring, sets)  # before the comparisons are added to the numbers
    if cfg.eval.eval_base and cfg.eval.model == "base":  # the base model *is* the model
        for m in sets.values():
            m.update({f"base_{k}": m[k] for k in BASE_KEYS if k in m}, delta=0.0)
    compare_with_base(cfg, sets, build.partial, baseline)
    metrics = by_set(sets, cfg.eval.set_names[0])
    (build.partial / "metrics.json").write_text(json.dumps(metrics, indent=2))
    set_fps = _set_fingerprints(cfg, prepare_dir, sets, build.partial)
    build.commit({"metrics": metrics, "eval_set_fingerprint": set_fps[cfg.eval.set_names[0]], "eval_sets": set_fps,
                  "model": cfg.eval.model or reuse.TRAINED, "model_dir": model["source"], "model_kind": model["kind"],
                  **({"train_fingerprint": train_fingerprint} if cfg.eval.model is None and train_fingerprint else {}),
                  "baseline": baseline, "base_model": base_model, "prepare_dir": prepare_dir,
                  "world_size": processes, "scoring": scored})
    return metrics
