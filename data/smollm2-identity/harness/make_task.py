"""Writes retention_mc.jsonl: the retention test questions as four-option multiple choice, for the
harness-set example (retention_mc.yaml, an lm-evaluation-harness task with local data).

    python data/smollm2-identity/harness/make_task.py

Each question keeps its own reference as the right option; the three wrong ones are the references
of other questions, picked by position (no model is asked, nothing is selected by an answer), and
the right option's place rotates with the row's index. Deterministic: rerunning reproduces the file.
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "retention_test.jsonl"


def items(source: Path = SOURCE) -> list[dict]:
    """Every row of `source` (messages: a question, its reference) as a four-option item; also the
    items bench/choice_bench.py times."""
    rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    refs = [r["messages"][1]["content"] for r in rows]
    out = []
    for i, row in enumerate(rows):
        options, k = [refs[i]], 1
        while len(options) < 4:
            candidate = refs[(i + 37 * k) % len(refs)]
            if candidate not in options:
                options.append(candidate)
            k += 1
        shift = i % 4
        options = options[-shift:] + options[:-shift] if shift else options
        out.append({"question": row["messages"][0]["content"], "choices": options, "answer": options.index(refs[i])})
    return out


if __name__ == "__main__":
    path = HERE / "retention_mc.jsonl"
    path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items()), encoding="utf-8")
    print(f"wrote {path} ({len(items())} items)")
