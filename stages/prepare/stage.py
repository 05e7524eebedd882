"""prepare: chat data -> tokenized, masked Arrow shards.

Data path: sources (files, `datasets` folders, hub names) are read as raw records in the main
process, in order, `CHUNK_RECORDS` at a time; each chunk is parsed, converted to
conversations, rendered through the chat template, masked and tokenized in-process or by one
of `data.num_proc - 1` spawned workers; results come back in submission order and stream
into one piece per source (pieces.py: cached by content and settings, so only new or edited
sources are tokenized). The folder is then assembled from the pieces in source order, one
Arrow record batch at a time. Memory stays bounded by the chunks in flight plus one Arrow batch
per split, and the output is identical for any `num_proc` and any mix of reused and new pieces.
The data gate (data.max_bad_fraction) runs on the pieces' counts, before the folder is written,
in prepare and prepare_eval alike; when it stops one, `<stage>/<fp>.rejected/quarantine.jsonl`
keeps the quarantined rows. A reused folder is gated on its manifest's counts (run_stage).

Output folder:
    train/shard-*.arrow, val/shard-*.arrow   prepared rows (see stages/chatdata/shards.py); val only when
                                             data.val_data_paths or data.val_fraction asks for it: the
                                             `train` source's held-out rows
    heldout/<source>/shard-*.arrow           with a mixture and data.val_fraction, each other source's
                                             held-out rows (docs/data.md, "Validation by source")
    eval/<set>/shard-*.arrow                 each named eval set (eval.sets), rows as in val
    quarantine.jsonl                         every row not kept: file, line, split, reason, detail, raw
    preview.txt                              the first samples, trainable spans in [[...]]
    manifest.json                            sources (each with its rows read, kept and dropped by reason),
                                             counts by split and reason, tokens, trainable tokens, the
                                             mixture's rows per source (`mix`) and held-out rows (`val_mix`)
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from stages.chatdata.readers import file_format, iter_records
from stages.chatdata.shards import ShardWriter, read_shards
from stages.core.cache.artifacts import StageBuild, input_digest, is_complete, read_manifest, stage_dir
from stages.core.cache.codeversion import code_version
from stages.core.cache.inputs import HUB_PREFIX
from stages.runtime.mixture import epoch_samples, new_data_epoch
from stages.core.config import REHEARSE, SFTConfig, eval_split, mix_split
from stages.core.errors import StageError
from stages.core.quarantine import Check, breach, gate_error

from .pieces import (Piece, PieceBuilder, PieceDamaged, SplitStats, clean_stale, open_piece, piece_key, pieces_root,
                     remove, strict_error, tokenizer_identity)
from .rows import Options, ordered_results

PREVIEW_SAMPLES = 3
CHUNK_RECORDS = 256
# New input below this many bytes per process is tokenized by fewer processes than data.num_proc: a
# spawned worker takes about a second to start, about what one core needs for 8 MB of chat rows.
WORKER_MIN_BYTES = 8 << 20


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


def heldout_split(source: str) -> str:
    """The folder of a mixture source's held-out rows (the `train` source's are `val`)."""
    return f"heldout/{source}"


def splits_of(cfg: SFTConfig, part: str = "train") -> list[str]:
    """The splits a part writes: train, and val when asked for; or one per named eval set."""
    d = cfg.data
    if part == "eval":
        return [eval_split(name) for name, s in cfg.eval.sets.items() if not s.is_harness]  # harness: lm-eval's data
    return ["train", *(["val"] if d.val_data_paths or d.val_fraction > 0 else [])]


def mix_order(cfg: SFTConfig) -> list[str]:
    """The mixture's sources in the order their rows follow each other in the train split."""
    return ["train", *(n for n in cfg.mix_weights() if n != "train")]


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
    add(inputs["val"], "val", d.format, kind="val")  # the validation rows of `train`, the new rows
    # every other source of a mixture holds out its own share by content hash (docs/data.md, "Validation
    # by source"): what validation scores per source, e.g. whether the rehearsed rows are still known
    held = "auto" if d.val_fraction > 0 else "train"
    for name in mix_order(cfg)[1:]:
        if name == "replay":
            if replay_file is None:
                raise StageError("prepare: data.mix.replay needs the replay stage's answers; run the replay stage")
            add([replay_file], held, "messages", name)
        elif name == REHEARSE:  # each file as its version read it
            for e in cfg.rehearsal_files:
                out.append(Source(e["ref"], held, e["format"], name, e.get("columns")))
        else:
            m = d.mix[name]
            add(inputs[mix_split(name)], held, m.format or d.format, name, m.columns)
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


