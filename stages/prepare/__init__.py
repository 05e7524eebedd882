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

import hashlib
import json
import multiprocessing as mp
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from stages.chatdata.readers import RowError, file_format, iter_records, parse_record, row_content_key, to_conversations
from stages.chatdata.shards import ShardWriter, read_shards
from stages.core.artifacts import StageBuild, is_complete
from stages.core.config import SFTConfig, eval_split
from stages.core.errors import DataError, StageError

from .masking import Renderer, assistant_spans, encode_texts, finish, mask_from_encoding

PREVIEW_SAMPLES = 3
CHUNK_RECORDS = 256
RAW_LIMIT = 2000  # characters of a bad record kept in quarantine.jsonl


def load_tokenizer(model_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if not tok.is_fast:
        raise StageError(f"{model_path}: sftflow needs a fast tokenizer (character offsets) for assistant masks")
    if not tok.chat_template:
        raise StageError(f"{model_path}: tokenizer has no chat_template; set one in tokenizer_config.json")
    return tok


# --------------------------------------------------------------------------- the per-row work


@dataclass(frozen=True)
class Options:
    """What a tokenizing worker needs; picklable."""

    columns: dict[str, str]
    loss_on: str
    truncation: str
    max_length: int
    val_fraction: float

    @classmethod
    def from_config(cls, cfg: SFTConfig) -> "Options":
        d = cfg.data
        return cls(dict(d.columns), d.loss_on, d.truncation, d.max_length,
                   d.val_fraction if not d.val_data_paths else 0.0)


@dataclass
class Item:
    """One conversation's outcome (or one unreadable record's)."""

    split: str
    file: str
    line: int
    index: int | None          # k-th conversation of a multi-conversation record
    first: bool                # the first item of its record (counts the record once)
    ids: Any = None
    mask: Any = None
    messages: list[dict] | None = None
    reason: str | None = None
    detail: str = ""
    raw: str | None = None
    truncated: bool = False

    @property
    def source(self) -> str:
        return f"{self.file}:{self.line}" + (f"#{self.index}" if self.index is not None else "")


_WORKER: dict[str, Any] = {}


def _init_worker(opts: Options, backend, renderer: Renderer) -> None:
    """Per process: the Rust tokenizer and the template arrive pickled, so a spawned worker imports
    neither transformers' tokenizer classes nor torch and starts in about a second."""
    _WORKER.update(opts=opts, backend=backend, renderer=renderer)


def _held_out(record: Any, fraction: float) -> bool:
    h = hashlib.blake2b(row_content_key(record), digest_size=8).digest()
    return int.from_bytes(h, "big") < fraction * 2**64


def _raw_text(record: Any) -> str:
    text = record.decode("utf-8", "replace") if isinstance(record, bytes) else json.dumps(record, ensure_ascii=False, default=str)
    return text.strip()[:RAW_LIMIT]


def process_chunk(chunk: list[tuple[str, str, str, int, Any]]) -> list[Item]:
    """(split, format, file, line, record) records -> Items in order. Split "auto": by content hash."""
    opts: Options = _WORKER["opts"]
    renderer: Renderer = _WORKER["renderer"]
    items: list[Item] = []
    texts, pending = [], []
    for split, fmt, file, line, record in chunk:
        if split == "auto":
            split = "val" if _held_out(record, opts.val_fraction) else "train"
        try:
            convs = to_conversations(parse_record(record), fmt, opts.columns)
        except RowError as e:
            items.append(Item(split, file, line, None, True, reason=e.reason, detail=e.detail, raw=_raw_text(record)))
            continue
        for k, conv in enumerate(convs):
            # only held-out rows keep their messages (evaluate's prompts); train rows don't ship them back
            item = Item(split, file, line, k if len(convs) > 1 else None, k == 0, messages=conv if split != "train" else None)
            items.append(item)
            try:
                text, spans = assistant_spans(renderer, conv, opts.loss_on)
            except RowError as e:
                item.reason, item.detail, item.raw = e.reason, e.detail, _raw_text(record)
                continue
            texts.append(text)
            pending.append((item, spans, record))
    for (item, spans, record), text, (ids, enc) in zip(pending, texts, encode_texts(_WORKER["backend"], texts)):
        item.truncated = len(ids) > opts.max_length
        try:
            item.ids, item.mask = finish(ids, mask_from_encoding(enc, spans, text), opts.max_length, opts.truncation)
        except RowError as e:
            item.reason, item.detail, item.raw = e.reason, e.detail, _raw_text(record)
    return items


class _Done:
    """A chunk the calling process worked itself, queued in order among the workers' results."""

    def __init__(self, items: list[Item]):
        self.items = items

    def ready(self) -> bool:
        return True

    def get(self) -> list[Item]:
        return self.items


def _ordered_results(chunks: Iterator[list], opts: Options, num_proc: int, tokenizer) -> Iterator[list[Item]]:
    """Items per chunk, in submission order. With num_proc > 1 the calling process is one of the
    num_proc workers: it hands chunks to num_proc - 1 spawned processes while they have work
    queued and works the rest itself, so no core idles while they start (about a second) or
    while it waits on them."""
    state = (opts, tokenizer.backend_tokenizer, Renderer.of(tokenizer))
    _init_worker(*state)
    if num_proc <= 1:
        yield from map(process_chunk, chunks)
        return
    workers = num_proc - 1
    # spawn, not fork: the caller may be a Prefect worker thread pool, and fork copies held locks
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=state) as pool:
        in_flight: deque = deque()
        for chunk in chunks:
            queued = sum(not r.ready() for r in in_flight)
            if queued <= workers:  # each worker has its next chunk waiting
                in_flight.append(pool.apply_async(process_chunk, (chunk,)))
            else:
                in_flight.append(_Done(process_chunk(chunk)))
            while in_flight and in_flight[0].ready():
                yield in_flight.popleft().get()
            if len(in_flight) >= 8 * num_proc:  # bounded: never read far ahead of the writers
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


