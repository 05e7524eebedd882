"""Readers: data files -> raw records -> canonical conversations.

A *record* is one row of a source: a JSONL line, an element of a JSON array, a Parquet /
CSV / `datasets` row. A *conversation* is a list of `{"role": system|user|assistant|tool,
"content": str}` (assistant turns may also carry `tool_calls`). One record usually holds one
conversation; the `conversation` format holds several (`{"conversation": [[...], [...]]}`).

Problems with the whole file (unreadable, undetectable format, a JSON document that does not
parse) are `SourceError`s: one line that names the file. Problems with one record raise
`RowError` with a short machine-readable reason, so prepare counts and quarantines the row
instead of dropping it silently.

Records are read in the main process and parsed in the tokenizing workers: a JSONL record
travels as its raw bytes, so reading stays cheap however many workers tokenize.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Iterator

import orjson

from stages.core.errors import DataError
from stages.core.cache.inputs import HUB_PREFIX, JSONL_SUFFIXES, SUFFIXES, is_datasets_folder

ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
                  "system": "system", "tool": "tool", "function": "tool", "observation": "tool"}
FORMATS = ("messages", "sharegpt", "prompt_completion", "alpaca", "conversation", "choice")
# The keys that identify each format (canonical names; `data.columns` maps them to yours).
FORMAT_KEYS = {"messages": ("messages",), "sharegpt": ("conversations",), "prompt_completion": ("prompt", "completion"),
               "alpaca": ("instruction", "output"), "conversation": ("conversation",),
               "choice": ("question", "choices", "answer")}
# A multiple-choice row's options and the right one's index travel on its reply (the right option),
# for the eval sets that score them (`mode: choice`); `plain` leaves them out of what the chat
# template renders.
CHOICE_KEYS = ("choices", "answer")
# Message fields passed through to the template besides role and content.
EXTRA_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")



class RowError(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class SourceError(DataError):
    """A whole input file can't be read as data: a one-line message naming it."""


# --------------------------------------------------------------------------- sources


def iter_records(path: Path | str, split: str = "train") -> Iterator[tuple[int, Any]]:
    """(line or row number from 1, record) for every record of one source, in file order.

    JSONL records are `bytes` (parsed later by `parse_record`); the other sources yield parsed
    objects. `split` picks the split of a `datasets` DatasetDict or hub dataset."""
    if isinstance(path, str) and path.startswith(HUB_PREFIX):
        yield from _hub_records(path, split)
        return
    path = Path(path)
    if is_datasets_folder(path):
        yield from _datasets_records(path, split)
        return
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                if n == 1:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (Windows editors)
                if raw.strip():
                    yield n, raw
    elif suffix == ".json":
        yield from enumerate(_json_rows(path), start=1)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq
        n = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=2048):
            for row in batch.to_pylist():
                n += 1
                yield n, row
    elif suffix == ".csv":
        csv.field_size_limit(1 << 30)  # a cell may hold a whole conversation as JSON
        try:
            with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: Excel's "CSV UTF-8" starts with a BOM
                reader = csv.DictReader(f)
                for n, row in enumerate(reader, start=1):
                    yield n, ({k: v for k, v in row.items() if k is not None} if None in row else row)
        except UnicodeDecodeError as e:
            raise SourceError(f"{path}: not UTF-8 ({e.reason} at byte {e.start}); "
                              "re-encode the file as UTF-8") from None
        except csv.Error as e:
            raise SourceError(f"{path}: unreadable CSV near line {reader.line_num}: {e}") from None
    else:
        raise SourceError(f"{path}: unsupported file type '{suffix}'; use one of {', '.join(sorted(SUFFIXES))}, "
                          "a `datasets` save_to_disk folder, or hf:<dataset name>")


def _json_rows(path: Path) -> list:
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise SourceError(f"{path}: invalid JSON ({str(e).splitlines()[0]}); a .json file must be one JSON "
                          "document (an array of rows); use .jsonl for one row per line") from None
    return data if isinstance(data, list) else [data]


def _pick_split(ds, split: str, where: str):
    from datasets import DatasetDict, IterableDatasetDict
    if not isinstance(ds, (DatasetDict, IterableDatasetDict)):
        return ds
    wanted = [split] if split == "train" else ["validation", "val", "test", split]
    name = next((s for s in wanted if s in ds), None)
    if name is None:
        raise SourceError(f"{where}: no '{'/'.join(wanted)}' split among {sorted(ds)}")
    return ds[name]


