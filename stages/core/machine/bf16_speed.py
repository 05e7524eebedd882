"""What bf16 is worth on this CPU, measured: the speed of bf16 over fp32 at a model's own matmul
shapes, for a training step and for a decode step, timed where the work runs and cached per CPU.

Flags name what a CPU can compute, not how fast: with AVX512-BF16 and no AMX, bf16 trained SmolLM2
at 0.6x fp32's speed on one Intel Xeon (its hypervisor hid AMX) and at 1.8x on a 2-core AMD EPYC
(Zen 4); the same flags, oneDNN's kernels, opposite answers (docs/benchmarks.md "bf16 on CPU").
So `actor.precision: auto` on a CPU (core/machine/precision.py) is bf16 where this measurement says bf16 is
at least MARGIN times as fast as fp32 here, and fp32 otherwise. The flags stay a pre-filter: a CPU
with no native bf16 at all (no avx512_bf16, amx_bf16 or, on Arm, bf16) is fp32 without measuring.

The measurement (`measure`) times `F.linear` in both dtypes at the model's shapes: per layer q and o
(hidden -> hidden), k and v (hidden -> kv), gate and up (hidden -> intermediate), down
(intermediate -> hidden), and the head (hidden -> vocab) once, each weighted by how often a step
runs it. A training step is forward + backward at TRAIN_ROWS tokens; a decode step a forward at
DECODE_ROWS rows. A shape whose work exceeds a budget is timed on a slice of its output columns and
scaled, so a 7B model's calibration costs about what SmolLM2's does (well under a second here).
fp32 and bf16 alternate and each keeps its fastest repeat, so a burst of load on a shared machine
reaches both or neither.

One answer per (CPU model, its flags, torch version, shape class), in the user's cache
(`bf16-speed.json`): the plan, the training ranks, replay, evaluate and chat read the same entry,
so a folder's precision fact and the precision its processes ran agree, and a run pays the
calibration once. It is timed on one thread (CALIBRATION_THREADS): a per-core ratio, which a second
job on the machine leaves alone. On 2 threads, every thread of a parallel region waits for the one
the scheduler took away, which slows the faster dtype most: beside one busy pytest worker, SmolLM2's
training ratio on this project's 2-core Xeon (AMX) read 1.13, 3.23, 1.37, 1.67 and 2.15 at 2 threads,
and 3.28, 3.23, 3.15 and 3.34 at 1 thread. Whoever finds no entry (the plan, or a rank with a fresh
cache) measures and writes it under a lock, so two processes never time against each other. An entry
of another torch (another oneDNN) is never read: the key names the version.

Torch-free at import: planning never imports torch, so it measures in a subprocess
(`python -m stages.core.machine.bf16_speed`); a process that has torch already measures in place. The
registered chat model ships this file beside precision.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

__fingerprint__ = False  # a stage's precision fact carries the decision; how it was timed changes no result

MARGIN = 1.15  # bf16 must buy at least 15% to be worth its rounding: within the margin, fp32 (the exact one)
TRAIN_ROWS = 256   # tokens of a training matmul: past a few hundred rows the ratio per flop is flat
DECODE_ROWS = 16   # a decode step's batch of prompts (eval.batch_size's usual size)
FLOP_BUDGET = 1.5e9  # per timed training matmul: above it, a slice of the output columns is timed
BYTE_BUDGET = 32 * 1024 ** 2  # per decode weight (fp32 bytes): above it, likewise
REPEATS = 5
CALIBRATION_THREADS = 1  # see the module's docstring: a per-core ratio, robust to other work on the machine
NATIVE_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86's AVX512-BF16 and AMX, Arm's BF16
CACHE_FILE = "bf16-speed.json"
ENV_CACHE = "SFTFLOW_BF16_SPEED_CACHE"  # a file to use instead of the user cache's (tests, read-only homes)
# A number pins the answer instead of measuring (bf16's speed over fp32's, for training and decoding alike):
# the suite pins 0.5 so a test's precision is the same on every CI machine; the tests of the rule and the
# promises that must hold in what `auto` picks on the machine at hand unset it.
ENV_PIN = "SFTFLOW_CPU_BF16_SPEEDUP"


@dataclass(frozen=True)
class Dims:
    """A decoder's matmul shapes: what the calibration times."""

    hidden: int
    intermediate: int
    vocab: int
    kv: int
    layers: int

    @classmethod
    def from_hf_config(cls, c: dict) -> "Dims":
        """From a Hugging Face config.json; KeyError for a missing size."""
        h = int(c["hidden_size"])
        heads = int(c.get("num_attention_heads") or 1)
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or h // heads)
        return cls(h, int(c.get("intermediate_size") or 4 * h), int(c["vocab_size"]), kv_heads * head_dim,
                   int(c.get("num_hidden_layers") or 1))

    @property
    def shape_class(self) -> str:
        """What names a measurement: the layers' shapes. Not the vocabulary, which planning may know only as
        a bound before the model is built (a builtin's target size): the head is timed at whatever the
        first measurement saw, so the plan and the ranks, which read the built folder, share one entry."""
        return f"h{self.hidden}-i{self.intermediate}-kv{self.kv}-l{self.layers}"


