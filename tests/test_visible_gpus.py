"""The GPUs a process may use, in every form CUDA_VISIBLE_DEVICES takes (stages/core/machine/topology.py
`resolve_visible`): indices, GPU UUIDs whole or as a unique prefix, MIG device UUIDs (and the
`MIG-<GPU UUID>/<gi>/<ci>` of drivers before R470), in the order named, up to the first entry that
names nothing; a MIG device with its own memory, so the memory plan budgets the slice, not its
GPU. On simulated machines (tests/fake_gpu.py), in process and through `sftflow show --json` and
`sftflow run`; and the parsers on nvidia-smi's output as real drivers print it."""

from __future__ import annotations

import os

import pytest

from conftest import ROOT, sftflow
from fake_gpu import A100, A100_MIG, H100, H200, FakeGPU, FakeMIG, mig_uuids, simulated_machine, uuids
from stages.core.machine import topology
from test_gpu_machines import DEMO, show, three_b

MIB = 1024 ** 2


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """inventory() of this process on a simulated machine, with CUDA_VISIBLE_DEVICES (None: unset)."""
    monkeypatch.setattr(topology, "torch_build", lambda: "cuda")  # as on a GPU machine (this one's torch is CPU)
    monkeypatch.setattr(topology, "_torch_gpus", lambda visible: ())  # nvidia-smi is the one that answers

    def inventory(gpus: list[FakeGPU], visible: str | None = None, **smi) -> topology.Inventory:
        env = simulated_machine(tmp_path / f"machine{len(list(tmp_path.iterdir()))}", gpus, **smi)
        monkeypatch.setenv("PATH", env["PATH"])
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        topology._smi_gpus.cache_clear()
        return topology.inventory()
    yield inventory
    topology._smi_gpus.cache_clear()


def names(inv: topology.Inventory) -> list[str]:
    return [g.name for g in inv.gpus]


# --------------------------------------------------------------------------- whole GPUs


def test_indices_are_taken_in_the_order_named_up_to_the_first_invalid_one(machine):
    """CUDA's own example: `0,2,-1,1` makes 0 and 2 visible, 1 not; an index past the GPUs ends the
    list the same way (it doesn't skip to the next entry)."""
    gpus = [H100, H200, A100]
    assert names(machine(gpus, "2,0")) == [A100.name, H100.name]
    inv = machine(gpus, "0,2,-1,1")
    assert names(inv) == [H100.name, A100.name]
    assert "'-1' is neither a GPU index" in inv.note and "only the 2 devices named before it" in inv.note
    inv = machine(gpus, "1,7,0")
    assert names(inv) == [H200.name] and "'7' is no GPU index (nvidia-smi lists 3: 0-2)" in inv.note


def test_gpu_uuids_whole_or_a_unique_prefix_in_the_order_named(machine):
    gpus = [H100, H200, A100]
    u = uuids(gpus)
    named = [u[2], u[0], u[1]]  # neither the listing's order nor the UUIDs' sorted one
    assert named != u and named != sorted(u)
    inv = machine(gpus, f"{u[2]},{u[0][:10]},{u[1].upper()[:13]}")
    assert names(inv) == [A100.name, H100.name, H200.name] and [g.uuid for g in inv.gpus] == named
    assert [g.bytes for g in inv.gpus] == [A100.mib * MIB, H100.mib * MIB, H200.mib * MIB] and inv.note is None
    inv = machine(gpus, f"{u[1][:9]}")  # "GPU-" and 5 hex digits: still one GPU's
    assert [g.uuid for g in inv.gpus] == [u[1]]


def test_an_entry_naming_nothing_ends_the_list_and_the_note_names_it(machine):
    gpus = [H100, H200, A100]
    u = uuids(gpus)
    inv = machine(gpus, f"{u[1]},GPU-ffffffff,{u[0]}")
    assert names(inv) == [H200.name] and inv.source == "nvidia-smi"
    assert "'GPU-ffffffff' matches no GPU nvidia-smi lists" in inv.note
    assert "so this process sees only the 1 device named before it" in inv.note
    inv = machine(gpus, "GPU-")  # a prefix of every UUID names no GPU in particular
    assert inv.gpus == () and inv.source == "none" and "'GPU-' is not unique: it starts the UUIDs of 3 GPUs" in inv.note
    inv = machine(gpus, f"gpu0,{u[0]}")
    assert inv.gpus == () and "'gpu0' is neither a GPU index, a GPU UUID nor a MIG device UUID" in inv.note
    assert topology.visible_gpus() == 0 and topology.auto_nproc(1, 32)[0] == 1  # the CPU, one process


