"""The GPUs this machine's torch can train on, and how many processes a node runs when
`actor.nproc_per_node: auto`, and why.

On GPUs: one process per visible GPU that the batch sizes can use (FSDP2 shards over them; a
global batch of 32 in micro-batches of 16 keeps 2 of 8 GPUs busy, and says so). On CPU:
`actor.cpu_nproc_per_node` processes (default 1, whose torch threads use every core). FSDP2 over
gloo processes on one machine splits the same cores between ranks and adds the collectives on
top: on 2 cores the SmolLM2 quickstart (LoRA r=16) trains at 0.66x the tokens/s of one process
(docs/benchmarks.md, "Quickstart topology"); the demo asks for 2 to show torchrun + FSDP2.
A number in `actor.nproc_per_node` is obeyed on CPU; on GPUs a training count above the visible
GPUs is refused before launch (`pipeline.check_launch`).

Torch-free: the config is resolved in the CLI before any stage imports torch, on the machine that
launches torchrun. The GPUs come from nvidia-smi; where it is missing or lists none and the
installed torch is a CUDA or ROCm build (read from torch's own version.py, not imported), torch
itself is asked in a subprocess, so a machine whose torch sees a GPU never takes the CPU branch.
A CPU build of torch sees no GPU whatever nvidia-smi lists. CUDA_VISIBLE_DEVICES is applied as
CUDA applies it (`resolve_visible`: indices, GPU UUIDs and unique prefixes, MIG device UUIDs, up to
the first entry that names nothing), and a MIG device counts its own memory, not its GPU's
(`_smi_gpus`). The simulated GPU machine of the tests (tests/fake_gpu.py) is a fake nvidia-smi on
PATH plus `torch_build` answering "cuda".
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__fingerprint__ = False  # how the work is spread never changes a result (unhashed in the config)


@dataclass(frozen=True)
class GPU:
    index: str  # as CUDA_VISIBLE_DEVICES names it: nvidia-smi's index; a MIG device: its MIG UUID
    name: str
    bytes: int  # its own memory: a MIG device's slice, never its parent GPU's
    capability: tuple[int, int] | None = None  # compute capability; None: unknown (an old driver)
    uuid: str | None = None  # "GPU-..."; a MIG device: "MIG-..." ("MIG-GPU-.../gi/ci" before driver R470)
    slices: tuple[GPU, ...] = ()  # a GPU in MIG mode: its MIG devices, which CUDA enumerates instead of it
    parent: str | None = None  # a MIG device: its GPU's UUID
    instance: tuple[int, int] | None = None  # a MIG device: (GPU instance id, compute instance id), where known


@dataclass(frozen=True)
class Listing:
    """What nvidia-smi says of the machine: every GPU (a GPU in MIG mode with its MIG devices), and the
    driver's major version where it was read (only with MIG devices: CUDA's MIG rules depend on it)."""

    gpus: tuple[GPU, ...] = ()
    driver: int | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Inventory:
    """The GPUs visible to this process (CUDA_VISIBLE_DEVICES applied), where that came from, and
    a note when nvidia-smi and torch disagree or CUDA_VISIBLE_DEVICES names what CUDA can't use."""

    gpus: tuple[GPU, ...]
    source: str  # "nvidia-smi" | "torch" | "none"
    note: str | None = None


