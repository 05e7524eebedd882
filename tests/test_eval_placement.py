"""Where an evaluation of a multi-process config runs (stages/evaluate/placement.py): in the stage's
process on CPU when it is small, under torchrun on GPUs, for large work, custom workers, several machines,
and as `eval.launch` says. What is scored is the same either way: tests/test_evaluate.py holds a torchrun
evaluation equal to one process and to a naive loop, record by record."""

import os

import pytest

from conftest import tiny_config_dict
from fake_gpu import H100, simulated_machine
from stages.core.machine import topology
from stages.core.config import config_from_dict
from stages.evaluate import placement
from stages.evaluate.placement import describe, place, samples, weight_bytes
from stages.pipeline import plan, run_stage


@pytest.fixture(autouse=True)
def bound(monkeypatch):
    """A bound of 1e6 (weight bytes x samples x new tokens) instead of 2e12, so the model folders here hold
    kilobytes, not the hundreds of gigabytes the real bound would take to cross."""
    monkeypatch.setattr(placement, "IN_PROCESS_WORK", 1e6)
    return 1e6


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A two-process config (raw), its prepared folder (a val split of 12 rows) and a folder for models."""
    tmp = tmp_path_factory.mktemp("placement")
    raw = tiny_config_dict(tmp, actor={"nproc_per_node": 2})
    p = plan(config_from_dict(raw))
    return raw, run_stage(p, "prepare", on_line=lambda line: None).path, tmp


def model_of(tmp, size: int) -> dict:
    """`resolve_eval_model`'s answer for a folder holding `size` bytes of weights (a sparse file)."""
    folder = tmp / f"model-{size}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(size)
    return {"kind": "hf", "path": str(folder), "source": str(folder)}


def cfg_of(raw, **changes):
    raw = {**raw, **{k: {**raw.get(k, {}), **v} for k, v in changes.items()}}
    return config_from_dict(raw)


def test_samples_and_weights_are_read_from_the_stage_folders(prepared):
    raw, prep, tmp = prepared
    assert samples(config_from_dict(raw), prep) == 12
    assert samples(cfg_of(raw, eval={"max_samples": 5}), prep) == 5
    assert weight_bytes(model_of(tmp, 4000)) == 4000
    assert weight_bytes({"kind": "hf", "path": "HuggingFaceTB/SmolLM2-135M-Instruct"}) is None  # a Hub id


def test_a_small_evaluation_on_cpu_runs_in_the_stage_and_a_large_one_under_torchrun(prepared, bound):
    raw, prep, tmp = prepared
    cfg = cfg_of(raw)  # 12 samples x 8 new tokens
    per_byte = 12 * 8
    small = place(cfg, model_of(tmp, int(bound / per_byte) - 1), prep, has_gpu=False)
    assert small.processes == 1 and "CPU, a small evaluation" in small.why
    large = place(cfg, model_of(tmp, int(bound / per_byte) + 1), prep, has_gpu=False)
    assert large.processes == 2 and "CPU, a large evaluation" in large.why
    # the same model scored on fewer samples, or with more new tokens: the work follows them
    assert place(cfg_of(raw, eval={"max_samples": 1}), model_of(tmp, int(bound / per_byte) + 1), prep,
                 has_gpu=False).processes == 1
    assert place(cfg_of(raw, eval={"max_new_tokens": 100}), model_of(tmp, int(bound / per_byte) - 1), prep,
                 has_gpu=False).processes == 2


def test_gpus_several_machines_custom_workers_and_unknown_sizes_stay_on_torchrun(prepared):
    raw, prep, tmp = prepared
    tiny = model_of(tmp, 1000)
    assert place(cfg_of(raw), tiny, prep, has_gpu=True).processes == 2
    two_nodes = cfg_of(raw, actor={"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "127.0.0.1:29400"})
    assert place(two_nodes, tiny, prep, has_gpu=False).processes == 4
    worker = cfg_of(raw, actor={"worker": "custom_model:MLPWorker"})
    assert "actor.worker" in place(worker, tiny, prep, has_gpu=False).why
    assert place(cfg_of(raw), {"kind": "hf", "path": "org/model"}, prep, has_gpu=False).processes == 2


def test_eval_launch_overrides_auto_and_one_process_is_always_in_the_stage(prepared):
    raw, prep, tmp = prepared
    tiny, huge = model_of(tmp, 1000), model_of(tmp, 10**6)
    assert place(cfg_of(raw, eval={"launch": "torchrun"}), tiny, prep, has_gpu=False).processes == 2
    assert place(cfg_of(raw, eval={"launch": "in_process"}), huge, prep, has_gpu=True).processes == 1
    assert place(cfg_of(raw, actor={"nproc_per_node": 1}, eval={"launch": "torchrun"}), huge, prep,
                 has_gpu=True).processes == 1
    with pytest.raises(Exception, match="eval.launch"):
        cfg_of(raw, eval={"launch": "sometimes"})


def test_auto_asks_the_machine_a_simulated_gpu_machine_keeps_torchrun(prepared, monkeypatch):
    raw, prep, tmp = prepared
    tiny = model_of(tmp, 1000)
    topology._smi_gpus.cache_clear()
    assert place(cfg_of(raw), tiny, prep).processes == 1  # this machine: no GPU
    monkeypatch.setattr(topology, "torch_build", lambda: "cuda")
    monkeypatch.setattr(topology, "_torch_gpus", lambda visible: ())
    monkeypatch.setenv("PATH", simulated_machine(tmp / "h100", [H100, H100])["PATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    topology._smi_gpus.cache_clear()
    try:
        found = place(cfg_of(raw), tiny, prep)
    finally:
        monkeypatch.undo()
        topology._smi_gpus.cache_clear()
    assert (found.processes, found.why) == (2, "GPUs")
    assert os.environ.get("PATH") and topology.inventory().gpus == ()


def test_show_says_where_evaluations_will_run(prepared):
    raw, _, _ = prepared
    assert describe(cfg_of(raw), has_gpu=True) == "on 2 torchrun processes (eval.launch=auto: GPUs)"
    assert describe(cfg_of(raw), has_gpu=False).startswith("in the stage's process when small, else on 2 torchrun")
    assert describe(cfg_of(raw, eval={"launch": "torchrun"}), has_gpu=False) == \
        "on 2 torchrun processes (eval.launch=torchrun)"
    assert describe(cfg_of(raw, actor={"nproc_per_node": 1}), has_gpu=True) == "in the stage's process (one process)"


def test_show_lists_one_evaluation_device_where_the_stage_scores_in_its_process(prepared):
    """`show --json`'s eval_devices: one per rank under torchrun (they may share a GPU), one where the rule
    settles on the stage's process before any model exists; on CPU, where the work's size decides, the ranks'."""
    from stages.pipeline import launch_report
    from stages.planning.memory_plan import Device
    raw, _, _ = prepared
    h100 = Device("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0), count=1)
    cpu = Device("cpu", "cpu", 24 * 2**30, count=0)

    def devices(device, **sections):
        return launch_report(plan(cfg_of(raw, **sections)), device, memory=False)["eval_devices"]
    assert devices(h100) == ["cuda:0", "cuda:0"]
    assert devices(h100, eval={"launch": "in_process"}) == ["cuda:0"]
    assert devices(h100, actor={"nproc_per_node": 1}) == ["cuda:0"]
    assert devices(cpu) == ["cpu", "cpu"] and devices(cpu, eval={"launch": "in_process"}) == ["cpu"]
