"""One evaluation process; under torchrun, one rank of several.

    python -m torch.distributed.run --nproc_per_node=N ... -m stages.evaluate spec.json

Exactness: rank r of W takes the contiguous samples [r*n//W, (r+1)*n//W) -- every sample
exactly once, no sampler padding, no dropped tail, in any world size. A rank generates and
scores its slice and keeps *sums* (correct, total, token losses, tokens); all ranks' records
and sums are gathered (gloo, Python objects) and rank 0 writes predictions.jsonl in the
original order and divides once: accuracy = correct / total, eval_loss = loss sum / tokens.
Nothing is sharded (each rank holds the whole model), so ranks run no collectives while
generating and may hold different numbers of samples.

Two ways to score a model:
  * generation (Hugging Face causal LMs): greedy replies scored by `eval.scorer`;
  * the worker (`actor.worker` overriding `get_eval_model_output`): its summed `correct`/`total`
    over the worker's eval dataset. When those sums have no `total`, generation is used.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from stages.core.config import SFTConfig
from stages.core.errors import ConfigError
from stages.core.stats.scores import by_set, counted
from stages.runtime.batches import pad_token_id
from stages.runtime.saving.checkpoint import load_model_weights
from stages.runtime.distributed import (add_up, choose_precision, gather, local_device, log, precision_why,
                                        rank_and_world, rank_slice)
from stages.inference.generation import generate
from stages.inference.weights import load_merged
from stages.inference.harness import score_task
from stages.runtime.lora import lora_enabled
from stages.runtime.worker import SFTWorker, WorkerSpec, load_worker_class

from .choice import choice_scores
from .errors import EvaluationError
from .losses import loss_metrics, teacher_forced_sums
from .scorers import get_scorer
from .sets import BASE_KEYS, EvalSpec, eval_samples, prepared_sets, sample_indices, set_dir


# --------------------------------------------------------------------------- loading


def load_model(cfg: SFTConfig, ref: dict, base_model: str, device: torch.device):
    """(model, tokenizer or None) for a model reference from `stages.models.refs.resolve_eval_model`.

    A Hugging Face folder (or hub id) loads as it is; a DCP checkpoint or a plain state dict is
    loaded into the configured model type built from the base model, as training built it."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, PreTrainedModel

    from stages.runtime.model_types import WeightsLoadError, build_configured_model
    mc = cfg.actor.model
    kind, path = ref["kind"], ref["path"]
    lora = kind == "checkpoint" and lora_enabled(cfg)  # a LoRA checkpoint holds the adapters only
    weights = {"checkpoint": lambda m: load_model_weights(m, path),
               "state_dict": lambda m: load_file(str(Path(path) / "model.safetensors"))}.get(kind)
    if kind == "adapter":  # a LoRA folder: its base (by content) with the adapter merged, in memory
        try:
            model = load_merged(path, mc.trust_remote_code, roots=(cfg.artifacts_path,))
        except (ValueError, RuntimeError) as e:  # base.json unreadable, its base nowhere
            raise EvaluationError(f"eval.model: {path}: {e}") from None
    else:
        try:
            model = build_configured_model(cfg, path if kind == "hf" else base_model, seed=cfg.runner.seed,
                                           lora=lora, weights=weights, where=path)
        except WeightsLoadError as e:  # a checkpoint's own errors (CheckpointError) pass through: one line
            raise EvaluationError(f"eval.model: {e} (actor.model builds that model)") from None
    if lora:
        model = model.merge_and_unload()
    is_hf = isinstance(model, PreTrainedModel)
    model.to(device)
    if is_hf and choose_precision(cfg.eval.precision, device, base_model, "eval.precision") == "bf16":
        model.to(torch.bfloat16)
    model.eval()
    tok = None
    if is_hf:
        tok = AutoTokenizer.from_pretrained(path if kind in ("hf", "adapter") else base_model,
                                            trust_remote_code=mc.trust_remote_code)
    return model, tok


# --------------------------------------------------------------------------- scoring


def overrides_eval_output(worker_cls) -> bool:
    return worker_cls.get_eval_model_output is not SFTWorker.get_eval_model_output


