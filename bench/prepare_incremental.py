"""Prepare after new data: what a prepare costs when 1% new rows arrive as a new file, against a
full prepare of the same data (stages/prepare/pieces.py: tokenizing is cached per input file).

    .venv/bin/python bench/prepare_incremental.py                      # ~3 minutes on 2 CPU cores
    .venv/bin/python bench/prepare_incremental.py --files 20 --rows-per-file 500   # a quick look

The dataset: `--files` synthetic chat JSONL files of `--rows-per-file` rows (1-3 turns, a system
prompt in a third of the rows; bench/prepare_throughput.py's generator), 100 x 1,000 = 100,000 rows
by default, with the builtin tiny-chat tokenizer (built once on its own corpus, so it is the same
model folder for every run; `builtin:tiny-chat` itself trains its tokenizer on the training files,
so with it new data is a new tokenizer and every piece is rebuilt). `data.val_fraction` 0.01.

For each `data.num_proc`:
  * full         a prepare of all the files with an empty piece cache (what every prepare cost before)
  * incremental  the same prepare after a new file of 1% more rows, in the folder where the files
                 before it were prepared (their pieces reused)
Both are timed as `sftflow stage prepare` does the work: plan (content digests of the inputs,
fingerprints) + the prepare stage, in one warm process (imports and the tokenizer's first load are
paid by a warm-up prepare first, for both). The incremental output is checked byte-identical to a
full prepare of the same files. The incremental run's time is broken down by phase.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.prepare_throughput import build_tokenizer, synthetic_jsonl  # noqa: E402


def config(files: list[Path], model: str, artifacts: Path, num_proc: int):
    from stages.core.config import config_from_dict
    return config_from_dict({"artifacts_dir": str(artifacts), "actor": {"model": {"model_path": model}},
                             "data": {"train_data_paths": [str(f) for f in files], "val_fraction": 0.01,
                                      "format": "messages", "max_length": 4096, "num_proc": num_proc}})


PHASES: dict[str, float] = defaultdict(float)


@contextmanager
def phases():
    """Times prepare's phases by wrapping its functions (the bench only; the stage is unchanged)."""
    from stages.prepare import stage
    wrapped = {"load tokenizer": "load_tokenizer", "read sources, detect formats": "plan_sources",
               "find pieces (digests, keys, checks)": "source_pieces", "tokenize new files": "_build",
               "assemble the folder": "_assemble"}
    saved = {name: getattr(stage, name) for name in wrapped.values()}

    def timed(label, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                PHASES[label] += time.perf_counter() - t0
        return run
    for label, name in wrapped.items():
        setattr(stage, name, timed(label, saved[name]))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(stage, name, fn)


def timed_prepare(files: list[Path], model: str, artifacts: Path, num_proc: int) -> tuple[float, float, dict]:
    """(plan + stage seconds, plan seconds, the stage's manifest)."""
    import json
    from stages.pipeline import plan, run_stage
    t0 = time.perf_counter()
    p = plan(config(files, model, artifacts, num_proc))
    t1 = time.perf_counter()
    result = run_stage(p, "prepare", on_line=lambda _: None)
    t2 = time.perf_counter()
    return t2 - t0, t1 - t0, json.loads((Path(result.path) / "manifest.json").read_text())


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def du(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def same_files(a: Path, b: Path) -> bool:
    names = sorted(str(f.relative_to(a)) for f in a.rglob("*") if f.is_file() and f.name != "manifest.json")
    other = sorted(str(f.relative_to(b)) for f in b.rglob("*") if f.is_file() and f.name != "manifest.json")
    return names == other and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--rows-per-file", type=int, default=1000)
    ap.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=1, help="rounds; each measurement keeps its fastest")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="sftflow-bench-incremental-") as tmp:
        work = Path(tmp)
        model = build_tokenizer(work)
        data = work / "data"
        data.mkdir()
        files = [synthetic_jsonl(data / f"part-{i:04d}.jsonl", args.rows_per_file, seed=100 + i)
                 for i in range(args.files)]
        new_rows = max(1, args.files * args.rows_per_file // 100)
        warm = synthetic_jsonl(work / "warm.jsonl", 200, seed=7)
        timed_prepare([warm], model, work / "warm-art", 1)  # imports, the tokenizer's first load

        rows: list[tuple] = []
        for num_proc in args.num_proc:
            best_full = best_inc = None
            for r in range(args.repeat):
                new = synthetic_jsonl(data / f"new-{num_proc}-{r}.jsonl", new_rows, seed=10_000 + r)
                arts = work / f"inc-{num_proc}-{r}"
                timed_prepare(files, model, arts, num_proc)  # before the new file: builds every piece
                PHASES.clear()
                with phases():
                    inc = timed_prepare([*files, new], model, arts, num_proc)
                inc_phases = dict(PHASES)
                full = timed_prepare([*files, new], model, work / f"full-{num_proc}-{r}", num_proc)  # empty cache
                assert inc[2]["pieces"]["built"] == 1 and full[2]["pieces"]["reused"] == 0
                fp = inc[2]["fingerprint"]
                assert same_files(arts / "prepare" / fp, work / f"full-{num_proc}-{r}" / "prepare" / fp), \
                    "the incremental prepare differs from the full one"
                print(f"  num_proc {num_proc}, round {r + 1}: full {full[0]:.2f} s, incremental {inc[0]:.2f} s",
                      flush=True)
                if best_full is None or full[0] < best_full[0]:
                    best_full = full
                if best_inc is None or inc[0] < best_inc[0]:
                    best_inc, best_phases = inc, inc_phases
            rows.append((num_proc, best_full, best_inc, best_phases))
            disk = (du(arts / "prepare_pieces"), du(arts / "prepare" / fp))

        m = rows[0][1][2]
        kept = m["metrics"]["train_rows_kept"] + m["metrics"]["val_rows_kept"]
        tokens = m["metrics"]["train_tokens"] + m["metrics"]["val_tokens"]
        print(f"\n{args.files} files x {args.rows_per_file:,} rows + 1 new file of {new_rows:,} rows "
              f"({kept:,} rows kept, {tokens:,} tokens), {os.cpu_count()} CPUs ({cpu_name()})\n")
        print("| data.num_proc | full prepare (s) | after 1% new rows (s) | ratio | of which plan (s) |")
        print("|---:|---:|---:|---:|---:|")
        for num_proc, full, inc, _ in rows:
            print(f"| {num_proc} | {full[0]:.2f} | {inc[0]:.2f} | {100 * inc[0] / full[0]:.1f}% | "
                  f"{full[1]:.2f} / {inc[1]:.2f} |")
        print(f"\npiece cache on disk: {disk[0] / 2**20:,.0f} MiB, for a prepare folder of {disk[1] / 2**20:,.0f} MiB")
        for num_proc, _, inc, ph in rows:
            stage_total = inc[0] - inc[1]
            print(f"\nincremental, num_proc {num_proc}: plan {inc[1]:.2f} s, stage {stage_total:.2f} s:")
            tokenize = ph.get("tokenize new files", 0.0)
            ph = {**ph, "find pieces (digests, keys, checks)": ph.get("find pieces (digests, keys, checks)", 0.0)
                  - tokenize}  # timed around the tokenizing it calls
            ph["the rest (lock, input checks, ...)"] = stage_total - sum(ph.values())
            print("| phase | seconds |")
            print("|---|---:|")
            for label, seconds in ph.items():
                print(f"| {label} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
