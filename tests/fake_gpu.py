"""A simulated GPU machine for the planning process: what `stages.core.topology.inventory` reads,
faked at its inputs, so `sftflow show --json` and the pre-launch checks decide as on real GPUs.

  * a fake `nvidia-smi` first on PATH, answering `-L` and `--query-gpu=...` for the GPUs given
    (a driver without `compute_cap` when `capability` is None);
  * a `sitecustomize` on PYTHONPATH that makes `topology.torch_build()` answer "cuda" (this
    machine's torch is the CPU wheel, under which no GPU counts);
  * empty packages named in `packages` (flash_attn, flash_attn_interface), found by the planning's
    `importlib.util.find_spec` as an installed attention kernel is.

Nothing here reaches torch in a rank: the worker's own device rules (`local_device`, the backend,
`choose_precision`) are tested with a patched `torch.cuda` in tests/test_gpu_machines.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class FakeGPU:
    name: str
    mib: int
    capability: str | None  # "9.0"; None: a driver that doesn't know the compute_cap field


H200 = FakeGPU("NVIDIA H200", 143771, "9.0")
H100 = FakeGPU("NVIDIA H100 80GB HBM3", 81559, "9.0")
A100 = FakeGPU("NVIDIA A100-SXM4-80GB", 81920, "8.0")
L4 = FakeGPU("NVIDIA L4", 23034, "8.9")
RTX4090 = FakeGPU("NVIDIA GeForce RTX 4090", 24564, "8.9")
T4 = FakeGPU("Tesla T4", 15360, "7.5")


def nvidia_smi_script(gpus: list[FakeGPU]) -> str:
    listing = "".join(f"echo 'GPU {i}: {g.name} (UUID: GPU-{i:08d})'\n" for i, g in enumerate(gpus))
    with_cap = "".join(f"echo '{i}, {g.name}, {g.mib}, {g.capability}'\n" for i, g in enumerate(gpus))
    without = "".join(f"echo '{i}, {g.name}, {g.mib}'\n" for i, g in enumerate(gpus))
    old_driver = any(g.capability is None for g in gpus)
    cap_branch = ("echo 'Field \"compute_cap\" is not a valid field to query.' >&2; exit 2" if old_driver
                  else with_cap.replace("\n", "; ").rstrip("; "))
    return ("#!/bin/sh\n"
            "case \"$*\" in\n"
            f"  -L*) {listing.replace(chr(10), '; ').rstrip('; ') or 'true'};;\n"
            f"  *compute_cap*) {cap_branch};;\n"
            f"  *--query-gpu*) {without.replace(chr(10), '; ').rstrip('; ') or 'true'};;\n"
            "  *) echo 'fake nvidia-smi'; exit 0;;\n"
            "esac\n")


def simulated_machine(root: Path, gpus: list[FakeGPU], packages: tuple[str, ...] = (),
                      cuda_torch: bool = True) -> dict[str, str]:
    """The environment of a process on the simulated machine (PATH, PYTHONPATH); `cuda_torch=False`
    keeps this machine's CPU build of torch (nvidia-smi then lists GPUs torch can't use)."""
    root.mkdir(parents=True, exist_ok=True)
    bin_dir, site = root / "bin", root / "site"
    bin_dir.mkdir(exist_ok=True)
    site.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(nvidia_smi_script(gpus))
    smi.chmod(0o755)
    if cuda_torch:
        (site / "sitecustomize.py").write_text(
            "# the simulated machine's torch is a CUDA build (tests/fake_gpu.py)\n"
            "import stages.core.topology as _topology\n"
            "_topology.torch_build = lambda: 'cuda'\n")
    for name in packages:
        (site / name).mkdir(exist_ok=True)
        (site / name / "__init__.py").write_text("# a simulated installed package (tests/fake_gpu.py)\n")
    path = os.pathsep.join([str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": path}
