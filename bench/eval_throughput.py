"""Evaluation speed: the evaluate stage against a naive per-prompt `model.generate` loop.

    .venv/bin/python bench/eval_throughput.py                       # builtin tiny model, 64 prompts (~1 minute)
    .venv/bin/python bench/eval_throughput.py --model smollm2 --prompts 32 --max-new-tokens 48
                                                                    # the real model of the second quickstart,
                                                                    # on its retention questions
    .venv/bin/python bench/eval_throughput.py --model smollm2 \
        --prompts-file data/smollm2-identity/retention_test.jsonl --prompts 0 --max-new-tokens 48 \
        --methods batched,stage-generate,stage1,stage2,llama.cpp
                                                                    # issue 48's goal: the quickstart's retention
                                                                    # test set, every prompt once

Both score the same held-out prompts (`--prompts-file`, cycled to `--prompts`: the demo's eval
prompts, or for `--model smollm2` the quickstart's retention questions, which the base model
answers right) with the same model, greedy decoding and the `contains` scorer:

  * naive loop               one prompt at a time: `apply_chat_template` + `model.generate`
                             (KV cache, batch of 1), stopping at the same stop tokens.
  * evaluate stage, 1 proc   `run_stage(plan, "evaluate")` in-process: left-padded batches of
                             `eval.batch_size` (base model not scored: `eval.eval_base: false`).
  * evaluate stage, 2 procs  the same under torchrun, each rank a contiguous slice.
  * batched generate         plain transformers: `model.generate` per left-padded batch of
                             `--batch-size` in the file's order (what the stage did before issue 48).
  * evaluate stage through `generate`  the stage, 1 process, with generation.generate's former
                             path (`loop="generate"`): today's stage against its own past.
  * llama.cpp                (`llama.cpp`, needs llama-cpp-python) the model exported to GGUF f32
                             (stages/export), one prompt at a time, greedy, OMP_NUM_THREADS
                             threads (all cores when unset): the CPU
                             engine people compare with. Its own kernels round differently, so
                             its replies may differ (the check column counts them).

`--methods` picks and orders them (naive, stage1, stage2, stage2-in, stage2-auto, batched, stage-generate,
llama.cpp; stage2-in and stage2-auto: a 2-process config scored in the stage's process, and where
`eval.launch: auto` puts it, stages/evaluate/placement.py);
the first is the reference of the "vs" and "same replies" columns.

Throughput is generated tokens (each reply up to its stop token) per second of wall time,
model loading included on both sides (and torchrun's start for 2 processes). The replies are
compared: the check column says how many of the stage's predictions equal the naive loop's,
and the accuracies must be equal (batching with left padding can flip a near-tie argmax, which
the check would show).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def write_prompts(path: Path, n: int, source: Path) -> Path:
    """`n` rows of `source`, cycled (0: each row once)."""
    rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    with open(path, "w", encoding="utf-8") as f:
        for row in itertools.islice(itertools.cycle(rows), n or len(rows)):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def config(tmp: Path, args, nproc: int, launch: str = "auto"):
    from stages.core.config import config_from_dict
    model = {}
    if args.model == "smollm2":
        import yaml
        quick = yaml.safe_load((ROOT / "configs" / "examples" / "smollm2-identity.yaml").read_text())["actor"]["model"]
        model = {"model_path": quick["model_path"], "model_sha256": quick["model_sha256"]}
    elif args.model:
        model = {"model_path": args.model}
    prompts = write_prompts(tmp / "eval.jsonl", args.prompts, args.prompts_file)
    return config_from_dict({
        "artifacts_dir": str(args.artifacts or tmp / "artifacts"),
        "actor": {"nproc_per_node": nproc, "model": model},
        "data": {"train_data_paths": [str(prompts)], "val_data_paths": [str(prompts)], "format": "messages",
                 "max_length": 2048 if args.model else 512},
        "eval": {"model": "base", "eval_base": False, "batch_size": args.batch_size,
                 "max_new_tokens": args.max_new_tokens, "scorer": "contains",
                 "precision": getattr(args, "precision", "fp32"), "launch": launch},
    })


def run_stage_method(tmp: Path, args, nproc: int, loop: str = "auto", launch: str = "auto") -> dict:
    import functools

    import stages.evaluate.runner as runner
    from stages.pipeline import plan, run_stage
    p = plan(config(tmp, args, nproc, launch))
    run_stage(p, "prepare", on_line=lambda _: None)
    ours = runner.generate
    runner.generate = functools.partial(ours, loop=loop)  # in-process only: nproc 1
    try:
        t0 = time.perf_counter()
        result = run_stage(p, "evaluate", force=True, on_line=lambda _: None)
        seconds = time.perf_counter() - t0
    finally:
        runner.generate = ours
    preds = [json.loads(line) for line in (Path(result.path) / "predictions.jsonl").read_text().splitlines()]
    return {"seconds": seconds, "tokens": sum(r["new_tokens"] for r in preds),
            "texts": [r["prediction"] for r in preds], "accuracy": result.metrics["accuracy"]}


def model_and_rows(tmp: Path, args):
    from stages.models.base import resolve_model
    from stages.pipeline import plan
    cfg = config(tmp, args, 1)
    rows = [json.loads(line) for line in (tmp / "eval.jsonl").read_text(encoding="utf-8").splitlines()]
    return resolve_model(cfg, plan(cfg).fingerprints["models"]), rows


def run_batched(tmp: Path, args) -> dict:
    """Plain transformers: left-padded batches of --batch-size in file order, one `generate` each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from stages.chatdata.readers import prompt_and_reference
    from stages.evaluate.scorers import get_scorer
    from stages.inference.generation import stop_ids
    model_dir, rows = model_and_rows(tmp, args)
    score = get_scorer("contains")
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    dtype = torch.bfloat16 if getattr(args, "precision", "fp32") == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    stops = stop_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    texts, tokens, correct = [], 0, 0
    pairs = [prompt_and_reference(row["messages"]) for row in rows]
    with torch.no_grad():
        for b in range(0, len(pairs), args.batch_size):
            chunk = pairs[b:b + args.batch_size]
            enc = tok.apply_chat_template([p for p, _ in chunk], add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True, padding=True)
            out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=stops,
                                 pad_token_id=pad)
            for (_, reference), row in zip(chunk, out[:, enc["input_ids"].shape[1]:].tolist()):
                n = next((k for k, t in enumerate(row) if t in stops), len(row))
                text = tok.decode(row[:n], skip_special_tokens=True)
                texts.append(text)
                tokens += n
                correct += bool(score(text, reference))
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "texts": texts, "accuracy": correct / len(rows)}


