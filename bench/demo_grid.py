"""The demo's promise across machines' arithmetic: configs/default.yaml trained and scored over seeds x
processes x threads per process, each a fresh artifacts folder (prepare, baseline, train, evaluate
through `stages.pipeline.run_stage`, as `make run` runs them, without Prefect's server and the
register stage). Different seeds, world sizes and thread counts change the order of float additions
as a different CPU's kernels do; the promise must hold for each.

    .venv/bin/python bench/demo_grid.py --seeds 1234 7 42 100 2026 --out /tmp/grid   # ~25 min on 2 cores

Prints one row per run (held-out accuracy, identity and repeat items, the step at which the
validation loss first fell below 0.1, train seconds) and a summary line; `--jobs 2` runs two
one-thread, one-process runs side by side (the others use both cores and run alone).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMISE = 0.9


def one_run(out: Path, seed: int, nproc: int, threads: int, overrides: list[str]) -> dict:
    folder = out / f"seed{seed}-p{nproc}-t{threads}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_demo.py"), "--out", str(folder),
                           f"runner.seed={seed}", f"actor.nproc_per_node={nproc}", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    row = {"seed": seed, "nproc": nproc, "threads": threads, "wall_s": round(wall, 1)}
    result = folder / "gpu_demo.json"
    if not result.is_file():
        row["error"] = (proc.stdout + proc.stderr)[-2000:]
        return row
    data = json.loads(result.read_text())
    art = folder / "artifacts"
    preds = [json.loads(x) for x in next((art / "evaluate").glob("[!.]*")).joinpath(
        "predictions.jsonl").read_text().splitlines()]
    repeat = [p for p in preds if p["prompt"][-1]["content"].startswith("Repeat after me")]
    metrics = [json.loads(x) for x in next((art / "train").glob("[!.]*")).joinpath(
        "metrics.jsonl").read_text().splitlines()]
    below = next((m["step"] for m in metrics if m.get("val_loss", 1.0) < 0.1), None)
    row.update(accuracy=data["accuracy"], identity=sum(p["correct"] for p in preds if p not in repeat),
               identity_total=len(preds) - len(repeat), repeat=sum(p["correct"] for p in repeat),
               repeat_total=len(repeat), val_below_0_1_at=below, steps=metrics[-1]["step"],
               train_s=data["seconds"]["train"])
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 7, 42, 100, 2026])
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--jobs", type=int, default=2, help="one-core runs side by side")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    single = [(s, 1, 1) for s in args.seeds] if 1 in args.nproc and 1 in args.threads else []
    rest = [(s, n, t) for n in args.nproc for t in args.threads if (n, t) != (1, 1) for s in args.seeds]
    rows: list[dict] = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows += list(pool.map(lambda c: one_run(args.out, *c, args.overrides), single))
    for c in rest:
        rows.append(one_run(args.out, *c, args.overrides))
        print(json.dumps(rows[-1]), flush=True)
    print("| seed | processes | threads each | accuracy | identity | repeat | val loss < 0.1 at step | train s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['seed']} | {r['nproc']} | {r['threads']} | error | | | | |")
            continue
        print(f"| {r['seed']} | {r['nproc']} | {r['threads']} | {r['accuracy']:.3f} | {r['identity']}/"
              f"{r['identity_total']} | {r['repeat']}/{r['repeat_total']} | {r['val_below_0_1_at'] or 'never'} of "
              f"{r['steps']} | {r['train_s']:.0f} |")
    accs = [r.get("accuracy", 0.0) for r in rows]
    kept = sum(a >= PROMISE for a in accs)
    print(f"\n{kept}/{len(rows)} runs >= {PROMISE}; accuracy min {min(accs):.3f}, median "
          f"{sorted(accs)[len(accs) // 2]:.3f}, max {max(accs):.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if kept == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
