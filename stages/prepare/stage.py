"""prepare: chat data -> tokenized, masked Arrow shards.

Data path: sources (files, `datasets` folders, hub names) are read as raw records in the main
process, in order, `CHUNK_RECORDS` at a time; each chunk is parsed, converted to
conversations, rendered through the chat template, masked and tokenized in-process or by one
of `data.num_proc - 1` spawned workers; results come back in submission order and stream
into shard writers. Memory stays bounded by the chunks in flight plus one Arrow batch per
split, and the output is identical for any `num_proc`.

Output folder:
    train/shard-*.arrow, val/shard-*.arrow   prepared rows (see stages/chatdata/shards.py); val only when
                                             data.val_data_paths or data.val_fraction asks for it
    eval/<set>/shard-*.arrow                 each named eval set (eval.sets), rows as in val
    quarantine.jsonl                         every row not kept: file, line, split, reason, detail, raw
    preview.txt                              the first samples, trainable spans in [[...]]
    manifest.json                            sources, counts by split and reason, tokens, trainable tokens
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from stages.chatdata.readers import file_format, iter_records
from stages.chatdata.shards import ShardWriter, read_shards
from stages.core.artifacts import StageBuild, is_complete, read_manifest
from stages.runtime.mixture import epoch_samples
from stages.core.config import SFTConfig, eval_split, mix_split
from stages.core.errors import DataError, StageError

from .rows import Options, ordered_results

PREVIEW_SAMPLES = 3
CHUNK_RECORDS = 256


def load_tokenizer(model_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if not tok.is_fast:
        raise StageError(f"{model_path}: sftflow needs a fast tokenizer (character offsets) for assistant masks")
    if not tok.chat_template:
        raise StageError(f"{model_path}: tokenizer has no chat_template; set one in tokenizer_config.json")
    return tok


# --------------------------------------------------------------------------- sources and the stage


@dataclass(frozen=True)
class Source:
    ref: str      # a file or folder path, or hf:NAME
    split: str    # train | val | auto (held-out by content hash) | eval/<set>
    format: str
    mix: str = "train"  # the mixture source its train rows belong to (data.mix)
    columns: dict | None = None  # its own data.columns (a mixture source's), else data.columns


PARTS = ("train", "eval")  # prepare: what trains (train, val); prepare_eval: the named eval sets


def splits_of(cfg: SFTConfig, part: str = "train") -> list[str]:
    """The splits a part writes: train, and val when asked for; or one per named eval set."""
    d = cfg.data
    if part == "eval":
        return [eval_split(name) for name, s in cfg.eval.sets.items() if not s.is_harness]  # harness: lm-eval's data
    return ["train", *(["val"] if d.val_data_paths or d.val_fraction > 0 else [])]


def mix_order(cfg: SFTConfig) -> list[str]:
    """The mixture's sources in the order their rows follow each other in the train split."""
    return ["train", *(n for n in cfg.data.mix if n != "train")]


def plan_sources(cfg: SFTConfig, part: str = "train", replay_file: str | None = None) -> list[Source]:
    """Every file a part reads, in the order its rows are written: the train files (and val), then each
    mixture source's (the replay stage's answers for `replay`); or the eval sets' files."""
    d = cfg.data
    inputs = cfg.inputs()
    out: list[Source] = []

    def add(paths, split: str, fmt: str, mix: str = "train", columns: dict | None = None, kind: str = "train") -> None:
        for p in paths:
            out.append(Source(str(p), split, file_format(p, fmt, columns if columns is not None else d.columns, kind),
                              mix, columns))

    if part == "eval":
        for name, s in cfg.eval.sets.items():  # a choice set's rows are question/choices/answer
            if s.is_harness:  # an lm-eval task reads its own documents when it is scored
                continue
            add(inputs[eval_split(name)], eval_split(name), "choice" if s.mode == "choice" else d.format, kind="val")
        return out
    add(inputs["train"], "auto" if not d.val_data_paths and d.val_fraction > 0 else "train", d.format)
    add(inputs["val"], "val", d.format, kind="val")
    for name in mix_order(cfg)[1:]:
        m = d.mix[name]
        if name == "replay":
            if replay_file is None:
                raise StageError("prepare: data.mix.replay needs the replay stage's answers; run the replay stage")
            add([replay_file], "train", "messages", name)
        else:
            add(inputs[mix_split(name)], "train", m.format or d.format, name, m.columns)
    return out


