"""Per-file pieces: what prepare made of one input, cached by what shapes it.

A piece is the outcome of one source (a file, or a `datasets` folder, read as one split in one
format): its kept rows per split as Arrow shards (chatdata.shards' SCHEMA), its quarantined rows
as the exact lines `quarantine.jsonl` gets, and its counts per split. Pieces live in
`<artifacts>/prepare_pieces/<key>/`, shared by every prepare and prepare_eval folder; the key
(`piece_key`) hashes everything that shapes those bytes: the source's path and content digest,
its split, format and columns, the data options the per-row work reads, the tokenizer as loaded
(its Rust tokenizer, chat template and special tokens, with the libraries' versions) and
prepare's code version. A stage folder is assembled from its sources' pieces in order
(stage.py), so after one new file a prepare tokenizes that file alone, and what it writes is
byte-identical to a prepare from scratch.

    <key>/split-<i>/shard-00000.arrow   the kept rows of one split (piece.json's `splits` names it)
    <key>/quarantine.jsonl              the rows left out, one JSON line each, as the stage writes them
    <key>/piece.json                    written last: the key, counts per split, every file's size

A piece is built in a temporary folder beside it and renamed into place whole; a prepare that
finds the name taken (another prepare built it meanwhile) keeps the existing one and drops its
own. One without a sound piece.json, or whose files do not have the sizes it recorded, is
deleted and built again (`open_piece`); a shard that still fails to read is `PieceDamaged`.
Deleting the whole folder is always safe: it costs the next prepare a full tokenization.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow as pa

from stages.chatdata.shards import ShardWriter
from stages.core.cache.artifacts import canonical_json, remove_tree, sha256_text
from stages.core.errors import DataError, StageError

PIECES_DIR = "prepare_pieces"
PIECE_MANIFEST = "piece.json"
QUARANTINE = "quarantine.jsonl"
PIECE_FORMAT = 1  # what a piece folder holds; a change here makes older pieces unread (new keys)
STALE_SECONDS = 2 * 86400  # a temporary folder this old was left by a prepare that died


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

    def add(self, other: "SplitStats") -> None:
        for k in ("rows_read", "rows_kept", "tokens", "trainable_tokens", "truncated"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.dropped.update(other.dropped)

    @classmethod
    def from_dict(cls, d: dict) -> "SplitStats":
        return cls(int(d["rows_read"]), int(d["rows_kept"]), int(d["tokens"]), int(d["trainable_tokens"]),
                   int(d["truncated"]), Counter({k: int(v) for k, v in d["dropped"].items()}))


class PieceDamaged(Exception):
    """A piece's shard could not be read back as piece.json describes it."""

    def __init__(self, folder: Path, problem: str):
        super().__init__(f"{folder}: {problem}")
        self.folder, self.problem = folder, problem


def strict_error(source: str, reason: str, detail: str | None) -> DataError:
    return DataError(f"{source}: {reason}" + (f": {detail}" if detail else "")
                     + " (data.strict=true; set it to false to quarantine bad rows instead)")


def pieces_root(artifacts: Path) -> Path:
    return Path(artifacts) / PIECES_DIR


# --------------------------------------------------------------------------- keys


def tokenizer_identity(tokenizer) -> str:
    """What the tokenizing workers get from the tokenizer: the Rust tokenizer (its whole serialized
    state: vocabulary, merges, normalizer, pre-tokenizer, added tokens), the chat template and the
    special tokens the template sees; with the versions of the libraries that run them."""
    import jinja2
    import tokenizers
    import transformers
    return sha256_text(canonical_json({
        "backend": sha256_text(tokenizer.backend_tokenizer.to_str()),
        "chat_template": tokenizer.chat_template,
        "special_tokens": tokenizer.special_tokens_map,
        "versions": {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__,
                     "jinja2": jinja2.__version__},
    }))


def piece_key(src, digest: str, opts, tokenizer_id: str, trust_remote_code: bool, code: str) -> str:
    """The key of one source's piece (`src`: a stage.Source; `opts`: rows.Options; `digest`: the
    source's content digest). The path is part of it because each row's `source` names it."""
    return sha256_text(canonical_json({
        "piece_format": PIECE_FORMAT,
        "ref": src.ref,
        "digest": digest,
        "split": src.split,
        "format": src.format,
        "columns": opts.file_columns.get(src.ref, opts.columns),  # what the per-row work reads it with
        "loss_on": opts.loss_on,
        "truncation": opts.truncation,
        "max_length": opts.max_length,
        "val_fraction": opts.val_fraction if src.split == "auto" else None,  # only `auto` splits by it
        "tokenizer": tokenizer_id,
        "trust_remote_code": trust_remote_code,
        "code": code,
    }))


# --------------------------------------------------------------------------- reading


@dataclass
class Piece:
    folder: Path
    manifest: dict

    @property
    def splits(self) -> dict[str, dict]:
        return self.manifest["splits"]

    def stats(self, split: str) -> SplitStats:
        return SplitStats.from_dict(self.splits[split])

    @property
    def quarantined(self) -> int:
        return sum(sum(s["dropped"].values()) for s in self.splits.values())

    def quarantine_lines(self) -> Iterator[bytes]:
        with open(self.folder / QUARANTINE, "rb") as f:
            yield from f

    def first_quarantined(self) -> dict:
        return json.loads(next(self.quarantine_lines()))

    def copy_quarantine(self, out) -> None:
        with open(self.folder / QUARANTINE, "rb") as f:
            shutil.copyfileobj(f, out)

    def batches(self, split: str) -> Iterator[pa.RecordBatch]:
        """The kept rows of `split`, one record batch at a time (memory-mapped)."""
        info = self.splits[split]
        if not info.get("dir"):
            return
        path = self.folder / info["dir"] / "shard-00000.arrow"
        rows = 0
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                rows += batch.num_rows
                yield batch
        except (OSError, pa.ArrowException) as e:
            raise PieceDamaged(self.folder, f"{path.name} of {split} can't be read ({type(e).__name__})") from None
        if rows != info["rows_kept"]:
            raise PieceDamaged(self.folder, f"{split} holds {rows} rows, piece.json recorded {info['rows_kept']}")


