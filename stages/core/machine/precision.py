"""The one precision rule: what `actor.precision: auto` means on a device, for every process that runs a
model (the plan in `sftflow show`, the training worker, evaluate and its reference stages, replay, chat
and the registered chat model).

On a GPU, bf16 where the device computes it natively: an NVIDIA GPU of compute capability 8.0 or later
(Ampere on) or a ROCm GPU. Not on a T4 or V100 (7.x), where `torch.cuda.is_bf16_supported()` answers
True by its default `including_emulation=True` (a bf16 tensor can be made there, but every op is
emulated: slower than fp32 and not what the plan promised).

On a CPU, bf16 where it was measured at least `bf16_speed.MARGIN` times as fast as fp32 at the model's
own shapes on this CPU (core/machine/bf16_speed.py: timed once per CPU, torch and shape class, cached): flags
alone were wrong both ways. bf16 trained SmolLM2 at 0.6x fp32's speed on an Intel Xeon with
AVX512-BF16 whose hypervisor hid AMX, and at 1.8x on an AMD EPYC (Zen 4) with the same flags
(docs/benchmarks.md "bf16 on CPU"). A CPU without native bf16 at all is fp32, unmeasured. The key
decides which step is timed: `actor.precision` (training, and the replay and chat of that config) at a
training step's matmuls, `eval.precision` at a decode step's.
An explicit `fp32` or `bf16` in the config is obeyed.

Torch-free at import, so the planning process (which never imports torch: nvidia-smi's compute_cap,
/proc/cpuinfo, the cached measurement) and the ranks (which ask torch for the device's capability,
`device_facts`) apply the same function; the registered chat model ships this file and
bf16_speed.py beside generation.py; tests/test_precision_rule.py holds the GPU rule to torch's own
`is_bf16_supported(including_emulation=False)` and the CPU rule to patched timings.
"""

from __future__ import annotations

try:
    from stages.core.machine import bf16_speed
except ImportError:  # shipped beside a registered model: precision.py and bf16_speed.py side by side
    import bf16_speed

NATIVE_BF16_CAPABILITY = (8, 0)
Speed = bf16_speed.Speed


def use_of(key: str) -> str:
    """Which step a key's `auto` is timed at on a CPU: eval.precision's work is decoding, actor.precision's
    training."""
    return "generate" if key.startswith("eval") else "train"


def native_bf16(kind: str, capability: tuple[int, int] | None = None, rocm: bool = False,
                cpu: Speed | None = None, key: str = "actor.precision") -> bool:
    """Whether `auto` is bf16 on a device: kind "cuda" with capability >= 8.0, or ROCm; kind "cpu" where `cpu`
    (the measured speed; None: no native bf16) puts bf16 at MARGIN or more for the key's step. An unknown
    capability (an old driver's nvidia-smi) is not assumed to."""
    if kind == "cpu":
        return cpu is not None and cpu.ratio(use_of(key)) >= bf16_speed.MARGIN
    if kind != "cuda":
        return False
    return rocm or (capability is not None and tuple(capability) >= NATIVE_BF16_CAPABILITY)


def resolve(requested: str, kind: str, capability: tuple[int, int] | None = None, rocm: bool = False,
            cpu: Speed | None = None, key: str = "actor.precision") -> str:
    """`actor.precision` (or `eval.precision`: `key`) on this device: "fp32" or "bf16"."""
    if requested != "auto":
        return requested
    return "bf16" if native_bf16(kind, capability, rocm, cpu, key) else "fp32"


def why(requested: str, kind: str, capability: tuple[int, int] | None = None, rocm: bool = False,
        cpu: Speed | None = None, key: str = "actor.precision") -> str:
    """One line for `sftflow show`, train.log and the stage logs: which precision runs and why (`key`:
    the config key `requested` came from)."""
    chosen = resolve(requested, kind, capability, rocm, cpu, key)
    if requested != "auto":
        return f"{chosen}: {key}={requested} (set in the config)"
    if kind == "cpu":
        if cpu is None:
            return f"{chosen}: auto on a CPU without native bf16 (no avx512_bf16, amx_bf16 or bf16 flag; not measured)"
        step = "decode" if use_of(key) == "generate" else "training"
        ratio = cpu.ratio(use_of(key))
        said = f"{ratio:.2f}x fp32's speed at this model's {step} shapes on {cpu.where()} " \
               f"(bf16 from {bf16_speed.MARGIN:g}x)"
        return f"{chosen}: auto, measured {said}" if chosen == "bf16" else f"{chosen}: auto, bf16 measured {said}"
    if kind != "cuda":
        return f"{chosen}: auto on {kind}"
    if rocm:
        return f"{chosen}: auto on a ROCm GPU (bf16 in hardware)"
    if capability is None:
        return f"{chosen}: auto, the GPU's compute capability unknown (bf16 only where known to be native)"
    cap = f"{capability[0]}.{capability[1]}"
    if chosen == "bf16":
        return f"{chosen}: auto, compute capability {cap} computes bf16 in hardware"
    return f"{chosen}: auto, compute capability {cap} < 8.0 only emulates bf16"


def cpu_speed(dims=None) -> Speed | None:
    """This CPU's measured bf16 speed at `dims` (a bf16_speed.Dims; None: the default class), measured once
    and cached; None where the CPU has no native bf16."""
    return bf16_speed.speed(dims)


def device_facts(device, dims=None) -> tuple[str, tuple[int, int] | None, bool, Speed | None]:
    """(kind, compute capability, ROCm, the CPU's measured bf16 speed) of a torch.device, read from torch
    and the calibration cache (in a rank, never in planning). `dims`: the model's shapes."""
    import torch
    if device.type == "cpu":
        return "cpu", None, False, cpu_speed(dims)
    if device.type != "cuda":
        return device.type, None, False, None
    props = torch.cuda.get_device_properties(device)
    return "cuda", (props.major, props.minor), bool(torch.version.hip), None


def on_device(requested: str, device, dims=None, key: str = "actor.precision") -> str:
    """`resolve` for a torch.device; on a CPU only `auto` looks at (or takes) the measurement."""
    if requested != "auto":
        return requested
    return resolve(requested, *device_facts(device, dims), key=key)
