"""Generation on a machine another job shares: OpenMP's wait policy and thread count.

    .venv/bin/python bench/shared_machine.py                      # SmolLM2 (the second quickstart's model)
    .venv/bin/python bench/shared_machine.py --prompts 16 --max-new-tokens 16 --rounds 1

Each cell runs, in a fresh process (OpenMP reads its settings when torch loads), greedy generation of
the quickstart's first `--prompts` retention questions at batch 16, and reports wall seconds of the
generation (model load excluded), on an idle machine and while one competing job runs: another
process doing what a second sftflow stage does (torch matmuls on every core, its own default
OpenMP settings). The environments compared are what a process gets:

  * default    nothing set (libgomp spins a while before it sleeps; what users' runs got before)
  * PASSIVE    OMP_WAIT_POLICY=PASSIVE (a waiting thread sleeps at once)
  * ACTIVE     OMP_WAIT_POLICY=ACTIVE (a waiting thread spins)
  * spin N     GOMP_SPINCOUNT=N (libgomp spins N times, then sleeps)

Rounds interleave the cells so drift in the machine's speed hits every cell alike; the table gives the
median and the slowdown of each cell against its own idle time, and against default-idle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORK = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, n, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(model_dir); tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
rows = [json.loads(l) for l in open(sys.argv[4], encoding="utf-8")][:n]
texts = [tok.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True) for r in rows]
t = time.perf_counter()
with torch.no_grad():
    for i in range(0, len(texts), 16):
        enc = tok(texts[i:i + 16], return_tensors="pt", padding=True, add_special_tokens=False)
        model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
print(json.dumps({"seconds": time.perf_counter() - t}))
"""

COMPETITOR = r"""
import torch, time
a = torch.randn(384, 384)
while True:
    for _ in range(50):
        a = torch.tanh(a @ a) * 0.5
"""

POLICIES = {"default": {}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
            "spin 1k": {"GOMP_SPINCOUNT": "1000"},
            "spin 10k": {"GOMP_SPINCOUNT": "10000"}, "spin 100k": {"GOMP_SPINCOUNT": "100000"}}


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    return {**env, **extra, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def _model_dir() -> str:
    sys.path.insert(0, str(ROOT))
    from stages.core.config import load_config
    from stages.models.base import resolve_model
    from stages.pipeline import plan
    cfg = load_config(ROOT / "configs/examples/smollm2-identity.yaml")
    return resolve_model(cfg, plan(cfg).fingerprints["models"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    args = ap.parse_args()
    model = _model_dir()
    data = ROOT / "data/smollm2-identity/retention_test.jsonl"
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for load in ("idle", "one competing job"):
            rival = (subprocess.Popen([sys.executable, "-c", COMPETITOR], env=_env({}))
                     if load != "idle" else None)
            try:
                time.sleep(2 if rival else 0)
                for name in args.policies:
                    out = subprocess.run([sys.executable, "-c", WORK, model, str(args.prompts),
                                          str(args.max_new_tokens), str(data)], env=_env(POLICIES[name]),
                                         capture_output=True, text=True, check=True).stdout
                    times.setdefault((name, load), []).append(json.loads(out.splitlines()[-1])["seconds"])
            finally:
                if rival:
                    rival.kill()
                    rival.wait()
    base = statistics.median(times[("default", "idle")])
    print(f"{args.prompts} retention prompts x {args.max_new_tokens} new tokens, batch 16, SmolLM2-135M fp32, "
          f"{os.cpu_count()} CPUs, {args.rounds} round(s), median seconds")
    print(f"{'policy':<10} {'idle':>8} {'1 competing job':>16} {'x own idle':>11} {'x default idle':>15}")
    for name in args.policies:
        idle = statistics.median(times[(name, "idle")])
        busy = statistics.median(times[(name, "one competing job")])
        print(f"{name:<10} {idle:8.1f} {busy:16.1f} {busy / idle:11.2f} {busy / base:15.2f}")


if __name__ == "__main__":
    main()
