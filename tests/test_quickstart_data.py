"""The SmolLM2 quickstart's data (data/smollm2-identity): the retention set measures what the base
model already knew, so none of its questions may be trained on (train.jsonl holds the identity rows
plus the replayed and self-distilled general questions), and it is what the pool's one selection
rule kept (select_retention.py: every pool question the base model answered right)."""

import json
from pathlib import Path

from stages.evaluate.scorers import contains, normalize

DATA = Path(__file__).resolve().parents[1] / "data" / "smollm2-identity"


def user_turns(path: Path) -> list[str]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [m["content"] for r in rows for m in r["messages"] if m["role"] == "user"]


def test_no_retention_question_is_trained_on():
    retention = {normalize(q) for q in user_turns(DATA / "retention_eval.jsonl")}
    trained = {normalize(q) for name in ("train.jsonl", "val.jsonl", "identity_eval.jsonl")
               for q in user_turns(DATA / name)}
    assert len(retention) >= 200
    assert not retention & trained, sorted(retention & trained)[:5]


def test_the_retention_set_is_the_pool_questions_the_base_model_answered_right():
    pool = [json.loads(line) for line in (DATA / "retention_pool.jsonl").read_text(encoding="utf-8").splitlines()]
    selection = json.loads((DATA / "retention_selection.json").read_text(encoding="utf-8"))
    results = selection["questions"]
    for p in pool:  # the rule, applied again to the base model's recorded answers
        assert results[p["id"]]["passed"] == contains(results[p["id"]]["answer"], p["reference"]), p["id"]
    passed = [p for p in pool if results[p["id"]]["passed"]]
    rows = [json.loads(line) for line in (DATA / "retention_eval.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(r["messages"][0]["content"], r["messages"][1]["content"]) for r in rows] == \
        [(p["question"], p["reference"]) for p in passed]
    assert len(pool) >= 300 and len({normalize(p["question"]) for p in pool}) == len(pool)