def worker_scores(worker_cls, spec: EvalSpec, cfg: SFTConfig, model, device, rank: int, world: int,
                  set_name: str = "val") -> dict | None:
    """The worker's own accuracy: sums of get_eval_model_output over its eval dataset; None without `total`."""
    w = worker_cls.for_eval(WorkerSpec(config=spec.config, model_path=spec.base_model, out_dir=spec.out_dir),
                            model, device, rank, world)
    ds = w.build_dataloader(str(set_dir(spec.prepare_dir, set_name, bool(spec.config.eval.sets))), eval_dataset=True)
    kept = sample_indices(len(ds), cfg.eval.max_samples)  # the rows eval_samples scores
    mine = [kept[i] for i in rank_slice(len(kept), rank, world)]
    bs = cfg.eval.batch_size
    sums: dict[str, float] = {}
    with torch.no_grad():
        for i in range(0, len(mine), bs):
            w.add_eval_output(sums, w.get_eval_model_output(w.collate([ds[j] for j in mine[i:i + bs]])))
    total = add_up(gather(sums))
    if total.get("total", 0) <= 0:
        return None
    metrics = {**counted(total["correct"], total["total"]), "mode": "worker"}
    if total.get("n_tokens", 0) > 0:
        metrics.update(loss_metrics({"loss_sum": total.get("loss_sum", 0.0), "tokens": total["n_tokens"],
                                     "token_correct": total.get("token_correct", 0.0)}))
        if "token_correct" not in total:
            del metrics["token_accuracy"]
    if total.get("reply_total", 0) > 0:  # the default worker's count of rows whose replies are its greedy ones
        metrics["reply_accuracy"] = total["reply_correct"] / total["reply_total"]
    metrics.update({k: v for k, v in total.items()
                    if k not in ("correct", "total", "loss_sum", "n_tokens", "token_correct", "reply_correct",
                                 "reply_total")})
    return metrics


def generation_scores(cfg: SFTConfig, model, tok, rows: list[dict], rank: int, world: int,
                      set_name: str = "val") -> tuple[dict, list[dict]]:
    """Greedy generation on this rank's slice, scored per sample by the set's scorer; gathered and summed."""
    e = cfg.eval
    scorer = get_scorer(e.scorer_of(set_name), e.answer_pattern, e.numeric_tolerance)
    r = rank_slice(len(rows), rank, world)
    mine = rows[r.start:r.stop]
    preds = generate(model, tok, [s["prompt"] for s in mine], e.max_new_tokens, e.batch_size)
    records = [{**({"set": set_name} if e.sets else {}), "source": s["source"], "prompt": s["prompt"],
                "reference": s["reference"], "prediction": p["text"],
                "correct": bool(scorer(p["text"], s["reference"])), "new_tokens": p["new_tokens"]}
               for s, p in zip(mine, preds)]
    sums = teacher_forced_sums(model, mine, pad_token_id(tok), e.batch_size)
    sums.update(correct=sum(x["correct"] for x in records), total=len(records),
                new_tokens=sum(x["new_tokens"] for x in records))
    parts = gather({"records": records, "sums": sums})
    records = [x for part in parts for x in part["records"]]  # rank order = the original order
    total = add_up([part["sums"] for part in parts])
    metrics = {**counted(total["correct"], total["total"]), **loss_metrics(total),
               "mean_generated_tokens": total["new_tokens"] / max(total["total"], 1), "mode": "generate"}
    return metrics, records


def harness_scores(cfg: SFTConfig, model, tok, rank: int, world: int, set_name: str) -> tuple[dict, list[dict]]:
    """A `mode: harness` set: lm-eval runs its task on this model (stages/inference/harness.py), on rank 0
    (the task is small next to a training; lm-eval's own data parallelism needs its own launcher); every
    rank gets the result."""
    from transformers import PreTrainedModel
    result = None
    if rank == 0:
        if tok is None or not isinstance(model, PreTrainedModel):
            raise EvaluationError(f"evaluate: eval set '{set_name}' is mode: harness, which scores Hugging Face "
                                  f"causal LMs; {type(model).__name__} is not one")
        try:
            result = score_task(model, tok, cfg.eval.sets[set_name], set_name, cfg.eval.batch_size)
        except ValueError as e:
            raise EvaluationError(f"evaluate: {e}") from None
    return gather(result)[0]


