"""A simulated GPU machine for the planning process: what `stages.core.machine.topology.inventory` reads,
faked at its inputs, so `sftflow show --json` and the pre-launch checks decide as on real GPUs.

  * a fake `nvidia-smi` first on PATH, answering as the real one prints: `-L` (each GPU with its
    UUID, a GPU in MIG mode with its MIG devices under it), `--query-gpu=...` with or without the
    `uuid` field (a driver without `compute_cap` when `capability` is None), and `-q -x` (the XML,
    each MIG device with its own memory; `xml=False` makes it fail, as on a driver that can't);
  * a `sitecustomize` on PYTHONPATH that makes `topology.torch_build()` answer "cuda" (this
    machine's torch is the CPU wheel, under which no GPU counts);
  * empty packages named in `packages` (flash_attn, flash_attn_interface), found by the planning's
    `importlib.util.find_spec` as an installed attention kernel is.

UUIDs are deterministic: a GPU's from its place on the machine and its name (`uuids`), a MIG
device's from its GPU's UUID and its index there, unless given.

Nothing here reaches torch in a rank: the worker's own device rules (`local_device`, the backend,
`choose_precision`) are tested with a patched `torch.cuda` in tests/test_gpu_machines.py.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class FakeMIG:
    """A MIG device (one compute instance of one GPU instance) as nvidia-smi lists it."""
    profile: str  # "3g.40gb"; "1c.3g.40gb" for one of several compute instances
    mib: int  # its own memory, as `-q -x` reports it (fb_memory_usage/total)
    gi: int | None = None  # GPU instance id; None: one of its own per device
    ci: int = 0  # compute instance id
    uuid: str | None = None  # None: derived from its GPU's UUID and its index


@dataclass(frozen=True)
class FakeGPU:
    name: str
    mib: int
    capability: str | None  # "9.0"; None: a driver that doesn't know the compute_cap field
    uuid: str | None = None  # None: derived from its place on the machine and its name (`uuids`)
    migs: tuple[FakeMIG, ...] = ()  # MIG mode: its MIG devices


H200 = FakeGPU("NVIDIA H200", 143771, "9.0")
H100 = FakeGPU("NVIDIA H100 80GB HBM3", 81559, "9.0")
A100 = FakeGPU("NVIDIA A100-SXM4-80GB", 81920, "8.0")
L4 = FakeGPU("NVIDIA L4", 23034, "8.9")
RTX4090 = FakeGPU("NVIDIA GeForce RTX 4090", 24564, "8.9")
T4 = FakeGPU("Tesla T4", 15360, "7.5")
# an A100-80GB in MIG mode, split as `nvidia-smi mig -cgi 3g.40gb,2g.20gb,1g.10gb -C` does (memory
# as the A100-80GB's profiles have it: the names round up)
A100_MIG = FakeGPU(A100.name, A100.mib, A100.capability,
                   migs=(FakeMIG("3g.40gb", 40448, gi=2), FakeMIG("2g.20gb", 19968, gi=3),
                         FakeMIG("1g.10gb", 9728, gi=9)))

DRIVER = "570.124.06"  # R570: CUDA enumerates one MIG device per GPU instance


def _hex_uuid(prefix: str, seed: str) -> str:
    h = hashlib.sha256(seed.encode()).hexdigest()
    return f"{prefix}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def uuids(gpus: list[FakeGPU]) -> list[str]:
    """Each GPU's UUID on the machine `gpus` (the same list: the same UUIDs)."""
    return [g.uuid or _hex_uuid("GPU", f"{i}:{g.name}") for i, g in enumerate(gpus)]


def mig_uuids(gpus: list[FakeGPU], driver: str = DRIVER) -> list[list[str]]:
    """Each GPU's MIG device UUIDs: `MIG-<uuid>`; `MIG-<GPU uuid>/<gi>/<ci>` from a driver before R470."""
    legacy = int(driver.split(".")[0]) < 470
    return [[m.uuid or (f"MIG-{u}/{gi}/{m.ci}" if legacy else _hex_uuid("MIG", f"{u}/{k}"))
             for k, (m, gi) in enumerate(zip(g.migs, _gis(g)))] for g, u in zip(gpus, uuids(gpus))]


def _gis(g: FakeGPU) -> list[int]:
    return [m.gi if m.gi is not None else k + 1 for k, m in enumerate(g.migs)]


def _listing(gpus: list[FakeGPU], driver: str) -> str:
    lines = []
    for i, (g, u, migs) in enumerate(zip(gpus, uuids(gpus), mig_uuids(gpus, driver))):
        lines.append(f"GPU {i}: {g.name} (UUID: {u})")
        lines += [f"  MIG {m.profile:<11} Device {k:>2}: (UUID: {mu})" for k, (m, mu) in enumerate(zip(g.migs, migs))]
    return "".join(line + "\n" for line in lines)


