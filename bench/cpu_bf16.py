"""bf16 against fp32 on this CPU, side by side in one run: what `precision: auto` chooses here and why
(core/machine/precision.py: bf16 where core/machine/bf16_speed.py measured it faster at the model's shapes), and what
each precision costs.

    .venv/bin/python bench/cpu_bf16.py                        # flags, matmuls, generation, training (~15 min)
    .venv/bin/python bench/cpu_bf16.py --parts flags,matmul   # a minute
    .venv/bin/python bench/cpu_bf16.py --parts flags,quickstart  # the whole quickstart in each (~15-25 min)
    .venv/bin/python bench/cpu_bf16.py --prompts 0 --train-steps 8 --json /tmp/bf16.json

  flags       the CPU's name and its bf16 flags, torch's own queries, the calibration `auto` reads (bf16's
              measured speed over fp32's at SmolLM2-135M's training and decode shapes, timed afresh here
              and beside it what the cache holds), and `auto` as the plan and a rank resolve it.
  matmul      `torch.nn.functional.linear` at SmolLM2-135M's shapes (decode, output head, a training
              micro-batch), fp32 and bf16 GFLOP/s, the mean of --repeat calls after one warm-up.
  generate    the SmolLM2 quickstart's retention questions (--prompts of them, 0: all 279), greedy,
              48 new tokens, batch 16: plain transformers `generate` per left-padded batch (what a
              user writes) in fp32 and bf16, and the evaluate stage (1 process) in fp32 and bf16;
              seconds, the ratio to plain fp32 and to plain generate in the same precision, and how
              many replies equal plain generate's in the same precision.
  train       the quickstart's replay and train stages (`run_stage`, fresh artifacts each) at
              --train-steps optimizer steps, with actor.precision fp32 then bf16: seconds and ratio.
  quickstart  the SmolLM2 quickstart whole, every stage in the flow's order (`run_stage`, fresh artifacts
              each; the GGUF converted before the clock), in fp32 then bf16 (both keys): each stage's
              seconds and bf16's speed over fp32's, and the quickstart's verdicts in each (identity,
              retention against the base with its paired interval, the alias).

Timings are wall seconds on this machine as it is (say what else ran); the ratios are the claim.
"""

from __future__ import annotations

import argparse
import json
import os
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

    from stages.core.machine import bf16_speed
    from stages.core.machine.bf16_speed import Dims
    from stages.core.machine.precision import why
    from stages.runtime.distributed import precision_why
    name, flags = bf16_speed.cpu_identity()
    smollm2 = Dims(hidden=576, intermediate=1536, vocab=49152, kv=192, layers=30)
    cached = bf16_speed.speed(smollm2)  # what `auto` reads (measured once, on one thread)
    native = bf16_speed.native(flags)
    fresh = bf16_speed.measure(smollm2, bf16_speed.CALIBRATION_THREADS) if native else None  # again, now
    every = bf16_speed.measure(smollm2, os.cpu_count()) if native else None  # on every core, for comparison
    return {"cpu": name, "cores": os.cpu_count(), "flags": {f: f in flags for f in FLAGS},
            "torch": torch.__version__, "torch_amx_tile": bool(torch.cpu._is_amx_tile_supported()),
            "torch_avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "calibration_cached": cached and {"train": cached.train, "generate": cached.generate,
                                              "threads": cached.threads, "seconds": cached.seconds},
            "calibration_now": fresh and {"train": fresh.train, "generate": fresh.generate,
                                          "threads": fresh.threads, "seconds": fresh.seconds, "onednn": fresh.onednn},
            "calibration_all_cores": every and {"train": every.train, "generate": every.generate,
                                                "threads": every.threads, "seconds": every.seconds},
            "plan_auto": why("auto", "cpu", cpu=cached),
            "plan_auto_eval": why("auto", "cpu", cpu=cached, key="eval.precision"),
            "rank_auto": precision_why("auto", torch.device("cpu"))}


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


