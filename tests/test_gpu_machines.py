"""Every decision a GPU changes, walked on simulated machines (tests/fake_gpu.py) end to end through
`sftflow show --json` and the pre-launch checks of `sftflow run`: processes per node, the backend,
the precision, the attention kernel by installed package and compute capability, the memory plan
against 24/80/141 GiB, each rank's device, and the counts a machine can't run. The worker's own
rules (torch.cuda in a rank) are checked with a patched torch.cuda. The table of these decisions is
docs/operations.md, "On GPUs"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT, sftflow
from fake_gpu import A100, H100, H200, L4, T4, FakeGPU, simulated_machine

DEMO = str(ROOT / "configs" / "default.yaml")


def show(tmp: Path, gpus: list[FakeGPU], *overrides: str, packages: tuple[str, ...] = (), cuda_torch: bool = True,
         env: dict | None = None) -> dict:
    """`sftflow show --json` of the demo config on the simulated machine: its launch report."""
    machine = simulated_machine(tmp / "machine", gpus, packages, cuda_torch)
    proc = sftflow("show", "-c", DEMO, "--json", f"artifacts_dir={tmp / 'artifacts'}", *overrides, cwd=ROOT,
                   env={**machine, "PREFECT_HOME": str(tmp / ".prefect"), **(env or {})}, fresh=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["launch"]


FLASH = ("flash_attn",)
FLASH23 = ("flash_attn", "flash_attn_interface")

# machine, packages, overrides -> processes, backend, precision, attention, training devices
DECISIONS = [
    ("cpu", [], (), (), 2, "gloo", "fp32", "sdpa", ["cpu", "cpu"]),
    ("1 H100", [H100], (), (), 1, "nccl", "bf16", "flex_attention", ["cuda:0"]),
    ("1 H100, packing off", [H100], (), ("actor.packing=false",), 1, "nccl", "bf16", "sdpa", ["cuda:0"]),
    ("2 A100 + flash-attn 2", [A100] * 2, FLASH, (), 2, "nccl", "bf16", "flash_attention_2", ["cuda:0", "cuda:1"]),
    ("8 H200 + flash-attn 2 and 3", [H200] * 8, FLASH23, (), 2, "nccl", "bf16", "flash_attention_3",
     ["cuda:0", "cuda:1"]),
    ("8 H200, micro-batch 4", [H200] * 8, FLASH23, ("actor.micro_batch_size=4",), 8, "nccl", "bf16",
     "flash_attention_3", [f"cuda:{i}" for i in range(8)]),
    ("1 T4 (7.5) + flash-attn 2", [T4], FLASH, (), 1, "nccl", "fp32", "flex_attention", ["cuda:0"]),
    ("1 T4, bf16 asked", [T4], FLASH, ("actor.precision=bf16",), 1, "nccl", "bf16", "flex_attention", ["cuda:0"]),
    ("old driver (no compute_cap)", [FakeGPU("Tesla V100", 16384, None)], (), (), 1, "nccl", "fp32",
     "flex_attention", ["cuda:0"]),
]


@pytest.mark.parametrize("machine,gpus,packages,overrides,nproc,backend,precision,attn,devices", DECISIONS,
                         ids=[d[0] for d in DECISIONS])
def test_show_json_reports_each_decision_the_machine_makes(tmp_path, machine, gpus, packages, overrides, nproc,
                                                           backend, precision, attn, devices):
    env = {"CUDA_VISIBLE_DEVICES": ""} if not gpus else {"CUDA_VISIBLE_DEVICES": None}
    launch = show(tmp_path, gpus, *overrides, packages=packages, env=env)
    assert launch["device"]["kind"] == ("cuda" if gpus else "cpu")
    assert launch["device"]["count"] == len(gpus)
    assert (launch["nproc_per_node"], launch["backend"], launch["precision"], launch["attn_implementation"]) == (
        nproc, backend, precision, attn)
    assert launch["train_devices"] == devices and len(set(devices)) == len(devices) or devices[0] == "cpu"
    assert launch["refused"] is None, launch["refused"]
    if gpus and nproc < len(gpus):  # the reason names the batch sizes that cap it
        assert f"auto: {nproc} of {len(gpus)} visible GPUs" in launch["topology"]
        assert "actor.global_batch_size=32 in micro-batches of 16" in launch["topology"]
    elif gpus:
        assert launch["topology"] == f"{nproc} process{'es' if nproc > 1 else ''}: auto: one process per visible " \
                                     f"GPU ({nproc}), FSDP2 over them"
    else:
        assert "actor.cpu_nproc_per_node=2" in launch["topology"]


def test_visible_devices_narrow_the_gpus_and_an_empty_list_is_the_cpu(tmp_path):
    launch = show(tmp_path / "one", [H100, H100, A100], env={"CUDA_VISIBLE_DEVICES": "2"})
    assert (launch["nproc_per_node"], launch["device"]["name"], launch["device"]["count"]) == (1, A100.name, 1)
    launch = show(tmp_path / "none", [H100, H100], env={"CUDA_VISIBLE_DEVICES": ""})
    assert (launch["device"]["kind"], launch["nproc_per_node"], launch["backend"]) == ("cpu", 2, "gloo")


def test_a_cpu_build_of_torch_takes_the_cpu_branch_whatever_nvidia_smi_lists(tmp_path):
    launch = show(tmp_path, [H100, H100], cuda_torch=False, env={"CUDA_VISIBLE_DEVICES": None})
    assert (launch["device"]["kind"], launch["backend"], launch["precision"]) == ("cpu", "gloo", "fp32")
    assert "nvidia-smi lists 2 GPUs, but the installed torch is a CPU build" in launch["device"]["note"]


def three_b(tmp: Path) -> Path:
    """A Qwen2.5-3B-shaped model folder: its config.json is all the memory plan reads."""
    folder = tmp / "qwen2.5-3b-shape"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 2048,
        "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
        "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True}))
    return folder


@pytest.mark.parametrize("gpu,micro,verdict", [(L4, 16, "refused"), (H100, 16, "fits"), (H200, 16, "fits"),
                                               (H100, 64, "refused"), (H200, 64, "fits")],
                         ids=["24GiB", "80GiB", "141GiB", "80GiB-micro64", "141GiB-micro64"])
def test_the_memory_plan_is_judged_against_the_gpus_memory(tmp_path, gpu, micro, verdict):
    """Full fine-tuning of a 3B shape, one process, fp32 masters + AdamW (~48 GiB before activations):
    over a 24 GiB GPU, within 80 and 141 GiB; 4x the micro-batch's activations fit only 141 GiB."""
    launch = show(tmp_path, [gpu], f"actor.model.model_path={three_b(tmp_path)}", f"actor.micro_batch_size={micro}",
                  f"actor.global_batch_size={max(32, micro)}", env={"CUDA_VISIBLE_DEVICES": None})
    memory = launch["memory"]
    assert memory["budget_bytes"] == gpu.mib * 1024 ** 2 and memory["ranks_sharing_budget"] == 1
    if verdict == "fits":
        assert launch["refused"] is None and memory["per_rank_bytes"] <= memory["budget_bytes"]
    else:
        assert launch["refused_by"] == "memory" and memory["per_rank_bytes"] > memory["budget_bytes"] * 1.2
        assert launch["refused"].startswith("actor: training needs ~") and gpu.name in launch["refused"]


