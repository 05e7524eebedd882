"""QLoRA over GGUF's Q4_1 blocks (`actor.lora.quantize: q4_1`, stages/core/q4_1.py) against references
that share none of its code: gguf's own numpy Q4_1 (both directions, byte for byte), the same model
with the dequantized weights as plain frozen tensors, and the merge done by hand. Under torchrun
(slow): one process against two (FSDP2 over gloo, the uint8 rows sharded), and a killed and resumed
run against one that never stopped."""

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import base_model
from stages.core import nf4 as cq
from stages.core import q4_1
from stages.planning import memory_plan as mp
from stages.runtime.model_types import build_configured_model
from stages.runtime.qlora import base_bytes_line, quantize_base_, resident_bytes
from test_quantize import _grads, _nonzero_b, assert_gradients_over_plain_weights
from test_train_core import assert_same_weights, make_cfg

Q41 = {"r": 4, "alpha": 8, "quantize": "q4_1"}


def by_gguf(w: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """gguf's Q4_1 bytes of `w` and the weight they decode to, by gguf's numpy reference."""
    packed = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
    return packed, torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q4_1).copy())


def weights(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 128, generator=g) * 0.05
    w[3, :32] = 0.25  # a constant block: step 0
    w[5, 32:64] *= 40  # a wide one
    return w


def test_the_bytes_and_the_weights_are_gguf_s_own():
    w = weights()
    packed, decoded = by_gguf(w)
    mine = q4_1.quantize(w)
    assert mine.dtype == torch.uint8 and mine.shape == (48, 128 // 32 * 20) == packed.shape
    assert np.array_equal(mine.numpy(), packed)
    assert torch.equal(q4_1.dequantize(mine, 128), decoded)
    assert torch.equal(q4_1.roundtrip(w), decoded)
    assert q4_1.q4_1_bytes(w.numel()) == mine.numel() == 0.625 * w.numel()


def test_a_base_that_already_is_q4_1_goes_through_unchanged():
    """A weight that came out of a Q4_1 GGUF (the quickstart's) is its own round trip, bit for bit:
    quantizing it again changes nothing. NF4 of the same weight moves it."""
    _, from_gguf = by_gguf(weights(1))
    assert torch.equal(q4_1.roundtrip(from_gguf), from_gguf)
    assert np.array_equal(q4_1.quantize(from_gguf).numpy(), by_gguf(from_gguf)[0])
    assert not torch.equal(cq.roundtrip(from_gguf, 64, 256), from_gguf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_q4_1_linear_equals_a_linear_over_its_dequantized_weight(dtype):
    w = weights(2)
    model = nn.Sequential(nn.Linear(128, 48, bias=True)).to(dtype)
    with torch.no_grad():
        model[0].weight.copy_(w)
    bias = model[0].bias.detach().clone()
    plain = by_gguf(model[0].weight.detach().float())[1].to(dtype)  # decoded in fp32, then cast once
    assert quantize_base_(model, SimpleNamespace(quantize="q4_1")) == ["0"]
    assert model[0].weight.dtype == torch.uint8 and not model[0].weight.requires_grad
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        assert torch.equal(model(x), F.linear(x, plain, bias))
    xg, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    model(xg).sum().backward()
    F.linear(xr, plain, bias).sum().backward()
    assert torch.equal(xg.grad, xr.grad)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q41")
    cfg = make_cfg(tmp, actor={"lora": Q41})
    return cfg, base_model(cfg)


def test_lora_gradients_over_a_q4_1_base_equal_those_over_its_dequantized_weights(tiny):
    """The original weight decoded by gguf's Q4_1 reference."""
    assert_gradients_over_plain_weights(*tiny, lambda p: p.dtype == torch.uint8, lambda _, w: by_gguf(w)[1])


def test_the_base_bytes_measured_and_planned(tiny):
    """The storages behind the quantized weights are 0.625 bytes a weight (0.156x fp32), as the plan
    counts them, and the rank's log line says so."""
    cfg, path = tiny
    q = build_configured_model(cfg, path, seed=0, device="cpu", lora=True, nf4=True)
    full = dict(build_configured_model(cfg, path, seed=0, device="cpu", lora=True).named_parameters())
    names = [n for n, p in q.named_parameters() if p.dtype == torch.uint8]
    params = dict(q.named_parameters())
    measured = resident_bytes(params[n] for n in names)
    fp32 = resident_bytes(full[n] for n in names)
    assert measured * 32 == fp32 * 5 and measured <= 0.3 * fp32
    assert f"{len(names)} base weights 4-bit" in base_bytes_line(q) and "(0.156x their fp32" in base_bytes_line(q)
    arch = mp.Arch.from_hf_config(json_config(path))
    batch = mp.Batch(1, 64, "test")
    plain = mp.estimate(arch, world=1, precision="fp32", batch=batch, checkpointing=False, lora_r=4)
    planned = mp.estimate(arch, world=1, precision="fp32", batch=batch, checkpointing=False, lora_r=4, q4_1=True)
    assert planned.n_quantized * 5 == measured * 8  # 32 weights in 20 bytes
    assert plain.params - planned.params == fp32 - measured


def json_config(path: str) -> dict:
    import json
    return json.loads((Path(path) / "config.json").read_text())


def test_an_adapter_folder_loads_merged_into_the_q4_1_base(tiny, tmp_path):
    """Stored as adapters, base.json names the base and the q4_1 record: the one loader rebuilds
    W_deq + scale x B @ A, with W_deq decoded by gguf, computed here by hand."""
    from transformers import AutoModelForCausalLM

    from stages.core.cache import bases
    from stages.inference.weights import load_merged
    cfg, path = tiny
    model = build_configured_model(cfg, path, seed=0, device="cpu", lora=True, nf4=True)
    _nonzero_b(model)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    folder = tmp_path / "adapter"
    model.save_pretrained(folder)
    bases.write_ref(folder, bases.base_of_training(path, tmp_path / "artifacts"), cq.quantize_record(cfg))
    assert bases.read_ref(folder)["quantize"]["kind"] == "q4_1"
    merged = load_merged(folder, roots=(tmp_path / "artifacts",)).state_dict()
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    scale = Q41["alpha"] / Q41["r"]
    checked = 0
    for key, w in base.items():
        name = key.removesuffix(".weight")
        a = next((v for k, v in adapters.items() if k.endswith(f"{name}.lora_A.default.weight")), None)
        if a is None:
            if "lm_head" not in key:
                assert torch.equal(merged[key], w), key
            continue
        b = next(v for k, v in adapters.items() if k.endswith(f"{name}.lora_B.default.weight"))
        want = (by_gguf(w)[1] if w.shape[1] % 32 == 0 else w) + scale * b @ a
        torch.testing.assert_close(merged[key], want, atol=1e-6, rtol=0)
        checked += w.shape[1] % 32 == 0
    assert checked


def test_the_registered_version_needs_no_torchao(tmp_path):
    """q4_1's round trip is torch alone: a registered q4_1 version's requirements leave torchao out,
    and the file that applies it ships beside nf4.py."""
    from stages import register
    assert any(p.endswith("q4_1.py") for p in register.CODE_PATHS)
    record = cq.quantize_record(make_cfg(tmp_path, actor={"lora": Q41}))
    assert record["kind"] == "q4_1" and record["block_size"] == 32


# --------------------------------------------------------------------------- torchrun (slow)


@pytest.mark.slow
def test_one_process_equals_two_with_the_q4_1_rows_sharded(tmp_path):
    lora = {**Q41, "target_modules": "all-linear"}
    one = _grads(tmp_path, make_cfg(tmp_path, "one.yaml", actor={"lora": lora, "nproc_per_node": 1}), 1)
    cfg = make_cfg(tmp_path, "two.yaml", actor={"lora": lora, "nproc_per_node": 2})
    two = _grads(tmp_path, cfg, 2)
    assert one["batch"] == two["batch"]
    # every block linear's Q4_1 bytes split by rows over the two ranks (7 linears a block)
    layers = json_config(base_model(cfg))["num_hidden_layers"]
    assert sorted(n for n, dtype in two["sharded"].items() if dtype == "torch.uint8") == \
        sorted(n for n in two["sharded"] if n.endswith("base_layer.weight")) and \
        len([d for d in two["sharded"].values() if d == "torch.uint8"]) == 7 * layers
    assert one["grads"].keys() == two["grads"].keys() and all("lora_" in n for n in one["grads"])
    assert_same_weights(one["adapters"], two["adapters"], atol=1e-6)
    for n, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][n], g, atol=1e-6, rtol=1e-5, msg=n)
    assert one["stats"]["loss"] == pytest.approx(two["stats"]["loss"], rel=1e-6)