def torch_build() -> str | None:
    """"cuda", "rocm" or "cpu": which build of torch is installed, read from its version.py
    without importing it (seconds of CPU); None without torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None

    def field(name: str) -> str | None:
        m = re.search(rf"^{name}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        return m.group(1) if m else None
    return "rocm" if field("hip") else "cuda" if field("cuda") else "cpu"


def _capability(text: str) -> tuple[int, int] | None:
    parts = text.strip().split(".")
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 and all(p.isdigit() for p in parts) else None


# the --query-gpu fields, asked in this order until one answers: compute_cap needs a driver from 2021
# or later; a tool answering only the older fields without uuid (no GPU UUIDs to match) is still read
QUERIES = ("index,uuid,name,memory.total,compute_cap", "index,uuid,name,memory.total",
           "index,name,memory.total,compute_cap", "index,name,memory.total")


def parse_query(out: str, fields: str) -> tuple[GPU, ...]:
    """`nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits` (FIELDS one of QUERIES) as GPUs;
    () when the reply doesn't have those fields (an error, or a driver that lacks one)."""
    names = fields.split(",")
    rows = [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.count(",") == len(names) - 1]
    gpus = []
    for row in rows:
        r = dict(zip(names, row))
        if not (r["index"].isdigit() and r["memory.total"].isdigit()) or not r.get("uuid", "GPU-").startswith("GPU-"):
            return ()
        gpus.append(GPU(r["index"], r["name"], int(r["memory.total"]) * 1024 ** 2,
                        _capability(r["compute_cap"]) if "compute_cap" in r else None, r.get("uuid")))
    return tuple(gpus)


_L_GPU = re.compile(r"^GPU (\d+): (.*?) \(UUID: (GPU-[^)\s]+)\)\s*$")
_L_MIG = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)\s]+)\)\s*$")
_LEGACY_MIG = re.compile(r"^MIG-(GPU-[0-9A-Fa-f-]+)/(\d+)/(\d+)$")  # drivers before R470


def parse_list(out: str) -> list[tuple[str, str, str, list[tuple[str, int, str]]]]:
    """`nvidia-smi -L`: (index, name, GPU UUID, [(MIG profile, MIG device index, MIG UUID)]) per GPU,
    e.g. `GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-...)` then `  MIG 3g.40gb     Device  0: (UUID: MIG-...)`
    (`MIG-GPU-<gpu uuid>/<gi>/<ci>` from drivers before R470)."""
    gpus: list[tuple[str, str, str, list[tuple[str, int, str]]]] = []
    for line in out.splitlines():
        if m := _L_GPU.match(line):
            gpus.append((m.group(1), m.group(2), m.group(3), []))
        elif (m := _L_MIG.match(line)) and gpus:
            gpus[-1][3].append((m.group(1), int(m.group(2)), m.group(3)))
    return gpus


def parse_xml(out: str) -> tuple[int | None, dict[str, dict[int, dict]]]:
    """`nvidia-smi -q -x`: the driver's major version, and per GPU UUID its MIG devices by index (the
    `Device N` of `-L`): {"instance": (gi, ci), "mib": the slice's own memory.total or None, "uuid"
    where the driver writes one}; (None, {}) for anything that isn't that XML."""
    import xml.etree.ElementTree as ET
    try:
        root = ET.fromstring(out)
    except ET.ParseError:
        return None, {}

    def number(text: str | None) -> int | None:
        m = re.match(r"\s*(\d+)", text or "")
        return int(m.group(1)) if m else None
    driver = number(root.findtext("driver_version"))
    found: dict[str, dict[int, dict]] = {}
    for gpu in root.iter("gpu"):
        migs = {}
        for d in gpu.findall("mig_devices/mig_device"):
            index, gi, ci = (number(d.findtext(k)) for k in ("index", "gpu_instance_id", "compute_instance_id"))
            if index is not None:
                migs[index] = {"instance": (gi, ci) if gi is not None and ci is not None else None,
                               "mib": number(d.findtext("fb_memory_usage/total")),
                               "uuid": (d.findtext("uuid") or "").strip() or None}
        found[(gpu.findtext("uuid") or "").strip()] = migs
    return driver, found


def profile_bytes(profile: str) -> int | None:
    """A MIG profile's nominal memory (`1g.10gb`, `1c.3g.40gb`, `1g.10gb+me`) in decimal gigabytes:
    at or below the slice's real size on the A100/H100/H200 profiles (a 1g.10gb of an A100-80GB has
    9.5 GiB, 10.2e9 bytes), so the memory plan errs on the refusing side where the XML is missing."""
    m = re.search(r"(\d+)g\.(\d+)gb", profile)
    return int(m.group(2)) * 10 ** 9 if m else None


