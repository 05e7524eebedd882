"""The one precision rule (stages/core/precision.py) held to torch's own answer, never to the plan's:
on a patched CUDA device of each compute capability, `torch.cuda.is_bf16_supported(including_emulation=
False)` (torch's real function, which reads the device's properties) says whether bf16 is native; the
worker's `choose_precision`, the model `generation.load` returns (replay, chat, the registered chat
model) and `sftflow show --json` on the simulated machine must all say bf16 exactly there. A T4 or V100
makes bf16 tensors (torch's default `including_emulation=True` answers True there), so the rule must
not ask torch's default. On CPU the same holds with torch's `torch.cpu._is_amx_tile_supported()`
patched both ways (a rank) and /proc/cpuinfo's flags (the torch-free plan)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, sftflow
from fake_gpu import FakeGPU, simulated_machine

CAPABILITIES = [(7, 0), (7, 5), (8, 0), (8, 6), (9, 0)]
NAMES = {(7, 0): "Tesla V100-SXM2-16GB", (7, 5): "Tesla T4", (8, 0): "NVIDIA A100-SXM4-80GB",
         (8, 6): "NVIDIA RTX A6000", (9, 0): "NVIDIA H100 80GB HBM3"}


@pytest.fixture
def gpu(monkeypatch):
    """A rank's view of one CUDA GPU of compute capability `cap`, on which a bf16 tensor can be made
    (emulated on 7.x): what torch.cuda's real functions read is patched, nothing above them."""
    def machine(cap: tuple[int, int], hip: str | None = None):
        props = SimpleNamespace(major=cap[0], minor=cap[1], name=NAMES.get(cap, "GPU"), total_memory=16 << 30)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)
        monkeypatch.setattr(torch.version, "hip", hip)
    return machine


def torch_says_native(cap, gpu) -> bool:
    gpu(cap)
    return torch.cuda.is_bf16_supported(including_emulation=False)


@pytest.mark.parametrize("cap", CAPABILITIES, ids=lambda c: f"{c[0]}.{c[1]}")
def test_the_worker_uses_bf16_exactly_where_torch_says_it_is_native(gpu, cap):
    from stages.runtime.distributed import choose_precision, precision_why
    native = torch_says_native(cap, gpu)
    assert native == (cap >= (8, 0))  # torch's own reading of the patched device
    assert torch.cuda.is_bf16_supported() is True  # the default counts emulation: a T4 "supports" bf16
    device = torch.device("cuda", 0)
    assert choose_precision("auto", device) == ("bf16" if native else "fp32")
    assert choose_precision("fp32", device) == "fp32" and choose_precision("bf16", device) == "bf16"
    assert precision_why("auto", device).startswith(("bf16" if native else "fp32") + ": auto, compute capability "
                                                   f"{cap[0]}.{cap[1]}")


def test_a_rocm_gpu_computes_bf16(gpu):
    from stages.runtime.distributed import choose_precision
    gpu((9, 4), hip="6.4")
    assert torch.cuda.is_bf16_supported(including_emulation=False)
    assert choose_precision("auto", torch.device("cuda", 0)) == "bf16"


@pytest.mark.parametrize("amx", [False, True], ids=["no-AMX", "AMX"])
def test_a_cpu_rank_uses_bf16_exactly_where_torch_says_it_has_amx(monkeypatch, amx):
    """AVX512-BF16 alone is not enough (measured slower than fp32: core/precision.py); torch's AMX query is."""
    from stages.runtime.distributed import choose_precision, precision_why
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    cpu = torch.device("cpu")
    assert choose_precision("auto", cpu) == ("bf16" if amx else "fp32")
    assert choose_precision("bf16", cpu) == "bf16" and choose_precision("fp32", cpu) == "fp32"
    assert precision_why("auto", cpu) == ("bf16: auto on a CPU with AMX (bf16 matrix units)" if amx else
                                          "fp32: auto on a CPU without AMX (bf16 is emulated or, with AVX512-BF16 "
                                          "alone, slower than fp32)")
    assert precision_why("fp32", cpu, "eval.precision") == "fp32: eval.precision=fp32 (set in the config)"


def cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu sse2 avx2 {flags}\n\n")
    return str(path)


def test_the_plan_reads_amx_from_the_kernels_flags_as_torch_does(tmp_path):
    from stages.core.precision import cpu_amx
    assert cpu_amx(cpuinfo(tmp_path, "avx512f avx512_bf16 amx_bf16 amx_tile amx_int8")) is True
    assert cpu_amx(cpuinfo(tmp_path, "avx512f avx512_bf16 avx512_fp16")) is False  # AVX512-BF16 alone
    assert cpu_amx(cpuinfo(tmp_path, "avx512f amx_tile")) is False  # tiles without bf16
    assert cpu_amx(str(tmp_path / "missing")) is False  # no /proc: macOS, Windows
    # the machine this runs on: the plan's reading is the ranks' (torch's own query)
    assert cpu_amx() == bool(torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize("amx", [False, True], ids=["no-AMX", "AMX"])
def test_show_and_the_fingerprints_follow_the_cpus_amx(tmp_path, monkeypatch, amx):
    """`sftflow show` (the plan, torch-free) on a CPU with and without AMX: training and scoring in the
    rule's precision, said with why; the scoring stages' fingerprints carry it (a folder scored in
    fp32 is never reused as bf16), training's does not (the device is not part of what it computes)."""
    from typer.testing import CliRunner

    import flows.cli
    from conftest import tiny_config_dict, write_config
    from stages.core.config import load_config
    from stages.pipeline import plan
    from stages.planning import memory_plan
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["precision"] = raw["eval"]["precision"] = "auto"
    path = write_config(tmp_path, raw)
    monkeypatch.setattr(memory_plan, "cpu_amx", lambda: False)
    before = plan(load_config(path)).fingerprints
    monkeypatch.setattr(memory_plan, "cpu_amx", lambda: amx)
    p = plan(load_config(path))
    want = "bf16" if amx else "fp32"
    assert p.facts["actor_precision"] == p.facts["eval_precision"] == want
    for stage in ("baseline", "evaluate"):
        assert (p.fingerprints[stage] != before[stage]) == amx
    assert p.fingerprints["train"] == before["train"]
    result = CliRunner().invoke(flows.cli.app, ["show", "-c", str(path), "--json"])
    assert result.exit_code == 0, result.output
    launch = json.loads(result.output)["launch"]
    assert launch["precision"] == launch["eval_precision"] == want
    assert launch["device"]["amx"] is amx
    assert launch["precision_why"].startswith(f"{want}: auto on a CPU with{'out' * (not amx)} AMX")
    assert launch["eval_precision_why"].startswith(f"{want}: auto on a CPU with{'out' * (not amx)} AMX")
    shown = CliRunner().invoke(flows.cli.app, ["show", "-c", str(path)])
    assert f"training in {want}: auto on a CPU with" in " ".join(shown.output.split())


@pytest.mark.parametrize("cap", [(7, 5), (8, 0)], ids=["T4", "A100"])
def test_generation_loads_the_model_in_the_rules_precision(gpu, cap, tmp_path, monkeypatch):
    """generation.load (replay, chat, the registered chat model) on the patched GPU: the weights' dtype
    is torch's native answer; `precision` from the config overrides it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.inference.generation import load
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "m")
    import transformers
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: "tokenizer")
    real_to = torch.nn.Module.to

    def to(self, *args, **kwargs):  # the CPU build has no CUDA: the move is a no-op, a dtype still applies
        args = tuple(a for a in args if not (isinstance(a, (torch.device, str)) and str(a).startswith("cuda")))
        kwargs.pop("device", None)
        return real_to(self, *args, **kwargs) if args or kwargs else self
    monkeypatch.setattr(torch.nn.Module, "to", to)
    native = torch_says_native(cap, gpu)
    model, _ = load(str(tmp_path / "m"), device="cuda")
    assert next(model.parameters()).dtype == (torch.bfloat16 if native else torch.float32)
    assert model.sftflow_precision == ("bf16" if native else "fp32")
    model, _ = load(str(tmp_path / "m"), device="cuda", precision="fp32")
    assert next(model.parameters()).dtype == torch.float32


def test_show_json_says_what_torch_says_on_each_capability(tmp_path, gpu):
    """The torch-free plan (nvidia-smi's compute_cap) on the simulated machine of each capability:
    `sftflow show --json`'s precision is torch's answer for a device of that capability."""
    expected = {cap: "bf16" if torch_says_native(cap, gpu) else "fp32" for cap in CAPABILITIES}
    seen = {}
    for cap in CAPABILITIES:
        machine = simulated_machine(tmp_path / f"m{cap[0]}{cap[1]}", [FakeGPU(NAMES[cap], 81920,
                                                                             f"{cap[0]}.{cap[1]}")])
        proc = sftflow("show", "-c", str(ROOT / "configs" / "default.yaml"), "--json",
                       f"artifacts_dir={tmp_path / 'artifacts'}", cwd=ROOT,
                       env={**machine, "PREFECT_HOME": str(tmp_path / ".prefect"), "CUDA_VISIBLE_DEVICES": None},
                       fresh=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        launch = json.loads(proc.stdout)["launch"]
        seen[cap] = launch["precision"]
        assert launch["eval_precision"] == launch["precision"]  # scoring follows the same rule by default
        assert launch["precision_why"].startswith(f"{seen[cap]}: auto, compute capability {cap[0]}.{cap[1]}")
    assert seen == expected
    assert [seen[c] for c in CAPABILITIES] == ["fp32", "fp32", "bf16", "bf16", "bf16"]


@pytest.mark.parametrize("asked,amx,dtype", [("fp32", True, torch.float32), ("bf16", False, torch.bfloat16),
                                             ("auto", False, torch.float32), ("auto", True, torch.bfloat16)])
def test_evaluation_scores_in_eval_precision_whatever_training_used(tmp_path, monkeypatch, asked, amx, dtype):
    """evaluate, baseline and champion load the scored model in `eval.precision` (`auto`: the rule, also
    when training ran in bf16), so every model of a comparison is scored alike."""
    from conftest import base_model, tiny_config_dict
    from stages.core.config import config_from_dict
    from stages.evaluate.runner import load_model
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["precision"] = "bf16"
    raw.setdefault("eval", {})["precision"] = asked
    cfg = config_from_dict(raw)
    folder = base_model(cfg)
    model, _ = load_model(cfg, {"kind": "hf", "path": folder}, folder, torch.device("cpu"))
    assert next(model.parameters()).dtype == dtype


def test_a_comparison_of_a_bf16_and_an_fp32_scoring_is_refused():
    """Paired comparisons (evaluate against the baseline, register against the champion) are made in one
    precision: records that say they were computed apart are a ValueError naming both."""
    from stages.core.paired import compare_sets
    rows = [{"reference": "a", "prompt": [{"role": "user", "content": str(i)}], "correct": i % 2 == 0}
            for i in range(4)]
    mine = {"val": [{**r, "precision": "bf16"} for r in rows]}
    assert compare_sets(mine, {"val": [{**r, "precision": "bf16"} for r in rows]}, "the baseline")["val"]["n"] == 4
    assert compare_sets(mine, {"val": rows}, "the baseline")["val"]["n"] == 4  # before precision was recorded
    with pytest.raises(ValueError, match=r"the baseline was scored in fp32, this model in bf16 \(eval set 'val'\)"):
        compare_sets(mine, {"val": [{**r, "precision": "fp32"} for r in rows]}, "the baseline")