def test_a_count_the_gpus_cannot_run_is_refused_before_anything_runs(tmp_path):
    """The demo with 2 processes asked for on a 1-GPU machine: `sftflow run` exits 2 with one line naming
    actor.nproc_per_node before a Prefect server, torchrun or any stage folder; `auto` runs one process
    there; evaluation ranks may share the GPU (gloo, whole models), so show reports it, and the
    same count on CPU is obeyed."""
    machine = simulated_machine(tmp_path / "machine", [H100])
    art = tmp_path / "artifacts"
    proc = sftflow("run", "-c", DEMO, f"artifacts_dir={art}", "actor.nproc_per_node=2", cwd=ROOT, fresh=True,
                   env={**machine, "CUDA_VISIBLE_DEVICES": None, "PREFECT_API_URL": None,
                        "PREFECT_HOME": str(tmp_path / ".prefect")})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: actor.nproc_per_node=2 but this machine has 1 visible GPU "
                                                   f"({H100.name})"), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    # no stage folder, not even prepare's (planning's memo of the data files' digests may be there)
    assert {d.name for d in art.iterdir()} <= {"digests"} if art.exists() else True
    assert not (tmp_path / ".prefect").exists()
    launch = show(tmp_path / "auto", [H100], env={"CUDA_VISIBLE_DEVICES": None})
    assert launch["nproc_per_node"] == 1 and launch["refused"] is None
    launch = show(tmp_path / "two", [H100], "actor.nproc_per_node=2", env={"CUDA_VISIBLE_DEVICES": None})
    assert launch["refused_by"] == "processes" and launch["eval_devices"] == ["cuda:0", "cuda:0"]
    assert launch["eval_launch"] == "on 2 torchrun processes (eval.launch=auto: GPUs)"  # never the CPU's rule
    launch = show(tmp_path / "cpu", [], "actor.nproc_per_node=4", "actor.micro_batch_size=8",
                  env={"CUDA_VISIBLE_DEVICES": ""})
    assert launch["nproc_per_node"] == 4 and launch["refused"] is None
    assert launch["eval_launch"].startswith("in the stage's process when small, else on 4 torchrun processes")


