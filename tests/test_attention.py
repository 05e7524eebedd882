"""actor.attn_implementation: packed samples stay isolated under every attention kernel this
machine has, checked against the independent reference of each sample's own unpacked forward;
a kernel that lets samples see each other is shown to fail the same check; and `auto` resolves
as documented (stages/planning/attention.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import base_model, tiny_config_dict, write_config
from stages.core.config import ConfigError, load_config
from stages.planning import attention
from stages.planning.attention import (available_attn_implementations, effective_attn_implementation,
                                      resolve_attn_implementation)
from stages.runtime.batches import collate_packed

LENGTHS = (7, 31, 2, 18)  # a 2-token sample: its second token may only see its first
TOL = 1e-5


def llama_config():
    from transformers import LlamaConfig
    # a real architecture other than the builtin's Qwen2: RoPE, GQA (4 query heads on 2 kv heads)
    return LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def qwen2_config():
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def random_model(config_fn, impl: str, device="cpu", dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_fn(), attn_implementation=impl, dtype=dtype)
    return model.to(device).eval()


def samples(vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(5, vocab, n), "loss_mask": np.ones(n, dtype=np.int8)} for n in LENGTHS]


@torch.no_grad()
def packed_gap(model, rows: list[dict], use_cache: bool = False) -> float:
    """Largest |packed logit - the same sample's unpacked logit| over every token of every sample:
    0 up to rounding when the kernel keeps samples apart. `use_cache` as the forward is called
    (the worker passes False)."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in collate_packed(rows).items() if k != "labels"}
    packed = model(**batch, use_cache=use_cache).logits[0].float()
    gap, start = 0.0, 0
    for s in rows:
        alone = model(input_ids=torch.as_tensor(s["input_ids"], device=device)[None], use_cache=False).logits[0].float()
        gap = max(gap, (packed[start:start + len(alone)] - alone).abs().max().item())
        start += len(alone)
    return gap


# flex_attention compiles its kernel through inductor on first use: about a minute on 2 CPU cores per
# case. The suite keeps one flex case (the builtin model built as training builds it, slow tier); the
# two random-architecture ones run with SFTFLOW_ALL_FLEX=1 (e.g. `SFTFLOW_ALL_FLEX=1 pytest -m slow
# tests/test_attention.py -k flex`), and on a GPU in tests/test_gpu.py.
ALL_FLEX = os.environ.get("SFTFLOW_ALL_FLEX") == "1"
CPU_IMPLS = [pytest.param(i, marks=pytest.mark.slow) if i == "flex_attention" else i
             for i in available_attn_implementations("cpu")]
ARCH_IMPLS = [pytest.param(i, marks=[pytest.mark.slow, pytest.mark.skipif(
    not ALL_FLEX, reason="compiles a minute per case on CPU; SFTFLOW_ALL_FLEX=1 runs it "
                         "(the builtin flex case runs always)")])
    if i == "flex_attention" else i for i in available_attn_implementations("cpu")]


# --------------------------------------------------------------------------- isolation


@pytest.mark.parametrize("impl", ARCH_IMPLS)
@pytest.mark.parametrize("arch", [llama_config, qwen2_config], ids=["llama", "qwen2"])
def test_packed_logits_equal_unpacked_for_every_cpu_implementation(impl, arch):
    model = random_model(arch, impl)
    assert model.config._attn_implementation == impl  # the kernel under test is the one that ran
    assert packed_gap(model, samples(211)) < TOL


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_builtin_model_built_as_training_builds_it_keeps_samples_apart(tmp_path, impl):
    from stages.runtime.model_types import build_configured_model
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, n_train=24, n_val=4)))
    model = build_configured_model(cfg, base_model(cfg), seed=0, attn_implementation=impl).eval()
    assert effective_attn_implementation(model) == impl
    assert packed_gap(model, samples(model.config.vocab_size)) < TOL


