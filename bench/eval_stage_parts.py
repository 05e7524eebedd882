"""Where the evaluate stage's time goes: its parts timed inside one in-process run (nproc 1).

    .venv/bin/python bench/eval_stage_parts.py --batch-size 16     # SmolLM2, the 279 retention test prompts
    .venv/bin/python bench/eval_stage_parts.py --batch-size 64
    .venv/bin/python bench/eval_stage_parts.py --batch-size 64 --no-loss-prefix   # the loss pass computing every token

Prints one JSON line: the stage's seconds, and those of model loading, generation and the
teacher-forced loss pass, the generated tokens and tokens/s over the whole stage.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def main() -> None:
    import eval_throughput as et

    import stages.evaluate.runner as runner
    from stages.pipeline import plan, run_stage
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=0, help="0: every prompt of the file once")
    ap.add_argument("--no-loss-prefix", action="store_true",
                    help="the loss pass computes the shared system prompt again in every batch (as before)")
    a = ap.parse_args()
    if a.no_loss_prefix:
        import stages.evaluate.losses as losses
        losses.cache_argument = lambda model: None
    args = argparse.Namespace(model="smollm2", prompts=a.prompts, max_new_tokens=48, batch_size=a.batch_size,
                              prompts_file=ROOT / "data/smollm2-identity/retention_test.jsonl", artifacts=None)
    times: dict[str, float] = {}

    def timed(name: str) -> None:
        f = getattr(runner, name)

        @functools.wraps(f)
        def g(*x, **k):
            t = time.perf_counter()
            try:
                return f(*x, **k)
            finally:
                times[name] = times.get(name, 0.0) + time.perf_counter() - t
        setattr(runner, name, g)

    for name in ("load_model", "generate", "teacher_forced_sums"):
        timed(name)
    with tempfile.TemporaryDirectory() as tmp:
        p = plan(et.config(Path(tmp), args, 1))
        run_stage(p, "prepare", on_line=lambda _: None)
        t0 = time.perf_counter()
        res = run_stage(p, "evaluate", force=True, on_line=lambda _: None)
        total = time.perf_counter() - t0
        preds = [json.loads(line) for line in (Path(res.path) / "predictions.jsonl").read_text().splitlines()]
        metrics = json.loads((Path(res.path) / "metrics.json").read_text())
    tokens = sum(r["new_tokens"] for r in preds)
    print(json.dumps({"batch_size": a.batch_size, "loss_prefix": not a.no_loss_prefix, "stage_s": round(total, 1),
                      **{k + "_s": round(v, 1) for k, v in times.items()},
                      "generated_tokens": tokens, "tokens_per_s": round(tokens / total, 1),
                      "eval_loss": metrics.get("eval_loss"), "accuracy": metrics.get("accuracy")}))


if __name__ == "__main__":
    main()
