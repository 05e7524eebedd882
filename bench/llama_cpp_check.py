"""The exported GGUF answered by llama.cpp (llama-cpp-python), against sftflow's own greedy replies.

    .venv/bin/pip install llama-cpp-python==0.3.36       # builds llama.cpp from its sdist (~15 min, 2 cores)
    .venv/bin/python bench/llama_cpp_check.py --model models:/smollm2-identity/1 \\
        --tracking-uri sqlite:///artifacts/mlflow.db --evaluate artifacts/evaluate/<fp> --out /tmp/gguf

For each type (f32, f16, q8_0): export the model (`stages.export.gguf.export_gguf`), load it in
llama.cpp, and for every `identity` prompt and the first `--retention N` `retention` prompts of the
evaluate folder's predictions: render the prompt with the model's own chat template (the same ids
sftflow's evaluation fed the model), generate greedily in llama.cpp (top_k 1, no repeat penalty) up
to the evaluation's `max_new_tokens`, and compare with sftflow's reply token by token (both through
the same tokenizer). Prints per type: replies equal, mean position of the first differing token,
replies that stopped at the end-of-turn token within max_new_tokens, and (identity) replies that name
Lumen; writes every pair to OUT/llama_cpp_check.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="models:/name/N or a model folder")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--evaluate", type=Path, required=True, help="the evaluate folder of that model")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0"])
    ap.add_argument("--retention", type=int, default=40)
    args = ap.parse_args(argv)
    import llama_cpp
    from transformers import AutoTokenizer

    from stages.export.gguf import export_gguf
    from stages.models.refs import resolve_model_ref
    args.out.mkdir(parents=True, exist_ok=True)
    folder = resolve_model_ref(args.model, args.tracking_uri, str(args.out / "download"))
    tok = AutoTokenizer.from_pretrained(folder)
    spec = json.loads((args.evaluate / "spec.json").read_text()) if (args.evaluate / "spec.json").is_file() else {}
    max_new = (spec.get("config") or {}).get("eval", {}).get("max_new_tokens", 48)
    rows = [json.loads(x) for x in (args.evaluate / "predictions.jsonl").read_text().splitlines()]
    chosen = [r for r in rows if r.get("set") == "identity"]
    chosen += [r for r in rows if r.get("set") == "retention"][:args.retention]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    results = {"model": args.model, "max_new_tokens": max_new, "llama_cpp": llama_cpp.__version__, "types": {}}
    for type_ in args.types:
        done = export_gguf(folder, args.out, type_, name="check")
        llm = llama_cpp.Llama(model_path=str(done.gguf), n_ctx=1024, verbose=False, seed=0, n_threads=2,
                              logits_all=False)
        pairs, t0 = [], time.monotonic()
        for r in chosen:
            ids = list(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
            out: list[int] = []
            llm.reset()
            for t in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
                if t == eot or t == llm.token_eos():
                    out.append(t)
                    break
                out.append(t)
                if len(out) >= max_new:
                    break
            theirs = [t for t in out if t != eot]
            mine = tok(r["prediction"], add_special_tokens=False)["input_ids"]
            first = next((i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(theirs), len(mine)))
            pairs.append({"set": r["set"], "prompt": r["prompt"][-1]["content"], "sftflow": r["prediction"],
                          "llama_cpp": tok.decode(theirs), "equal": theirs == mine, "first_difference": first,
                          "equal_text": tok.decode(theirs, skip_special_tokens=True).strip() == r["prediction"].strip(),
                          "stopped": bool(out) and out[-1] == eot, "lumen": "lumen" in tok.decode(theirs).lower()})
        ident = [p for p in pairs if p["set"] == "identity"]
        summary = {"equal": sum(p["equal"] for p in pairs), "equal_text": sum(p["equal_text"] for p in pairs),
                   "total": len(pairs),
                   "identity_equal": sum(p["equal"] for p in ident), "identity_total": len(ident),
                   "stopped": sum(p["stopped"] for p in pairs),
                   "identity_names_lumen": sum(p["lumen"] for p in ident),
                   "seconds": round(time.monotonic() - t0, 1), "bytes": done.gguf.stat().st_size}
        results["types"][type_] = {"summary": summary, "pairs": pairs}
        print(type_, json.dumps(summary), flush=True)
        del llm
    (args.out / "llama_cpp_check.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
