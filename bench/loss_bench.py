"""The token loss before and after it ran on the trained positions only, in chunks (stages/runtime/loss.py).

    .venv/bin/python bench/loss_bench.py                 # ~8 minutes on 2 CPU cores; needs ~8 GB free RAM
    .venv/bin/python bench/loss_bench.py --tokens 2048 --trained 0.5 --steps 12

Two measurements, each method in a process of its own:

* Peak memory of one forward + backward of a model of a 150k vocabulary (Qwen2's 151,936, tied
  head) of hidden size 576 and a single block, on one packed micro-batch of `--tokens` tokens
  (4096) of which a fraction `--trained` (all) is trained, fp32 on CPU: the resident peak over the
  process' memory before the forward (Linux VmHWM, reset through /proc/self/clear_refs, with glibc
  returning every tensor of 64 KiB or more on free, as tests/memory_peak.py measures the worker's
  step). Three methods: the block alone (its output summed: no head, no loss), the full logits
  (`model(...).logits` into `token_loss_sum`, the arithmetic before) and the chunked loss
  (`model_loss`); the loss' part is a method's peak less the block alone's. Both losses are
  checked equal (value and the head's gradient) before anything is compared. The time column is
  the wall time of that forward + backward and, in brackets, the process' CPU time (steadier when
  other processes share the cores).
* Tokens/s of the real worker (`SFTWorker`, one process) training the builtin tiny model on the
  demo data (packed, micro-batch 4, global batch 16), one thread (OpenMP threads spinning on
  shared cores inflate both clocks), full logits against chunked, after
  `--warmup` untimed steps; the per-step losses are checked equal. Tokens per second of wall time
  and per second of the process' CPU time (steadier on shared cores), each method's best of
  `--repeat` interleaved rounds.
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

SHAPE = dict(vocab_size=151936, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
             tie_word_embeddings=True)
METHODS = {"block": "the block alone (no head, no loss)", "full": "full logits (before)",
           "chunked": "chunked on the trained positions (after)"}
GIB = 1024 ** 3


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def force_full_logits() -> None:
    """Every model takes the full-logits path (the arithmetic before), in this process."""
    from stages.runtime import loss
    loss._verdict = lambda model, inputs, labels: "forced by bench/loss_bench.py"


# --------------------------------------------------------------------------- children


def memory_child(method: str, tokens: int, trained: float) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stages.runtime.loss import IGNORE_INDEX, model_loss, token_loss_sum
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE)).float().train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, tokens), generator=g)
    labels = ids.clone()
    labels[0, torch.randperm(tokens, generator=g)[:round(tokens * (1 - trained))]] = IGNORE_INDEX
    labels[0, 0] = IGNORE_INDEX
    inputs = {"input_ids": ids, "position_ids": torch.arange(tokens)[None]}
    if method == "chunked":  # the path's one-time check (a forward without gradients) outside the measurement
        with torch.no_grad():
            model_loss(model, inputs, labels)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        resettable = True
    except OSError:
        resettable = False
    start = _status("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    if method == "block":
        value = model.model(**inputs).last_hidden_state.sum()
    elif method == "full":
        value = token_loss_sum(model(**inputs, use_cache=False).logits, labels)[0]
    else:
        value = model_loss(model, inputs, labels).ce
    value.backward()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = _status("VmHWM")
    head = model.get_output_embeddings().weight.grad
    return {"method": method, "peak_over_start": peak - start, "resettable": resettable, "seconds": seconds, "cpu": cpu,
            "value": value.item(), "head_grad_norm": head.norm().item(),
            "trained": int((labels[:, 1:] != IGNORE_INDEX).sum())}


def worker_child(spec_path: str, method: str, warmup: int, steps: int) -> dict:
    if method == "full":
        force_full_logits()
    from stages.runtime.batches import DataPosition
    from stages.runtime.worker import SFTWorker, WorkerSpec
    w = SFTWorker(WorkerSpec.read(spec_path))
    w.setup()
    pos, losses, tokens, seconds, cpu = DataPosition(), [], 0, 0.0, 0.0
    for k in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        batch = w.sampler.global_batch(pos)
        row = w.forward_backward(batch)
        w.optimizer_step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        pos = w.sampler.advance(pos, len(batch))
        losses.append(row["loss"])
        if k >= warmup:
            tokens, seconds, cpu = tokens + row["tokens"], seconds + dt, cpu + dc
    return {"method": method, "tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu, "losses": losses,
            "steps": steps}


# --------------------------------------------------------------------------- parent


def run_child(*args: str, threads: int | None = None) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
           "OMP_NUM_THREADS": str(threads or os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))}
    r = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True,
                       cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{args[0]} child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def worker_spec(tmp: Path, warmup: int, steps: int) -> Path:
    from stages.core.config import config_from_dict
    from stages.models.base import resolve_model
    from stages.pipeline import plan, run_stage
    from stages.runtime.worker import WorkerSpec
    cfg = config_from_dict({
        "artifacts_dir": str(tmp / "artifacts"),
        "runner": {"max_epochs": 1, "max_steps": warmup + steps, "val_check_interval": 0, "save_interval": 0,
                   "seed": 7, "resume": "never"},
        "actor": {"nproc_per_node": 1, "micro_batch_size": 4, "global_batch_size": 16, "packing": True},
        "data": {"train_data_paths": [str(ROOT / "data" / "demo" / "train.jsonl")],
                 "val_data_paths": [str(ROOT / "data" / "demo" / "eval.jsonl")], "format": "messages",
                 "max_length": 512},
    })
    p = plan(cfg)
    run_stage(p, "prepare", on_line=lambda _: None)
    spec = WorkerSpec(config=cfg, model_path=resolve_model(cfg, p.fingerprints["models"]), out_dir=str(tmp / "out"),
                      train_dir=str(p.folder("prepare") / "train"))
    return spec.write(tmp / "spec.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the micro-batch (memory)")
    ap.add_argument("--trained", type=float, default=1.0, help="fraction of them trained (memory)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="timed worker steps per method")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved worker rounds; each method's fastest is kept")
    ap.add_argument("--only", choices=["memory", "speed"], help="one of the two measurements")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "memory":
            out = memory_child(rest[0], int(rest[1]), float(rest[2]))
        else:
            out = worker_child(rest[0], rest[1], int(rest[2]), int(rest[3]))
        print(json.dumps(out))
        return

    print(f"{time.strftime('%Y-%m-%d')} · {platform.machine()} {os.cpu_count()} CPU cores · "
          f"`.venv/bin/python bench/loss_bench.py --tokens {args.tokens} --trained {args.trained} "
          f"--warmup {args.warmup} --steps {args.steps} --repeat {args.repeat}"
          + (f" --only {args.only}" if args.only else "") + "`\n")
    if args.only != "speed":
        memory(args)
    if args.only != "memory":
        speed(args)


def memory(args) -> None:
    mem = {m: run_child("memory", m, str(args.tokens), str(args.trained)) for m in METHODS}
    full, chunked = mem["full"], mem["chunked"]
    if abs(full["value"] - chunked["value"]) > 1e-5 * abs(full["value"]) or \
            abs(full["head_grad_norm"] - chunked["head_grad_norm"]) > 1e-4 * full["head_grad_norm"]:
        raise SystemExit(f"the two losses differ: {full} vs {chunked}")
    print(f"Peak memory, one forward + backward: vocabulary {SHAPE['vocab_size']:,}, hidden {SHAPE['hidden_size']}, "
          f"1 block, {args.tokens} tokens of which {full['trained']} trained, fp32"
          + ("" if full["resettable"] else " (VmHWM not resettable here: peaks include the model's build)") + "\n")
    block = mem["block"]["peak_over_start"]
    print("| method | peak over start | the loss' part | vs before | forward + backward: wall (CPU) |")
    print("|---|---:|---:|---:|---:|")
    for m, name in METHODS.items():
        r = mem[m]
        part = r["peak_over_start"] - block
        ratio = "" if m == "block" else f"{(full['peak_over_start'] - block) / part:.1f}x smaller" if m == "chunked" \
            else "1.0x"
        print(f"| {name} | {r['peak_over_start'] / GIB:.2f} GiB | "
              f"{'' if m == 'block' else f'{part / GIB:.2f} GiB'} | {ratio} | "
              f"{r['seconds']:.1f} s ({r['cpu']:.1f} s) |")


def speed(args) -> None:
    runs: dict[str, list[dict]] = {"full": [], "chunked": []}
    with tempfile.TemporaryDirectory() as tmp:
        spec = worker_spec(Path(tmp), args.warmup, args.steps)
        for _ in range(args.repeat):
            for m in runs:
                runs[m].append(run_child("worker", str(spec), m, str(args.warmup), str(args.steps), threads=1))
    speed = {m: {key: max(r[key] for r in rs) for key in ("tokens_per_s", "tokens_per_cpu_s")}
             | {"losses": rs[0]["losses"]}
             for m, rs in runs.items()}
    worst = max(abs(a - b) for a, b in zip(speed["full"]["losses"], speed["chunked"]["losses"]))
    if worst > 1e-5:
        raise SystemExit(f"the worker's losses differ by {worst}")
    print(f"\nThe worker on the builtin model, demo data, 1 process of 1 thread: {args.steps} timed steps after "
          f"{args.warmup} "
          f"(losses equal within {worst:.1e}), each method's fastest of {args.repeat} interleaved rounds\n")
    print("| method | tokens/s (wall) | vs before | tokens per CPU second | vs before |")
    print("|---|---:|---:|---:|---:|")
    for m in ("full", "chunked"):
        tps, cps = speed[m]["tokens_per_s"], speed[m]["tokens_per_cpu_s"]
        print(f"| {METHODS[m]} | {tps:,.0f} | {tps / speed['full']['tokens_per_s']:.2f}x | {cps:,.0f} | "
              f"{cps / speed['full']['tokens_per_cpu_s']:.2f}x |")


if __name__ == "__main__":
    main()
