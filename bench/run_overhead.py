"""Where a short run's wall time goes: `sftflow run` of a tiny config (builtin model, 30 steps by
default) from the CLI's start to its exit, split at the lines the run prints, against the sum of
its step times (`step_time` in metrics.jsonl), then fully cached runs (their median).

    .venv/bin/python bench/run_overhead.py                      # the default: the first call starts a
                                                                # kept server, the cached runs reuse it
    .venv/bin/python bench/run_overhead.py --server temporary   # SFTFLOW_KEEP_SERVER=0: one per call
    .venv/bin/python bench/run_overhead.py --server running     # a long-lived local server (what
                                                                # `make serve` runs) shared by the calls
    .venv/bin/python bench/run_overhead.py --steps 30 --nproc 1

Parts (each from the previous mark to the line named):
  CLI, config, plan, Prefect server   process start -> "Beginning flow run"
  prepare                             -> "prepare done"
  train: MLflow run                   -> "mlflow: created run"
  train: torchrun, rendezvous, model  -> "training N steps" (rank 0 ready to step)
  train: steps                        -> the last "step N/N" (first step included)
  train: export, commit               -> "train done"
  evaluate                            -> "evaluate done"
  register (MLflow, model logging)    -> "register done"
  flow end, server stop, exit         -> process exit
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MARKS = [("CLI, config, plan, Prefect server", r"Beginning flow run"),
         ("prepare", r"prepare (done|reused)"),
         ("train: MLflow run", r"mlflow: (created|continuing) run|mlflow: no live metrics"),
         ("train: torchrun, rendezvous, model load", r"training \d+ steps"),
         ("train: steps", r"step (\d+)/\1\b"),
         ("train: export, commit", r"train (done|reused)"),
         ("evaluate", r"evaluate (done|reused)"),
         ("register (MLflow, model logging)", r"register (done|reused)")]
STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \|")


def stamped(lines: list[tuple[float, str]], day: datetime) -> list[tuple[float, str]]:
    """(epoch seconds, text) per line: Prefect's own timestamp when the line has one, else when read."""
    out = []
    for seen, line in lines:
        m = STAMP.match(line)
        if m:
            h, mi, s, ms = map(int, m.groups())
            seen = day.replace(hour=h, minute=mi, second=s, microsecond=ms * 1000).timestamp()
        out.append((seen, line))
    return out


def timed_run(cmd: list[str], cwd: Path, env: dict) -> tuple[float, float, list[tuple[float, str]]]:
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.time(), line.rstrip("\n")) for line in proc.stdout]
    if proc.wait() != 0:
        raise SystemExit("run failed:\n" + "\n".join(text for _, text in lines[-40:]))
    return t0, time.time(), stamped(lines, datetime.fromtimestamp(t0))


def breakdown(t0: float, t1: float, lines: list[tuple[float, str]]) -> list[tuple[str, float]]:
    parts, last = [], t0
    for name, pattern in MARKS:
        hits = [t for t, text in lines if re.search(pattern, text)]
        if not hits:
            continue
        at = hits[-1] if name == "train: steps" else hits[0]
        parts.append((name, at - last))
        last = at
    parts.append(("flow end, server stop, exit", t1 - last))
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--server", choices=["kept", "temporary", "running"], default="kept")
    ap.add_argument("--cached-runs", type=int, default=5, help="fully cached runs after the first")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import tiny_config_dict, write_config
    with tempfile.TemporaryDirectory(prefix="sftflow-bench-overhead-") as tmp:
        work = Path(tmp)
        raw = tiny_config_dict(work, n_train=16 * args.steps, n_val=12)
        raw["runner"].update(max_steps=args.steps, save_interval=10, val_check_interval=10, log_interval=1)
        raw["actor"]["nproc_per_node"] = args.nproc
        cfg_path = write_config(work, raw)
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env["PREFECT_HOME"] = str(work / ".prefect")
        env["SFTFLOW_KEEP_SERVER"] = "0" if args.server == "temporary" else "600"
        cmd = [sys.executable, "-m", "flows.cli", "run", "-c", str(cfg_path)]
        server = None
        if args.server == "running":
            from flows.servers.prefect_server import local_server
            server = local_server("127.0.0.1", 0, work / ".prefect", work / "server.log", ui=False, shared=True)
            server.__enter__()
        try:
            t0, t1, lines = timed_run(cmd, work, env)
            cached = sorted(c1 - c0 for c0, c1, _ in (timed_run(cmd, work, env) for _ in range(args.cached_runs)))
        finally:
            if server is not None:
                server.__exit__(None, None, None)
        rows = [json.loads(x)
                for x in next((work / "artifacts" / "train").glob("*/metrics.jsonl")).read_text().splitlines()]
        steps = sum(r["step_time"] for r in rows)
    wall = t1 - t0
    print(f"\n`sftflow run`, builtin model, {args.steps} steps on {args.nproc} process(es), "
          f"{args.server} Prefect server\n")
    print("| part | seconds | share |")
    print("|---|---|---|")
    for name, seconds in breakdown(t0, t1, lines):
        print(f"| {name} | {seconds:.1f} | {seconds / wall:.0%} |")
    print(f"| **CLI wall** | **{wall:.1f}** | |")
    print(f"\nsum of step times {steps:.1f} s: CLI wall / steps = {wall / steps:.2f}x; "
          f"fully cached runs: median {statistics.median(cached):.1f} s ({', '.join(f'{c:.1f}' for c in cached)})")


if __name__ == "__main__":
    main()
