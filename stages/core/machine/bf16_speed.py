"""What bf16 is worth on this CPU, measured: the speed of bf16 over fp32 at a model's own shapes, for
a training micro-batch and for a decode step, timed where the work runs and cached per CPU.

Flags name what a CPU can compute, not how fast: with AVX512-BF16 and no AMX, bf16 trained SmolLM2
at 0.6x fp32's speed on one Intel Xeon (its hypervisor hid AMX) and at 1.8x on a 2-core AMD EPYC
(Zen 4); the same flags, oneDNN's kernels, opposite answers (docs/benchmarks.md "bf16 on CPU").
So `actor.precision: auto` on a CPU (core/machine/precision.py) is bf16 where this measurement says bf16 is
at least MARGIN times as fast as fp32 here, and fp32 otherwise. The flags stay a pre-filter: a CPU
with no native bf16 at all (no avx512_bf16, amx_bf16 or, on Arm, bf16) is fp32 without measuring.

What is timed is the work, not its matmuls: matmuls alone overstate bf16. On this project's 2-core
Xeon with AMX, SmolLM2's matmuls at a micro-batch's 256 rows ran 3.2x as fast in bf16, while the
quickstart's train stage ran 0.7-1.0x: its micro-batches are small, and FSDP2's mixed precision
casts every weight for each micro-batch, norms and softmax upcast, attention is its own kernel. So
`measure` times one decoder layer as the worker runs it (norms, grouped-query attention, the gated
MLP; fp32 weights cast for each micro-batch, gradients back in fp32) forward and backward at
TRAIN_ROWS tokens, and the head with the loss's fp32 log-softmax; and a decode step: the layer over
a cache with the model loaded in the dtype, and the head in fp32 as the stages' decode loop computes
it (generation.Fp32Head). Each part is weighted by how often a step runs it (the layers, the head
once); a part whose work exceeds a budget is timed on fewer rows or a slice of the head's columns and
scaled, so a 7B model's calibration costs about what SmolLM2's does. fp32 and bf16 alternate and each
keeps its fastest repeat, so a burst of load on a shared machine reaches both or neither.

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
TRAIN_ROWS = 256   # tokens of a timed training micro-batch (the quickstart's packed micro-batches: 230-300)
MIN_ROWS = 32      # the fewest a big model's layer is timed at (its budget would allow fewer)
DECODE_ROWS = 16   # a decode step's batch of prompts (eval.batch_size's default)
CACHE_TOKENS = 128  # the earlier tokens a decode step attends to
FLOP_BUDGET = 1.5e9  # per timed training call: above it, fewer rows (a layer) or a slice of the head's columns
BYTE_BUDGET = 32 * 1024 ** 2  # the decode head's fp32 bytes: above it, a slice of its columns, scaled
REPEATS = 3
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
    """A decoder's shapes: what the calibration times."""

    hidden: int
    intermediate: int
    vocab: int
    kv: int
    layers: int
    head_dim: int = 64

    @classmethod
    def from_hf_config(cls, c: dict) -> "Dims":
        """From a Hugging Face config.json; KeyError for a missing size."""
        h = int(c["hidden_size"])
        heads = int(c.get("num_attention_heads") or 1)
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or h // heads)
        return cls(h, int(c.get("intermediate_size") or 4 * h), int(c["vocab_size"]), kv_heads * head_dim,
                   int(c.get("num_hidden_layers") or 1), head_dim)

    @property
    def shape_class(self) -> str:
        """What names a measurement: the layers' shapes. Not the vocabulary, which planning may know only as
        a bound before the model is built (a builtin's target size): the head is timed at whatever the
        first measurement saw, so the plan and the ranks, which read the built folder, share one entry."""
        return f"h{self.hidden}-i{self.intermediate}-kv{self.kv}-d{self.head_dim}-l{self.layers}"


# What the calibration times when a model's shapes can't be read before it is built (a GGUF file not yet
# fetched, a custom model type): a 1B-class decoder, between SmolLM2-135M and the 7B models.
DEFAULT_DIMS = Dims(hidden=2048, intermediate=8192, vocab=32000, kv=512, layers=16, head_dim=64)


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