def run_llama_cpp(tmp: Path, args) -> dict:
    """llama.cpp on the model exported to GGUF f32 (export not timed; loading is), one prompt at a time."""
    import llama_cpp
    from transformers import AutoTokenizer
    from stages.chatdata.readers import prompt_and_reference
    from stages.evaluate.scorers import get_scorer
    from stages.export.gguf import export_gguf
    model_dir, rows = model_and_rows(tmp, args)
    done = export_gguf(model_dir, tmp / "gguf", "f32", name="bench")
    tok = AutoTokenizer.from_pretrained(model_dir)
    stops = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tok.get_vocab()}
    score = get_scorer("contains")
    t0 = time.perf_counter()
    # as many threads as the torch methods get (OMP_NUM_THREADS when set), for a like-for-like row
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count())
    llm = llama_cpp.Llama(model_path=str(done.gguf), n_ctx=1024, verbose=False, seed=0, n_threads=threads,
                          n_threads_batch=threads, n_batch=512)
    stops.add(llm.token_eos())
    texts, tokens, correct = [], 0, 0
    for row in rows:
        prompt, reference = prompt_and_reference(row["messages"])
        ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"])
        out: list[int] = []
        for t in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if t in stops:
                break
            out.append(t)
            if len(out) >= args.max_new_tokens:
                break
        text = tok.decode(out, skip_special_tokens=True)
        texts.append(text)
        tokens += len(out)
        correct += bool(score(text, reference))
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "texts": texts, "accuracy": correct / len(rows)}


