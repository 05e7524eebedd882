"""Splits the committed retention pool into an unselected dev set (for trials) and test set (scored
once per chosen configuration, for the README), before any model answers either.

    python data/smollm2-identity/split_retention.py     # rewrites retention_dev.jsonl, retention_test.jsonl

Rule: the pool's ids in file order, shuffled with random.Random(SEED); the first half (rounded down)
is dev, the rest test; each set keeps pool order. No item is chosen by any model's answer: a set
of what the base model gets right can only lose (docs/evaluation.md, "Retention").
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261203


def main() -> None:
    pool = [json.loads(line) for line in (HERE / "retention_pool.jsonl").read_text(encoding="utf-8").splitlines()]
    ids = [q["id"] for q in pool]
    assert len(set(ids)) == len(ids), "pool ids must be unique"
    shuffled = ids[:]
    random.Random(SEED).shuffle(shuffled)
    dev = set(shuffled[: len(ids) // 2])
    for name, keep in (("retention_dev.jsonl", lambda i: i in dev), ("retention_test.jsonl", lambda i: i not in dev)):
        rows = [{"messages": [{"role": "user", "content": q["question"]},
                              {"role": "assistant", "content": q["reference"]}]} for q in pool if keep(q["id"])]
        (HERE / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        print(f"{name}: {len(rows)} questions")


if __name__ == "__main__":
    main()
