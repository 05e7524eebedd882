"""Readers: data files -> canonical conversations.

A canonical conversation is a list of `{"role": system|user|assistant|tool, "content": str}`.
Every row that can't become one raises `RowError` with a short machine-readable reason, so
prepare can count and quarantine it instead of dropping it silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function": "tool"}
FORMATS = ("messages", "sharegpt", "prompt_completion", "alpaca")


class RowError(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def iter_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line or row number starting at 1, parsed record | RowError) for a .jsonl or .json file."""
    path = Path(path)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            yield 1, RowError("malformed_json", str(e))
            return
        rows = data if isinstance(data, list) else [data]
        yield from enumerate(rows, start=1)
        return
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield n, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield n, RowError("invalid_utf8", str(e))
            except json.JSONDecodeError as e:
                yield n, RowError("malformed_json", str(e))


def detect_format(row: dict) -> str:
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "instruction" in row and "output" in row:
        return "alpaca"
    raise RowError("unknown_format", f"keys {sorted(row)[:6]} match none of {', '.join(FORMATS)}")


def _check(messages: list[dict]) -> list[dict]:
    if not messages:
        raise RowError("empty_conversation")
    for m in messages:
        if m["role"] not in ROLES:
            raise RowError("unknown_role", repr(m["role"]))
        if not isinstance(m["content"], str):
            raise RowError("non_string_content", type(m["content"]).__name__)
    assistants = [m for m in messages if m["role"] == "assistant"]
    if not assistants:
        raise RowError("no_assistant_turn")
    if any(not m["content"].strip() for m in assistants):
        raise RowError("empty_assistant_reply")
    return messages


def _message(m: Any, role_key: str, content_key: str, role_map: dict | None = None) -> dict:
    if not isinstance(m, dict) or role_key not in m:
        raise RowError("missing_role", f"turn {m!r:.60}")
    role = m[role_key]
    if role_map is not None:
        if role not in role_map:
            raise RowError("unknown_role", repr(role))
        role = role_map[role]
    return {"role": role, "content": m.get(content_key)}


def to_messages(row: Any, fmt: str = "auto") -> list[dict]:
    if not isinstance(row, dict):
        raise RowError("not_an_object", type(row).__name__)
    fmt = detect_format(row) if fmt == "auto" else fmt
    if fmt == "messages":
        turns = row.get("messages")
        if not isinstance(turns, list):
            raise RowError("missing_key", "messages")
        return _check([_message(m, "role", "content") for m in turns])
    if fmt == "sharegpt":
        turns = row.get("conversations")
        if not isinstance(turns, list):
            raise RowError("missing_key", "conversations")
        return _check([_message(m, "from", "value", SHAREGPT_ROLES) for m in turns])
    if fmt == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        msgs = msgs + (completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}])
        return _check([_message(m, "role", "content") for m in msgs])
    if fmt == "alpaca":
        instruction, extra = row.get("instruction"), row.get("input") or ""
        if not isinstance(instruction, str) or not isinstance(extra, str):
            raise RowError("non_string_content", "instruction/input")
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        msgs = ([{"role": "system", "content": row["system"]}] if row.get("system") else [])
        return _check(msgs + [{"role": "user", "content": prompt}, {"role": "assistant", "content": row.get("output")}])
    raise RowError("unknown_format", fmt)


def iter_conversations(paths: list[Path], fmt: str = "auto") -> Iterator[tuple[str, list[dict] | RowError]]:
    """("file:line", messages | RowError) for every record of every file, in order."""
    for path in paths:
        for n, rec in iter_records(path):
            where = f"{path}:{n}"
            if isinstance(rec, RowError):
                yield where, rec
                continue
            try:
                yield where, to_messages(rec, fmt)
            except RowError as e:
                yield where, e
