"""prepare's per-row work (records -> tokenized, masked Items) and who does it: this process
alone, or this process and `num_proc - 1` spawned workers. A spawned worker imports this module
only (not the stage's, with its config and shard writers), so it is ready sooner."""

from __future__ import annotations

import json
import multiprocessing as mp
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from stages.chatdata.readers import RowError, parse_record, plain, row_content_key, to_conversations

from stages.runtime.mixture import held_out

from .masking import Renderer, assistant_spans, encode_texts, finish, mask_from_encoding

if TYPE_CHECKING:
    from stages.core.config import SFTConfig

RAW_LIMIT = 2000  # characters of a bad record kept in quarantine.jsonl


@dataclass(frozen=True)
class Options:
    """What a tokenizing worker needs; picklable."""

    columns: dict[str, str]
    loss_on: str
    truncation: str
    max_length: int
    val_fraction: float
    file_columns: dict[str, dict[str, str]] = field(default_factory=dict)  # a mixture source's own data.columns

    @classmethod
    def from_config(cls, cfg: SFTConfig) -> "Options":
        d = cfg.data
        # with data.val_data_paths, train's files are split "train" and only a mixture's other sources
        # ("auto") hold out by it (stage.plan_sources)
        return cls(dict(d.columns), d.loss_on, d.truncation, d.max_length, d.val_fraction)


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


def _raw_text(record: Any) -> str:
    text = (record.decode("utf-8", "replace") if isinstance(record, bytes)
            else json.dumps(record, ensure_ascii=False, default=str))
    return text.strip()[:RAW_LIMIT]


def process_chunk(chunk: list[tuple[str, str, str, int, Any]]) -> list[Item]:
    """(split, format, file, line, record) records -> Items in order. Split "auto": by content hash."""
    opts: Options = _WORKER["opts"]
    renderer: Renderer = _WORKER["renderer"]
    items: list[Item] = []
    texts, pending = [], []
    for split, fmt, file, line, record in chunk:
        if split == "auto":
            split = "val" if held_out(row_content_key(record), opts.val_fraction) else "train"
        try:
            convs = to_conversations(parse_record(record), fmt, opts.file_columns.get(file, opts.columns))
        except RowError as e:
            items.append(Item(split, file, line, None, True, reason=e.reason, detail=e.detail, raw=_raw_text(record)))
            continue
        for k, conv in enumerate(convs):
            # only held-out rows keep their messages (evaluate's prompts); train rows don't ship them back
            item = Item(split, file, line, k if len(convs) > 1 else None, k == 0,
                        messages=conv if split != "train" else None)
            items.append(item)
            try:
                text, spans = assistant_spans(renderer, plain(conv), opts.loss_on)
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


def ordered_results(chunks: Iterator[list], opts: Options, num_proc: int, tokenizer) -> Iterator[list[Item]]:
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