def layer_rows(dims: Dims, rows: int) -> int:
    """The tokens a timed layer step takes: `rows`, fewer where one step's work would pass the budget (a 7B
    layer), never under MIN_ROWS."""
    per_token = 6 * (2 * dims.hidden * dims.hidden + 2 * dims.hidden * dims.kv + 3 * dims.hidden * dims.intermediate)
    return max(MIN_ROWS, min(rows, int(FLOP_BUDGET // per_token)))


def _rms(x, w):
    """RMSNorm as transformers' Llama-family norms compute it: in fp32, the result cast back."""
    import torch
    y = x.float()
    return w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _layer(x, w, dims: Dims, cache=None):
    """One decoder layer (norms, q/k/v/o with grouped-query attention, a SiLU-gated MLP) on `x` [batch,
    tokens, hidden] with weights `w`; `cache`: (k, v) of earlier tokens for a decode step."""
    import torch
    import torch.nn.functional as F
    b, t, h = x.shape
    d = dims.head_dim
    a = _rms(x, w["n1"])
    q = F.linear(a, w["q"]).view(b, t, h // d, d).transpose(1, 2)
    k = F.linear(a, w["k"]).view(b, t, dims.kv // d, d).transpose(1, 2)
    v = F.linear(a, w["v"]).view(b, t, dims.kv // d, d).transpose(1, 2)
    if cache is not None:
        k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None, enable_gqa=True)
    x = x + F.linear(o.transpose(1, 2).reshape(b, t, h), w["o"])
    m = _rms(x, w["n2"])
    return x + F.linear(F.silu(F.linear(m, w["g"])) * F.linear(m, w["u"]), w["dn"])


def _weights(dims: Dims, gen, grad: bool) -> dict:
    import torch
    h, i, kv = dims.hidden, dims.intermediate, dims.kv
    shapes = {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "g": (i, h), "u": (i, h), "dn": (h, i)}
    w = {n: (torch.randn(*s, generator=gen) / s[1] ** 0.5) for n, s in shapes.items()}
    w.update(n1=torch.ones(h), n2=torch.ones(h))
    return {n: t.requires_grad_(grad) for n, t in w.items()}


def _train_calls(dims: Dims, gen) -> list[tuple[float, object, object]]:
    """(weight, fp32 call, bf16 call) for a training micro-batch: a layer's forward and backward (times the
    layers) and the head's with the loss's fp32 log-softmax (its columns sliced within the budget, scaled),
    as the worker runs them: fp32 weights, which bf16 (FSDP2's mixed precision, one process included) casts
    for each micro-batch and whose gradients come back in fp32."""
    import torch
    import torch.nn.functional as F
    rows = layer_rows(dims, TRAIN_ROWS)
    masters = _weights(dims, gen, grad=True)
    x32 = torch.randn(1, rows, dims.hidden, generator=gen)
    g32 = torch.randn(1, rows, dims.hidden, generator=gen)
    cols = max(1, min(dims.vocab, int(FLOP_BUDGET // (6 * rows * dims.hidden))))
    head = (torch.randn(cols, dims.hidden, generator=gen) / dims.hidden ** 0.5).requires_grad_(True)

    def layer(dtype):
        def call():
            w = {n: t.to(dtype) for n, t in masters.items()}  # a no-op in fp32
            x = x32.to(dtype).requires_grad_(True)
            _layer(x, w, dims).backward(g32.to(dtype))
            for t in masters.values():
                t.grad = None
        return call

    def logits(dtype):
        def call():
            x = x32.to(dtype).requires_grad_(True)
            F.log_softmax(F.linear(x, head.to(dtype)).float(), -1).mean().backward()
            head.grad = None
        return call
    return [(float(dims.layers), layer(torch.float32), layer(torch.bfloat16)),
            (dims.vocab / cols, logits(torch.float32), logits(torch.bfloat16))]


def _decode_calls(dims: Dims, gen) -> list[tuple[float, object, object]]:
    """(weight, fp32 call, bf16 call) for a decode step of DECODE_ROWS replies over a cache of CACHE_TOKENS:
    a layer's forward with the model loaded in the dtype (generation.load), and the head, which the stages'
    decode loop computes in fp32 either way (generation.Fp32Head: only the hidden state is cast)."""
    import torch
    import torch.nn.functional as F
    w32 = _weights(dims, gen, grad=False)
    w16 = {n: t.to(torch.bfloat16) for n, t in w32.items()}
    x32 = torch.randn(DECODE_ROWS, 1, dims.hidden, generator=gen)
    kv32 = [torch.randn(DECODE_ROWS, dims.kv // dims.head_dim, CACHE_TOKENS, dims.head_dim, generator=gen)
            for _ in range(2)]
    kv16 = [t.to(torch.bfloat16) for t in kv32]
    cols = max(1, min(dims.vocab, BYTE_BUDGET // (4 * dims.hidden)))
    head = torch.randn(cols, dims.hidden, generator=gen) / dims.hidden ** 0.5
    x16 = x32.to(torch.bfloat16)

    def layer(x, w, kv):
        def call():
            with torch.no_grad():
                _layer(x, w, dims, kv)
        return call

    def logits(x):
        def call():
            with torch.no_grad():
                F.linear(x.float(), head).argmax(-1)
        return call
    return [(float(dims.layers), layer(x32, w32, kv32), layer(x16, w16, kv16)),
            (dims.vocab / cols, logits(x32), logits(x16))]


def _timings(dims: Dims, clock=None) -> tuple[float, float]:
    """(train, generate): bf16's speed over fp32's for a training micro-batch and a decode step, each part's
    time weighted by how often a step runs it. `clock(fp32_call, bf16_call) -> (seconds, seconds)` times
    one call of each (tests patch it)."""
    import torch
    clock = clock or _best_pair
    gen = torch.Generator().manual_seed(0)
    out = []
    with torch.inference_mode(False):
        for calls in (_train_calls(dims, gen), _decode_calls(dims, gen)):
            totals = [0.0, 0.0]
            for weight, fp32, bf16 in calls:
                for j, t in enumerate(clock(fp32, bf16)):
                    totals[j] += weight * t
            out.append(totals[0] / totals[1])
    return out[0], out[1]


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