def test_an_old_driver_without_compute_cap_still_resolves_uuids(machine):
    v100, p100 = FakeGPU("Tesla V100-SXM2-32GB", 32768, None), FakeGPU("Tesla P100-PCIE-16GB", 16384, None)
    u = uuids([v100, p100])
    inv = machine([v100, p100], u[1][:12])
    assert [(g.name, g.bytes, g.capability) for g in inv.gpus] == [(p100.name, p100.mib * MIB, None)]


# --------------------------------------------------------------------------- MIG devices


def test_mig_uuids_each_with_its_own_memory(machine):
    """An A100-80GB split 3g.40gb + 2g.20gb + 1g.10gb beside a whole H100: each MIG device named is a
    CUDA device of its own memory (nvidia-smi's --query-gpu says 81920 MiB for every one of them) and
    its GPU's compute capability, in the order named."""
    gpus = [A100_MIG, H100]
    u, mig = uuids(gpus), mig_uuids(gpus)
    inv = machine(gpus, f"{mig[0][2]},{mig[0][0][:12]},{u[1]}")
    assert [(g.name, g.bytes // MIB, g.capability) for g in inv.gpus] == [
        (f"{A100.name} MIG 1g.10gb", 9728, (8, 0)), (f"{A100.name} MIG 3g.40gb", 40448, (8, 0)),
        (H100.name, H100.mib, (9, 0))]
    assert [g.uuid for g in inv.gpus] == [mig[0][2], mig[0][0], u[1]] and inv.note is None
    assert [g.index for g in inv.gpus] == [mig[0][2], mig[0][0], "1"]  # as CUDA_VISIBLE_DEVICES names each
    # unset, or the GPU named by index or UUID: its MIG devices, never the GPU whole
    for visible in (None, "0,1", f"{u[0]},1"):
        inv = machine(gpus, visible)
        assert [g.bytes // MIB for g in inv.gpus] == [40448, 19968, 9728, H100.mib], visible
    # drivers before R470 name a MIG device MIG-<GPU UUID>/<GPU instance>/<compute instance>; CUDA
    # still takes that form from later drivers
    assert [g.bytes // MIB for g in machine(gpus, f"MIG-{u[0]}/3/0").gpus] == [19968]
    legacy = mig_uuids(gpus, "460.106.00")
    assert legacy[0][1] == f"MIG-{u[0]}/3/0"
    inv = machine(gpus, legacy[0][1], driver="460.106.00")
    assert [(g.name, g.bytes // MIB) for g in inv.gpus] == [(f"{A100.name} MIG 2g.20gb", 19968)]
    inv = machine(gpus, f"{mig[0][1]},MIG-{u[0]}/5/0,1")
    assert names(inv) == [f"{A100.name} MIG 2g.20gb"]
    assert "matches no MIG device (GPU instance 5, compute instance 0)" in inv.note


def test_cuda_enumerates_one_mig_device_per_process_before_r570_and_one_per_gpu_instance_after(machine):
    """The MIG user guide's enumeration rules, by the driver `nvidia-smi -q -x` reports."""
    gpus = [A100_MIG, H100]
    mig = mig_uuids(gpus)
    inv = machine(gpus, f"{mig[0][2]},{mig[0][0]},1", driver="535.183.01")
    assert [(g.name, g.bytes // MIB) for g in inv.gpus] == [(f"{A100.name} MIG 1g.10gb", 9728)]
    assert "driver R535: before R570 CUDA enumerates a single MIG device per process" in inv.note
    assert len(machine(gpus, None, driver="535.183.01").gpus) == 1
    split = FakeGPU(A100.name, A100.mib, "8.0", migs=(FakeMIG("1c.3g.40gb", 40448, gi=1, ci=0),
                                                      FakeMIG("2c.3g.40gb", 40448, gi=1, ci=1),
                                                      FakeMIG("1g.10gb", 9728, gi=9)))
    inv = machine([split], None)  # R570: one compute instance of GPU instance 1, and the 1g.10gb
    assert names(inv) == [f"{A100.name} MIG 1c.3g.40gb", f"{A100.name} MIG 1g.10gb"]
    assert "1 MIG device sharing a GPU instance with an earlier one left out" in inv.note


def test_without_the_xml_a_mig_device_counts_its_profiles_nominal_memory(machine):
    gpus = [A100_MIG]
    mig = mig_uuids(gpus)
    inv = machine(gpus, mig[0][2], xml=False)
    assert [(g.name, g.bytes) for g in inv.gpus] == [(f"{A100.name} MIG 1g.10gb", 10 * 10 ** 9)]  # not 80 GiB
    assert "each MIG device counts its profile's nominal size" in inv.note


def test_show_reports_the_slices_memory_and_a_plan_that_fits_the_gpu_but_not_the_slice_is_refused(tmp_path):
    """Full fine-tuning of a 3B shape (~48 GiB) fits a whole A100-80GB; on its 1g.10gb slice, named by
    its MIG UUID, `sftflow show` budgets the slice's 9.5 GiB and `sftflow run` refuses before anything
    runs, with the one-line error naming the slice."""
    model = f"actor.model.model_path={three_b(tmp_path)}"
    whole = show(tmp_path / "whole", [A100], model, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert whole["refused"] is None and whole["memory"]["budget_bytes"] == A100.mib * MIB
    slice_uuid = mig_uuids([A100_MIG])[0][2]
    launch = show(tmp_path / "slice", [A100_MIG], model, env={"CUDA_VISIBLE_DEVICES": slice_uuid})
    slice_name = f"{A100.name} MIG 1g.10gb"
    assert (launch["device"]["name"], launch["device"]["count"], launch["device"]["memory_gib"]) == (
        slice_name, 1, 9.5)
    assert launch["device"]["capability"] == "8.0" and launch["memory"]["budget_bytes"] == 9728 * MIB
    assert launch["refused_by"] == "memory" and launch["refused"].startswith("actor: training needs ~")
    assert slice_name in launch["refused"]
    env = simulated_machine(tmp_path / "run" / "machine", [A100_MIG])
    art = tmp_path / "run" / "artifacts"
    proc = sftflow("run", "-c", DEMO, f"artifacts_dir={art}", model, cwd=ROOT, fresh=True,
                   env={**env, "CUDA_VISIBLE_DEVICES": slice_uuid, "PREFECT_API_URL": None,
                        "PREFECT_HOME": str(tmp_path / "run" / ".prefect")})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: actor: training needs ~"), proc.stderr
    assert slice_name in lines[0] and "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / ".prefect").exists()
    assert {d.name for d in art.iterdir()} <= {"digests"} if art.exists() else True


# --------------------------------------------------------------------------- the parsers

# nvidia-smi's output as drivers print it (UUIDs made up): R570 and R460 `-L`, `--query-gpu` CSV,
# and `-q -x` cut to the elements around what is read

LIST_R570 = """\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)
  MIG 3g.40gb     Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)
  MIG 2g.20gb     Device  1: (UUID: MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb)
  MIG 1g.10gb     Device  2: (UUID: MIG-1e099852-3624-56c0-8064-c5db1211e44f)
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-0aa11ebd-627f-af3f-1a0d-4e1fd92fd7b0)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-c08d91cb-e324-655c-71ba-7570956445bc)
  MIG 1c.3g.40gb  Device  0: (UUID: MIG-c788539f-c1ea-5a36-8b4d-9b07d024b1bb)
  MIG 1g.10gb+me  Device  1: (UUID: MIG-b4b2228d-6933-5839-bc0e-41ab9edb61c6)
"""

LIST_R460 = """\
GPU 0: A100-SXM4-40GB (UUID: GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f)
  MIG 1g.5gb Device 0: (UUID: MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f/7/0)
  MIG 1g.5gb Device 1: (UUID: MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f/8/0)
"""

QUERY = """\
0, GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77, NVIDIA A100-SXM4-80GB, 81920, 8.0
1, GPU-0aa11ebd-627f-af3f-1a0d-4e1fd92fd7b0, NVIDIA A100-SXM4-80GB, 81920, 8.0
2, GPU-c08d91cb-e324-655c-71ba-7570956445bc, NVIDIA H100 80GB HBM3, 81559, 9.0
"""

XML = """\
<?xml version="1.0" ?>
<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">
<nvidia_smi_log>
\t<timestamp>Fri Oct 11 18:24:09 2024</timestamp>
\t<driver_version>570.86.15</driver_version>
\t<cuda_version>12.8</cuda_version>
\t<attached_gpus>2</attached_gpus>
\t<gpu id="00000000:07:00.0">
\t\t<product_name>NVIDIA A100-SXM4-80GB</product_name>
\t\t<mig_mode>
\t\t\t<current_mig>Enabled</current_mig>
\t\t\t<pending_mig>Enabled</pending_mig>
\t\t</mig_mode>
\t\t<mig_devices>
\t\t\t<mig_device>
\t\t\t\t<index>0</index>
\t\t\t\t<gpu_instance_id>2</gpu_instance_id>
\t\t\t\t<compute_instance_id>0</compute_instance_id>
\t\t\t\t<device_attributes>
\t\t\t\t\t<shared>
\t\t\t\t\t\t<multiprocessor_count>42</multiprocessor_count>
\t\t\t\t\t\t<copy_engine_count>3</copy_engine_count>
\t\t\t\t\t</shared>
\t\t\t\t</device_attributes>
\t\t\t\t<fb_memory_usage>
\t\t\t\t\t<total>40448 MiB</total>
\t\t\t\t\t<reserved>0 MiB</reserved>
\t\t\t\t\t<used>298 MiB</used>
\t\t\t\t\t<free>40151 MiB</free>
\t\t\t\t</fb_memory_usage>
\t\t\t\t<bar1_memory_usage>
\t\t\t\t\t<total>32767 MiB</total>
\t\t\t\t</bar1_memory_usage>
\t\t\t</mig_device>
\t\t\t<mig_device>
\t\t\t\t<index>2</index>
\t\t\t\t<gpu_instance_id>13</gpu_instance_id>
\t\t\t\t<compute_instance_id>0</compute_instance_id>
\t\t\t\t<fb_memory_usage>
\t\t\t\t\t<total>9728 MiB</total>
\t\t\t\t\t<used>N/A</used>
\t\t\t\t</fb_memory_usage>
\t\t\t</mig_device>
\t\t</mig_devices>
\t\t<uuid>GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77</uuid>
\t\t<fb_memory_usage>
\t\t\t<total>81920 MiB</total>
\t\t\t<reserved>446 MiB</reserved>
\t\t\t<used>3703 MiB</used>
\t\t\t<free>77771 MiB</free>
\t\t</fb_memory_usage>
\t</gpu>
\t<gpu id="00000000:0B:00.0">
\t\t<mig_mode>
\t\t\t<current_mig>Disabled</current_mig>
\t\t\t<pending_mig>Disabled</pending_mig>
\t\t</mig_mode>
\t\t<mig_devices>
\t\t\tNone
\t\t</mig_devices>
\t\t<uuid>GPU-0aa11ebd-627f-af3f-1a0d-4e1fd92fd7b0</uuid>
\t\t<fb_memory_usage>
\t\t\t<total>81920 MiB</total>
\t\t</fb_memory_usage>
\t</gpu>
</nvidia_smi_log>
"""


def test_parsers_read_nvidia_smis_output_as_drivers_print_it():
    gpus = topology.parse_query(QUERY, topology.QUERIES[0])
    assert [(g.index, g.uuid[:12], g.bytes // MIB, g.capability) for g in gpus] == [
        ("0", "GPU-5d5ba0d6", 81920, (8, 0)), ("1", "GPU-0aa11ebd", 81920, (8, 0)),
        ("2", "GPU-c08d91cb", 81559, (9, 0))]
    # a reply without the fields asked (an error, a driver that lacks one) is no listing
    assert topology.parse_query("Field \"compute_cap\" is not a valid field to query.\n", topology.QUERIES[0]) == ()
    assert topology.parse_query("0, NVIDIA H200, 143771, 9.0\n", topology.QUERIES[1]) == ()  # no uuid there
    assert [g.name for g in topology.parse_query("0, NVIDIA H200, 143771, 9.0\n", topology.QUERIES[2])] == [
        "NVIDIA H200"]

    listed = topology.parse_list(LIST_R570)
    assert [(i, name, uuid[:12], len(migs)) for i, name, uuid, migs in listed] == [
        ("0", "NVIDIA A100-SXM4-80GB", "GPU-5d5ba0d6", 3), ("1", "NVIDIA A100-SXM4-80GB", "GPU-0aa11ebd", 0),
        ("2", "NVIDIA H100 80GB HBM3", "GPU-c08d91cb", 2)]
    assert listed[0][3][2] == ("1g.10gb", 2, "MIG-1e099852-3624-56c0-8064-c5db1211e44f")
    assert [m[0] for m in listed[2][3]] == ["1c.3g.40gb", "1g.10gb+me"]
    assert topology.parse_list(LIST_R460)[0][3][1] == ("1g.5gb", 1, "MIG-GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc3f/8/0")

    driver, migs = topology.parse_xml(XML)
    assert driver == 570
    assert migs == {"GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77": {
        0: {"instance": (2, 0), "mib": 40448, "uuid": None}, 2: {"instance": (13, 0), "mib": 9728, "uuid": None}},
        "GPU-0aa11ebd-627f-af3f-1a0d-4e1fd92fd7b0": {}}
    assert topology.parse_xml("Unable to determine the device handle for GPU 0000:07:00.0: Unknown Error") == (None, {})

    assert [topology.profile_bytes(p) for p in ("1g.10gb", "1c.3g.40gb", "1g.10gb+me", "7g.80gb", "MIG")] == [
        10 ** 10, 4 * 10 ** 10, 10 ** 10, 8 * 10 ** 10, None]


def test_the_listing_joins_the_three_replies(tmp_path, monkeypatch):
    """The samples above, answered by a fake nvidia-smi: the MIG devices of GPU 0 take the XML's
    memory; GPU 2's (no XML entry for them) their profile's nominal size; GPU 1 stays whole."""
    smi = tmp_path / "nvidia-smi"
    for name, text in (("query", QUERY), ("list", LIST_R570), ("xml", XML)):
        (tmp_path / name).write_text(text)
    smi.write_text(f'#!/bin/sh\ncase "$*" in\n  -L) cat {tmp_path}/list;;\n  "-q -x") cat {tmp_path}/xml;;\n'
                   f'  *) cat {tmp_path}/query;;\nesac\n')
    smi.chmod(0o755)
    listing = topology._smi_gpus.__wrapped__(str(tmp_path))
    assert listing.driver == 570
    assert [[(s.name, s.bytes, s.instance) for s in g.slices] for g in listing.gpus] == [
        [("NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40448 * MIB, (2, 0)),
         ("NVIDIA A100-SXM4-80GB MIG 2g.20gb", 20 * 10 ** 9, None),
         ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", 9728 * MIB, (13, 0))],
        [],
        [("NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb", 40 * 10 ** 9, None),
         ("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", 10 * 10 ** 9, None)]]
    monkeypatch.setattr(topology, "_smi_gpus", topology._smi_gpus.__wrapped__)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1e09,GPU-0aa1,MIG-b4b2")
    monkeypatch.setattr(topology, "torch_build", lambda: "cuda")
    inv = topology.inventory()
    assert [(g.name, g.bytes) for g in inv.gpus] == [("NVIDIA A100-SXM4-80GB MIG 1g.10gb", 9728 * MIB),
                                                     ("NVIDIA A100-SXM4-80GB", 81920 * MIB),
                                                     ("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", 10 ** 10)]