def _chunks(sources: list[Source]) -> Iterator[list]:
    buf: list = []
    for src in sources:
        for n, rec in iter_records(src.ref if src.ref.startswith("hf:") else Path(src.ref),
                                   "train" if src.split in ("train", "auto") else "val"):
            buf.append((src.split, src.format, src.ref, n, rec))
            if len(buf) >= CHUNK_RECORDS:
                yield buf
                buf = []
    if buf:
        yield buf


def segments(tokenizer, ids, mask) -> list[tuple[str, bool]]:
    """Decoded runs of one sample: (text, trainable)."""
    out, run, cur = [], [], None
    for tid, m in zip(list(ids), list(mask)):
        m = bool(m)
        if m != cur and run:
            out.append((tokenizer.decode(run), cur))
            run = []
        cur = m
        run.append(int(tid))
    if run:
        out.append((tokenizer.decode(run), cur))
    return out


def render_preview(tokenizer, ids, mask) -> str:
    """Decoded sample with trainable runs wrapped in [[ ]]."""
    return "".join(f"[[{text}]]" if on else text for text, on in segments(tokenizer, ids, mask))


@dataclass
class SplitStats:
    rows_read: int = 0
    rows_kept: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict:
        return {**{k: v for k, v in self.__dict__.items() if k != "dropped"},
                "dropped": dict(sorted(self.dropped.items()))}


def run_prepare(cfg: SFTConfig, fp: str, model_path: str, part: str = "train", replay_file: str | None = None,
                stage: str = "prepare") -> dict:
    """Writes the folder of `part` (prepare: "train", prepare_eval: "eval") for fingerprint `fp`; returns
    its manifest metrics. `replay_file`: the replay stage's conversations (data.mix.replay)."""
    d = cfg.data
    tokenizer = load_tokenizer(model_path, cfg.actor.model.trust_remote_code)
    sources = plan_sources(cfg, part, replay_file)  # format detection fails here, before any output exists
    build = StageBuild(cfg.artifacts_path, stage, fp)
    writers = {s: ShardWriter(build.partial / s, d.shard_rows) for s in splits_of(cfg, part)}
    stats = {s: SplitStats() for s in writers}
    mixed = Counter()  # kept train rows per mixture source
    mix_of = {s.ref: s.mix for s in sources}
    preview: list[str] = []
    opts = replace(Options.from_config(cfg), file_columns={s.ref: s.columns for s in sources if s.columns is not None})
    with open(build.partial / "quarantine.jsonl", "w", encoding="utf-8") as quarantine:
        for items in ordered_results(_chunks(sources), opts, d.num_proc, tokenizer):
            for it in items:
                st = stats[it.split]
                st.rows_read += it.first
                if it.reason is not None:
                    if d.strict:
                        raise DataError(f"{it.source}: {it.reason}" + (f": {it.detail}" if it.detail else "")
                                         + " (data.strict=true; set it to false to quarantine bad rows instead)")
                    st.dropped[it.reason] += 1
                    quarantine.write(json.dumps({"file": it.file, "line": it.line, "index": it.index,
                                                 "source": it.source, "split": it.split, "reason": it.reason,
                                                 "detail": it.detail, "raw": it.raw}, ensure_ascii=False) + "\n")
                    continue
                writers[it.split].add({"input_ids": it.ids, "loss_mask": it.mask, "source": it.source,
                                       "messages": (json.dumps(it.messages, ensure_ascii=False) if it.messages
                                                    else None)})
                st.rows_kept += 1
                st.tokens += len(it.ids)
                st.trainable_tokens += int(it.mask.sum())
                st.truncated += it.truncated
                if it.split == "train":
                    mixed[mix_of[it.file]] += 1
                    if len(preview) < PREVIEW_SAMPLES:
                        preview.append(f"--- {it.source}\n{render_preview(tokenizer, it.ids, it.mask)}\n")
    shards = {s: w.close() for s, w in writers.items()}
    (build.partial / "preview.txt").write_text("".join(preview), encoding="utf-8")
    for split, st in stats.items():
        if st.rows_kept == 0:
            raise StageError(f"{stage}: no usable rows in the {split} split; see {build.partial / 'quarantine.jsonl'} "
                             f"(dropped: {dict(st.dropped)})")
    mix = [{"source": n, "rows": mixed[n]} for n in mix_order(cfg)] if d.mix and part == "train" else []
    empty = [m["source"] for m in mix if m["rows"] == 0]
    if empty:
        raise StageError(f"{stage}: data.mix.{empty[0]} has no usable rows; see {build.partial / 'quarantine.jsonl'}")
    splits = {s: {**st.to_dict(), "shards": shards[s]} for s, st in stats.items()}
    metrics = {f"{s}_{k}": v for s, st in splits.items() for k, v in st.items()
               if isinstance(v, int) and s in ("train", "val")}  # named eval sets: in `splits`
    metrics.update({f"mix_{m['source']}_rows": m["rows"] for m in mix})
    if part == "eval":  # every named set's rows (each set's counts: in `splits`)
        metrics.update(rows_kept=sum(st.rows_kept for st in stats.values()),
                       rows_dropped=sum(sum(st.dropped.values()) for st in stats.values()))
    build.commit({"metrics": metrics, "splits": splits, "model_path": model_path, "mix": mix,
                  "sources": [{k: v for k, v in s.__dict__.items() if k != "columns"} for s in sources],
                  "inputs": {s: [x.ref for x in sources
                                 if x.split == s or (x.split == "auto" and s in ("train", "val"))]
                             for s in splits}})
    return metrics


