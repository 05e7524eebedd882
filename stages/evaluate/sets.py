"""The eval sets a stage scores, as data (torch-free): where each set's prepared rows live, which of
them `eval.max_samples` keeps, what they ask (the set fingerprint), and the spec the scoring
processes are given. docs/evaluation.md describes the sets."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from stages.chatdata.readers import choices_of, prompt_and_reference
from stages.chatdata.shards import read_shards
from stages.core.cache.artifacts import canonical_json, sha256_text
from stages.core.config import SFTConfig, eval_split

BASE_KEYS = ("accuracy", "correct", "total", "eval_loss")  # what a reference contributes as `base_<key>`


def set_dir(prepare_dir: str | Path, name: str, named: bool) -> Path:
    """Where eval set `name` was prepared: with named sets (`eval.sets`, `named`), prepare_eval's
    `eval/<name>` for every name, `val` included; without them, the prepare stage's val split."""
    return Path(prepare_dir) / (eval_split(name) if named else "val")


def sample_indices(n: int, max_samples: int) -> list[int]:
    """Which of a set's `n` rows `eval.max_samples` keeps: all of them, or that many spread evenly
    over the whole set in file order (the first N rows are often all one kind of prompt)."""
    if max_samples <= 0 or max_samples >= n:
        return list(range(n))
    return [i * n // max_samples for i in range(max_samples)]


def eval_samples(prepare_dir: str, max_samples: int = 0, set_name: str = "val", named: bool = False) -> list[dict]:
    table = read_shards(set_dir(prepare_dir, set_name, named), ["input_ids", "loss_mask", "source", "messages"])
    rows = table.take(sample_indices(table.num_rows, max_samples)).to_pylist()
    for r in rows:
        messages = json.loads(r["messages"])
        r["prompt"], r["reference"] = prompt_and_reference(messages)
        choice = choices_of(messages)
        if choice is not None:
            r["choices"], r["answer"] = choice
    return rows


def prepared_sets(cfg: SFTConfig) -> list[str]:
    """The sets scored from prepared rows, in report order: every set but the harness sets (whose
    lm-eval task holds its own documents, stages/inference/harness.py)."""
    return [n for n in cfg.eval.set_names if n not in cfg.eval.sets or not cfg.eval.sets[n].is_harness]


def eval_set_fingerprint(rows: list[dict]) -> str:
    """Identifies *what* was asked, independent of tokenizer and model: accuracies are comparable iff equal."""
    return sha256_text(canonical_json([[r["prompt"], r["reference"]] for r in rows]))[:16]


def set_fingerprint(cfg: SFTConfig, prepare_dir: str, name: str, numbers: dict, records: list[dict]) -> str:
    """What a scored set asked, as a stage's manifest records it (`eval_sets`): a prepared set's prompts and
    references (`eval_set_fingerprint`), with the worker when the worker's own counts scored it (its data, not
    comparable to prompt scoring); a harness set's scored documents and targets (`records`) and how they were
    put."""
    s = cfg.eval.sets.get(name)
    if s is not None and s.is_harness:
        return sha256_text(canonical_json([eval_set_fingerprint(records), s.task, s.num_fewshot,
                                           s.uses_chat_template]))[:16]
    fp = eval_set_fingerprint(eval_samples(prepare_dir, cfg.eval.max_samples, name, bool(cfg.eval.sets)))
    return sha256_text(f"{fp}:{cfg.actor.worker}")[:16] if numbers.get("mode") == "worker" else fp


class EvalSpec(BaseModel):
    """What the evaluation processes are given (`spec.json`): models are `resolve_eval_model` results."""

    model_config = ConfigDict(extra="forbid")

    config: SFTConfig
    prepare_dir: str
    out_dir: str
    base_model: str
    models: dict[str, dict]
