"""What starting torchrun's ranks costs: the train stage of a tiny config (builtin model, 4 steps),
its ranks forked from torchrun's agent after it imported their modules once (the default without a
GPU) against ranks started as fresh interpreters (`SFTFLOW_FORK_RANKS=0`, torchrun's own
`python -m`), for 1 and 2 processes. Per run: wall time of the stage and the CPU time of every
process it started (torchrun's agent and its ranks). Both ways must train the same weights.

    .venv/bin/python bench/rank_start.py [--nproc 1,2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed_train(work: Path, nproc: int, fork: bool) -> tuple[float, float, dict]:
    from safetensors.torch import load_file

    from conftest import tiny_config_dict, write_config
    from stages.core.config import load_config
    from stages.pipeline import plan, run_stage
    raw = tiny_config_dict(work)
    raw["actor"]["nproc_per_node"] = nproc
    p = plan(load_config(write_config(work, raw)))
    run_stage(p, "prepare")
    os.environ["SFTFLOW_FORK_RANKS"] = "1" if fork else "0"
    c0, t0 = children_cpu(), time.perf_counter()
    result = run_stage(p, "train", on_line=lambda line: None)
    wall, cpu = time.perf_counter() - t0, children_cpu() - c0
    return wall, cpu, load_file(str(Path(result.path) / "model" / "model.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", default="1,2")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median is shown")
    args = ap.parse_args()
    rows = []
    for nproc in (int(n) for n in args.nproc.split(",")):
        runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        weights = {}
        for _ in range(args.repeat):
            for fork in (False, True):
                with tempfile.TemporaryDirectory(prefix="sftflow-bench-ranks-") as tmp:
                    wall, cpu, weights[fork] = timed_train(Path(tmp), nproc, fork)
                    runs[fork].append((wall, cpu))
        worst = max((weights[True][k] - weights[False][k]).abs().max().item() for k in weights[True])
        assert worst <= 1e-6, f"forked and fresh ranks trained different weights (max |diff| {worst})"
        for fork in (False, True):
            wall = statistics.median(w for w, _ in runs[fork])
            cpu = statistics.median(c for _, c in runs[fork])
            rows.append((nproc, fork, wall, cpu))
    print(f"\ntrain stage, builtin model, 4 steps; median of {args.repeat} interleaved rounds\n")
    print("| procs | ranks | wall (s) | CPU of torchrun and ranks (s) | wall vs fresh | CPU vs fresh |")
    print("|---:|---|---:|---:|---:|---:|")
    for nproc, fork, wall, cpu in rows:
        ref = next(r for r in rows if r[0] == nproc and not r[1])
        print(f"| {nproc} | {'forked from the agent' if fork else 'fresh interpreters'} | {wall:.1f} | {cpu:.1f} | "
              f"{wall / ref[2]:.2f}x | {cpu / ref[3]:.2f}x |")


if __name__ == "__main__":
    main()
