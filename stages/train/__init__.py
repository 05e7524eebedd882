"""train: prepared shards + base model -> fine-tuned Hugging Face model folder.

Output folder:
    model/               the exported Hugging Face model (safetensors, tokenizer, chat template)
    adapter/             LoRA (a model with a tokenizer: instead of model/): the adapter in peft's format,
                         the tokenizer, generation config and `base.json`, the base it belongs to by content
                         digest, stored once under artifacts/bases/ (stages/core/cache/bases.py)
    checkpoints/step_*/  DCP checkpoints (resume)
    metrics.jsonl        one row per optimizer step
    train.log            torchrun's output
    runtime.json         what the workers resolved `auto` to (attention kernel, precision, device), also
                         in the manifest's `runtime` and the MLflow params `runtime.*`; with early stopping
                         or best-checkpoint selection also the step that shipped and why (`shipped_step`;
                         with runner.best_model_guard the start's values and each check's verdict)
    spec.json            exactly what the workers were given (`WorkerSpec`)

The stage opens the model's MLflow run before torchrun starts, so rank 0 logs into it live
(stages/tracking), and marks it FINISHED / FAILED / KILLED with the stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from stages.chatdata.shards import count_rows
from stages.core.cache import bases
from stages.core.cache.artifacts import StageBuild, file_digest, partial_dir, read_manifest
from stages.core.config import SFTConfig
from stages.core.errors import ConfigError, StageError
from stages.launch.ahead import Ahead
from stages.launch.launcher import run_torchrun, start_ahead, torchrun_command
from stages.core.chat import model_card
from stages.core.nf4 import quantize_record
from stages.runtime.mixture import describe, new_data_epoch
from stages.runtime.reporting import RUNTIME_FILE
from stages.runtime.worker import WorkerSpec
from stages.tracking.live import read_metrics_file
from stages.tracking.run import Lineage, log_runtime_params, training_run


# What a rank imports before its first step (4-5 s on 2 cores): a rank started ahead of the stage
# (launch/ahead.py) imports these while the stages before train run.
WARM_MODULES = ("torch", "torch.distributed.checkpoint", "stages.runtime.distributed", "stages.runtime.worker",
                "stages.runtime.saving.checkpoint", "transformers.models.auto.tokenization_auto",
                "transformers.models.auto.modeling_auto")


SPEC, RANK_MODULE = "spec.json", "stages.train"  # the ranks run `-m stages.train <partial>/spec.json`


def warm_modules(model_type: str | None) -> list[str]:
    """`WARM_MODULES`, and the model's own modeling module when its Hugging Face `model_type` is known."""
    if not (model_type and model_type.isidentifier()):
        return list(WARM_MODULES)
    return [*WARM_MODULES, f"transformers.models.{model_type}.modeling_{model_type}"]


def start_rank_ahead(cfg: SFTConfig, fp: str, model_type: str | None) -> Ahead | None:
    """The one-process rank of the training with fingerprint `fp`, started before the stage runs
    (launch/ahead.py); None when it trains on more processes."""
    return start_ahead(cfg, partial_dir(cfg.artifacts_path, "train", fp) / SPEC, RANK_MODULE, warm_modules(model_type))


def check_guarded_sources(cfg: SFTConfig, val_mix: list[dict]) -> None:
    """Before torchrun: a per-source metric the runner watches needs held-out rows of that source."""
    r = cfg.runner
    if not (r.early_stopping_patience or r.load_best_model_at_end):
        return
    held = {m["source"]: m["rows"] for m in val_mix}
    for key, what in [(r.metric_for_best_model, "runner.metric_for_best_model"),
                      *((g.key, "runner.best_model_guard") for g in r.best_model_guard)]:
        source = key.partition("/")[2]
        if source and not held.get(source):
            have = ", ".join(f"{s} {n}" for s, n in held.items()) or "no mixture"
            raise ConfigError(f"{what}: {key} needs held-out rows of the source '{source}'; held out: {have} "
                              "(data.val_fraction holds out each mixture source's share; docs/data.md)")


def record_base(cfg: SFTConfig, model_path: str, adapter: Path) -> None:
    """`adapter/base.json`: the node the adapter belongs to (the base model, or a warm start's LoRA version
    as a chain), stored once under artifacts/bases/; `quantize`: QLoRA's record of how the base's weights
    were transformed before training (None without it)."""
    digest = bases.base_of_training(model_path, cfg.artifacts_path,
                                    lambda f: file_digest(f, cfg.artifacts_path))
    bases.write_ref(adapter, digest, quantize_record(cfg))


class TrainingFailed(StageError):
    """torchrun or a worker failed; the message names the first cause found in the log."""