# What the calibration times when a model's shapes can't be read before it is built (a GGUF file not yet
# fetched, a custom model type): a 1B-class decoder, between SmolLM2-135M and the 7B models.
DEFAULT_DIMS = Dims(hidden=2048, intermediate=8192, vocab=32000, kv=512, layers=16)


def dims_of(model_dir) -> Dims | None:
    """A model folder's shapes from its config.json, or None."""
    try:
        return Dims.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Speed:
    """bf16's speed over fp32's on this CPU at one shape class, as measured."""

    train: float      # a training step's matmuls (forward + backward)
    generate: float   # a decode step's
    cpu: str          # the CPU's model name and its bf16 flags
    threads: int
    torch: str
    onednn: str
    seconds: float    # what the calibration took
    shape_class: str

    def ratio(self, use: str) -> float:
        return self.generate if use == "generate" else self.train

    def where(self) -> str:
        return f"{self.cpu}, {self.threads} thread{'s' * (self.threads != 1)}, torch {self.torch}"


def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """(the CPU's model name, its flags) from the kernel; ("unknown CPU", {}) without /proc (macOS, Windows)."""
    name, flags = "unknown CPU", frozenset()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model name") and name == "unknown CPU":
                    name = " ".join(value.split())
                elif key in ("flags", "Features") and not flags:  # x86, Arm
                    flags = frozenset(value.split())
                if flags and name != "unknown CPU":
                    break
    except OSError:
        pass
    return name, flags


def native(flags: frozenset[str]) -> bool:
    """Whether a CPU computes bf16 in hardware at all (the pre-filter: otherwise fp32, unmeasured)."""
    return bool(NATIVE_FLAGS & flags)


def torch_version() -> str:
    """The installed torch's version, torch-free (its distribution metadata): it names oneDNN too."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torch")
    except PackageNotFoundError:
        return "none"


def cache_key(dims: Dims, cpuinfo: str = "/proc/cpuinfo") -> str:
    name, flags = cpu_identity(cpuinfo)
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    return f"{name}|flags {digest}|torch {torch_version()}|{dims.shape_class}"


def cache_path() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    try:
        from stages.core.cache.user_cache import cache_dir
    except ImportError:  # shipped beside a registered model, without the package
        cache_dir = lambda: Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sftflow"  # noqa: E731
    return cache_dir() / CACHE_FILE


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a missing or damaged cache is measured again, never trusted


def lookup(dims: Dims, path: Path | None = None) -> Speed | None:
    """The cached measurement for this CPU, torch and shape class, or None."""
    entry = _read(path or cache_path()).get(cache_key(dims))
    try:
        return Speed(**entry) if isinstance(entry, dict) else None
    except TypeError:
        return None


@contextmanager
def _locked(path: Path):
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _store(path: Path, key: str, speed: Speed) -> None:
    data = _read(path)
    torch_part = key.split("|")[2]
    # entries of another torch can never be read again (the key names the version): they go
    data = {k: v for k, v in data.items() if k.split("|")[2:3] == [torch_part]}
    data[key] = asdict(speed)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def speed(dims: Dims | None, cpuinfo: str = "/proc/cpuinfo") -> Speed | None:
    """bf16's measured speed over fp32 for `dims` on this CPU (cached; measured once where missing), or None
    where the CPU has no native bf16 (never measured)."""
    pinned = os.environ.get(ENV_PIN, "").strip()
    if pinned:
        try:
            r = float(pinned)
        except ValueError:
            raise ValueError(f"{ENV_PIN}={pinned!r}: a number (bf16's speed over fp32's), or unset to "
                             "measure") from None
        return Speed(train=r, generate=r, cpu=f"a CPU pinned by {ENV_PIN}={pinned}", threads=0,
                     torch=torch_version(), onednn="", seconds=0.0, shape_class=(dims or DEFAULT_DIMS).shape_class)
    if not native(cpu_identity(cpuinfo)[1]):
        return None
    dims = dims or DEFAULT_DIMS
    found = _remembered.get((dims, cpuinfo))
    if found is not None:
        return found
    path = cache_path()
    found = lookup(dims, path)
    if found is None:
        with _locked(path):
            found = lookup(dims, path)  # another process may have measured while this one waited
            if found is None:
                found = _measure_somewhere(dims, CALIBRATION_THREADS, cpuinfo)
                _store(path, cache_key(dims, cpuinfo), found)
    _remembered[(dims, cpuinfo)] = found
    return found


_remembered: dict[tuple[Dims, str], Speed] = {}  # a process reads the file once per shape class


def _measure_somewhere(dims: Dims, threads: int | None, cpuinfo: str) -> Speed:
    """In this process when it has torch already (a rank, chat); else in a subprocess, so planning
    never imports torch."""
    if "torch" in sys.modules:
        return measure(dims, threads, cpuinfo)
    cmd = [sys.executable, "-m", "stages.core.machine.bf16_speed", json.dumps(asdict(dims)), "--cpuinfo", cpuinfo]
    if threads:
        cmd += ["--threads", str(threads)]
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"measuring bf16 against fp32 failed: {(out.stderr or out.stdout).strip()[-500:]}")
    return Speed(**json.loads(out.stdout.strip().splitlines()[-1]))


def _shapes(dims: Dims) -> list[tuple[int, int, int]]:
    """(in features, out features, times a step runs it)."""
    h, i, kv, n = dims.hidden, dims.intermediate, dims.kv, dims.layers
    return [(h, h, 2 * n), (h, kv, 2 * n), (h, i, 2 * n), (i, h, n), (h, dims.vocab, 1)]


def _best_pair(fp32, bf16, repeats: int = REPEATS) -> tuple[float, float]:
    """Each call's fastest of `repeats`, the two alternating, so a burst of other work on the machine
    slows both or neither; the first call of each pays oneDNN's kernel choice, not the steady state."""
    fp32(), bf16()
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for j, fn in enumerate((fp32, bf16)):
            t = time.perf_counter()
            fn()
            best[j] = min(best[j], time.perf_counter() - t)
    return best[0], best[1]