def quickstart(args, work: Path) -> list[dict]:
    """The quickstart's stages in each precision: seconds per stage, and its verdicts."""
    from stages.core.config import load_config
    from stages.models.base import resolve_model
    from stages.pipeline import plan, run_stage
    runs = {}
    for precision in args.precisions.split(","):
        art = work / f"quickstart-{precision}"
        if args.artifacts:  # the converted model reused: a GGUF conversion is no stage of the day
            art.mkdir(parents=True, exist_ok=True)
            models = Path(args.artifacts) / "models"
            if models.is_dir() and not (art / "models").exists():
                (art / "models").symlink_to(models.resolve())
        cfg = load_config(QUICKSTART, [f"artifacts_dir={art}", f"actor.precision={precision}",
                                       f"eval.precision={precision}"])
        p = plan(cfg)
        resolve_model(cfg, p.fingerprints["models"], lambda _: None)
        seconds = {}
        for stage in p.stages:
            t0 = time.perf_counter()
            run_stage(p, stage, on_line=lambda _: None)
            seconds[stage] = time.perf_counter() - t0
            print(f"{precision} {stage}: {seconds[stage]:.1f} s", flush=True)
        ev = json.loads((p.folder("evaluate") / "metrics.json").read_text())
        reg = json.loads((p.folder("register") / "registration.json").read_text())
        decided = json.loads((p.folder("register") / "manifest.json").read_text())["metrics"]
        sets = ev["sets"]
        runs[precision] = {"seconds": seconds, "identity": sets["identity"]["accuracy"],
                           "retention": sets["retention"]["accuracy"],
                           "retention_vs_base": (sets["retention"]["delta"], sets["retention"]["delta_low"],
                                                 sets["retention"]["delta_high"]),
                           "alias": ",".join(reg.get("aliases") or []) or None,
                           "reason": decided.get("alias_reason")}
    for precision, r in runs.items():
        d, lo, hi = r["retention_vs_base"]
        print(f"{precision}: identity {r['identity']:.3f}, retention {r['retention']:.3f} "
              f"({d:+.3f} [{lo:+.3f}, {hi:+.3f}] vs base), alias {r['alias']} ({r['reason']})", flush=True)
    if len(runs) < 2:
        return [{"stage": stage, f"{precision}_s": round(t, 1)} for precision, r in runs.items()
                for stage, t in r["seconds"].items()]
    rows = []
    for stage in runs["fp32"]["seconds"]:
        a, b = runs["fp32"]["seconds"][stage], runs["bf16"]["seconds"].get(stage)
        rows.append({"stage": stage, "fp32_s": round(a, 1), "bf16_s": round(b, 1) if b else None,
                     "bf16_speed_vs_fp32": round(a / b, 2) if b else None})
    total = {k: sum(r["seconds"].values()) for k, r in runs.items()}
    rows.append({"stage": "all stages", "fp32_s": round(total["fp32"], 1), "bf16_s": round(total["bf16"], 1),
                 "bf16_speed_vs_fp32": round(total["fp32"] / total["bf16"], 2)})
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
    ap.add_argument("--precisions", default="fp32,bf16", help="quickstart: the precisions to run (fp32,bf16)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    result: dict = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    facts = result["machine"] = cpu_facts()
    print(f"{facts['cpu']}, {facts['cores']} cores; flags: "
          + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in facts["flags"].items())
          + f"\ntorch {facts['torch']}: amx_tile {facts['torch_amx_tile']}, avx512_bf16 {facts['torch_avx512_bf16']}, "
            f"capability {facts['torch_capability']}\ncalibration (cached, what auto reads): "
            f"{facts['calibration_cached']}\ncalibration (timed again now): {facts['calibration_now']}\n"
            f"calibration (on every core): {facts['calibration_all_cores']}\n"
            f"auto (plan, training): {facts['plan_auto']}\nauto (plan, evaluation): {facts['plan_auto_eval']}\n"
            f"auto (rank, default shapes): {facts['rank_auto']}\n", flush=True)
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
        if "quickstart" in parts:
            result["quickstart"] = quickstart(args, work)
            print(table(result["quickstart"]) + "\n", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
