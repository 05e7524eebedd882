"""The one precision rule: what `actor.precision: auto` means on a device, for every process that runs a
model (the plan in `sftflow show`, the training worker, evaluate and its reference stages, replay, chat
and the registered chat model).

bf16 only where the device computes it natively and faster than fp32: an NVIDIA GPU of compute capability
8.0 or later (Ampere on), a ROCm GPU, or a CPU with AMX (Intel Sapphire Rapids on: bf16 tile matrix
units). Everywhere else fp32, including a T4 or V100 (7.x), where `torch.cuda.is_bf16_supported()`
answers True by its default `including_emulation=True` (a bf16 tensor can be made there, but every op
is emulated: slower than fp32 and not what the plan promised), and a CPU whose only bf16 is AVX512-BF16
(Cooper Lake, Zen 4, or a Sapphire Rapids whose hypervisor hides AMX): its bf16 dot products are native,
but measured there bf16 trained 0.6x and generated 0.95x as fast as fp32 (oneDNN's bf16 kernels against
MKL's fp32 ones; docs/benchmarks.md "bf16 on CPU"), so `auto` would be a slowdown.
An explicit `fp32` or `bf16` in the config is obeyed.

Torch-free at import, so the planning process (which never imports torch: nvidia-smi's compute_cap,
/proc/cpuinfo's flags) and the ranks (which ask torch for the device's capability, `device_facts`) apply
the same function; the registered chat model
ships this file beside generation.py; tests/test_precision_rule.py holds both to
torch's own `is_bf16_supported(including_emulation=False)`.
"""

from __future__ import annotations

NATIVE_BF16_CAPABILITY = (8, 0)
CPU_AMX_FLAGS = frozenset({"amx_bf16", "amx_tile"})  # /proc/cpuinfo's names for AMX's bf16 tiles


def native_bf16(kind: str, capability: tuple[int, int] | None = None, rocm: bool = False, amx: bool = False) -> bool:
    """Whether `auto` is bf16 on a device: kind "cuda" with capability >= 8.0, or ROCm; kind "cpu" with AMX
    (`amx`). An unknown capability (an old driver's nvidia-smi) is not assumed to."""
    if kind == "cpu":
        return amx
    if kind != "cuda":
        return False
    return rocm or (capability is not None and tuple(capability) >= NATIVE_BF16_CAPABILITY)


def resolve(requested: str, kind: str, capability: tuple[int, int] | None = None, rocm: bool = False,
            amx: bool = False) -> str:
    """`actor.precision` on this device: "fp32" or "bf16"."""
    if requested != "auto":
        return requested
    return "bf16" if native_bf16(kind, capability, rocm, amx) else "fp32"


def why(requested: str, kind: str, capability: tuple[int, int] | None = None, rocm: bool = False,
        amx: bool = False, key: str = "actor.precision") -> str:
    """One line for `sftflow show`, train.log and the stage logs: which precision runs and why (`key`:
    the config key `requested` came from)."""
    chosen = resolve(requested, kind, capability, rocm, amx)
    if requested != "auto":
        return f"{chosen}: {key}={requested} (set in the config)"
    if kind == "cpu":
        return (f"{chosen}: auto on a CPU with AMX (bf16 matrix units)" if amx else
                f"{chosen}: auto on a CPU without AMX (bf16 is emulated or, with AVX512-BF16 alone, slower than fp32)")
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


def cpu_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU has AMX's bf16 tiles, from the kernel's flags (torch-free, for planning;
    False where there is no /proc/cpuinfo: macOS, Windows). tests/test_precision_rule.py holds it to
    torch's own `torch.cpu._is_amx_tile_supported()` on the machine the tests run on."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return CPU_AMX_FLAGS <= set(line.partition(":")[2].split())
    except OSError:
        pass
    return False


def torch_cpu_amx() -> bool:
    """torch's answer to whether its CPU kernels can use AMX tiles here (the CPU has them and the kernel
    lets this process use them). A torch without the query answers by the flags."""
    import torch
    query = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(query()) if query is not None else cpu_amx()


def device_facts(device) -> tuple[str, tuple[int, int] | None, bool, bool]:
    """(kind, compute capability, ROCm, AMX) of a torch.device, read from torch (in a rank, never in planning)."""
    import torch
    if device.type == "cpu":
        return "cpu", None, False, torch_cpu_amx()
    if device.type != "cuda":
        return device.type, None, False, False
    props = torch.cuda.get_device_properties(device)
    return "cuda", (props.major, props.minor), bool(torch.version.hip), False


def on_device(requested: str, device) -> str:
    """`resolve` for a torch.device."""
    return resolve(requested, *device_facts(device))