def _smi(smi: str, *args: str) -> str:
    try:
        return subprocess.run([smi, *args], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@lru_cache(maxsize=None)
def _smi_gpus(path: str | None = None) -> Listing:
    """Every GPU nvidia-smi lists (index, UUID, name, memory, compute capability; a GPU in MIG mode with
    its MIG devices, each with its own memory), CUDA_VISIBLE_DEVICES not applied.

    GPUs: `--query-gpu` (QUERIES). MIG devices: `-L` names them under their GPU (profile, UUID);
    their memory and GPU/compute instance ids come from `-q -x` (each `<mig_device>`'s own
    `fb_memory_usage/total`: `--query-gpu` reports the parent GPU's memory for a MIG device), asked
    only when `-L` lists a MIG device; without it, the profile's nominal size (`profile_bytes`)."""
    smi = shutil.which("nvidia-smi", path=path)
    if not smi:
        return Listing()
    gpus: tuple[GPU, ...] = ()
    for fields in QUERIES:
        gpus = parse_query(_smi(smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"), fields)
        if gpus:
            break
    if not gpus:
        return Listing()
    listed = {index: (uuid, migs) for index, _, uuid, migs in parse_list(_smi(smi, "-L"))}
    driver, xml, notes = None, {}, []
    if any(migs for _, migs in listed.values()):
        driver, xml = parse_xml(_smi(smi, "-q", "-x"))
        if not xml:
            notes.append("nvidia-smi -q -x gave no MIG memory: each MIG device counts its profile's nominal "
                         "size")
    out = []
    for g in gpus:
        uuid, migs = listed.get(g.index, (g.uuid, []))
        uuid = g.uuid or uuid
        slices = []
        for profile, k, mig_uuid in migs:
            info = xml.get(uuid or "", {}).get(k, {})
            legacy = _LEGACY_MIG.match(mig_uuid)
            instance = info.get("instance") or ((int(legacy.group(2)), int(legacy.group(3))) if legacy else None)
            size = info["mib"] * 1024 ** 2 if info.get("mib") else profile_bytes(profile) or g.bytes
            slices.append(GPU(mig_uuid, f"{g.name} MIG {profile}", size, g.capability, mig_uuid, (), uuid, instance))
        out.append(GPU(g.index, g.name, g.bytes, g.capability, uuid, tuple(slices)))
    return Listing(tuple(out), driver, tuple(notes))


_PROBE = ("import json, torch\n"
          "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
          "ps = [torch.cuda.get_device_properties(i) for i in range(n)]\n"
          "print(json.dumps([[str(i), p.name, p.total_memory, [p.major, p.minor]] for i, p in enumerate(ps)]))\n")


@lru_cache(maxsize=None)
def _torch_gpus(visible: str | None) -> tuple[GPU, ...]:
    """The GPUs torch itself sees (CUDA_VISIBLE_DEVICES applied by torch, a MIG device with its own
    memory), asked in a subprocess so that the CLI never imports torch or initializes CUDA; only where
    nvidia-smi can't tell."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120).stdout
        rows = json.loads(out.strip().splitlines()[-1]) if out.strip() else []
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return ()
    return tuple(GPU(str(i), name, int(mem), (cap[0], cap[1])) for i, name, mem, cap in rows)


def _unique(entry: str, candidates: list[GPU], what: str) -> tuple[GPU | None, str]:
    """The one candidate whose UUID starts with `entry` (CUDA accepts any unique prefix)."""
    hits = [g for g in candidates if g.uuid and g.uuid.lower().startswith(entry.lower())]
    if len(hits) == 1:
        return hits[0], ""
    return None, (f"'{entry}' matches no {what} nvidia-smi lists" if not hits else
                  f"'{entry}' is not unique: it starts the UUIDs of {len(hits)} {what}s")


def _match(gpus: tuple[GPU, ...], entry: str) -> tuple[GPU | None, str]:
    """The GPU or MIG device a CUDA_VISIBLE_DEVICES entry names, else None and why."""
    if entry.isdigit():
        hit = next((g for g in gpus if g.index == str(int(entry))), None)
        return hit, "" if hit else f"'{entry}' is no GPU index (nvidia-smi lists {len(gpus)}: 0-{len(gpus) - 1})"
    upper = entry.upper()
    if upper.startswith("GPU-"):
        return _unique(entry, list(gpus), "GPU")
    migs = [s for g in gpus for s in g.slices]
    if upper.startswith("MIG-"):
        if legacy := _LEGACY_MIG.match(entry):  # MIG-<GPU UUID>/<GPU instance>/<compute instance>
            parent, why = _unique(legacy.group(1), list(gpus), "GPU")
            want = (int(legacy.group(2)), int(legacy.group(3)))
            hit = next((s for s in (parent.slices if parent else ()) if s.instance == want or s.uuid == entry), None)
            return hit, "" if hit else why or f"'{entry}' matches no MIG device (GPU instance {want[0]}, compute " \
                                              f"instance {want[1]}) nvidia-smi lists"
        return _unique(entry, migs, "MIG device")
    return None, f"'{entry}' is neither a GPU index, a GPU UUID nor a MIG device UUID"


def resolve_visible(gpus: tuple[GPU, ...], visible: str | None,
                    driver: int | None = None) -> tuple[tuple[GPU, ...], str | None]:
    """The devices CUDA enumerates, in its order, from nvidia-smi's listing and CUDA_VISIBLE_DEVICES,
    and a note of what it left out and why (None: nothing). CUDA's documented rules:

      * CUDA_VISIBLE_DEVICES unset: every GPU. Set: comma-separated entries, each a GPU index, a GPU
        UUID (`GPU-...`, or any prefix of it that starts one GPU's UUID only) or a MIG device UUID
        (`MIG-...`, or `MIG-<GPU UUID>/<GPU instance id>/<compute instance id>` before driver R470);
        the devices are enumerated in the order named, each once; the first entry that names nothing
        ends the list: CUDA sees only the devices named before it (`0,2,-1,1`: 0 and 2).
      * A GPU in MIG mode is not a CUDA device itself: CUDA enumerates its MIG devices. From driver
        R570 one compute instance per GPU instance (the first named), beside whole GPUs; before
        R570 (and where the driver is unknown) a process enumerates one MIG device only, the first,
        and no whole GPU beside it.
    Each MIG device has its own memory (`GPU.bytes`) and its GPU's compute capability."""
    notes = []
    if visible is None:
        named = list(gpus)
    else:
        named = []
        for entry in visible.split(","):
            hit, why = _match(gpus, entry.strip())
            if hit is None:
                before = (f"only the {len(named)} device{'s' if len(named) > 1 else ''} named before it"
                          if named else "no GPU")
                notes.append(f"CUDA_VISIBLE_DEVICES={visible}: {why}; CUDA stops at the first entry it can't "
                             f"match, so this process sees {before}")
                break
            named.append(hit)
    devices: list[GPU] = []
    for d in named:
        for each in d.slices or (d,):
            if each not in devices:
                devices.append(each)
    if any(d.parent for d in devices):
        if driver is not None and driver >= 570:
            kept, seen = [], set()
            for d in devices:
                key = (d.parent, d.instance[0]) if d.parent and d.instance else None
                if key is None or key not in seen:
                    kept.append(d)
                    seen.add(key)
            if len(kept) < len(devices):
                notes.append("CUDA enumerates one compute instance per MIG GPU instance: "
                             f"{len(devices) - len(kept)} MIG device{'s' if len(devices) - len(kept) > 1 else ''} "
                             "sharing a GPU instance with an earlier one left out")
        else:
            kept = [next(d for d in devices if d.parent)]
            if len(devices) > 1:
                notes.append(f"driver {f'R{driver}' if driver else 'version unknown'}: before R570 CUDA enumerates "
                             f"a single MIG device per process and no other GPU beside it: only {kept[0].uuid} "
                             f"({kept[0].name}) of {len(devices)}")
        devices = kept
    return tuple(devices), "; ".join(notes) or None


def inventory() -> Inventory:
    """The GPUs this process may train on (`resolve_visible`: CUDA's rules on nvidia-smi's listing)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return Inventory((), "none")
    build = torch_build()
    listing = _smi_gpus(os.environ.get("PATH"))
    smi, note = resolve_visible(listing.gpus, visible, listing.driver)
    if build == "cpu":
        note = (f"nvidia-smi lists {len(smi)} GPU{'s' if len(smi) > 1 else ''}, but the installed torch is a "
                "CPU build: training runs on the CPU; install a CUDA build of torch to use them") if smi else None
        return Inventory((), "none", note)
    if smi:
        return Inventory(smi, "nvidia-smi", "; ".join([*listing.notes, *([note] if note else [])]) or None)
    if listing.gpus:  # nvidia-smi lists GPUs, CUDA_VISIBLE_DEVICES names none of them: CUDA sees none
        return Inventory((), "none", note)
    if build in ("cuda", "rocm"):
        found = _torch_gpus(visible)
        if found:
            return Inventory(found, "torch")
    return Inventory((), "none")


def visible_gpus() -> int:
    """How many GPUs this process may use."""
    return len(inventory().gpus)


def usable_gpus(gpus: int, micro_batch_size: int, global_batch_size: int, nnodes: int = 1) -> int:
    """The most of `gpus` processes per node whose micro-batches split a global batch evenly:
    every process runs the same number of micro-batches per step."""
    return max([n for n in range(1, gpus + 1) if global_batch_size % (micro_batch_size * n * nnodes) == 0] or [1])


def auto_nproc(micro_batch_size: int = 1, global_batch_size: int = 1, nnodes: int = 1,
               cpu_nproc: int = 1) -> tuple[int, str]:
    """(processes per node, the reason shown by `sftflow show` and written to train.log)."""
    gpus = visible_gpus()
    if gpus:
        n = usable_gpus(gpus, micro_batch_size, global_batch_size, nnodes)
        if n == gpus:
            return gpus, f"auto: one process per visible GPU ({gpus}), FSDP2 over them"
        return n, (f"auto: {n} of {gpus} visible GPUs, one process each: actor.global_batch_size="
                   f"{global_batch_size} in micro-batches of {micro_batch_size} splits evenly over at most {n} "
                   f"process{'es' if n > 1 else ''}{f' per node x {nnodes} nodes' if nnodes > 1 else ''} "
                   "(a smaller actor.micro_batch_size uses more GPUs)")
    cores = os.cpu_count() or 1
    if cpu_nproc > 1:
        return cpu_nproc, (f"auto: no GPU visible, actor.cpu_nproc_per_node={cpu_nproc} processes on CPU "
                           f"(FSDP2 over gloo), sharing {cores} cores")
    return 1, (f"auto: one process on CPU, its torch threads on all {cores} cores (FSDP2 over gloo processes "
               "would split the same cores and add collectives; set actor.nproc_per_node to choose)")


def backend(device_kind: str) -> str:
    """The process group's backend: NCCL between GPUs, gloo on CPU (the worker's and the plan's rule)."""
    return "nccl" if device_kind == "cuda" else "gloo"


def rank_gpu(local_rank: int, gpus: int, shared: bool = False) -> int:
    """The GPU index of a node's `local_rank`: its own (training: FSDP2 over NCCL needs distinct
    devices, and a count above the GPUs is refused before launch); with `shared` (evaluation and
    replay ranks hold whole models and talk over gloo) ranks may share them, round robin."""
    return local_rank % gpus if shared else local_rank


def describe(nproc_per_node: int, nnodes: int, reason: str | None) -> str:
    """One line: how many processes train, and why."""
    world = nproc_per_node * nnodes
    what = f"{world} process{'es' if world > 1 else ''}" + (f" ({nproc_per_node} per node x {nnodes} nodes)"
                                                             if nnodes > 1 else "")
    return f"{what}: {reason or f'actor.nproc_per_node={nproc_per_node} (set in the config)'}"
