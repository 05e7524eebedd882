"""Multiple choice by log-likelihood (stages/evaluate/choice.py): one forward per option against
one prompt forward per item.

    .venv/bin/python bench/choice_bench.py                       # ~150 four-option items, tiny + SmolLM2
    .venv/bin/python bench/choice_bench.py --items 60 --batch-size 8 --models tiny
    .venv/bin/python bench/choice_bench.py --lm-eval /tmp/lmeval/bin/python   # also lm-evaluation-harness

Items: the first `--items` rows of data/smollm2-identity/retention_eval.jsonl (a short question, a
short reference: capitals, arithmetic, ...), each with four options: its own reference and the
references of three other rows, in an order fixed by the row's index. Models: the builtin tiny
model (built into a temporary folder) and, when one was converted, SmolLM2-135M from
artifacts/models/*/ (the first folder whose config.json says model_type llama), both float32 on CPU.

Per model, `option_logprobs` runs both ways on the same items and batch size, after one untimed
warm-up call each: `share_prompts=False` (one forward of prompt + option per option, the code before)
and the default (each prompt once, its KV cache shared by its options). Before any time is printed,
the two are checked: the same token counts, the same pick under every rule (sum, chars, bytes) and
the largest difference in a log-likelihood. Times are the best of `--repeats` runs, wall clock
and, in brackets, the process' CPU time (steadier when other jobs share the cores).

With `--lm-eval PYTHON` (a virtual environment with lm-eval 0.4.13 installed), that Python also
scores the same (rendered prompt, option) pairs with lm-eval's HFLM.loglikelihood at the same
batch size, timed the same way. Its numbers differ a little by construction (it tokenizes
prompt + option as one string and moves trailing whitespace into the option; see choice.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DATA = ROOT / "data" / "smollm2-identity" / "retention_eval.jsonl"
RULES = ("sum", "chars", "bytes")

LM_EVAL_CHILD = r"""
import json, sys, time
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
args = json.loads(sys.stdin.read())
lm = HFLM(pretrained=args["path"], batch_size=args["batch_size"], device="cpu", dtype="float32")
reqs = [Instance(request_type="loglikelihood", doc={}, arguments=(c, o), idx=k)
        for k, (c, o) in enumerate(args["pairs"])]
lm.loglikelihood(reqs[:8])
best = None
for _ in range(args["repeats"]):
    w, c = time.perf_counter(), time.process_time()
    out = lm.loglikelihood(reqs)
    w, c = time.perf_counter() - w, time.process_time() - c
    best = (w, c) if best is None or w < best[0] else best
print(json.dumps({"wall": best[0], "cpu": best[1], "lls": [float(x[0]) for x in out]}))
"""


def items(n: int) -> list[dict]:
    """The harness example's four-option items (data/smollm2-identity/harness/make_task.py), built from DATA."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_task",
                                                  ROOT / "data" / "smollm2-identity" / "harness" / "make_task.py")
    make_task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_task)
    return [{"prompt": [{"role": "user", "content": x["question"]}], "choices": x["choices"], "answer": x["answer"]}
            for x in make_task.items(DATA)[:n]]


def tiny_model(tmp: Path) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import base_model, tiny_config_dict, write_config

    from stages.core.config import load_config
    return base_model(load_config(write_config(tmp, tiny_config_dict(tmp, n_train=48, n_val=4))))


def smollm2() -> str | None:
    for cfg in sorted((ROOT / "artifacts" / "models").glob("*/config.json")):
        try:
            if json.loads(cfg.read_text()).get("model_type") == "llama":
                return str(cfg.parent)
        except (OSError, ValueError):
            continue
    return None


def picks(rows, lps) -> dict[str, list[int]]:
    from stages.evaluate.choice import pick
    out = {}
    for rule in RULES:
        div = {"sum": lambda c, nb: 1, "chars": lambda c, nb: len(c), "bytes": lambda c, nb: nb}[rule]
        out[rule] = [pick([lp / div(c, nb) for (lp, _, nb), c in zip(opts, r["choices"])])
                     for r, opts in zip(rows, lps)]
    return out


def timed(fn, repeats: int):
    best = None
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        w, c = time.perf_counter() - w, time.process_time() - c
        if best is None or w < best[0]:
            best = (w, c, result)
    return best