def _xml(gpus: list[FakeGPU], driver: str) -> str:
    """`nvidia-smi -q -x` as a real driver writes it, cut to the elements around what is read."""
    out = ['<?xml version="1.0" ?>', '<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">', "<nvidia_smi_log>",
           "\t<timestamp>Tue Jul 15 16:01:30 2025</timestamp>", f"\t<driver_version>{driver}</driver_version>",
           "\t<cuda_version>12.8</cuda_version>", f"\t<attached_gpus>{len(gpus)}</attached_gpus>"]
    for i, (g, u) in enumerate(zip(gpus, uuids(gpus))):
        mode = "Enabled" if g.migs else "Disabled"
        out += [f'\t<gpu id="00000000:{7 + 4 * i:02X}:00.0">', f"\t\t<product_name>{g.name}</product_name>",
                f"\t\t<mig_mode>\n\t\t\t<current_mig>{mode}</current_mig>\n\t\t\t<pending_mig>{mode}</pending_mig>"
                "\n\t\t</mig_mode>", "\t\t<mig_devices>"]
        if not g.migs:
            out.append("\t\t\tNone")
        for k, (m, gi) in enumerate(zip(g.migs, _gis(g))):
            out += ["\t\t\t<mig_device>", f"\t\t\t\t<index>{k}</index>",
                    f"\t\t\t\t<gpu_instance_id>{gi}</gpu_instance_id>",
                    f"\t\t\t\t<compute_instance_id>{m.ci}</compute_instance_id>",
                    "\t\t\t\t<device_attributes>\n\t\t\t\t\t<shared>\n\t\t\t\t\t\t<multiprocessor_count>"
                    f"{14 * int(m.profile.split('g.')[0].split('.')[-1])}</multiprocessor_count>\n"
                    "\t\t\t\t\t</shared>\n\t\t\t\t</device_attributes>",
                    f"\t\t\t\t<fb_memory_usage>\n\t\t\t\t\t<total>{m.mib} MiB</total>\n\t\t\t\t\t<reserved>0 MiB"
                    f"</reserved>\n\t\t\t\t\t<used>13 MiB</used>\n\t\t\t\t\t<free>{m.mib - 13} MiB</free>\n"
                    "\t\t\t\t</fb_memory_usage>", "\t\t\t</mig_device>"]
        out += ["\t\t</mig_devices>", f"\t\t<uuid>{u}</uuid>", f"\t\t<minor_number>{i}</minor_number>",
                f"\t\t<fb_memory_usage>\n\t\t\t<total>{g.mib} MiB</total>\n\t\t\t<reserved>446 MiB</reserved>\n"
                f"\t\t\t<used>{'N/A' if g.migs else '0 MiB'}</used>\n\t\t\t<free>N/A</free>\n\t\t</fb_memory_usage>",
                "\t</gpu>"]
    return "\n".join(out + ["</nvidia_smi_log>", ""])


def _heredoc(text: str) -> str:
    return f"cat <<'EOF'\n{text}EOF\n" if text else "true\n"


def nvidia_smi_script(gpus: list[FakeGPU], driver: str = DRIVER, xml: bool = True) -> str:
    """The fake nvidia-smi of the machine `gpus` (see the module's docstring)."""
    ids = uuids(gpus)
    rows = {fields: "".join(", ".join(row) + "\n" for row in (
        [str(i), *([u] if "uuid" in fields else []), g.name, str(g.mib), *([g.capability or ""] if "cap" in fields
                                                                          else [])]
        for i, (g, u) in enumerate(zip(gpus, ids)))) for fields in ("uuid,cap", "uuid", "cap", "")}
    old_driver = any(g.capability is None for g in gpus)
    no_cap = "echo 'Field \"compute_cap\" is not a valid field to query.' >&2; exit 2\n"
    no_xml = "echo 'Unable to write the XML' >&2; exit 3\n"
    return ("#!/bin/sh\n"
            "case \"$*\" in\n"
            f"  -L*) {_heredoc(_listing(gpus, driver))};;\n"
            f"  -q*-x*) {_heredoc(_xml(gpus, driver)) if xml else no_xml};;\n"
            f"  *uuid*compute_cap*) {no_cap if old_driver else _heredoc(rows['uuid,cap'])};;\n"
            f"  *uuid*) {_heredoc(rows['uuid'])};;\n"
            f"  *compute_cap*) {no_cap if old_driver else _heredoc(rows['cap'])};;\n"
            f"  *--query-gpu*) {_heredoc(rows[''])};;\n"
            "  *) echo 'fake nvidia-smi'; exit 0;;\n"
            "esac\n")


def simulated_machine(root: Path, gpus: list[FakeGPU], packages: tuple[str, ...] = (),
                      cuda_torch: bool = True, driver: str = DRIVER, xml: bool = True) -> dict[str, str]:
    """The environment of a process on the simulated machine (PATH, PYTHONPATH); `cuda_torch=False`
    keeps this machine's CPU build of torch (nvidia-smi then lists GPUs torch can't use)."""
    root.mkdir(parents=True, exist_ok=True)
    bin_dir, site = root / "bin", root / "site"
    bin_dir.mkdir(exist_ok=True)
    site.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(nvidia_smi_script(gpus, driver, xml))
    smi.chmod(0o755)
    if cuda_torch:
        (site / "sitecustomize.py").write_text(
            "# the simulated machine's torch is a CUDA build (tests/fake_gpu.py)\n"
            "import stages.core.machine.topology as _topology\n"
            "_topology.torch_build = lambda: 'cuda'\n")
    for name in packages:
        (site / name).mkdir(exist_ok=True)
        (site / name / "__init__.py").write_text("# a simulated installed package (tests/fake_gpu.py)\n")
    path = os.pathsep.join([str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": path}