def score(cfg: SFTConfig, spec: EvalSpec, worker_cls, model, tok, rows, device, rank, world,
          set_name: str = "val") -> tuple[dict, list[dict]]:
    s = cfg.eval.sets.get(set_name)
    if s is not None and s.is_harness:  # before the worker: lm-eval scores the model itself
        return harness_scores(cfg, model, tok, rank, world, set_name)
    if overrides_eval_output(worker_cls):
        metrics = worker_scores(worker_cls, spec, cfg, model, device, rank, world, set_name)
        if metrics is not None:
            return metrics, []
    if tok is None or not getattr(tok, "chat_template", None):
        raise EvaluationError(
            f"evaluate: {type(model).__name__} is not a Hugging Face causal LM with a chat template, and actor.worker "
            f"({cfg.actor.worker or 'SFTWorker'}) has no get_eval_model_output returning 'correct' and 'total'")
    if s is not None and s.mode == "choice":
        return multiple_choice_scores(cfg, model, tok, rows, rank, world, set_name)
    return generation_scores(cfg, model, tok, rows, rank, world, set_name)


def multiple_choice_scores(cfg: SFTConfig, model, tok, rows: list[dict], rank: int, world: int,
                           set_name: str) -> tuple[dict, list[dict]]:
    """A `mode: choice` set: the option with the highest log-likelihood is the pick (choice.py), plus the
    teacher-forced loss on the right option, summed over ranks like generation's."""
    missing = next((r["source"] for r in rows if "choices" not in r), None)
    if missing is not None:
        raise EvaluationError(f"evaluate: eval set '{set_name}' is mode: choice, but {missing} has no choices "
                              "(its rows must be {\"question\", \"choices\", \"answer\"}); rebuild it with "
                              "`sftflow stage prepare --force -c <config>`")
    try:
        metrics, records = choice_scores(model, tok, rows, rank, world, cfg.eval.batch_size,
                                         cfg.eval.sets[set_name].choice_rule, set_name)
    except ValueError as e:
        raise EvaluationError(f"evaluate: eval set '{set_name}': {e}") from None
    r = rank_slice(len(rows), rank, world)
    total = add_up(gather(teacher_forced_sums(model, rows[r.start:r.stop], pad_token_id(tok), cfg.eval.batch_size)))
    return {**metrics, **loss_metrics(total)}, records


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def evaluate_spec(spec: EvalSpec) -> dict:
    """Scores every model in `spec.models` ("model", then "base"); rank 0 writes the files."""
    cfg = spec.config
    rank, world = rank_and_world()
    device = local_device(shared=True)
    try:
        worker_cls = load_worker_class(cfg.actor.worker)  # also registers its model types
    except ConfigError as e:
        raise EvaluationError(str(e)) from None
    sets = cfg.eval.set_names
    named = bool(cfg.eval.sets)
    rows = {s: eval_samples(spec.prepare_dir, cfg.eval.max_samples, s, named) if s in prepared_sets(cfg) else []
            for s in sets}
    out = Path(spec.out_dir)
    per_set: dict[str, dict] = {s: {} for s in sets}
    log(f"evaluate: precision {precision_why(cfg.eval.precision, device, 'eval.precision', spec.base_model)}")
    for name, ref in spec.models.items():
        model, tok = load_model(cfg, ref, spec.base_model, device)
        # what each number was computed in, as the weights are: paired comparisons refuse a mix (core/stats/paired.py)
        computed_in = "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"
        records: list[dict] = []
        for s in sets:
            m, recs = score(cfg, spec, worker_cls, model, tok, rows[s], device, rank, world, s)
            m["precision"] = computed_in
            records += [{**r, "precision": computed_in} for r in recs]
            where = "" if s == "val" else f" on '{s}'"
            log(f"evaluate {name} ({ref['kind']} {ref.get('source', ref['path'])}){where}: "
                f"accuracy {m['accuracy']:.4f} "
                f"({m['correct']}/{m['total']}) on {world} process(es)")
            per_set[s].update(m if name == "model" else {f"{name}_{k}": m[k] for k in BASE_KEYS if k in m})
        if rank == 0:
            _write_jsonl(out / ("predictions.jsonl" if name == "model" else f"{name}_predictions.jsonl"), records)
        del model
    metrics = by_set(per_set, sets[0])  # the primary set ranks models
    if rank == 0:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def main(spec_path: str) -> None:
    """One rank's share of the work for the `spec.json` torchrun was given."""
    spec = EvalSpec.model_validate_json(Path(spec_path).read_text())
    # Only Python objects travel between ranks (records and sums), so gloo serves CPU and GPU runs alike.
    dist.init_process_group("gloo")
    try:
        evaluate_spec(spec)
        dist.barrier()
    finally:
        dist.destroy_process_group()