def run_prepare(cfg: SFTConfig, fp: str, model_path: str, part: str = "train", replay_file: str | None = None,
                stage: str = "prepare") -> dict:
    """Writes the folder of `part` (prepare: "train", prepare_eval: "eval") for fingerprint `fp`; returns
    its manifest metrics. `replay_file`: the replay stage's conversations (data.mix.replay).

    Each source's rows come from its piece (pieces.py): reused when one with its key exists, else
    tokenized now (every missing source together, by up to data.num_proc processes) and kept for the
    next prepare. The folder is then assembled from the pieces in source order, byte-identical to
    tokenizing every row here. With data.max_bad_fraction set, the data gate runs between the two
    (`check_bad_fraction`), for the training data and the named eval sets alike."""
    started = time.time()
    tokenizer = load_tokenizer(model_path, cfg.actor.model.trust_remote_code)
    sources = plan_sources(cfg, part, replay_file)  # format detection fails here, before any output exists
    opts = replace(Options.from_config(cfg), file_columns={s.ref: s.columns for s in sources if s.columns is not None})
    root = pieces_root(cfg.artifacts_path)
    root.mkdir(parents=True, exist_ok=True)
    clean_stale(root)
    scratch = Path(tempfile.mkdtemp(prefix=".scratch-", suffix=".tmp", dir=root))  # pieces of hub sources
    try:
        for attempt in (1, 2):
            pieces, reuse = source_pieces(cfg, sources, opts, tokenizer, scratch)
            check_bad_fraction(cfg, stage, fp, pieces, splits_of(cfg, part), sources)
            try:
                return _assemble(cfg, fp, model_path, part, stage, sources, pieces, reuse, tokenizer, started)
            except PieceDamaged as e:  # unreadable past the checks open_piece makes: build it again, once
                if attempt == 2:
                    raise StageError(f"{stage}: the piece {e} is damaged again after a rebuild; "
                                     f"delete {root} and run the stage again") from None
                remove(e.folder)
        raise AssertionError("unreachable")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def source_pieces(cfg: SFTConfig, sources: list[Source], opts: Options, tokenizer,
                  scratch: Path) -> tuple[list[Piece], dict]:
    """Each source's piece, in order, building the missing ones; and how many were reused, built, and
    not cached (hub sources, whose pieces live in `scratch` for this prepare only). Under data.strict
    the first quarantined row, in source order, is the error (sources after it are not tokenized)."""
    root = pieces_root(cfg.artifacts_path)
    trust = cfg.actor.model.trust_remote_code
    tok_id, code = tokenizer_identity(tokenizer), code_version("prepare")
    keys: list[str | None] = []
    digests: list[str | None] = []
    for src in sources:
        digest = None if src.ref.startswith(HUB_PREFIX) else input_digest(Path(src.ref), cfg.artifacts_path)
        digests.append(digest)
        keys.append(None if digest is None else piece_key(src, digest, opts, tok_id, trust, code))
    found: dict[str, Piece | None] = {}
    for k in keys:
        if k is not None and k not in found:
            found[k] = open_piece(root, k)
    pieces: list[Piece | None] = [found[k] if k is not None else None for k in keys]
    stop = len(sources)
    if cfg.data.strict:  # a reused piece with a quarantined row: nothing after it matters
        stop = next((i for i, p in enumerate(pieces) if p is not None and p.quarantined), stop)
    todo: list[int] = []
    wanted: set[str] = set()
    for i in range(stop):
        if pieces[i] is None and (keys[i] is None or keys[i] not in wanted):
            todo.append(i)
            wanted.add(keys[i])
    built = _build(cfg, sources, todo, keys, digests, opts, tokenizer, root, scratch)
    for i, piece in built.items():
        if keys[i] is not None:
            found[keys[i]] = piece
    pieces = [built.get(i) or (found.get(keys[i]) if keys[i] is not None else None) for i in range(len(sources))]
    if stop < len(sources):
        q = pieces[stop].first_quarantined()
        raise strict_error(q["source"], q["reason"], q["detail"])
    uncached = sum(k is None for k in keys)
    built_n = sum(keys[i] is not None for i in todo)
    return pieces, {"reused": len(sources) - built_n - uncached, "built": built_n, "uncached": uncached,
                    "dir": str(root)}


def _source_bytes(src: Source) -> int:
    if src.ref.startswith(HUB_PREFIX):
        return 1 << 50  # unknown: as large as can be
    p = Path(src.ref)
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def _source_chunks(sources: list[tuple[int, Source]], order: deque) -> Iterator[list]:
    """Chunks of one source each (one empty chunk for a source without records), each one's source
    index appended to `order` as it is handed out: results come back in the same order."""
    for i, src in sources:
        buf: list = []
        handed = False
        for n, rec in iter_records(src.ref if src.ref.startswith(HUB_PREFIX) else Path(src.ref),
                                   "train" if src.split in ("train", "auto") else "val"):
            buf.append((src.split, src.format, src.ref, n, rec))
            if len(buf) >= CHUNK_RECORDS:
                order.append(i)
                yield buf
                buf, handed = [], True
        if buf or not handed:
            order.append(i)
            yield buf


