"""Data preparation throughput and memory: sftflow's prepare stage against a TRL-style path.

    .venv/bin/python bench/prepare_throughput.py                  # ~5 minutes on 2 CPU cores
    .venv/bin/python bench/prepare_throughput.py --rows 5000 --rss-rows 0   # a quick look

Both sides start from the same synthetic chat JSONL (1-3 turns, a system prompt in a third of
the rows) and the same tokenizer (the builtin tiny-chat BPE with a ChatML template that has
`{% generation %}` markers, which the TRL-style path needs and sftflow does not use):

  * sftflow prepare          the real stage (`run_stage(plan(cfg), "prepare")`): read, validate,
                             render, mask (template-agnostic), tokenize, write Arrow shards,
                             quarantine; `data.num_proc` 1 and 2.
  * render + encode floor    what no single-pass preparation can beat: each conversation
                             rendered once and its text encoded once, nothing else.
  * TRL-style                what SFTTrainer-style preparation does: `datasets.load_dataset("json")`
                             then `.map(apply_chat_template(..., tokenize=True, return_dict=True,
                             return_assistant_tokens_mask=True))`, num_proc 1 and 2, written to a
                             fresh datasets cache (its equivalent of our shards).

Throughput = tokens produced / wall seconds of the whole preparation (each side's own counting
of tokens; they agree, which is checked). Peak RSS: sftflow prepare run in a fresh process on
`--rss-rows` single-turn conversations (default 1,000,000), measured with `resource.getrusage` (the maximum
over the process and its tokenizing children). Timings on a shared machine are noisy; use
--repeat to keep each method's best round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta", "ro", "vi", "ze", "po") for b in
         ("n", "ra", "li", "mo", "tes", "dor", "x", "ve", "lu", "ge", "pa", "qi")]


def synthetic_jsonl(path: Path, n: int, seed: int = 0, max_turns: int = 3) -> Path:
    rng = random.Random(seed)

    def sentence(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            msgs = [{"role": "system", "content": sentence(4, 10)}] if rng.random() < 1 / 3 else []
            for _ in range(rng.randint(1, max_turns)):
                msgs += [{"role": "user", "content": sentence(5, 25)},
                         {"role": "assistant", "content": sentence(10, 60)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def build_tokenizer(work: Path) -> str:
    from stages.core.config import config_from_dict
    from stages.models.base import resolve_model
    from stages.pipeline import plan
    corpus = synthetic_jsonl(work / "corpus.jsonl", 500, seed=1)
    cfg = config_from_dict({"artifacts_dir": str(work / "artifacts"),
                            "data": {"train_data_paths": [str(corpus)], "val_data_paths": [str(corpus)]}})
    return resolve_model(cfg, plan(cfg).fingerprints["models"])


def run_sftflow(data: Path, model: str, work: Path, num_proc: int) -> tuple[float, int]:
    from stages.core.config import config_from_dict
    from stages.pipeline import plan, run_stage
    cfg = config_from_dict({"artifacts_dir": str(work), "actor": {"model": {"model_path": model}},
                            "data": {"train_data_paths": [str(data)], "val_fraction": 0.01, "format": "messages",
                                     "max_length": 4096, "num_proc": num_proc}})
    t0 = time.perf_counter()
    m = run_stage(plan(cfg), "prepare", force=True, on_line=lambda _: None).metrics
    return time.perf_counter() - t0, m["train_tokens"] + m["val_tokens"]


def run_trl_style(data: Path, model: str, work: Path, num_proc: int) -> tuple[float, int]:
    import datasets
    from transformers import AutoTokenizer
    datasets.disable_caching()
    tok = AutoTokenizer.from_pretrained(model)

    def tokenize(row):
        out = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(work / "hf-cache"))
    ds = ds.map(tokenize, remove_columns=ds.column_names, num_proc=num_proc if num_proc > 1 else None,
                cache_file_name=str(work / f"mapped-{num_proc}.arrow"))
    seconds = time.perf_counter() - t0
    tokens = sum(len(x) for x in ds["input_ids"])
    return seconds, tokens


def run_floor(data: Path, model: str, work: Path, num_proc: int) -> tuple[float, int]:
    """The floor of any single-pass design: read the rows, render each conversation once with the
    compiled template and encode the text once (batched, fast tokenizer); no masks, no checks, no
    output. `num_proc` is ignored (one process)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    t0 = time.perf_counter()
    tokens, texts = 0, []
    with open(data, encoding="utf-8") as f:
        for line in f:
            texts.append(tok.apply_chat_template(json.loads(line)["messages"], tokenize=False))
            if len(texts) == 1000:
                tokens += sum(len(x) for x in tok(texts, add_special_tokens=False)["input_ids"])
                texts = []
    if texts:
        tokens += sum(len(x) for x in tok(texts, add_special_tokens=False)["input_ids"])
    return time.perf_counter() - t0, tokens


