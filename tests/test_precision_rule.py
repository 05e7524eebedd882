"""The one precision rule (stages/core/precision.py) held to torch's own answer, never to the plan's:
on a patched CUDA device of each compute capability, `torch.cuda.is_bf16_supported(including_emulation=
False)` (torch's real function, which reads the device's properties) says whether bf16 is native; the
worker's `choose_precision`, the model `generation.load` returns (replay, chat, the registered chat
model) and `sftflow show --json` on the simulated machine must all say bf16 exactly there. A T4 or V100
makes bf16 tensors (torch's default `including_emulation=True` answers True there), so the rule must
not ask torch's default."""

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


def test_the_cpu_stays_fp32_unless_the_config_says_bf16():
    from stages.runtime.distributed import choose_precision
    assert choose_precision("auto", torch.device("cpu")) == "fp32"
    assert choose_precision("bf16", torch.device("cpu")) == "bf16"


@pytest.mark.parametrize("cap", [(7, 5), (8, 0)], ids=["T4", "A100"])
def test_generation_loads_the_model_in_the_rules_precision(gpu, cap, tmp_path, monkeypatch):
    """generation.load (replay, chat, the registered chat model) on the patched GPU: the weights' dtype
    is torch's native answer; `precision` from the config overrides it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.runtime.generation import load
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
        assert launch["eval_precision"] == "fp32"  # scoring stays fp32 unless eval.precision says otherwise
        assert launch["precision_why"].startswith(f"{seen[cap]}: auto, compute capability {cap[0]}.{cap[1]}")
    assert seen == expected
    assert [seen[c] for c in CAPABILITIES] == ["fp32", "fp32", "bf16", "bf16", "bf16"]


@pytest.mark.parametrize("asked,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("auto", torch.float32)])
def test_evaluation_scores_in_eval_precision_whatever_training_used(tmp_path, asked, dtype):
    """evaluate, baseline and champion load the scored model in `eval.precision` (fp32 by default, also
    when training ran in bf16), so every model of a comparison is scored alike."""
    from conftest import base_model, tiny_config_dict
    from stages.core.config import config_from_dict
    from stages.evaluate.runner import load_model
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["precision"] = "bf16"
    raw.setdefault("eval", {})["precision"] = asked
    cfg = config_from_dict(raw)
    folder = base_model(cfg)
    model, _ = load_model(cfg, {"kind": "hf", "path": folder}, folder, torch.device("cpu"))
    assert next(model.parameters()).dtype == dtype