def bench_model(name: str, path: str, rows: list[dict], bs: int, repeats: int, lm_eval: str | None,
                skip_old: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.evaluate.choice import option_logprobs
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, options = [r["prompt"] for r in rows], [r["choices"] for r in rows]
    run = {"old": lambda: option_logprobs(model, tok, prompts, options, bs, share_prompts=False),
           "new": lambda: option_logprobs(model, tok, prompts, options, bs)}
    if skip_old:  # the old path's numbers are in docs/benchmarks.md; tests hold both paths equal
        del run["old"]
    for k in run:  # warm-up
        option_logprobs(model, tok, prompts[:4], options[:4], bs, share_prompts=k == "new")
    res = {k: timed(fn, repeats) for k, fn in run.items()}
    new = res["new"][2]
    old = res["old"][2] if "old" in res else new
    assert [[(n, b) for _, n, b in r] for r in old] == [[(n, b) for _, n, b in r] for r in new]
    p_old, p_new = picks(rows, old), picks(rows, new)
    out = {"model": name, "items": len(rows), "options": sum(len(r["choices"]) for r in rows), "batch": bs,
           "old": res["old"][:2] if "old" in res else None, "new": res["new"][:2],
           "max_diff": max(abs(a[0] - b[0]) for ra, rb in zip(old, new) for a, b in zip(ra, rb)),
           "max_abs_ll": max(abs(a[0]) for r in old for a in r),
           "same_picks": all(p_old[rule] == p_new[rule] for rule in RULES),
           "accuracy": sum(p == r["answer"] for p, r in zip(p_new["sum"], rows)) / len(rows)}
    if not out["same_picks"]:
        raise SystemExit(f"{name}: the picks differ between the two paths: {p_old} vs {p_new}")
    if lm_eval:
        pairs = [(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False), o)
                 for r in rows for o in r["choices"]]
        proc = subprocess.run([lm_eval, "-c", LM_EVAL_CHILD], capture_output=True, text=True,
                              input=json.dumps({"path": path, "batch_size": bs, "pairs": pairs, "repeats": repeats}),
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            out["lm_eval"] = None
        else:
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            flat = iter(got["lls"])
            lme = [[next(flat) for _ in r["choices"]] for r in rows]
            out["lm_eval"] = (got["wall"], got["cpu"])
            out["lm_eval_same_sum_picks"] = sum(
                max(range(len(s)), key=lambda k: (s[k], -k)) == p for s, p in zip(lme, p_new["sum"])) / len(rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=16, help="eval.batch_size (default 16, as the config's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    ap.add_argument("--lm-eval", default=None, metavar="PYTHON", help="a Python with lm-eval 0.4.13 installed")
    ap.add_argument("--skip-old", action="store_true", help="leave out the forward-per-option path (the slowest)")
    args = ap.parse_args()
    import torch
    rows = items(args.items)
    print(f"# {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} "
          f"threads); {len(rows)} items x 4 options from {DATA.relative_to(ROOT)}; batch size {args.batch_size}; "
          f"best of {args.repeats}")
    results = []
    with tempfile.TemporaryDirectory(prefix="sftflow-bench-choice-") as tmp:
        for name in args.models.split(","):
            path = tiny_model(Path(tmp)) if name == "tiny" else smollm2()
            if path is None:
                print(f"# {name}: no converted folder under artifacts/models/, skipped")
                continue
            r = bench_model(name, path, rows, args.batch_size, args.repeats, args.lm_eval, args.skip_old)
            results.append(r)
            print(json.dumps(r), flush=True)
    print()
    head = "| model | items (options) | batch | forward per option, s | one prompt forward, s | speed-up |"
    sep = "|---|---|---|---|---|---|"
    if args.lm_eval:
        head += " lm-eval 0.4.13, s | vs lm-eval |"
        sep += "---|---|"
    head += " max |Δ log-lik| | same picks (3 rules) |"
    sep += "---|---|"
    print(head)
    print(sep)
    for r in results:
        old = ((f"{r['old'][0]:.2f} ({r['old'][1]:.2f}) | ", f"{r['old'][0] / r['new'][0]:.2f}x") if r["old"]
               else ("- | ", "-"))
        line = (f"| {r['model']} | {r['items']} ({r['options']}) | {r['batch']} "
                f"| {old[0]}{r['new'][0]:.2f} ({r['new'][1]:.2f}) | {old[1]} |")
        if args.lm_eval:
            le = r.get("lm_eval")
            line += (f" {le[0]:.2f} ({le[1]:.2f}) | {le[0] / r['new'][0]:.2f}x |" if le else " failed | - |")
        line += (f" {r['max_diff']:.1e} (of up to {r['max_abs_ll']:.0f}) | {'yes' if r['same_picks'] else 'NO'} |"
                 if r["old"] else " - | - |")
        print(line)
    for r in results:
        if args.lm_eval and r.get("lm_eval"):
            print(f"\n{r['model']}: lm-eval's pick by summed log-likelihood = sftflow's on "
                  f"{r['lm_eval_same_sum_picks']:.0%} of the items")


if __name__ == "__main__":
    main()