def _timings(dims: Dims, clock=None) -> tuple[float, float]:
    """(train, generate): bf16's speed over fp32's, the step's matmuls weighted by how often it runs them.
    `clock(fp32_call, bf16_call) -> (seconds, seconds)` times one call of each (tests patch it)."""
    import torch
    import torch.nn.functional as F
    clock = clock or _best_pair
    gen = torch.Generator().manual_seed(0)
    totals = {"train": [0.0, 0.0], "generate": [0.0, 0.0]}
    rows = {"train": TRAIN_ROWS, "generate": DECODE_ROWS}
    for k, n, count in _shapes(dims):
        timed = {"train": max(1, min(n, int(FLOP_BUDGET // (6 * TRAIN_ROWS * k)))),
                 "generate": max(1, min(n, BYTE_BUDGET // (4 * k)))}
        for use in ("train", "generate"):
            cols = timed[use]
            x32 = torch.randn(rows[use], k, generator=gen)
            w32 = torch.randn(cols, k, generator=gen) / k ** 0.5
            g32 = torch.randn(rows[use], cols, generator=gen)
            calls = []
            for dtype in (torch.float32, torch.bfloat16):
                x, w, g = x32.to(dtype), w32.to(dtype), g32.to(dtype)
                if use == "train":
                    x.requires_grad_(True)
                    w.requires_grad_(True)

                    def step(x=x, w=w, g=g):
                        F.linear(x, w).backward(g)
                        x.grad = w.grad = None
                else:
                    def step(x=x, w=w):
                        with torch.no_grad():
                            F.linear(x, w)
                calls.append(step)
            for j, t in enumerate(clock(*calls)):
                totals[use][j] += t * count * n / cols
    return tuple(totals[u][0] / totals[u][1] for u in ("train", "generate"))


def measure(dims: Dims, threads: int | None = None, cpuinfo: str = "/proc/cpuinfo", clock=None) -> Speed:
    """Time fp32 against bf16 at `dims`'s shapes with `threads` (default: this process's)."""
    import torch
    before = torch.get_num_threads()
    threads = threads or before
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        train, generate = _timings(dims, clock)
    finally:
        torch.set_num_threads(before)
    name, flags = cpu_identity(cpuinfo)
    shown = " ".join(sorted(f for f in flags if f in NATIVE_FLAGS or f.startswith("amx_"))) or "no bf16 flags"
    import re
    found = re.search(r"(?:oneDNN|MKL-DNN) v([\d.]+)", torch.__config__.show())  # the build's kernels, for the record
    onednn = found.group(1) if found else ""
    return Speed(train=round(train, 3), generate=round(generate, 3), cpu=f"{name} ({shown})", threads=threads,
                 torch=torch_version(), onednn=onednn, seconds=round(time.perf_counter() - t0, 3),
                 shape_class=dims.shape_class)


def main(argv: list[str] | None = None) -> None:
    """The planning process's calibration in a process of its own: prints one JSON line (a Speed)."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m stages.core.machine.bf16_speed")
    ap.add_argument("dims", help="a Dims as JSON")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpuinfo", default="/proc/cpuinfo")
    a = ap.parse_args(argv)
    print(json.dumps(asdict(measure(Dims(**json.loads(a.dims)), a.threads, a.cpuinfo))))


if __name__ == "__main__":
    main()
