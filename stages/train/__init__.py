"""train: prepared shards + base model -> fine-tuned Hugging Face model folder.

Output folder:
    model/               the exported Hugging Face model (safetensors, tokenizer, chat template)
    checkpoints/step_*/  DCP checkpoints (resume)
    metrics.jsonl        one row per optimizer step
    train.log            torchrun's output
    spec.json            exactly what the workers were given

With MLflow reachable, the metrics also reach the MLflow run live (see live.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from stages.artifacts import StageBuild
from stages.config import SFTConfig

from .launcher import check_worker_and_model_type, run_torchrun, torchrun_command


def read_metrics(folder: Path) -> list[dict]:
    path = Path(folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_train(cfg: SFTConfig, fp: str, model_path: str, prepare_dir: str, on_line: Callable[[str], None] = print,
              env: dict[str, str] | None = None) -> dict:
    """`env` goes to the workers: MLFLOW_RUN_ID (+ MLFLOW_TRACKING_URI) makes rank 0 log to that run live."""
    check_worker_and_model_type(cfg)
    # keep_partial: an interrupted run's checkpoints are where runner.resume=auto continues from
    build = StageBuild(cfg.artifacts_path, "train", fp, keep_partial=True)
    spec = {"config": cfg.model_dump(mode="json"), "model_path": model_path, "out_dir": str(build.partial),
            "train_dir": str(Path(prepare_dir) / "train"), "val_dir": str(Path(prepare_dir) / "val")}
    spec_path = build.partial / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    run_torchrun(torchrun_command(cfg, spec_path), build.partial / "train.log", on_line, cfg.actor.nproc_per_node, env)
    rows = read_metrics(build.partial)
    if not (build.partial / "model").is_dir():
        raise RuntimeError(f"train: torchrun finished but exported no model in {build.partial / 'model'}")
    last = rows[-1] if rows else {}
    vals = [r for r in rows if "val_loss" in r]
    metrics = {"steps": last.get("step", 0), "final_loss": last.get("loss"),
               "val_loss": vals[-1]["val_loss"] if vals else None,
               "first_loss": rows[0]["loss"] if rows else None,
               "mean_tokens_per_s": sum(r["tokens_per_s"] for r in rows) / len(rows) if rows else None}
    build.commit({"metrics": metrics, "model_dir": str(build.final / "model"), "base_model": model_path,
                  "prepare_dir": prepare_dir})
    return metrics