def _build(cfg: SFTConfig, sources: list[Source], todo: list[int], keys: list, digests: list, opts: Options,
           tokenizer, root: Path, scratch: Path) -> dict[int, Piece]:
    """Tokenizes the sources `todo` (indices into `sources`) into pieces, together: one stream of chunks
    through `ordered_results`, by up to data.num_proc processes (fewer for a little new data)."""
    if not todo:
        return {}
    new_bytes = sum(_source_bytes(sources[i]) for i in todo)
    procs = max(1, min(cfg.data.num_proc, 1 + new_bytes // max(WORKER_MIN_BYTES, 1)))
    order: deque = deque()
    built: dict[int, Piece] = {}
    builder: PieceBuilder | None = None
    current = -1

    def commit() -> None:
        src = sources[current]
        if digests[current] is not None and input_digest(Path(src.ref), cfg.artifacts_path) != digests[current]:
            raise StageError(f"prepare: {src.ref} changed while it was being prepared; run it again")
        built[current] = builder.commit()

    try:
        for items in ordered_results(_source_chunks([(i, sources[i]) for i in todo], order), opts, procs, tokenizer):
            i = order.popleft()
            if i != current:
                if builder is not None:
                    commit()
                current = i
                builder = PieceBuilder(root if keys[i] is not None else scratch, keys[i], sources[i],
                                       cfg.data.strict)
            for it in items:
                builder.add(it)
        if builder is not None:
            commit()
            builder = None
    finally:
        if builder is not None and current not in built:
            builder.discard()
    return built


def check_bad_fraction(cfg: SFTConfig, stage: str, fp: str, pieces: list[Piece], splits: list[str],
                       sources: list[Source] | None = None) -> None:
    """The data gate: a DataError when more than data.max_bad_fraction of any source file's rows, or
    of any split's (prepare: train, then val; prepare_eval: each named eval set's), were quarantined.
    Per file too: a bad drop among a long history would pass a split-wide share. The quarantine file
    it names is `<artifacts>/<stage>/<fp>.rejected/quarantine.jsonl` (what the folder's
    quarantine.jsonl would have held), kept until a prepare of this fingerprint succeeds; no stage
    folder is written. The same rule and line hold a reused folder (quarantine.check_folder)."""
    limit = cfg.data.max_bad_fraction
    if limit is None:
        return
    checks: list[Check] = []
    for piece, src in zip(pieces, sources or []):
        st = _whole(piece)
        checks.append((src.ref, st.rows_read, st.dropped))
    for split in splits:
        st = SplitStats()
        for p in pieces:
            if split in p.splits:
                st.add(p.stats(split))
        checks.append((f"the {split} split", st.rows_read, st.dropped))
    found = breach(checks, limit)
    if found is None:
        return
    folder = rejected_dir(cfg, stage, fp)
    tmp = folder.parent / f".{folder.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "quarantine.jsonl", "wb") as out:
        for p in pieces:
            p.copy_quarantine(out)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    raise gate_error(stage, found, limit, folder / "quarantine.jsonl")


def _whole(piece: Piece) -> SplitStats:
    """One source's counts over its splits (an `auto` source's train and val): what the gate checks
    per file, and what the manifest keeps of each source for the gate on a reused folder."""
    st = SplitStats()
    for split in piece.splits:
        st.add(piece.stats(split))
    return st


def _source_entry(src: Source, piece: Piece) -> dict:
    """A source in the manifest: what it is, the piece it came from (what retention keeps for it), and
    its counts over its splits (the data gate checks them per file when the folder is reused:
    quarantine.folder_checks)."""
    st = _whole(piece)
    piece_name = None if src.ref.startswith(HUB_PREFIX) else piece.folder.name  # a hub source's is this run's
    return {**{k: v for k, v in src.__dict__.items() if k != "columns"}, "piece": piece_name,
            "rows_read": st.rows_read, "rows_kept": st.rows_kept, "dropped": dict(sorted(st.dropped.items()))}


def rejected_dir(cfg: SFTConfig, stage: str, fp: str) -> Path:
    """Where a prepare the data gate stopped keeps its quarantine.jsonl."""
    folder = stage_dir(cfg.artifacts_path, stage, fp)
    return folder.parent / f"{fp}.rejected"


def _assemble(cfg: SFTConfig, fp: str, model_path: str, part: str, stage: str, sources: list[Source],
              pieces: list[Piece], reuse: dict, tokenizer, started: float) -> dict:
    """The stage folder from the sources' pieces, streamed in order one record batch at a time."""
    d = cfg.data
    build = StageBuild(cfg.artifacts_path, stage, fp)
    build.started = started  # the manifest's `seconds`: the whole stage, pieces included
    writers = {s: ShardWriter(build.partial / s, d.shard_rows) for s in splits_of(cfg, part)}
    stats = {s: SplitStats() for s in writers}
    # the held-out rows of a mixture's other sources: a folder each beside val/ (train's, which evaluate
    # also scores), validated per source during training (manifest `val_mix`)
    others = {src.mix for src in sources if src.split == "auto" and src.mix != "train"} if part == "train" else set()
    heldout = {m: ShardWriter(build.partial / heldout_split(m), d.shard_rows) for m in sorted(others)}
    mixed = Counter()  # kept train rows per mixture source
    held = Counter()  # kept val rows per mixture source (the val split holds them source after source)
    mix_of = {s.ref: s.mix for s in sources}
    preview: list[str] = []
    with open(build.partial / "quarantine.jsonl", "wb") as quarantine:
        for src, piece in zip(sources, pieces):
            piece.copy_quarantine(quarantine)
            for split in piece.splits:
                to = heldout[src.mix] if split == "val" and src.mix in heldout else writers[split]
                if to is writers[split]:
                    stats[split].add(piece.stats(split))
                for batch in piece.batches(split):
                    to.add_batch(batch)
                    if split == "train" and len(preview) < PREVIEW_SAMPLES:
                        first = batch.slice(0, PREVIEW_SAMPLES - len(preview))
                        for source, ids, mask in zip(*(first.column(c).to_pylist()
                                                       for c in ("source", "input_ids", "loss_mask"))):
                            preview.append(f"--- {source}\n{render_preview(tokenizer, ids, mask)}\n")
            if "train" in piece.splits:
                mixed[mix_of[src.ref]] += piece.splits["train"]["rows_kept"]
            if "val" in piece.splits:
                held[mix_of[src.ref]] += piece.splits["val"]["rows_kept"]
    shards = {s: w.close() for s, w in writers.items()}
    heldout_shards = {m: w.close() for m, w in heldout.items()}
    (build.partial / "preview.txt").write_text("".join(preview), encoding="utf-8")
    for split, st in stats.items():
        if st.rows_kept == 0:
            raise StageError(f"{stage}: no usable rows in the {split} split; see {build.partial / 'quarantine.jsonl'} "
                             f"(dropped: {dict(st.dropped)})")
    mix = [{"source": n, "rows": mixed[n]} for n in mix_order(cfg)] if cfg.mix_weights() and part == "train" else []
    empty = [m["source"] for m in mix if m["rows"] == 0]
    if empty:
        raise StageError(f"{stage}: data.mix.{empty[0]} has no usable rows; see {build.partial / 'quarantine.jsonl'}")
    val_mix = [{"source": m["source"], "rows": held[m["source"]],
                "dir": "val" if m["source"] == "train" else heldout_split(m["source"]),
                **({"shards": heldout_shards[m["source"]]} if m["source"] in heldout else {})}
               for m in mix] if "val" in writers else []
    splits = {s: {**st.to_dict(), "shards": shards[s]} for s, st in stats.items()}
    metrics = {f"{s}_{k}": v for s, st in splits.items() for k, v in st.items()
               if isinstance(v, int) and s in ("train", "val")}  # named eval sets: in `splits`
    metrics.update({f"mix_{m['source']}_rows": m["rows"] for m in mix})
    metrics.update({f"val_mix_{m['source']}_rows": m["rows"] for m in val_mix})
    if part == "eval":  # every named set's rows (each set's counts: in `splits`)
        metrics.update(rows_kept=sum(st.rows_kept for st in stats.values()),
                       rows_dropped=sum(sum(st.dropped.values()) for st in stats.values()))
    build.commit({"metrics": metrics, "splits": splits, "model_path": model_path, "mix": mix, "val_mix": val_mix,
                  "sources": [_source_entry(s, p) for s, p in zip(sources, pieces)],
                  "inputs": {s: [x.ref for x in sources
                                 if x.split == s or (x.split == "auto" and s in ("train", "val"))]
                             for s in splits},
                  "pieces": reuse})
    shutil.rmtree(rejected_dir(cfg, stage, fp), ignore_errors=True)  # a gate's verdict on this fingerprint, now moot
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
        weights = [cfg.mix_weights()[m["source"]] for m in mix]
        total = new_data_epoch(weights, sizes, cfg.data.rehearsal.passes) if cfg.rehearsal_files else None
        order = epoch_samples(cfg.runner.seed, 0, weights, sizes, total)[:n]
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
                out.append((f"{name}: {it.source}" if cfg.mix_weights() else it.source,
                            segments(tokenizer, it.ids, it.mask)))
                if len(out) >= n:
                    return out
    return out