# --------------------------------------------------------------------------- in process


def test_a_cuda_build_without_nvidia_smi_asks_torch(tmp_path, monkeypatch):
    """ROCm hosts and many containers have no nvidia-smi: a CUDA/ROCm build of torch is asked in a
    subprocess (here a stand-in torch package that sees 2 GPUs), never the CPU branch."""
    from stages.core.machine import topology
    fake = tmp_path / "fake_torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "class _P:\n    name = 'AMD Instinct MI300X'; total_memory = 192 * 1024 ** 3; major, minor = 9, 4\n"
        "class cuda:\n    is_available = staticmethod(lambda: True)\n    device_count = staticmethod(lambda: 2)\n"
        "    get_device_properties = staticmethod(lambda i: _P())\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # no nvidia-smi
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))  # the probe's interpreter imports the stand-in
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(topology, "torch_build", lambda: "rocm")
    topology._smi_gpus.cache_clear()
    topology._torch_gpus.cache_clear()
    try:
        inv = topology.inventory()
        assert (inv.source, len(inv.gpus), inv.gpus[0].name, inv.gpus[0].capability) == (
            "torch", 2, "AMD Instinct MI300X", (9, 4))
        assert topology.auto_nproc(4, 32)[0] == 2
        monkeypatch.setattr(topology, "torch_build", lambda: "cpu")  # a CPU build is never asked
        assert topology.inventory() == topology.Inventory((), "none")
    finally:
        topology._smi_gpus.cache_clear()
        topology._torch_gpus.cache_clear()


def test_the_installed_torch_build_is_read_without_importing_it():
    import torch

    from stages.core.machine import topology
    expected = "rocm" if torch.version.hip else "cuda" if torch.version.cuda else "cpu"
    assert topology.torch_build() == expected


@pytest.fixture
def cuda(monkeypatch):
    """torch.cuda as a rank on a machine with `n` GPUs of compute capability `cap` sees it."""
    import torch
    from types import SimpleNamespace

    def machine(n: int, cap: tuple[int, int] = (9, 0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device=None: SimpleNamespace(major=cap[0], minor=cap[1]))
    return machine


def test_each_training_rank_takes_its_own_gpu_and_evaluation_ranks_may_share(cuda, monkeypatch):
    import torch

    from stages.core.machine.topology import backend
    from stages.runtime.distributed import choose_precision, local_device
    cuda(8)
    seen = []
    for rank in range(8):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        seen.append(local_device())
    assert seen == [torch.device("cuda", r) for r in range(8)]
    assert backend(seen[0].type) == "nccl" and choose_precision("auto", seen[0]) == "bf16"
    cuda(1)
    shared = []
    for rank in range(2):  # 2 evaluation processes on 1 GPU
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        shared.append(local_device(shared=True))
    assert shared == [torch.device("cuda", 0)] * 2
    cuda(1, (7, 5))  # a T4
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert choose_precision("auto", local_device()) == "fp32"
    assert backend("cpu") == "gloo" and choose_precision("auto", torch.device("cpu")) == "fp32"