def test_nf4_s_block_keys_are_refused_under_q4_1_and_left_out_of_show(tmp_path):
    from conftest import tiny_config_dict, write_config
    from stages.core.config import ConfigError, load_config
    from test_cli_tables import cells, check_whole, run_to_file, tables
    raw = tiny_config_dict(tmp_path, actor={"lora": {"r": 4, "quantize": "q4_1", "quantize_block_size": 32}})
    with pytest.raises(ConfigError, match=r"actor\.lora\.quantize_block_size sets nf4's blocks"):
        load_config(write_config(tmp_path, raw, "blocks.yaml"))
    # a config written out whole (a run's spec, a resumed run's config) holds the defaults: still valid
    whole = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor={"lora": {"r": 4, "quantize": "q4_1"}}),
                                     "q.yaml")).model_dump(mode="json")
    assert whole["actor"]["lora"]["quantize_block_size"] == 64
    type(load_config(write_config(tmp_path, tiny_config_dict(tmp_path), "p.yaml"))).model_validate(whole)
    shown = {}
    for kind in ("q4_1", "nf4"):
        raw = tiny_config_dict(tmp_path, actor={"lora": {"r": 4, "quantize": kind}})
        out = tmp_path / f"show-{kind}.txt"
        proc = run_to_file(["-m", "flows.cli", "show", "-c", str(write_config(tmp_path, raw, f"{kind}.yaml"))], out,
                           tmp_path, env={"PREFECT_HOME": str(tmp_path / ".prefect")})
        assert proc.returncode == 0, proc.stderr
        table = next(t for t in tables(out.read_text(encoding="utf-8")) if cells(t[1]) == ["key", "value"])
        shown[kind] = dict(check_whole(table)[1])
    assert shown["q4_1"]["actor.lora.quantize"] == "q4_1" and "actor.lora.quantize_block_size" not in shown["q4_1"]
    assert shown["nf4"]["actor.lora.quantize_block_size"] == "64"
    assert set(shown["nf4"]) - set(shown["q4_1"]) == {"actor.lora.quantize_block_size",
                                                       "actor.lora.quantize_scaler_block_size"}
