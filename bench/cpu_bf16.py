"""bf16 against fp32 on this CPU, side by side in one run: what `precision: auto` chooses here and why
(core/precision.py: bf16 only with AMX), and what each precision costs.

    .venv/bin/python bench/cpu_bf16.py                        # flags, matmuls, generation, training (~15 min)
    .venv/bin/python bench/cpu_bf16.py --parts flags,matmul   # a minute
    .venv/bin/python bench/cpu_bf16.py --prompts 0 --train-steps 8 --json /tmp/bf16.json

  flags       the CPU's name and the flags that decide it (avx2, avx512f, avx512_bf16, amx_bf16, amx_tile),
              torch's own queries, and `auto` as the plan (/proc/cpuinfo) and a rank (torch) resolve it.
  matmul      `torch.nn.functional.linear` at SmolLM2-135M's shapes (decode, output head, a training
              micro-batch), fp32 and bf16 GFLOP/s, the mean of --repeat calls after one warm-up.
  generate    the SmolLM2 quickstart's retention questions (--prompts of them, 0: all 279), greedy,
              48 new tokens, batch 16: plain transformers `generate` per left-padded batch (what a
              user writes) in fp32 and bf16, and the evaluate stage (1 process) in fp32 and bf16;
              seconds, the ratio to plain fp32 and to plain generate in the same precision, and how
              many replies equal plain generate's in the same precision.
  train       the quickstart's replay and train stages (`run_stage`, fresh artifacts each) at
              --train-steps optimizer steps, with actor.precision fp32 then bf16: seconds and ratio.

Timings are wall seconds on this machine as it is (say what else ran); the ratios are the claim.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
SHAPES = [(16, 576, 1536, 1, "decode, batch 16"), (64, 576, 1536, 1, "decode, batch 64"),
          (64, 576, 49152, 2, "output head, batch 64"), (2048, 576, 1536, 2, "training micro-batch"),
          (2048, 576, 49152, 2, "training output head")]
QUICKSTART = ROOT / "configs" / "examples" / "smollm2-identity.yaml"


def cpu_facts() -> dict:
    import torch

    from stages.core.precision import cpu_amx, torch_cpu_amx, why
    from stages.runtime.distributed import precision_why
    name, flags = platform.processor() or "?", set()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name") and name in ("?", "", "x86_64"):
                name = line.partition(":")[2].strip()
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                break
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count(), "flags": {f: f in flags for f in FLAGS},
            "torch": torch.__version__, "torch_amx_tile": bool(torch.cpu._is_amx_tile_supported()),
            "torch_avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "plan_auto": why("auto", "cpu", amx=cpu_amx()), "rank_auto": precision_why("auto", torch.device("cpu")),
            "rank_amx": torch_cpu_amx()}


def matmuls(repeat: int) -> list[dict]:
    import torch
    import torch.nn.functional as F
    rows = []
    for n, i, o, threads, what in SHAPES:
        torch.set_num_threads(threads)
        rate = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            x, w = torch.randn(n, i, dtype=dtype), torch.randn(o, i, dtype=dtype)
            F.linear(x, w)
            t0 = time.perf_counter()
            for _ in range(repeat):
                F.linear(x, w)
            rate[name] = 2 * n * i * o * repeat / (time.perf_counter() - t0) / 1e9
        rows.append({"shape": f"{n} x {i} x {o} ({what})", "threads": threads, "fp32_gflops": round(rate["fp32"]),
                     "bf16_gflops": round(rate["bf16"]), "ratio": round(rate["bf16"] / rate["fp32"], 2)})
    torch.set_num_threads(os.cpu_count() or 1)
    return rows


def generation(args, work: Path) -> list[dict]:
    import eval_throughput as et
    ns = argparse.Namespace(model="smollm2", prompts=args.prompts, max_new_tokens=48, batch_size=16,
                            artifacts=args.artifacts, prompts_file=ROOT / "data" / "smollm2-identity" /
                            "retention_test.jsonl", precision="fp32")
    out = {}
    for precision in ("fp32", "bf16"):
        ns.precision = precision
        out[("plain", precision)] = et.run_batched(work, ns)
        print(f"plain generate {precision}: {out[('plain', precision)]['seconds']:.1f} s", flush=True)
        out[("stage", precision)] = et.run_stage_method(work, ns, 1)
        print(f"evaluate stage {precision}: {out[('stage', precision)]['seconds']:.1f} s", flush=True)
    rows, plain32 = [], out[("plain", "fp32")]["seconds"]
    for (how, precision), r in out.items():
        same = out[("plain", precision)]["texts"]
        rows.append({"method": f"{'plain `generate`' if how == 'plain' else 'evaluate stage'} {precision}",
                     "seconds": round(r["seconds"], 1), "vs_plain_fp32": round(plain32 / r["seconds"], 2),
                     "vs_plain_same_precision": round(out[("plain", precision)]["seconds"] / r["seconds"], 2),
                     "same_replies": f"{sum(a == b for a, b in zip(r['texts'], same))}/{len(same)}",
                     "accuracy": round(r["accuracy"], 3)})
    return rows


def training(args, work: Path) -> list[dict]:
    from stages.core.config import load_config
    from stages.models.base import resolve_model
    from stages.pipeline import plan, run_stage
    rows = []
    for precision in ("fp32", "bf16"):
        cfg = load_config(QUICKSTART, [f"artifacts_dir={work / ('train-' + precision)}",
                                       f"actor.precision={precision}", f"eval.precision={precision}",
                                       f"runner.max_steps={args.train_steps}", "runner.save_interval=0",
                                       "runner.val_check_interval=0"])
        p = plan(cfg)
        resolve_model(cfg, p.fingerprints["models"], lambda _: None)  # the GGUF converted before the clock starts
        seconds = {}
        for stage in ("replay", "prepare", "train"):
            t0 = time.perf_counter()
            run_stage(p, stage, on_line=lambda _: None)
            seconds[stage] = time.perf_counter() - t0
        rows.append({"precision": precision, "replay_s": round(seconds["replay"], 1),
                     "train_s": round(seconds["train"], 1), "steps": args.train_steps})
        print(f"{precision}: replay {seconds['replay']:.1f} s, train {seconds['train']:.1f} s", flush=True)
    for r in rows:
        r["train_speed_vs_fp32"] = round(rows[0]["train_s"] / r["train_s"], 2)
        r["replay_speed_vs_fp32"] = round(rows[0]["replay_s"] / r["replay_s"], 2)
    return rows


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys),
                      *("| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="flags,matmul,generate,train")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=64, help="retention questions to generate for (0: all 279)")
    ap.add_argument("--train-steps", type=int, default=8)
    ap.add_argument("--artifacts", type=Path, default=None, help="keep the converted SmolLM2 here between runs")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    parts = args.parts.split(",")
    result: dict = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    facts = result["machine"] = cpu_facts()
    print(f"{facts['cpu']}, {facts['cores']} cores; flags: "
          + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in facts["flags"].items())
          + f"\ntorch {facts['torch']}: amx_tile {facts['torch_amx_tile']}, avx512_bf16 {facts['torch_avx512_bf16']}, "
            f"capability {facts['torch_capability']}\nauto (plan): {facts['plan_auto']}\nauto (rank): "
            f"{facts['rank_auto']}\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="sftflow-bench-bf16-") as tmp:
        work = Path(tmp)
        if "matmul" in parts:
            result["matmul"] = matmuls(args.repeat)
            print(table(result["matmul"]) + "\n", flush=True)
        if "generate" in parts:
            result["generate"] = generation(args, work)
            print(table(result["generate"]) + "\n", flush=True)
        if "train" in parts:
            result["train"] = training(args, work)
            print(table(result["train"]) + "\n", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