def _datasets_records(path: Path, split: str) -> Iterator[tuple[int, Any]]:
    from datasets import load_from_disk
    ds = _pick_split(load_from_disk(str(path)), split, str(path))
    n = 0
    for batch in ds.iter(batch_size=2048):  # columns of a memory-mapped Arrow table, a batch at a time
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys)):
            n += 1
            yield n, dict(zip(keys, values))


def _hub_records(ref: str, split: str) -> Iterator[tuple[int, Any]]:
    """`hf:NAME` or `hf:NAME:SPLIT`, streamed from the Hugging Face hub (needs the network)."""
    from datasets import load_dataset
    name, _, explicit = ref[len(HUB_PREFIX):].partition(":")
    try:
        ds = load_dataset(name, split=explicit or None, streaming=True)
    except Exception as e:  # noqa: BLE001 - any failure of the library is reported as one line
        raise SourceError(f"{ref}: cannot load from the hub "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    yield from enumerate(_pick_split(ds, split, ref), start=1)


# --------------------------------------------------------------------------- records -> conversations


def parse_record(record: Any) -> Any:
    if isinstance(record, bytes):
        try:
            text = record.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RowError("invalid_utf8", f"{e.reason} at byte {e.start}") from None
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError as e:  # the row is one line of its file: the column is within it
            raise RowError("malformed_json", f"{e.msg} at column {e.colno} of the line") from None
    return record


def detect_format(row: Any) -> str:
    """The one format whose keys the row has; ambiguous or unknown rows raise RowError."""
    if not isinstance(row, dict):
        raise RowError("not_an_object", type(row).__name__)
    found = [f for f, keys in FORMAT_KEYS.items() if all(k in row for k in keys)]
    if "sharegpt" in found and _is_list_of_lists(_json_field(row["conversations"])):
        found[found.index("sharegpt")] = "conversation"
    found = sorted(set(found))
    if len(found) == 1:
        return found[0]
    if not found:
        raise RowError("unknown_format", f"keys {sorted(map(str, row))[:8]} match none of {', '.join(FORMATS)}")
    raise RowError("ambiguous_format", f"keys {sorted(map(str, row))[:8]} match {' and '.join(found)}")


TURN_FIELDS = ("role", "content", "from", "value")


def rename_fields(row: Any, columns: dict[str, str]) -> Any:
    """Your field names -> canonical ones (`data.columns` maps canonical -> yours), in the row and its turns."""
    if not columns or not isinstance(row, dict):
        return row
    row = dict(row)
    for canon, yours in columns.items():
        if canon not in TURN_FIELDS and yours in row and canon not in row:
            row[canon] = row.pop(yours)
    turn_map = {yours: canon for canon, yours in columns.items() if canon in TURN_FIELDS}
    if not turn_map:
        return row

    def fix(turns: Any) -> Any:
        if isinstance(turns, list):
            return [fix(t) if isinstance(t, list) else
                    {turn_map.get(k, k): v for k, v in t.items()} if isinstance(t, dict) else t for t in turns]
        return turns
    for key in ("messages", "conversations", "conversation"):
        if key in row:
            row[key] = fix(_json_field(row[key]))
    for key in ("prompt", "completion"):  # a string there is text, whatever it looks like
        if key in row:
            row[key] = fix(row[key])
    return row


def _is_list_of_lists(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(c, list) for c in v)


def _json_field(v: Any) -> Any:
    """CSV cells and some Parquet exports hold message lists as JSON text, in the fields that can
    only hold turns (messages, conversations, conversation). Only a list of turns (dicts with a
    role/from) or of conversations is taken; any other text stays the string it is. Prompt and
    completion strings are never parsed: they are text, even when they look like JSON."""
    if not (isinstance(v, str) and v.lstrip()[:1] == "["):
        return v
    try:
        parsed = orjson.loads(v)
    except orjson.JSONDecodeError:
        return v

    def is_turn(t: Any) -> bool:
        return isinstance(t, dict) and ("role" in t or "from" in t)
    if isinstance(parsed, list) and parsed and all(is_turn(t) or (isinstance(t, list) and all(map(is_turn, t)))
                                                   for t in parsed):
        return parsed
    return v


def _content(v: Any) -> Any:
    """OpenAI content parts [{"type": "text", "text": ...}] -> one string; other values unchanged."""
    if isinstance(v, list) and all(isinstance(p, dict) for p in v):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in v):
            raise RowError("non_string_content", "content parts other than text")
        return "".join(p["text"] for p in v)
    return v


