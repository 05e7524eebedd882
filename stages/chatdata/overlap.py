"""The contamination check: no prompt that trains (a training row's user turn, a replay prompt) may
equal an eval set's prompt after normalization, or the eval set measures recall of its own answers.

Planning runs it on local files (hub sources are not read at planning); the first collision is a
one-line error naming both file:line. Normalization: NFKC, case-folded, punctuation dropped,
whitespace collapsed ("What is 2+2?" == "what is 2 + 2").
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Iterator

from .readers import RowError, iter_records, parse_record, to_conversations, to_prompt


def normalize_prompt(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(re.sub(r"[^\w\s]", " ", text).split())


def user_turns(path: Path, fmt: str, columns: dict | None, split: str) -> Iterator[tuple[int, str]]:
    """(line, user turn text) of every readable row; unreadable rows are prepare's to count."""
    for line, rec in iter_records(path, split):
        try:
            row = parse_record(rec)  # "prompt": a replay prompt row, no reply
            convs = [to_prompt(row, columns)] if fmt == "prompt" else to_conversations(row, fmt, columns or {})
        except RowError:
            continue
        for conv in convs:
            for m in conv:
                if m["role"] == "user" and isinstance(m["content"], str):
                    yield line, m["content"]


def eval_prompts(path: Path, fmt: str, columns: dict | None) -> Iterator[tuple[int, str]]:
    """(line, prompt) of an eval set: the last user turn before the reply it scores."""
    for line, rec in iter_records(path, "val"):
        try:
            convs = to_conversations(parse_record(rec), fmt, columns or {})
        except RowError:
            continue
        for conv in convs:
            users = [m["content"] for m in conv if m["role"] == "user" and isinstance(m["content"], str)]
            if users:
                yield line, users[-1]


def first_collision(trains: list[tuple[Path, str, dict | None]], evals: dict[str, list[tuple[Path, str, dict | None]]]
                    ) -> str | None:
    """`trains`: (file, format, columns) whose user turns train; `evals`: set -> its files. The first
    training prompt equal to an eval prompt, as one line, or None."""
    seen: dict[str, tuple[str, Path, int]] = {}
    for name, files in evals.items():
        for path, fmt, columns in files:
            for line, text in eval_prompts(path, fmt, columns):
                key = normalize_prompt(text)
                if key:
                    seen.setdefault(key, (name, path, line))
    if not seen:
        return None
    for path, fmt, columns in trains:
        for line, text in user_turns(path, fmt, columns, "train"):
            hit = seen.get(normalize_prompt(text))
            if hit is not None:
                name, epath, eline = hit
                short = text if len(text) <= 60 else text[:57] + "..."
                return (f"{path}:{line}: the prompt {short!r} is also eval set '{name}''s prompt at {epath}:{eline} "
                        "(after normalization); remove it from one of them, or the set scores what was trained")
    return None
