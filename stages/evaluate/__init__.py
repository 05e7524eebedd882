"""evaluate: held-out prompts -> accuracy, loss and per-sample predictions.

For every val conversation, the prompt is the turns before its final assistant reply and
the reference is that reply. Accuracy = correct / total over every sample (no batch
averaging, nothing dropped). The untrained base model is scored the same way
(`base_accuracy`) so the report shows base -> tuned.

Output folder: metrics.json, predictions.jsonl, base_predictions.jsonl, manifest.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from stages.artifacts import StageBuild, canonical_json, sha256_text
from stages.config import SFTConfig
from stages.prepare.masking import prompt_and_reference
from stages.prepare.shards import read_shards

from .generate import generate, load, teacher_forced_loss
from .scorers import SCORERS


def eval_samples(prepare_dir: str, max_samples: int = 0) -> list[dict]:
    table = read_shards(Path(prepare_dir) / "val", ["input_ids", "loss_mask", "source", "messages"])
    rows = table.to_pylist()
    rows = rows[:max_samples] if max_samples > 0 else rows
    for r in rows:
        r["prompt"], r["reference"] = prompt_and_reference(json.loads(r["messages"]))
    return rows


def score_model(model_dir: str, rows: list[dict], cfg: SFTConfig) -> tuple[dict, list[dict]]:
    model, tok = load(model_dir, cfg.actor.model.trust_remote_code)
    preds = generate(model, tok, [r["prompt"] for r in rows], cfg.eval.max_new_tokens, cfg.eval.batch_size)
    scorer = SCORERS["exact"]
    records = []
    for r, p in zip(rows, preds):
        records.append({"source": r["source"], "prompt": r["prompt"], "reference": r["reference"],
                        "prediction": p["text"], "correct": bool(scorer(p["text"], r["reference"])),
                        "new_tokens": p["new_tokens"]})
    correct = sum(r["correct"] for r in records)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    metrics = {"accuracy": correct / len(records) if records else 0.0, "correct": correct, "total": len(records),
               "mean_generated_tokens": sum(r["new_tokens"] for r in records) / max(len(records), 1),
               **teacher_forced_loss(model, rows, pad_id, cfg.eval.batch_size)}
    return metrics, records


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def run_evaluate(cfg: SFTConfig, fp: str, base_model: str, model_dir: str, prepare_dir: str) -> dict:
    build = StageBuild(cfg.artifacts_path, "evaluate", fp)
    rows = eval_samples(prepare_dir, cfg.eval.max_samples)
    metrics, records = score_model(model_dir, rows, cfg)
    _write_jsonl(build.partial / "predictions.jsonl", records)
    if cfg.eval.eval_base:
        base, base_records = score_model(base_model, rows, cfg)
        _write_jsonl(build.partial / "base_predictions.jsonl", base_records)
        metrics.update({f"base_{k}": v for k, v in base.items() if k in ("accuracy", "correct", "eval_loss")})
    (build.partial / "metrics.json").write_text(json.dumps(metrics, indent=2))
    # Identifies *what* was asked, independent of tokenizer and model: accuracies are comparable iff equal.
    eval_set = sha256_text(canonical_json([[r["prompt"], r["reference"]] for r in rows]))[:16]
    build.commit({"metrics": metrics, "eval_set_fingerprint": eval_set, "model_dir": model_dir, "base_model": base_model, "prepare_dir": prepare_dir})
    return metrics