def _message(m: Any, role_key: str, content_key: str, role_map: dict | None = None) -> dict:
    if not isinstance(m, dict) or role_key not in m:
        raise RowError("missing_role", f"turn {m!r:.60}")
    role = m[role_key]
    if role_map is not None:
        if role not in role_map:
            raise RowError("unknown_role", repr(role))
        role = role_map[role]
    msg = {"role": role, "content": _content(m.get(content_key))}
    msg.update({k: m[k] for k in EXTRA_MESSAGE_KEYS if m.get(k) is not None})
    if msg["content"] is None and msg.get("tool_calls"):
        msg["content"] = ""
    return msg


def check_conversation(messages: list[dict]) -> list[dict]:
    if not messages:
        raise RowError("empty_conversation")
    for m in messages:
        if m["role"] not in ROLES:
            raise RowError("unknown_role", repr(m["role"]))
        if not isinstance(m["content"], str):
            raise RowError("non_string_content", f"{m['role']} content is {type(m['content']).__name__}")
    assistants = [m for m in messages if m["role"] == "assistant"]
    if not assistants:
        raise RowError("no_assistant_turn")
    if any(not m["content"].strip() and not m.get("tool_calls") for m in assistants):
        raise RowError("empty_assistant_reply")
    return messages


def _turns(row: dict, key: str) -> list:
    turns = _json_field(row.get(key))
    if not isinstance(turns, list):
        raise RowError("missing_key", f"'{key}' is {type(turns).__name__}, not a list of turns")
    return turns


def _one(turns: list, sharegpt: bool) -> list[dict]:
    first = turns[0] if turns and isinstance(turns[0], dict) else {}
    if sharegpt or ("from" in first and "role" not in first):
        return check_conversation([_message(m, "from", "value", SHAREGPT_ROLES) for m in turns])
    return check_conversation([_message(m, "role", "content") for m in turns])


def to_conversations(row: Any, fmt: str = "auto", columns: dict[str, str] | None = None) -> list[list[dict]]:
    """Every conversation in one record (usually one). Raises RowError for a bad record."""
    if not isinstance(row, dict):
        raise RowError("not_an_object", type(row).__name__)
    row = rename_fields(row, columns or {})
    fmt = detect_format(row) if fmt == "auto" else fmt
    if fmt == "messages":
        return [_one(_turns(row, "messages"), False)]
    if fmt == "sharegpt":
        return [_one(_turns(row, "conversations"), True)]
    if fmt == "conversation":
        key = "conversation" if "conversation" in row else "conversations"
        convs = _turns(row, key)
        if not _is_list_of_lists(convs):
            raise RowError("missing_key", f"'{key}' is not a list of conversations")
        return [_one(c, False) for c in convs]
    if fmt == "prompt_completion":
        if "completion" not in row:
            raise RowError("missing_column", "no 'completion' (the reply) in a prompt/completion row")
        prompt, completion = row.get("prompt"), row.get("completion")
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        msgs = msgs + (completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}])
        return [check_conversation([_message(m, "role", "content") for m in msgs])]
    if fmt == "alpaca":
        if "output" not in row:
            raise RowError("missing_column", "no 'output' (the reply) in an Alpaca row")
        instruction, extra = row.get("instruction"), row.get("input") or ""
        if not isinstance(instruction, str) or not isinstance(extra, str):
            raise RowError("non_string_content", "instruction/input")
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        msgs = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        return [check_conversation(msgs + [{"role": "user", "content": prompt},
                                           {"role": "assistant", "content": row.get("output")}])]
    if fmt == "choice":
        return [check_conversation(_choice(row))]
    raise RowError("unknown_format", fmt)


def to_prompt(row: Any, columns: dict[str, str] | None = None) -> list[dict]:
    """The turns of a prompt row (the replay stage's prompts; no reply needed): `messages` or ShareGPT
    `conversations` (a trailing assistant reply and everything after it are left out), a `prompt`
    (text or turns, with an optional `completion` that is left out), or Alpaca `instruction` + `input`."""
    if not isinstance(row, dict):
        raise RowError("not_an_object", type(row).__name__)
    row = rename_fields(row, columns or {})
    if "messages" in row or "conversations" in row:
        key = "messages" if "messages" in row else "conversations"
        turns = _turns(row, key)
        first = turns[0] if turns and isinstance(turns[0], dict) else {}
        sharegpt = "from" in first and "role" not in first
        msgs = [_message(m, "from", "value", SHAREGPT_ROLES) if sharegpt else _message(m, "role", "content")
                for m in turns]
    elif "prompt" in row:
        prompt = row["prompt"]
        msgs = [_message(m, "role", "content") for m in prompt] if isinstance(prompt, list) else \
            [{"role": "user", "content": prompt}]
    elif "instruction" in row:
        instruction, extra = row.get("instruction"), row.get("input") or ""
        if not isinstance(instruction, str) or not isinstance(extra, str):
            raise RowError("non_string_content", "instruction/input")
        msgs = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + \
            [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra.strip() else instruction}]
    else:
        raise RowError("unknown_format", f"keys {sorted(map(str, row))[:8]}: a prompt row has messages, "
                                         "conversations, prompt or instruction")
    for m in msgs:
        if m["role"] not in ROLES:
            raise RowError("unknown_role", repr(m["role"]))
        if not isinstance(m["content"], str):
            raise RowError("non_string_content", f"{m['role']} content is {type(m['content']).__name__}")
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    msgs = msgs[:last] if last is not None and all(m["role"] != "user" for m in msgs[last:]) else msgs
    if not msgs or msgs[-1]["role"] != "user" or not msgs[-1]["content"].strip():
        raise RowError("no_user_turn", "a prompt ends with a non-empty user turn")
    return msgs