def run_train(cfg: SFTConfig, fp: str, model_path: str, prepare_dir: str, lineage: Lineage,
              on_line: Callable[[str], None] = print) -> dict:
    """`lineage`: fingerprints, upstream folders and tags for the MLflow run (see tracking.run).
    The worker class and model type were checked when the run was planned (`pipeline.check_code`)."""
    if not cfg.actor.worker:  # a custom worker reads data of its own (build_dataloader)
        try:
            count_rows(Path(prepare_dir) / "train", "training samples")
        except ValueError as e:
            raise TrainingFailed(f"train: {e}; rebuild them with `sftflow stage prepare --force -c <config>`") from None
    # keep_partial: an interrupted run's checkpoints are where runner.resume=auto continues from
    build = StageBuild(cfg.artifacts_path, "train", fp, keep_partial=True)
    val = Path(prepare_dir) / "val"  # absent when only named eval sets hold out data: no validation loss
    selecting = cfg.runner.early_stopping_patience or cfg.runner.load_best_model_at_end
    if selecting and not val.is_dir():  # before torchrun: the ranks would find out only after starting
        raise ConfigError("runner.early_stopping_patience and runner.load_best_model_at_end need a validation set: "
                          "data.val_data_paths or data.val_fraction")
    weights = cfg.mix_weights()
    prepared = read_manifest(Path(prepare_dir))
    mix = [{**m, "weight": weights[m["source"]]} for m in prepared.get("mix") or []]
    # each mixture source's held-out rows (prepare: val/ for train, heldout/<source>/ for the others)
    val_mix = [{"source": m["source"], "rows": m["rows"], "dir": str(Path(prepare_dir) / m["dir"])}
               for m in prepared.get("val_mix") or []] if val.is_dir() else []
    check_guarded_sources(cfg, val_mix)
    # the KL holds the earlier sources' rows only: train's (the new ones) come first in the split
    kl_from = mix[0]["rows"] if cfg.rehearsal_files and cfg.data.rehearsal.kl_on == "earlier" and mix else 0
    total = (new_data_epoch([m["weight"] for m in mix], [m["rows"] for m in mix], cfg.data.rehearsal.passes)
             if cfg.rehearsal_files else None)
    spec = WorkerSpec(config=cfg, model_path=model_path, out_dir=str(build.partial),
                      train_dir=str(Path(prepare_dir) / "train"), val_dir=str(val) if val.is_dir() else None, mix=mix,
                      epoch_samples=total or 0, kl_rows_from=kl_from, val_mix=val_mix)
    spec_path = spec.write(build.partial / SPEC)
    metrics_file = build.partial / "metrics.jsonl"
    topology = f"topology: {cfg.actor.topology}"
    with open(build.partial / "train.log", "a", encoding="utf-8") as log:
        log.write(topology + "\n")
    on_line(topology)
    with training_run(cfg, lineage, on_line, metrics_file) as env:
        mlflow_run_id = env.get("MLFLOW_RUN_ID") or None
        waited = run_torchrun(torchrun_command(cfg, spec_path, module=RANK_MODULE), build.partial / "train.log",
                              TrainingFailed, "training", on_line, cfg.actor.nproc_per_node, env)
        runtime_file = build.partial / RUNTIME_FILE
        runtime = json.loads(runtime_file.read_text()) if runtime_file.is_file() else {}
        if mlflow_run_id and runtime:
            log_runtime_params(cfg, mlflow_run_id, runtime, on_line)
        mixture = describe([m["source"] for m in mix], [m["weight"] for m in mix], [m["rows"] for m in mix], total)
        if mlflow_run_id and mixture:  # per source: rows, samples per epoch, passes
            log_runtime_params(cfg, mlflow_run_id, {f"{m['source']}.{k}": m[k] for m in mixture
                                                    for k in ("rows", "per_epoch", "passes")}, on_line, prefix="mix.")
    rows = read_metrics_file(metrics_file)
    shipped = "model" if (build.partial / "model").is_dir() else "adapter"
    if not (build.partial / shipped).is_dir():
        raise TrainingFailed(f"train: torchrun finished but exported no model in {build.partial / 'model'}")
    if shipped == "adapter":
        record_base(cfg, model_path, build.partial / "adapter")
    started = lineage.tags.get("sftflow.start", "base")
    (build.partial / shipped / model_card.CARD).write_text(model_card.render(
        cfg.registry.model_name, cfg.actor.model.model_path, {},
        "Trained from the base model." if started == "base" else f"Continued from `{started}`.",
        model_card.trained_on(cfg, prepare_dir, lineage.inputs), cfg.actor.lora.r > 0,
        quantized=quantize_record(cfg)), encoding="utf-8")
    last = rows[-1] if rows else {}
    vals = [r for r in rows if "val_loss" in r]
    metrics = {"steps": last.get("step", 0), "final_loss": last.get("loss"),
               "val_loss": vals[-1]["val_loss"] if vals else None,
               "first_loss": rows[0]["loss"] if rows else None,
               "mean_tokens_per_s": sum(r["tokens_per_s"] for r in rows) / len(rows) if rows else None}
    metrics.update({f"mix_{m['source']}_per_epoch": m["per_epoch"] for m in mixture})
    if "shipped_step" in runtime:  # early stopping or best-checkpoint selection: which step's weights model/ holds
        metrics.update({k: runtime[k] for k in ("shipped_step", "best_step", "best_metric", "stopped_at",
                                                "eligible_checks", "shipped_start") if k in runtime})
    build.commit({"metrics": metrics, "model_dir": str(build.final / shipped), "base_model": model_path,
                  "mixture": mixture, "topology": cfg.actor.topology,
                  "held_out": [{k: m[k] for k in ("source", "rows")} for m in val_mix],
                  "prepare_dir": prepare_dir, "mlflow_run_id": mlflow_run_id, "runtime": runtime}, waited=waited)
    return metrics
