"""Does evaluation's accuracy depend on the batch size or the process count? (issue 56)

    .venv/bin/python bench/eval_invariance.py                     # SmolLM2, the quickstart's 303 prompts
    .venv/bin/python bench/eval_invariance.py --every 8           # every 8th prompt (a quick look)
    .venv/bin/python bench/eval_invariance.py --precisions bf16 --heads model,fp32 --layouts 1,16,64,2x64

The quickstart's two eval sets (identity 24, retention 279: 303 prompts fixed before any model
answered them) are answered by the base model SmolLM2-135M-Instruct with the evaluate stage's own
decode (`stages.inference.generation.generate`, greedy, 48 new tokens), once per layout:

  * `B`      one process, `eval.batch_size: B` (1, 16, 64);
  * `2xB`    two processes at batch B: each rank's contiguous slice (`rank_slice`) decoded on its own,
             as evaluate's ranks do (in this process: same slices, same batches, one set of threads);

in each precision (fp32; bf16: `actor.precision=bf16`) and, in bf16, with the token picked by the
model's own bf16 logits (`--heads model`) or by the head in fp32 (`fp32`: evaluate's rule). The
independent reference is one plain `model.generate` per prompt in the same precision (`--no-reference`
leaves it out). Per row: accuracy per set (contains scorer), the replies that differ from the
reference and from batch 1 of the same precision and head, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
SETS = {"identity": "identity_eval.jsonl", "retention": "retention_test.jsonl"}


def smollm2_folder(artifacts: Path) -> str:
    """The quickstart's base model as a Hugging Face folder (converted from its pinned GGUF once)."""
    import yaml

    from stages.core.config import config_from_dict
    from stages.models.base import resolve_model
    from stages.pipeline import plan
    raw = yaml.safe_load((ROOT / "configs" / "examples" / "smollm2-identity.yaml").read_text())
    raw["artifacts_dir"] = str(artifacts)
    for key in ("train_data_paths", "val_data_paths"):
        raw["data"][key] = [str(ROOT / p) for p in raw["data"][key]]
    raw["replay"]["prompt_paths"] = [str(ROOT / p) for p in raw["replay"]["prompt_paths"]]
    for s in raw["eval"]["sets"].values():
        s["data_paths"] = [str(ROOT / p) for p in s["data_paths"]]
    cfg = config_from_dict(raw)
    return resolve_model(cfg, plan(cfg).fingerprints["models"])


def prompts(every: int) -> list[tuple[str, list[dict], str]]:
    """(set, prompt messages, reference) in file order, every `every`-th (by position, never by a reply)."""
    from stages.chatdata.readers import prompt_and_reference
    out = []
    for name, file in SETS.items():
        for line in (ROOT / "data" / "smollm2-identity" / file).read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append((name, *prompt_and_reference(json.loads(line)["messages"])))
    return out[::every]


def one_at_a_time(model, tok, items, max_new_tokens) -> list[str]:
    """The independent reference: a plain `model.generate` per prompt, greedy, the same stop tokens."""
    import torch

    from stages.inference.generation import stop_ids
    stops, out = stop_ids(model, tok), []
    with torch.no_grad():
        for _, prompt, _ in items:
            text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            enc = tok(text, add_special_tokens=False, return_tensors="pt")
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)[0, enc["input_ids"].shape[1]:]
            ids = gen.tolist()
            n = next((k for k, t in enumerate(ids) if t in stops), len(ids))
            out.append(tok.decode(ids[:n], skip_special_tokens=True))
    return out


def layout_replies(model, tok, items, layout: str, max_new_tokens: int, fp32_head: bool) -> list[str]:
    from stages.runtime.distributed import rank_slice
    from stages.inference.generation import generate
    ranks, batch = (int(layout.split("x")[0]), int(layout.split("x")[1])) if "x" in layout else (1, int(layout))
    replies: list[str] = []
    for rank in range(ranks):
        r = rank_slice(len(items), rank, ranks)
        replies += [x["text"] for x in generate(model, tok, [p for _, p, _ in items[r.start:r.stop]],
                                                max_new_tokens, batch, fp32_head=fp32_head)]
    return replies


def accuracy(items, replies) -> dict[str, str]:
    from stages.evaluate.scorers import get_scorer
    contains = get_scorer("contains", None, None)
    out = {}
    for name in SETS:
        pairs = [(r, ref) for (s, _, ref), r in zip(items, replies) if s == name]
        correct = sum(bool(contains(r, ref)) for r, ref in pairs)
        out[name] = f"{correct}/{len(pairs)}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--heads", default="model,fp32",
                    help="bf16 only: the argmax of the model's own logits, of an fp32 head")
    ap.add_argument("--layouts", default="1,16,64,2x64")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--artifacts", type=Path, default=ROOT / "artifacts")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()

    import torch

    from stages.inference.generation import load
    folder = smollm2_folder(args.artifacts)
    items = prompts(args.every)
    print(f"# {len(items)} prompts, SmolLM2-135M-Instruct, {args.max_new_tokens} new tokens, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    rows = []
    print("| precision | argmax of | layout | identity | retention | ≠ reference | ≠ batch 1 | seconds |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for precision in args.precisions.split(","):
        model, tok = load(folder, device="cpu", precision=precision)
        reference = None
        if not args.no_reference:
            t0 = time.perf_counter()
            reference = one_at_a_time(model, tok, items, args.max_new_tokens)
            acc = accuracy(items, reference)
            secs = time.perf_counter() - t0
            rows.append({"precision": precision, "head": "generate", "layout": "1 per prompt", **acc, "seconds": secs})
            print(f"| {precision} | `model.generate` | one per prompt | {acc['identity']} | {acc['retention']} "
                  f"| 0 | - | {secs:.0f} |", flush=True)
        heads = [h for h in args.heads.split(",")] if precision != "fp32" else ["model"]
        for head in heads:
            first = None
            for layout in args.layouts.split(","):
                t0 = time.perf_counter()
                replies = layout_replies(model, tok, items, layout, args.max_new_tokens, head == "fp32")
                secs = time.perf_counter() - t0
                first = first or replies
                acc = accuracy(items, replies)
                vs_ref = sum(a != b for a, b in zip(replies, reference)) if reference else None
                vs_first = sum(a != b for a, b in zip(replies, first))
                rows.append({"precision": precision, "head": head, "layout": layout, **acc, "vs_reference": vs_ref,
                             "vs_batch1": vs_first, "seconds": secs})
                name = ({"model": "the model's logits", "fp32": "an fp32 head"}[head] if precision != "fp32"
                        else "logits")
                lay = f"{layout.split('x')[0]} processes, batch {layout.split('x')[1]}" if "x" in layout else \
                    f"batch {layout}"
                print(f"| {precision} | {name} | {lay} | {acc['identity']} | {acc['retention']} | "
                      f"{'-' if vs_ref is None else vs_ref} | {vs_first} | {secs:.0f} |", flush=True)
        del model
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