def _choice(row: dict) -> list[dict]:
    """`{"question", "choices", "answer"}` -> the question and the right option as its reply, which also
    holds the options and the right one's index (CHOICE_KEYS)."""
    question, choices, answer = row.get("question"), _json_field(row.get("choices")), row.get("answer")
    if not isinstance(question, str):
        raise RowError("non_string_content", f"question is {type(question).__name__}")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c.strip() for c in choices):
        raise RowError("bad_choices", "'choices' must be a list of at least 2 non-empty strings")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise RowError("bad_answer", f"'answer' must be the index of the right choice (0..{len(choices) - 1}), "
                                     f"got {answer!r}")
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": choices[answer], "choices": list(choices), "answer": answer}]


def plain(messages: list[dict]) -> list[dict]:
    """The conversation as the chat template sees it (without a choice row's options)."""
    return [{k: v for k, v in m.items() if k not in CHOICE_KEYS} if "choices" in m else m for m in messages]


def file_format(path: Path | str, fmt: str, columns: dict[str, str] | None, split: str = "train",
                sample: int = 50) -> str:
    """`data.format` for one file; with `auto`, the one format its first readable rows agree on."""
    if fmt != "auto":
        return fmt
    seen: dict[str, int] = {}
    for _, rec in _take(iter_records(path, split), sample):
        try:
            f = detect_format(rename_fields(parse_record(rec), columns or {}))
        except RowError as e:
            if e.reason == "ambiguous_format":
                raise SourceError(f"{path}: ambiguous format, {e.detail}; set data.format") from None
            continue
        seen[f] = seen.get(f, 0) + 1
    if len(seen) == 1:
        return next(iter(seen))
    if not seen and next(iter_records(path, split), None) is None:
        return "auto"  # an empty file (e.g. an empty part of a sharded export): no rows to read
    if not seen:
        raise SourceError(f"{path}: cannot detect the format from its first {sample} rows (none has the keys of "
                          f"{', '.join(FORMATS)}); set data.format, or map your field names with data.columns")
    raise SourceError(f"{path}: rows mix formats ({', '.join(f'{k}: {v}' for k, v in sorted(seen.items()))}); "
                      "split the file or set data.format")


def _take(it: Iterator, n: int) -> Iterator:
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


def iter_conversations(paths: list[Path], fmt: str = "auto", columns: dict[str, str] | None = None
                       ) -> Iterator[tuple[str, list[dict] | RowError]]:
    """("file:line", messages | RowError) for every conversation of every file, in order."""
    for path in paths:
        f = file_format(path, fmt, columns)
        for n, rec in iter_records(path):
            try:
                convs = to_conversations(parse_record(rec), f, columns)
            except RowError as e:
                yield f"{path}:{n}", e
                continue
            for k, conv in enumerate(convs):
                yield (f"{path}:{n}" if len(convs) == 1 else f"{path}:{n}#{k}"), conv


def row_content_key(record: Any) -> bytes:
    """Stable bytes of a record's content (for the hash-based held-out split)."""
    if isinstance(record, bytes):
        return record.strip()
    return orjson.dumps(record, option=orjson.OPT_SORT_KEYS, default=str)



def prompt_and_reference(messages: list[dict]) -> tuple[list[dict], str]:
    """Eval split: the turns before the final assistant reply, and that reply."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], messages[last]["content"]


def choices_of(messages: list[dict]) -> tuple[list[str], int] | None:
    """A multiple-choice row's (options, index of the right one); None for any other row."""
    last = messages[max(i for i, m in enumerate(messages) if m["role"] == "assistant")]
    if "choices" not in last:
        return None
    return last["choices"], last["answer"]