def peak_rss_child(rows: int, model: str, work: Path) -> tuple[float, float, int]:
    """(peak RSS MiB, seconds, tokens) of sftflow prepare on `rows` conversations, in a fresh process."""
    data = synthetic_jsonl(work / "big.jsonl", rows, seed=2, max_turns=1)  # one turn each: minutes, not an hour
    code = (f"import sys, json, time, resource; sys.path.insert(0, {str(ROOT)!r}); "
            "from bench.prepare_throughput import run_sftflow; from pathlib import Path; "
            f"s, t = run_sftflow(Path({str(data)!r}), {model!r}, Path({str(work / 'big-art')!r}), 1); "
            "print(json.dumps({'seconds': s, 'tokens': t, "
            "'self': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["self"] / 1024, out["seconds"], out["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20_000, help="conversations for the throughput comparison")
    ap.add_argument("--rss-rows", type=int, default=1_000_000, help="conversations for the peak-RSS run (0: skip)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; each method keeps its fastest")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="sftflow-bench-prepare-") as tmp:
        work = Path(tmp)
        model = build_tokenizer(work)
        data = synthetic_jsonl(work / "chat.jsonl", args.rows)
        methods = {"TRL-style, num_proc 1": (run_trl_style, 1), "TRL-style, num_proc 2": (run_trl_style, 2),
                   "render + encode floor, 1 process": (run_floor, 1),
                   "sftflow prepare, num_proc 1": (run_sftflow, 1), "sftflow prepare, num_proc 2": (run_sftflow, 2)}
        best: dict[str, tuple[float, int]] = {}
        for r in range(args.repeat):
            for name, (fn, nproc) in methods.items():
                seconds, tokens = fn(data, model, work / f"{fn.__name__}-{nproc}-{r}", nproc)
                if name not in best or seconds < best[name][0]:
                    best[name] = (seconds, tokens)
                print(f"  round {r + 1}: {name}: {seconds:.2f} s, {tokens} tokens", flush=True)
        token_counts = {t for _, t in best.values()}
        assert len(token_counts) == 1, f"the methods disagree on the token count: {best}"
        base, floor = best["TRL-style, num_proc 1"][0], best["render + encode floor, 1 process"][0]
        print(f"\n{args.rows} conversations, {token_counts.pop()} tokens, {os.cpu_count()} CPUs\n")
        print("| method | seconds | tokens/s | vs TRL-style (1 proc) | vs the floor |")
        print("|---|---:|---:|---:|---:|")
        for name, (seconds, tokens) in best.items():
            print(f"| {name} | {seconds:.2f} | {tokens / seconds:,.0f} | {base / seconds:.2f}x | "
                  f"{floor / seconds:.2f}x |")
        if args.rss_rows:
            rss, seconds, tokens = peak_rss_child(args.rss_rows, model, work)
            print(f"\nsftflow prepare of {args.rss_rows:,} conversations ({tokens:,} tokens) in one process: "
                  f"peak RSS {rss:,.0f} MiB, {seconds:.0f} s ({tokens / seconds:,.0f} tokens/s)")


if __name__ == "__main__":
    main()