def preview_samples(cfg: SFTConfig, prepare_dir: Path | None, model_path: str, n: int,
                    replay_file: str | None = None) -> list[tuple[str, list[tuple[str, bool]]]]:
    """(source, segments) of n training samples: from the prepared shards when they exist (with a
    mixture: the first n of epoch 0, in the order training takes them), else prepared on the fly from
    the first records of each source (nothing is written). With a mixture, `source` starts with the
    mixture source's name (`replay: .../conversations.jsonl:7`)."""
    tokenizer = load_tokenizer(model_path, cfg.actor.model.trust_remote_code)
    if prepare_dir is not None and is_complete(prepare_dir):
        table = read_shards(Path(prepare_dir) / "train", ["input_ids", "loss_mask", "source"])
        mix = read_manifest(Path(prepare_dir)).get("mix") or []
        if not mix:
            return [(r["source"], segments(tokenizer, r["input_ids"], r["loss_mask"]))
                    for r in table.slice(0, n).to_pylist()]
        sizes = [m["rows"] for m in mix]
        order = epoch_samples(cfg.runner.seed, 0, [cfg.data.mix[m["source"]].weight for m in mix], sizes)[:n]
        starts = np.cumsum([0, *sizes])
        rows = table.take(order).to_pylist()
        names = [mix[int(np.searchsorted(starts, i, side="right")) - 1]["source"] for i in order]
        return [(f"{name}: {r['source']}", segments(tokenizer, r["input_ids"], r["loss_mask"]))
                for name, r in zip(names, rows)]
    sources = plan_sources(cfg, "train", replay_file)
    mix_of = {s.ref: s.mix for s in sources}
    per_source = -(-n // max(len({s.mix for s in sources}), 1))  # the first rows of every source
    taken: Counter = Counter()
    out: list = []
    for items in ordered_results(_chunks(sources), Options.from_config(cfg), 1, tokenizer):
        for it in items:
            name = mix_of[it.file]
            if it.reason is None and it.split == "train" and taken[name] < per_source:
                taken[name] += 1
                out.append((f"{name}: {it.source}" if cfg.data.mix else it.source,
                            segments(tokenizer, it.ids, it.mask)))
                if len(out) >= n:
                    return out
    return out
