"""prepare: chat files -> tokenized, masked Arrow shards.

Output folder:
    train/shard-*.arrow, val/shard-*.arrow   prepared rows (see shards.py)
    quarantine.jsonl                         every row not kept: {"source", "split", "reason", "detail"}
    preview.txt                              the first samples, trainable spans in [[...]]
    manifest.json                            counts by split and reason, tokens, trainable tokens
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from stages.artifacts import StageBuild
from stages.config import SFTConfig, expand_paths
from stages.errors import StageError

from .masking import Tokenized, tokenize_conversation
from .readers import RowError, iter_conversations
from .shards import ShardWriter

PREVIEW_SAMPLES = 3


def load_tokenizer(model_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if not tok.is_fast:
        raise StageError(f"{model_path}: sftflow needs a fast tokenizer (character offsets) for assistant masks")
    if not tok.chat_template:
        raise StageError(f"{model_path}: tokenizer has no chat_template; set one in tokenizer_config.json")
    return tok


def render_preview(tokenizer, t: Tokenized) -> str:
    """Decoded sample with trainable runs wrapped in [[ ]]."""
    out, run, cur = [], [], None
    for tid, m in zip(t.input_ids, t.loss_mask):
        if m != cur and run:
            text = tokenizer.decode(run)
            out.append(f"[[{text}]]" if cur else text)
            run = []
        cur = m
        run.append(tid)
    if run:
        text = tokenizer.decode(run)
        out.append(f"[[{text}]]" if cur else text)
    return "".join(out)


def prepare_split(tokenizer, files: list[Path], split: str, folder: Path, cfg: SFTConfig,
                  quarantine, preview: list[str]) -> dict:
    writer = ShardWriter(folder / split)
    stats: dict = {"rows_read": 0, "rows_kept": 0, "dropped": Counter(), "tokens": 0, "trainable_tokens": 0}
    for source, conv in iter_conversations(files, cfg.data.format):
        stats["rows_read"] += 1
        try:
            if isinstance(conv, RowError):
                raise conv
            t = tokenize_conversation(tokenizer, conv, cfg.data.max_length)
        except RowError as e:
            stats["dropped"][e.reason] += 1
            quarantine.write(json.dumps({"source": source, "split": split, "reason": e.reason, "detail": e.detail},
                                        ensure_ascii=False) + "\n")
            continue
        writer.add({"input_ids": t.input_ids, "loss_mask": t.loss_mask, "length": len(t.input_ids), "source": source,
                    "messages": json.dumps(conv, ensure_ascii=False) if split == "val" else None})
        stats["rows_kept"] += 1
        stats["tokens"] += len(t.input_ids)
        stats["trainable_tokens"] += t.trainable
        if split == "train" and len(preview) < PREVIEW_SAMPLES:
            preview.append(f"--- {source}\n{render_preview(tokenizer, t)}\n")
    stats["shards"] = writer.close()
    stats["dropped"] = dict(stats["dropped"])
    return stats


def run_prepare(cfg: SFTConfig, fp: str, model_path: str) -> dict:
    """Writes the prepare folder for fingerprint `fp`; returns its manifest metrics."""
    build = StageBuild(cfg.artifacts_path, "prepare", fp)
    tokenizer = load_tokenizer(model_path, cfg.actor.model.trust_remote_code)
    files = {"train": expand_paths(cfg.data.train_data_paths, "data.train_data_paths"),
             "val": expand_paths(cfg.data.val_data_paths, "data.val_data_paths")}
    preview: list[str] = []
    with open(build.partial / "quarantine.jsonl", "w", encoding="utf-8") as quarantine:
        splits = {s: prepare_split(tokenizer, f, s, build.partial, cfg, quarantine, preview) for s, f in files.items()}
    (build.partial / "preview.txt").write_text("".join(preview), encoding="utf-8")
    for split, st in splits.items():
        if st["rows_kept"] == 0:
            raise StageError(f"prepare: no usable rows in the {split} split; see {build.partial / 'quarantine.jsonl'} "
                             f"(dropped: {st['dropped']})")
    metrics = {f"{s}_{k}": v for s, st in splits.items() for k, v in st.items() if isinstance(v, int)}
    build.commit({"metrics": metrics, "splits": splits, "model_path": model_path,
                  "inputs": {s: [str(p) for p in f] for s, f in files.items()}})
    return metrics
