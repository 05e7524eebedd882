"""The one precision rule: what `actor.precision: auto` means on a device, for every process that runs a
model (the plan in `sftflow show`, the training worker, evaluate and its reference stages, replay, chat
and the registered chat model).

bf16 only where the device computes it natively: an NVIDIA GPU of compute capability 8.0 or later
(Ampere on), or a ROCm GPU. Everywhere else fp32, including a T4 or V100 (7.x), where
`torch.cuda.is_bf16_supported()` answers True by its default `including_emulation=True` (a bf16
tensor can be made there, but every op is emulated: slower than fp32 and not what the plan promised).
An explicit `fp32` or `bf16` in the config is obeyed.

Torch-free at import, so the planning process (which never imports torch) and the ranks (which ask
torch for the device's capability, `device_facts`) apply the same function; the registered chat model
ships this file beside generation.py; tests/test_precision_rule.py holds both to
torch's own `is_bf16_supported(including_emulation=False)`.
"""

from __future__ import annotations

NATIVE_BF16_CAPABILITY = (8, 0)


def native_bf16(kind: str, capability: tuple[int, int] | None = None, rocm: bool = False) -> bool:
    """Whether a device computes bf16 in hardware: kind "cuda" with capability >= 8.0, or ROCm.
    An unknown capability (an old driver's nvidia-smi) is not assumed to."""
    if kind != "cuda":
        return False
    return rocm or (capability is not None and tuple(capability) >= NATIVE_BF16_CAPABILITY)


def resolve(requested: str, kind: str, capability: tuple[int, int] | None = None, rocm: bool = False) -> str:
    """`actor.precision` on this device: "fp32" or "bf16"."""
    if requested != "auto":
        return requested
    return "bf16" if native_bf16(kind, capability, rocm) else "fp32"


def why(requested: str, kind: str, capability: tuple[int, int] | None = None, rocm: bool = False,
        key: str = "actor.precision") -> str:
    """One line for `sftflow show`, train.log and the stage logs: which precision runs and why (`key`:
    the config key `requested` came from)."""
    chosen = resolve(requested, kind, capability, rocm)
    if requested != "auto":
        return f"{chosen}: {key}={requested} (set in the config)"
    if kind != "cuda":
        return f"{chosen}: auto on CPU"
    if rocm:
        return f"{chosen}: auto on a ROCm GPU (bf16 in hardware)"
    if capability is None:
        return f"{chosen}: auto, the GPU's compute capability unknown (bf16 only where known to be native)"
    cap = f"{capability[0]}.{capability[1]}"
    if chosen == "bf16":
        return f"{chosen}: auto, compute capability {cap} computes bf16 in hardware"
    return f"{chosen}: auto, compute capability {cap} < 8.0 only emulates bf16"


def device_facts(device) -> tuple[str, tuple[int, int] | None, bool]:
    """(kind, compute capability, ROCm) of a torch.device, read from torch (in a rank, never in planning)."""
    import torch
    if device.type != "cuda":
        return device.type, None, False
    props = torch.cuda.get_device_properties(device)
    return "cuda", (props.major, props.minor), bool(torch.version.hip)


def on_device(requested: str, device) -> str:
    """`resolve` for a torch.device."""
    return resolve(requested, *device_facts(device))