def _problem(folder: Path, key: str) -> tuple[dict | None, str | None]:
    try:
        manifest = json.loads((folder / PIECE_MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return None, f"{PIECE_MANIFEST} can't be read ({type(e).__name__})"
    if not isinstance(manifest, dict) or manifest.get("key") != key or manifest.get("piece_format") != PIECE_FORMAT:
        return None, f"{PIECE_MANIFEST} is not this piece's"
    try:
        for name, size in manifest["files"].items():
            path = folder / name
            if not path.is_file():
                return None, f"{name} is missing"
            if path.stat().st_size != size:
                return None, f"{name} has {path.stat().st_size} bytes, {PIECE_MANIFEST} recorded {size}"
        for info in manifest["splits"].values():
            SplitStats.from_dict(info)
            if info.get("dir"):
                pa.ipc.open_file(pa.memory_map(str(folder / info["dir"] / "shard-00000.arrow"), "r"))
    except (KeyError, TypeError, ValueError, AttributeError, OSError, pa.ArrowException) as e:
        return None, f"unreadable ({type(e).__name__})"
    return manifest, None


def open_piece(root: Path, key: str) -> Piece | None:
    """The sound piece of `key`, else None (a damaged one is deleted, so it is built again)."""
    folder = Path(root) / key
    if not (folder / PIECE_MANIFEST).exists():
        if folder.exists():  # no piece.json: a folder was never renamed here half-built, but be sure
            remove(folder)
        return None
    manifest, problem = _problem(folder, key)
    if problem is not None:
        remove(folder)
        return None
    return Piece(folder, manifest)


def remove(folder: Path) -> None:
    """Moves a piece aside before deleting it, so no reader sees it half-deleted."""
    remove_tree(folder)


def clean_stale(root: Path) -> None:
    """Temporary folders of prepares that died (older than STALE_SECONDS)."""
    if not root.is_dir():
        return
    now = time.time()
    for p in root.iterdir():
        if p.name.startswith(".") and p.name.endswith((".tmp", ".trash")):
            try:
                if now - p.stat().st_mtime > STALE_SECONDS or p.name.endswith(".trash"):
                    shutil.rmtree(p, ignore_errors=True)
            except OSError:
                pass


# --------------------------------------------------------------------------- writing


class PieceBuilder:
    """Writes one source's Items (rows.Item, in order) into a temporary folder; `commit` renames it
    into place under its key (or, with `key` None, leaves it where it is: a source that can't be
    cached, such as a hub dataset, gets a piece for this prepare only)."""

    def __init__(self, root: Path, key: str | None, src, strict: bool):
        self.root, self.key, self.src, self.strict = Path(root), key, src, strict
        name = key or "uncached"
        self.tmp = self.root / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        self.tmp.mkdir(parents=True)
        self.stats: dict[str, SplitStats] = {}
        self.writers: dict[str, ShardWriter] = {}
        self.quarantine = open(self.tmp / QUARANTINE, "w", encoding="utf-8")

    def add(self, it) -> None:
        st = self.stats.setdefault(it.split, SplitStats())
        st.rows_read += it.first
        if it.reason is not None:
            if self.strict:
                raise strict_error(it.source, it.reason, it.detail)
            st.dropped[it.reason] += 1
            self.quarantine.write(json.dumps({"file": it.file, "line": it.line, "index": it.index,
                                              "source": it.source, "split": it.split, "reason": it.reason,
                                              "detail": it.detail, "raw": it.raw}, ensure_ascii=False) + "\n")
            return
        if it.split not in self.writers:
            self.writers[it.split] = ShardWriter(self.tmp / f"split-{len(self.writers)}", shard_rows=1 << 62)
        self.writers[it.split].add({"input_ids": it.ids, "loss_mask": it.mask, "source": it.source,
                                    "messages": json.dumps(it.messages, ensure_ascii=False) if it.messages else None})
        st.rows_kept += 1
        st.tokens += len(it.ids)
        st.trainable_tokens += int(it.mask.sum())
        st.truncated += it.truncated

    def commit(self) -> Piece:
        self.quarantine.close()
        for w in self.writers.values():
            w.close()
        dirs = {split: w.folder.name for split, w in self.writers.items()}
        splits = {split: {**st.to_dict(), "dir": dirs.get(split)} for split, st in self.stats.items()}
        files = {str(f.relative_to(self.tmp)): f.stat().st_size for f in sorted(self.tmp.rglob("*")) if f.is_file()}
        manifest = {"piece_format": PIECE_FORMAT, "key": self.key, "ref": self.src.ref, "split": self.src.split,
                    "format": self.src.format, "splits": splits, "files": files,
                    "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (self.tmp / PIECE_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if self.key is None:
            return Piece(self.tmp, manifest)
        final = self.root / self.key
        for _ in range(3):
            try:
                os.replace(self.tmp, final)
                return Piece(final, manifest)
            except OSError:  # taken: another prepare built the same piece meanwhile; its copy is as good
                found = open_piece(self.root, self.key)
                if found is not None:
                    shutil.rmtree(self.tmp, ignore_errors=True)
                    return found
        raise StageError(f"prepare: can't put the piece {final} in place")

    def discard(self) -> None:
        self.quarantine.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

