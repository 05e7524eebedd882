"""Two trainings on one machine at once against one after the other, with and without the ledger of
cores (stages/core/machine/cores.py) that makes runs sharing a machine share its cores.

    .venv/bin/python bench/concurrent_runs.py                       # the demo config, 60 steps, 1 process each
    .venv/bin/python bench/concurrent_runs.py --steps 20 --nproc 2  # the demo's own 2 processes each

Two runs (a, b: the demo config, `configs/default.yaml`, with seeds of their own, `--steps` steps,
`--nproc` processes, each in an artifacts folder of its own) are prepared once, then their train stage
runs (`stages.pipeline.run_stage`, forced, in a fresh process per run as a Prefect worker's flow run
would be): a then b, and a and b started together; with `SFTFLOW_CORES=off` (before: each launch gives
its ranks `cores // its own ranks` threads) and with the ledger (after). The ledger is a folder of the
bench's own, so another sftflow run on the machine doesn't change the rows. MLflow is left out (an
unreachable tracking URI: "no live metrics"), so the rows time training, not a store.

Per run: tokens/s over its steps after the first (metrics.jsonl: tokens / step_time, so waiting for
the other run's startup is not counted) and the train stage's wall seconds (torchrun, model build,
steps, the final checkpoint, export); per row, the wall seconds from the first start to the last end.
Lines a rank printed about its threads ("threads: 2 -> 1 per rank ...") are listed under the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "configs" / "default.yaml"
RUNS = {"a": 1234, "b": 4321}  # run -> seed: two trainings with fingerprints of their own


def overrides(out: Path, run: str, steps: int, nproc: int) -> list[str]:
    return [f"artifacts_dir={out / run}", f"runner.max_steps={steps}", f"runner.seed={RUNS[run]}",
            f"actor.nproc_per_node={nproc}", "runner.val_check_interval=0", "runner.save_interval=0",
            "runner.log_interval=1000", "registry.tracking_uri=http://127.0.0.1:9"]


def child(stage: str, args: list[str]) -> None:
    """One stage of one run, in this process; prints its result as the last line."""
    from stages.core.config import load_config
    from stages.pipeline import plan, run_stage
    lines: list[str] = []
    p = plan(load_config(CONFIG, args))
    t0 = time.perf_counter()
    result = run_stage(p, stage, force=stage == "train", on_line=lines.append)
    wall = time.perf_counter() - t0
    out = {"wall": wall}
    if stage == "train":
        rows = [json.loads(x) for x in (Path(result.path) / "metrics.jsonl").read_text().splitlines()]
        steady = rows[1:] or rows
        out.update(tokens_per_s=sum(r["tokens"] for r in steady) / sum(r["step_time"] for r in steady),
                   threads=[x.strip() for x in lines if "threads: " in x])
    print("RESULT " + json.dumps(out), flush=True)


def start(stage: str, run: str, out: Path, a: argparse.Namespace, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--child", stage, "--", *overrides(out, run, a.steps, a.nproc)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, what: str) -> dict:
    text, _ = proc.communicate()
    last = [x for x in text.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not last:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{text[-4000:]}")
    return json.loads(last[-1].removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--nproc", type=int, default=1, help="processes per run (the demo's own: 2)")
    ap.add_argument("--out", type=Path, default=None, help="artifacts and results (default: a temporary folder)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.rest)
    out = a.out or Path(tempfile.mkdtemp(prefix="concurrent-runs-"))
    out.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SFTFLOW_CORES")}
    base["SFTFLOW_CORES_DIR"] = str(out / "cores")
    if "OMP_NUM_THREADS" in os.environ:
        print(f"(OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} left out: it would fix every rank's threads)")
    from stages.core.machine.cores import usable_cores
    print(f"{usable_cores()} usable cores; 2 runs x {a.nproc} process(es), {a.steps} steps; folder {out}")
    for run in RUNS:
        finish(start("prepare", run, out, a, base), f"prepare {run}")

    results = []
    for ledger in ("off", "on"):
        env = {**base, "SFTFLOW_CORES": "off"} if ledger == "off" else base
        for how in ("one after the other", "together"):
            t0, got = time.perf_counter(), {}
            if how == "together":
                procs = {run: start("train", run, out, a, env) for run in RUNS}
                got = {run: finish(p, f"train {run}") for run, p in procs.items()}
            else:
                for run in RUNS:
                    got[run] = finish(start("train", run, out, a, env), f"train {run}")
            results.append({"ledger": ledger, "how": how, "wall": time.perf_counter() - t0, "runs": got})
            print(f"  done: ledger {ledger}, {how}", flush=True)

    print(f"\n{'ledger':<7}{'runs':<21}{'a tok/s':>9}{'b tok/s':>9}{'a train s':>11}{'b train s':>11}{'both s':>8}")
    for r in results:
        ra, rb = r["runs"]["a"], r["runs"]["b"]
        print(f"{r['ledger']:<7}{r['how']:<21}{ra['tokens_per_s']:>9.0f}{rb['tokens_per_s']:>9.0f}"
              f"{ra['wall']:>11.1f}{rb['wall']:>11.1f}{r['wall']:>8.1f}")
    for r in results:
        for run, got in r["runs"].items():
            for line in got["threads"]:
                print(f"ledger {r['ledger']}, {r['how']}, run {run}: {line}")
    (out / "concurrent_runs.json").write_text(json.dumps(results, indent=2))
    print(f"\n{out / 'concurrent_runs.json'}")


if __name__ == "__main__":
    main()