def test_the_check_fails_on_a_kernel_that_lets_samples_see_each_other():
    """A registered kernel that drops the mask (plain causal attention over the whole packed row)
    is what a wrong varlen kernel looks like: the same check must catch it by a wide margin."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def leaky(module, query, key, value, attention_mask, **kw):
        return sdpa_attention_forward(module, query, key, value, None, **kw)

    AttentionInterface.register("leaky_causal", leaky)
    ALL_MASK_ATTENTION_FUNCTIONS.register("leaky_causal", sdpa_mask)
    model = random_model(llama_config, "leaky_causal")
    assert packed_gap(model, samples(211)) > 1e-2


def test_the_check_fails_when_the_forward_keeps_a_cache():
    """transformers builds the per-sample mask from position_ids only when no cache is passed: the
    default `use_cache=True` silently attends across samples, which is why every packed forward of
    the worker passes use_cache=False."""
    model = random_model(llama_config, "sdpa")
    assert packed_gap(model, samples(211), use_cache=False) < TOL
    assert packed_gap(model, samples(211), use_cache=True) > 1e-2


# --------------------------------------------------------------------------- resolution


def test_auto_on_cpu_keeps_the_models_default():
    assert resolve_attn_implementation("auto", "cpu", packing=True) is None
    assert resolve_attn_implementation("auto", "cpu", packing=False) is None


def test_explicit_choice_passes_through_when_available():
    assert resolve_attn_implementation("eager", "cpu", packing=True) == "eager"
    assert resolve_attn_implementation("sdpa", "cpu", packing=False) == "sdpa"


def test_auto_on_cuda_prefers_flash_then_flex_when_packing(monkeypatch):
    monkeypatch.setattr(attention, "_flash_available", lambda v: v == 2)
    bf16 = dict(precision="bf16", capability=(9, 0))
    assert resolve_attn_implementation("auto", "cuda", packing=True, **bf16) == "flash_attention_2"
    assert resolve_attn_implementation("auto", "cuda", packing=False, **bf16) == "flash_attention_2"
    monkeypatch.setattr(attention, "_flash_available", lambda v: True)
    assert resolve_attn_implementation("auto", "cuda", packing=True, **bf16) == "flash_attention_3"
    monkeypatch.setattr(attention, "_flash_available", lambda v: False)
    assert resolve_attn_implementation("auto", "cuda", packing=True, **bf16) == "flex_attention"
    assert resolve_attn_implementation("auto", "cuda", packing=False, **bf16) is None  # padded: the model's sdpa


def test_auto_never_picks_flash_for_fp32_or_a_gpu_older_than_ampere(monkeypatch):
    """flash-attn has no fp32 kernel (actor.precision fp32, or auto on a GPU without bf16) and no
    kernel below compute capability 8.0: auto falls back as if flash were not installed."""
    monkeypatch.setattr(attention, "_flash_available", lambda v: True)
    for precision, capability in [("fp32", (9, 0)), ("bf16", (7, 5)), ("fp32", (7, 0))]:
        assert resolve_attn_implementation("auto", "cuda", True, precision, capability) == "flex_attention"
        assert resolve_attn_implementation("auto", "cuda", False, precision, capability) is None
    assert resolve_attn_implementation("auto", "cuda", True, "bf16", (8, 0)) == "flash_attention_3"


def test_explicit_flash_with_fp32_or_an_old_gpu_is_a_one_line_error_naming_both_keys(monkeypatch):
    monkeypatch.setattr(attention, "_flash_available", lambda v: True)
    with pytest.raises(ConfigError, match=r"^actor.attn_implementation: 'flash_attention_2' has no fp32 kernel "
                                          r"but actor.precision resolves to fp32") as e:
        resolve_attn_implementation("flash_attention_2", "cuda", True, "fp32", (9, 0))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^actor.attn_implementation: 'flash_attention_3' needs a GPU of compute "
                                          r"capability >= 8.0, this one has 7.5"):
        resolve_attn_implementation("flash_attention_3", "cuda", True, "bf16", (7, 5))
    assert resolve_attn_implementation("flash_attention_2", "cuda", True, "bf16", (8, 0)) == "flash_attention_2"


def test_the_memory_plan_resolves_the_kernel_by_the_workers_rule(monkeypatch):
    """The plan's torch-free guess (installed packages, nvidia-smi's capability) agrees with the
    worker's resolution (transformers' checks, torch's capability) when both see the same machine."""
    from stages.planning import memory_plan as mp
    packages = {"flash_attn": 2, "flash_attn_interface": 3}
    real_find_spec = attention.importlib.util.find_spec
    for flash in (set(), {2}, {2, 3}):
        monkeypatch.setattr(attention, "_flash_available", lambda v, flash=flash: v in flash)
        monkeypatch.setattr(attention.importlib.util, "find_spec",
                            lambda name, *a, flash=flash: object() if packages.get(name) in flash
                            else (None if name in packages else real_find_spec(name, *a)))
        for capability in ((7, 5), (8, 0), (9, 0)):
            gpu = mp.Device("cuda", "test GPU", 80 * mp.GIB, capability)
            for requested in ("auto", "sdpa"):
                for packing in (True, False):
                    precision = gpu.precision("auto")
                    assert precision == ("bf16" if capability >= (8, 0) else "fp32")  # is_bf16_supported's rule
                    want = resolve_attn_implementation(requested, "cuda", packing, precision, capability) or "sdpa"
                    assert mp.attention_kernel(requested, gpu, packing, precision) == want