# --------------------------------------------------------------------------- sources and the stage


@dataclass(frozen=True)
class Source:
    ref: str      # a file or folder path, or hf:NAME
    split: str    # train | val | auto (held-out by content hash)
    format: str


def splits_of(cfg: SFTConfig) -> list[str]:
    """The splits prepare writes: train; val when asked for; one per named eval set."""
    d = cfg.data
    val = ["val"] if d.val_data_paths or d.val_fraction > 0 else []
    return ["train", *val, *(eval_split(name) for name in cfg.eval.sets)]


def plan_sources(cfg: SFTConfig) -> list[Source]:
    d = cfg.data
    out = []
    for key, paths in cfg.inputs().items():
        split = "auto" if key == "train" and not d.val_data_paths and d.val_fraction > 0 else key
        for p in paths:
            out.append(Source(str(p), split, file_format(p, d.format, d.columns, "train" if key == "train" else "val")))
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
        return {**{k: v for k, v in self.__dict__.items() if k != "dropped"}, "dropped": dict(sorted(self.dropped.items()))}


def run_prepare(cfg: SFTConfig, fp: str, model_path: str) -> dict:
    """Writes the prepare folder for fingerprint `fp`; returns its manifest metrics."""
    d = cfg.data
    tokenizer = load_tokenizer(model_path, cfg.actor.model.trust_remote_code)
    sources = plan_sources(cfg)  # format detection fails here, before any output exists
    build = StageBuild(cfg.artifacts_path, "prepare", fp)
    writers = {s: ShardWriter(build.partial / s, d.shard_rows) for s in splits_of(cfg)}
    stats = {s: SplitStats() for s in writers}
    preview: list[str] = []
    opts = Options.from_config(cfg)
    with open(build.partial / "quarantine.jsonl", "w", encoding="utf-8") as quarantine:
        for items in _ordered_results(_chunks(sources), opts, d.num_proc, tokenizer):
            for it in items:
                st = stats[it.split]
                st.rows_read += it.first
                if it.reason is not None:
                    if d.strict:
                        raise DataError(f"{it.source}: {it.reason}" + (f": {it.detail}" if it.detail else "")
                                         + " (data.strict=true; set it to false to quarantine bad rows instead)")
                    st.dropped[it.reason] += 1
                    quarantine.write(json.dumps({"file": it.file, "line": it.line, "index": it.index, "source": it.source,
                                                 "split": it.split, "reason": it.reason, "detail": it.detail,
                                                 "raw": it.raw}, ensure_ascii=False) + "\n")
                    continue
                writers[it.split].add({"input_ids": it.ids, "loss_mask": it.mask, "source": it.source,
                                       "messages": json.dumps(it.messages, ensure_ascii=False) if it.messages else None})
                st.rows_kept += 1
                st.tokens += len(it.ids)
                st.trainable_tokens += int(it.mask.sum())
                st.truncated += it.truncated
                if it.split == "train" and len(preview) < PREVIEW_SAMPLES:
                    preview.append(f"--- {it.source}\n{render_preview(tokenizer, it.ids, it.mask)}\n")
    shards = {s: w.close() for s, w in writers.items()}
    (build.partial / "preview.txt").write_text("".join(preview), encoding="utf-8")
    for split, st in stats.items():
        if st.rows_kept == 0:
            raise StageError(f"prepare: no usable rows in the {split} split; see {build.partial / 'quarantine.jsonl'} "
                             f"(dropped: {dict(st.dropped)})")
    splits = {s: {**st.to_dict(), "shards": shards[s]} for s, st in stats.items()}
    metrics = {f"{s}_{k}": v for s, st in splits.items() for k, v in st.items()
               if isinstance(v, int) and s in ("train", "val")}  # named eval sets: in `splits`
    build.commit({"metrics": metrics, "splits": splits, "model_path": model_path,
                  "sources": [s.__dict__ for s in sources],
                  "inputs": {s: [x.ref for x in sources if x.split == s or (x.split == "auto" and s in ("train", "val"))]
                             for s in splits}})
    return metrics


def preview_samples(cfg: SFTConfig, prepare_dir: Path | None, model_path: str, n: int) -> list[tuple[str, list[tuple[str, bool]]]]:
    """(source, segments) of the first n training samples: from the prepared shards when they
    exist, else prepared on the fly from the first records (nothing is written)."""
    tokenizer = load_tokenizer(model_path, cfg.actor.model.trust_remote_code)
    if prepare_dir is not None and is_complete(prepare_dir):
        table = read_shards(Path(prepare_dir) / "train", ["input_ids", "loss_mask", "source"]).slice(0, n).to_pylist()
        return [(r["source"], segments(tokenizer, r["input_ids"], r["loss_mask"])) for r in table]
    out: list = []
    for items in _ordered_results(_chunks(plan_sources(cfg)), Options.from_config(cfg), 1, tokenizer):
        for it in items:
            if it.reason is None and it.split == "train":
                out.append((it.source, segments(tokenizer, it.ids, it.mask)))
                if len(out) >= n:
                    return out
    return out
