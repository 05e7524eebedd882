"""The GPU check (issues #27, #44), one command: the GPU-marked tests, the demo's stages on this
machine's GPUs (bench/gpu_demo.py: `make run`'s work without Prefect and MLflow), then the train benchmark on a
SmolLM2-135M-shaped and a Qwen2-0.5B-shaped model (random init, built from their transformers
configs): sftflow's worker against the bare packed loop, packed and padded, packed with
activation checkpointing; trained tokens/s, MFU and peak memory in one table.

    python3 bench/gpu_check.py --out DIR      # on a GPU machine: <= 8.5 minutes on one H200
    .venv/bin/python bench/gpu_check.py --dry-run   # the same code on CPU (the demo's stages included): ~2 min

On the device machine (docs/benchmarks.md, "GPU check"), pydantic and orjson are carried as wheels
(the image has torch, transformers, peft, pyarrow, tokenizers, pytest, hypothesis, psutil):

    .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_17_x86_64 -d build/device-wheels pydantic==2.14.4 pydantic_core==2.50.5 \\
        annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 orjson==3.13.0
    run(carry=["build/device-wheels"], timeout_s=560, command=
        "python3 -m pip install -q --no-index --no-deps --target /tmp/site build/device-wheels/*.whl &&
         PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out $OUT")

Every part runs in a subprocess under a timeout cut from one overall budget (`--budget`, 480 s by
default), in order of importance: the tests, the demo, the 135M shape, the 0.5B shape. A part that no longer
fits is reported as skipped, never left to overrun the device's time. The table goes to stdout and,
with --out, to DIR/gpu_check.md (with the parts' logs in DIR/gpu_check.log).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "train_throughput.py"
# sftflow packed (vs the bare packed loop: the ceiling), padded (what packing gains) and packed with
# activation checkpointing (what it saves and costs). Each method is a process of its own that builds
# the model and compiles flex_attention (inductor's disk cache helps the later ones): ~30 s apiece.
MATRIX = "worker-packed,bare-packed,worker-padded,worker-packed-ckpt"

# (shape, its share of the bench time, bench arguments). On an H200: micro-batches of 8 samples of
# ~0.5-4k tokens (replies x 8), enough work per kernel to say something about MFU; 2 + 5 steps.
GPU_BENCH = [
    ("smollm2-135m", 0.45, ["--steps", "5", "--warmup", "2", "--global-batch", "32", "--micro-batch", "8",
                            "--seq-scale", "8"]),
    ("0.5b", 0.55, ["--steps", "5", "--warmup", "2", "--global-batch", "32", "--micro-batch", "8",
                    "--seq-scale", "8"]),
]
DRY_BENCH = [("tiny", 1.0, ["--steps", "1", "--warmup", "1", "--global-batch", "4", "--micro-batch", "2"])]
TESTS_SHARE = 0.3  # of the budget, at most
DEMO_SHARE = 0.25  # the demo's stages (bench/gpu_demo.py); the benches share what is left


def run_part(name: str, cmd: list[str], timeout: float, log) -> tuple[str, float]:
    """(status, seconds): ok, failed (exit code N), timed out, or skipped (no time left)."""
    if timeout < 20:
        return "skipped (budget spent)", 0.0
    t0 = time.monotonic()
    print(f"== {name}: {' '.join(cmd)} (timeout {timeout:.0f} s)", flush=True)
    log.write(f"\n== {name}: {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Ctrl-C first: the bench and the train stage then stop the torchrun children they started
        # in sessions of their own, which a plain kill would leave running on the GPU
        proc.send_signal(signal.SIGINT)
        try:
            stdout, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
        log.write(stdout)
        print(stdout[-3000:], flush=True)
        return f"timed out after {timeout:.0f} s", time.monotonic() - t0
    log.write(stdout)
    log.flush()
    print(stdout[-6000:], flush=True)
    status = "ok" if proc.returncode == 0 else f"failed (exit code {proc.returncode})"
    return status, time.monotonic() - t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, the tiny shape, 1 + 1 steps: the same code in seconds")
    ap.add_argument("--out", type=Path, default=None, help="write gpu_check.md, gpu_check.json and gpu_check.log here")
    ap.add_argument("--budget", type=float, default=None, help="seconds for everything (default 480; dry run 360)")
    ap.add_argument("--methods", default=MATRIX, help="bench methods (bench/train_throughput.py --methods)")
    ap.add_argument("--skip-tests", action="store_true", help="leave out the GPU-marked tests")
    ap.add_argument("--skip-demo", action="store_true", help="leave out the demo's stages (bench/gpu_demo.py)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch  # after argument parsing: --help stays instant

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("no CUDA device here: use --dry-run for the CPU path", file=sys.stderr)
        return 2
    budget = args.budget or (360.0 if args.dry_run else 480.0)
    deadline = time.monotonic() + budget
    out = args.out or Path(tempfile.mkdtemp(prefix="sftflow-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    env_note = (f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}" if cuda else "CPU (dry run)")
    print(f"gpu_check: {env_note}, torch {torch.__version__}, budget {budget:.0f} s", flush=True)
    parts: list[dict] = []
    rows: list[list[str]] = []
    head: list[str] = []
    with open(out / "gpu_check.log", "w") as log:
        if not args.skip_tests:
            # -m gpu: they skip on a CPU machine, so the dry run checks the command and the collection
            cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"]
            os.environ["SFTFLOW_GPU_CHECK_OUT"] = str(out)  # the generation test's differing share lands there
            status, secs = run_part("tests", cmd, min(TESTS_SHARE * budget, deadline - time.monotonic()), log)
            parts.append({"part": "pytest -m gpu", "status": status, "seconds": round(secs)})
            for kind in ("nf4", "q4_1"):  # tests/test_gpu.py's QLoRA cases: the plan against the CUDA peak
                qlora = out / f"qlora_peak_{kind}.json"
                if not qlora.is_file():
                    continue
                q = json.loads(qlora.read_text())
                measured = f"{q['measured'] / 2 ** 20:.0f} MiB" if q.get("measured") else "not measured (CPU)"
                parts.append({"part": f"QLoRA {kind}, SmolLM2-135M shape x4 layers ({q['precision']}, {q['attn']}): "
                              f"peak {measured}, plan {q['planned'] / 2 ** 20:.0f} MiB; {q['base']}",
                              "status": "ok", "seconds": 0})
            gen = out / "generation.json"
            if gen.is_file():
                g = json.loads(gen.read_text())
                parts.append({"part": "the stage's generation vs one `model.generate` per prompt: " + ", ".join(
                    f"{p} {v['differ']} of {v['total']} replies differ" for p, v in g.items() if isinstance(v, dict)),
                    "status": "ok", "seconds": 0})
        # the first command on this machine: the demo through its stages, one process per GPU it can use
        demo_out = out / "demo"
        if args.skip_demo:
            cmd = []
        else:
            cmd = [sys.executable, str(ROOT / "bench" / "gpu_demo.py"), "--out", str(demo_out)]
        if cmd:
            status, secs = run_part("demo", cmd, min(DEMO_SHARE * budget, deadline - time.monotonic()), log)
            demo = (json.loads((demo_out / "gpu_demo.json").read_text()) if (demo_out / "gpu_demo.json").is_file()
                    else {})
            detail = (f": accuracy {demo['accuracy']:.3f} (base {demo['base_accuracy']:.3f}), {demo['topology']}, "
                      f"{demo['launch']['precision']}, {demo['launch']['attn_implementation']}, stages "
                      + ", ".join(f"{k} {v} s" for k, v in demo["seconds"].items())) if demo else ""
            parts.append({"part": "demo (make run's stages, no Prefect/MLflow)", "status": status + detail,
                          "seconds": round(secs)})
        bench_total = deadline - time.monotonic()
        for shape, share, extra in (DRY_BENCH if args.dry_run else GPU_BENCH):
            result = out / f"bench-{shape}.json"
            cmd = [sys.executable, str(BENCH), "--shape", shape, "--methods", args.methods, "--json", str(result),
                   *extra]
            status, secs = run_part(f"bench {shape}", cmd, min(share * bench_total, deadline - time.monotonic()), log)
            parts.append({"part": f"bench {shape}", "status": status, "seconds": round(secs)})
            if status == "ok":
                data = json.loads(result.read_text())
                head = ["shape", *data["head"]]
                rows += [[shape, *r] for r in data["rows"]]
    lines = [f"GPU check on {env_note} (torch {torch.__version__})", "",
             "| part | status | seconds |", "|---|---|---:|"]
    lines += [f"| {p['part']} | {p['status']} | {p['seconds']} |" for p in parts]
    if rows:
        lines += ["", "| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print("\n" + text, flush=True)
    (out / "gpu_check.md").write_text(text)
    (out / "gpu_check.json").write_text(json.dumps({"device": env_note, "parts": parts, "head": head, "rows": rows}))
    return 0 if all(p["status"] == "ok" for p in parts) else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