def run_naive(tmp: Path, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from stages.chatdata.readers import prompt_and_reference
    from stages.evaluate.scorers import get_scorer
    from stages.models.base import resolve_model
    from stages.pipeline import plan
    from stages.inference.generation import stop_ids
    cfg = config(tmp, args, 1)
    model_dir = resolve_model(cfg, plan(cfg).fingerprints["models"])
    rows = [json.loads(line) for line in (tmp / "eval.jsonl").read_text(encoding="utf-8").splitlines()]
    score = get_scorer("contains")
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir)
    dtype = torch.bfloat16 if getattr(args, "precision", "fp32") == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    stops = stop_ids(model, tok)
    texts, tokens, correct = [], 0, 0
    with torch.no_grad():
        for row in rows:
            prompt, reference = prompt_and_reference(row["messages"])
            ids = tok.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=stops,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stops[0])
            new = out[0, ids["input_ids"].shape[1]:].tolist()
            n = next((k for k, t in enumerate(new) if t in stops), len(new))
            text = tok.decode(new[:n], skip_special_tokens=True)
            texts.append(text)
            tokens += n
            correct += bool(score(text, reference))
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "texts": texts, "accuracy": correct / len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64, help="prompts, the file's rows cycled (0: each row once)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16, help="eval.batch_size of the stage")
    ap.add_argument("--model", default=None, help="smollm2 (the real-model quickstart's) or any actor.model.model_path")
    ap.add_argument("--artifacts", type=Path, default=None, help="keep the fetched/converted model here between runs")
    ap.add_argument("--prompts-file", type=Path, default=None, help="chat rows whose last assistant turn is the "
                    "reference (default: data/demo/eval.jsonl; for smollm2 its retention_eval.jsonl)")
    ap.add_argument("--methods", default="naive,stage1,stage2",
                    help="comma-separated, the first the reference: naive, stage1, stage2, batched, stage-generate, "
                         "llama.cpp")
    args = ap.parse_args()
    if args.prompts_file is None:
        args.prompts_file = ROOT / "data" / ("smollm2-identity/retention_eval.jsonl" if args.model == "smollm2"
                                             else "demo/eval.jsonl")
    with tempfile.TemporaryDirectory(prefix="sftflow-bench-eval-") as tmp:
        work = Path(tmp)
        methods = {
            "naive": ("naive loop (per prompt)", lambda: run_naive(work, args)),
            "stage1": ("evaluate stage, 1 process", lambda: run_stage_method(work, args, 1)),
            "stage2": ("evaluate stage, 2 processes (torchrun)",
                       lambda: run_stage_method(work, args, 2, launch="torchrun")),
            "stage2-in": ("evaluate stage, 2-process config scored in the stage's process",
                          lambda: run_stage_method(work, args, 2, launch="in_process")),
            "stage2-auto": ("evaluate stage, 2-process config, eval.launch auto",
                            lambda: run_stage_method(work, args, 2)),
            "batched": (f"transformers `generate`, batches of {args.batch_size}", lambda: run_batched(work, args)),
            "stage-generate": ("evaluate stage, 1 process, former path (`generate` per batch)",
                               lambda: run_stage_method(work, args, 1, loop="generate")),
            "llama.cpp": ("llama.cpp 0.3 (GGUF f32, per prompt)", lambda: run_llama_cpp(work, args)),
        }
        results = {}
        for key in args.methods.split(","):
            name, fn = methods[key]
            results[name] = fn()
            print(f"{name}: {results[name]['seconds']:.1f} s", flush=True)
    ref_name, ref = next(iter(results.items()))
    base = ref["tokens"] / ref["seconds"]
    n = len(ref["texts"])
    print(f"\n{n} prompts, max_new_tokens {args.max_new_tokens}, model {args.model or 'builtin tiny-chat'}, "
          f"stage batch {args.batch_size}; reference: {ref_name}\n")
    print("| method | seconds | generated tokens | tokens/s | vs reference | same replies | accuracy |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        same = sum(a == b for a, b in zip(r["texts"], ref["texts"]))
        print(f"| {name} | {r['seconds']:.1f} | {r['tokens']:,} | {r['tokens'] / r['seconds']:,.0f} | "
              f"{r['tokens'] / r['seconds'] / base:.2f}x | {same}/{n} | {r['accuracy']:.3f} |")


if __name__ == "__main__":
    main()
