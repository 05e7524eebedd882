"""The first command's work on whatever this machine has: the demo config (configs/default.yaml,
`actor.nproc_per_node: auto`) through the stages that `make run` runs (prepare, baseline, train,
evaluate) via `stages.pipeline.run_stage`, without Prefect or MLflow (a device machine lacks them:
the train stage reports "no live metrics" and goes on; register is left out). Prints the topology
the machine chose, each stage's seconds and the held-out accuracy; exits 1 below the demo's promise.

    .venv/bin/python bench/gpu_demo.py --out DIR     # on CPU: ~2 min on 2 cores (the dry run)
    python3 bench/gpu_demo.py --out $OUT              # on a GPU machine (bench/gpu_check.py runs it)
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
PROMISE = 0.9  # the demo's held-out accuracy on any machine (docs/benchmarks.md, "The demo on any machine")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="artifacts and gpu_demo.json go here")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # the config's data paths are relative to the project
    from stages.core.config import load_config
    from stages.pipeline import check_launch, launch_report, plan, run_stage
    out = (args.out or Path(tempfile.mkdtemp(prefix="sftflow-gpu-demo-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(ROOT / "configs" / "default.yaml", [f"artifacts_dir={out / 'artifacts'}", *args.overrides])
    p = plan(cfg)
    launch = launch_report(p)
    print(f"topology: {cfg.actor.topology}; {launch['backend']}, {launch['precision']}, attention "
          f"{launch['attn_implementation']}", flush=True)
    check_launch(p)
    seconds = {}
    for stage in ("prepare", "baseline", "train", "evaluate"):
        t0 = time.monotonic()
        run_stage(p, stage, on_line=lambda line, s=stage: print(f"  {s}: {line}", flush=True))
        seconds[stage] = round(time.monotonic() - t0, 1)
        print(f"{stage}: {seconds[stage]} s", flush=True)
    metrics = json.loads((p.folder("evaluate") / "metrics.json").read_text())
    result = {"topology": cfg.actor.topology, "launch": launch, "seconds": seconds,
              "accuracy": metrics["accuracy"], "base_accuracy": metrics.get("base_accuracy"),
              "correct": metrics.get("correct"), "total": metrics.get("total")}
    (out / "gpu_demo.json").write_text(json.dumps(result, indent=2))
    print(f"held-out accuracy {metrics['accuracy']:.3f} (base {metrics.get('base_accuracy')}); "
          f"promise >= {PROMISE}: {'kept' if metrics['accuracy'] >= PROMISE else 'BROKEN'}", flush=True)
    return 0 if metrics["accuracy"] >= PROMISE else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