def test_unavailable_implementation_is_a_one_line_error_naming_the_key(monkeypatch):
    with pytest.raises(ConfigError) as e:
        resolve_attn_implementation("flash_attention_2", "cpu", packing=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("actor.attn_implementation: 'flash_attention_2' is not available on cpu")
    assert "available: eager, sdpa" in msg
    monkeypatch.setattr(attention, "_flash_available", lambda v: False)
    with pytest.raises(ConfigError,
                       match=r"^actor.attn_implementation: 'flash_attention_2' .*flash_attn.* not installed"):
        resolve_attn_implementation("flash_attention_2", "cuda", True, "bf16", (9, 0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine may have flash_attn")
def test_a_kernel_this_machine_lacks_stops_the_cli_run_before_anything_but_not_a_deployments_plan(tmp_path):
    """Planning (a deployment, `sftflow show`) may happen on a host without the GPU: it does not check
    the kernel; `sftflow run` checks it on the machine that trains, exit 2 before anything runs."""
    from conftest import sftflow
    from stages.pipeline import check_launch, plan
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path, actor={"attn_implementation": "flash_attention_2"}))
    p = plan(load_config(cfg_path))  # what `sftflow deploy` does
    assert p.fingerprints["train"]
    with pytest.raises(ConfigError, match=r"^actor.attn_implementation: 'flash_attention_2' is not available on cpu"):
        check_launch(p)  # what run_stage('train') does on the worker
    r = sftflow("run", "-c", str(cfg_path), cwd=tmp_path, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: actor.attn_implementation: 'flash_attention_2' is not "
                                                   "available on cpu"), r.stderr
    assert not (tmp_path / "artifacts" / "prepare").exists() and not (tmp_path / ".prefect").exists()


def test_unknown_implementation_is_a_one_line_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^actor.attn_implementation: unknown 'flash'"):
        resolve_attn_implementation("flash", "cpu", packing=True)
    raw = tiny_config_dict(tmp_path, actor={"attn_implementation": "flash"})
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path, raw))
    assert "actor.attn_implementation" in str(e.value) and "\n" not in str(e.value).strip()


def test_the_key_is_outside_the_fingerprint(tmp_path):
    from stages.core.config import hashed
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor={"attn_implementation": "eager"})))
    assert cfg.actor.attn_implementation == "eager"
    assert "attn_implementation" not in hashed(cfg.actor)


def test_effective_implementation_sees_through_peft_and_plain_modules():
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(random_model(llama_config, "eager"), LoraConfig(r=2, target_modules=["q_proj"]))
    assert effective_attn_implementation(model) == "eager"
    assert effective_attn_implementation(torch.nn.Linear(2, 2)) == "n/a"


# --------------------------------------------------------------------------- the choice is recorded


@pytest.mark.slow
def test_the_kernel_that_ran_reaches_train_log_manifest_and_mlflow(tmp_path):
    """An explicit `eager` (auto would keep the model's sdpa on CPU): the worker logs it, writes it to
    runtime.json, the train stage puts it in its manifest and the MLflow run's params. The process
    count `actor.nproc_per_node: auto` chose, and why, reach train.log and the manifest too."""
    from mlflow.tracking import MlflowClient

    from stages.core.cache.artifacts import read_manifest
    from stages.pipeline import plan, run_stage
    raw = tiny_config_dict(tmp_path, n_train=24, n_val=4, runner={"max_steps": 2, "val_check_interval": 0},
                           actor={"nproc_per_node": "auto", "global_batch_size": 8, "attn_implementation": "eager"})
    cfg = load_config(write_config(tmp_path, raw))
    assert cfg.actor.nproc_per_node == 1 and cfg.actor.topology.startswith("1 process: auto: one process")
    p = plan(cfg)
    run_stage(p, "prepare")
    folder = Path(run_stage(p, "train", on_line=lambda line: None).path)
    log = (folder / "train.log").read_text()
    assert "attention eager, packed micro-batches" in log and f"topology: {cfg.actor.topology}\n" in log
    manifest = read_manifest(folder)
    assert manifest["topology"] == cfg.actor.topology
    assert manifest["runtime"] == {"attn_implementation": "eager", "precision": "fp32", "device": "cpu",
                                   "packing": True, "world_size": 1}
    params = MlflowClient(cfg.resolved_tracking_uri).get_run(manifest["mlflow_run_id"]).data.params
    assert params["runtime.attn_implementation"] == "eager"
    assert params["actor.attn_implementation"] == "eager"  # the config's own value, as every key
