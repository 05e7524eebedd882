"""Where generation's time goes: `model.generate` per left-padded batch (the former path) against
our decode loop (stages/inference/generation.py), on the same prompts, model and batch size.

    .venv/bin/python bench/generation_breakdown.py                  # SmolLM2 base, the quickstart's eval sets
    .venv/bin/python bench/generation_breakdown.py --sets retention_test --batch-size 16 --max-new-tokens 48

Every `model.forward` call is timed (the first of a `generate` call is its prefill), so the
wall time splits into tokenization, prefill forwards, decode forwards and the rest (`generate`'s
own per-step work: logits processors, stopping criteria, cache and mask bookkeeping; for our loop,
refills and row selection). Counted, not timed: the prefill's pad tokens and the tokens of the
prefix every prompt shares (the system prompt), and the decode row-steps spent on rows that had
already stopped. Both paths must give the same replies (checked).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def smollm2_dir() -> str:
    import yaml

    from stages.core.config import config_from_dict
    from stages.models.base import resolve_model
    from stages.pipeline import plan
    raw = yaml.safe_load((ROOT / "configs" / "examples" / "smollm2-identity.yaml").read_text())
    raw["artifacts_dir"] = str(ROOT / "artifacts")
    cfg = config_from_dict(raw)
    return resolve_model(cfg, plan(cfg).fingerprints["models"])


def prompts_of(sets: list[str]) -> list[list[dict]]:
    from stages.chatdata.readers import prompt_and_reference
    out = []
    for name in sets:
        rows = (ROOT / "data" / "smollm2-identity" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        out += [prompt_and_reference(json.loads(r)["messages"])[0] for r in rows if r.strip()]
    return out


class Timed:
    """Wraps `model.forward`: seconds and (rows, new tokens, cache length) of each call."""

    def __init__(self, model):
        self.model, self.calls, self.inner = model, [], model.forward

    def __enter__(self):
        @functools.wraps(self.inner)  # `generate` and our loop read the signature
        def forward(*args, **kw):
            t0 = time.perf_counter()
            out = self.inner(*args, **kw)
            ids = kw.get("input_ids", args[0] if args else None)
            self.calls.append((time.perf_counter() - t0, ids.shape[0], ids.shape[1]))
            return out
        self.model.forward = forward
        return self

    def __exit__(self, *exc):
        del self.model.forward


def common_prefix(ids: list[list[int]]) -> int:
    n = min(len(i) for i in ids)
    for k in range(n):
        if any(i[k] != ids[0][k] for i in ids):
            return k
    return n


def measure(model, tok, prompts, args, loop: str) -> dict:
    from stages.inference.generation import generate
    t0 = time.perf_counter()
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    tokenize = time.perf_counter() - t0
    with Timed(model) as timed:
        t0 = time.perf_counter()
        replies = generate(model, tok, prompts, args.max_new_tokens, args.batch_size, loop=loop)
        wall = time.perf_counter() - t0
    prefill = [c for c in timed.calls if c[2] > 1]
    decode = [c for c in timed.calls if c[2] == 1]
    return {"replies": replies, "wall": wall, "tokenize": tokenize, "ids": ids,
            "prefill_s": sum(c[0] for c in prefill), "prefill_calls": len(prefill),
            "prefill_tokens": sum(c[1] * c[2] for c in prefill),
            "decode_s": sum(c[0] for c in decode), "decode_calls": len(decode),
            "decode_row_steps": sum(c[1] for c in decode)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Hugging Face folder (default: the quickstart's SmolLM2)")
    ap.add_argument("--sets", default="identity_eval,retention_test", help="files of data/smollm2-identity/")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    from stages.inference.generation import load
    model, tok = load(args.model or smollm2_dir(), device="cpu")
    prompts = prompts_of(args.sets.split(","))
    import torch
    print(f"{len(prompts)} prompts ({args.sets}), batch {args.batch_size}, {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads")
    old = measure(model, tok, prompts, args, "generate")
    new = measure(model, tok, prompts, args, "auto")
    same = sum(a == b for a, b in zip(old["replies"], new["replies"]))
    ids = old["ids"]
    lengths = [len(i) for i in ids]
    real = sum(r["new_tokens"] for r in old["replies"])
    # the former path: batches in file order, each padded to its longest prompt, decoding to its longest reply
    pads = steps = useful = 0
    for b in range(0, len(ids), args.batch_size):
        chunk, reps = lengths[b:b + args.batch_size], old["replies"][b:b + args.batch_size]
        pads += max(chunk) * len(chunk) - sum(chunk)
        longest = max(min(r["new_tokens"] + r["stopped"], args.max_new_tokens) for r in reps)
        steps += (longest - 1) * len(reps)  # decode steps after the prefill's token, every row
        useful += sum(min(r["new_tokens"] + r["stopped"], args.max_new_tokens) - 1 for r in reps)
    shared = common_prefix(ids)
    print(f"prompt tokens: {sum(lengths):,} (mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}); "
          f"prefix shared by every prompt: {shared} tokens; generated tokens: {real:,}; same replies: "
          f"{same}/{len(prompts)}\n")
    print("| | former: `generate` per batch | ours |")
    print("|---|---:|---:|")
    for name, key in (("wall, s", "wall"), ("prefill forwards, s", "prefill_s"), ("decode forwards, s", "decode_s")):
        print(f"| {name} | {old[key]:.1f} | {new[key]:.1f} |")
    for r in (old, new):
        r["rest"] = r["wall"] - r["prefill_s"] - r["decode_s"]
    print(f"| the rest (loop's own work, detokenizing), s | {old['rest']:.1f} | {new['rest']:.1f} |")
    print(f"| tokenizing the prompts (before the loop), s | {old['tokenize']:.2f} | {new['tokenize']:.2f} |")
    print(f"| prefill forwards (tokens fed) | {old['prefill_calls']} ({old['prefill_tokens']:,}) "
          f"| {new['prefill_calls']} ({new['prefill_tokens']:,}) |")
    print(f"| decode forwards (row-steps) | {old['decode_calls']} ({old['decode_row_steps']:,}) "
          f"| {new['decode_calls']} ({new['decode_row_steps']:,}) |")
    print(f"| ms per decode forward (rows per forward) | {1e3 * old['decode_s'] / max(old['decode_calls'], 1):.0f} "
          f"({old['decode_row_steps'] / max(old['decode_calls'], 1):.1f}) "
          f"| {1e3 * new['decode_s'] / max(new['decode_calls'], 1):.0f} "
          f"({new['decode_row_steps'] / max(new['decode_calls'], 1):.1f}) |")
    print(f"| generated tokens/s | {real / old['wall']:.1f} | {real / new['wall']:.1f} "
          f"({old['wall'] / new['wall']:.2f}x) |")
    print(f"\nformer path, counted: pad tokens {pads:,} of {pads + sum(lengths):,} prefill tokens "
          f"({pads / (pads + sum(lengths)):.0%}); the shared prefix {shared * len(ids):,} "
          f"({shared * len(ids) / (pads + sum(lengths)):.0%}); decode row-steps on rows already stopped "
          f"{steps - useful:,} of {steps:,} ({(steps - useful) / max(steps, 1):.0%})")


if __name__ == "__main__":
    main()
