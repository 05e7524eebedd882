"""QLoRA (`actor.lora.quantize: nf4`) against references that share none of its code path: NF4
decoded by hand from its codes and scales, the same model with the dequantized weights as plain
frozen tensors, merging the adapters into that base by hand, and the bytes the tensors' storages
really occupy. Under torchrun (slow): one process against two (FSDP2 over gloo, the 4-bit weights
sharded), and a killed and resumed run against one that never stopped."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import ROOT, base_model
from stages.core import nf4 as cq
from stages.core.errors import ConfigError
from stages.launch.launcher import worker_env
from stages.pipeline import plan, run_stage
from stages.planning import memory_plan as mp
from stages.runtime.model_types import build_configured_model
from stages.runtime.qlora import is_nf4, quantize_base_, resident_bytes, unshardable
from test_train_core import assert_same_weights, killed, make_cfg, train

NF4 = {"r": 4, "alpha": 8, "quantize": "nf4"}
# the published NF4 code book (QLoRA, arXiv 2305.14314, appendix E), as torchao rounds it
CODES = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461, 0.3379, 0.4407,
         0.5626, 0.7230, 1.0]


def decoded_by_hand(t) -> torch.Tensor:
    """An NF4Tensor's weight from its stored parts, element by element in its own dtype: two codes a
    byte (high nibble first), each block's int8 scale over its scaler block's factor, plus the mean."""
    n, block, scaler_block = t.numel(), t.block_size, t.scaler_block_size
    codes = torch.empty(n, dtype=torch.long)
    codes[0::2], codes[1::2] = (t.quantized_data >> 4).long(), (t.quantized_data & 15).long()
    table = torch.tensor(CODES, dtype=t.dtype)
    block_of = torch.arange(n) // block
    scale = (t.quantized_scalers.float() / t.quantization_factor.repeat_interleave(scaler_block)).to(t.dtype)
    scale = scale + t.scaler_mean
    return (table[codes] * scale[block_of]).view(t.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_4bit_linear_equals_a_linear_over_its_dequantized_weight(dtype):
    nf4 = cq.torchao_nf4()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=g) * 0.05
    q = nf4.to_nf4(w, 64, 256)
    plain = decoded_by_hand(q)
    assert torch.equal(plain, cq.roundtrip(w, 64, 256))
    # 4 bits: each weight within half the widest gap of the code book (0.3038) x its block's absmax
    absmax = w.view(-1, 64).abs().amax(1, keepdim=True)
    assert ((plain - w).view(-1, 64).abs() <= 0.16 * absmax + 1e-3).all()
    x = torch.randn(3, 5, 256, generator=g).to(dtype)
    model = nn.Sequential(nn.Linear(256, 128, bias=True))
    with torch.no_grad():
        model[0].weight.copy_(w)
    model.to(dtype)
    bias = model[0].bias.detach().clone()
    # in bf16 the weight is quantized from bf16: the reference decodes that one
    lora = SimpleNamespace(quantize="nf4", quantize_block_size=64, quantize_scaler_block_size=256)
    assert quantize_base_(model, lora) == ["0"]
    assert is_nf4(model[0].weight) and not model[0].weight.requires_grad
    plain = decoded_by_hand(model[0].weight)
    with torch.no_grad():
        got = model(x)
    assert torch.equal(got, F.linear(x, plain, bias))  # the bias inside the matmul, as a plain layer adds it
    xg = x.clone().requires_grad_(True)
    model(xg).sum().backward()
    xr = x.clone().requires_grad_(True)
    F.linear(xr, plain, bias).sum().backward()
    assert torch.equal(xg.grad, xr.grad)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q")
    cfg = make_cfg(tmp, actor={"lora": NF4})
    return cfg, base_model(cfg)


def _nonzero_b(model) -> None:
    """B starts at zero: gradients of A would all be zero, and the comparison empty."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def assert_gradients_over_plain_weights(cfg, path, is_quantized, decode) -> None:
    """The quantized model against the same model whose weights are the dequantized ones (`decode`, a
    reference that shares no code with the layer), as plain frozen tensors: the loss and every adapter's
    gradient bit for bit (fp32, CPU; both sides run the same kernels on the same values)."""
    q = build_configured_model(cfg, path, seed=0, device="cpu", lora=True, nf4=True)
    ref = build_configured_model(cfg.model_copy(update={"actor": cfg.actor.model_copy(update={
        "lora": cfg.actor.lora.model_copy(update={"quantize": "none"})})}), path, seed=0, device="cpu", lora=True)
    quantized = {n: p for n, p in q.named_parameters() if is_quantized(p)}
    assert quantized and all("lora_" not in n and "lm_head" not in n for n in quantized)
    plain = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in quantized.items():
            plain[n].copy_(decode(p, plain[n].detach()))
    for n, p in q.named_parameters():  # what isn't quantized is the same tensor values
        if n not in quantized:
            assert torch.equal(p, plain[n]), n
    _nonzero_b(q)
    _nonzero_b(ref)
    ids = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(0))
    lq, lr = q(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    lq.backward()
    lr.backward()
    assert torch.equal(lq, lr)
    got = {n: p.grad for n, p in q.named_parameters() if p.requires_grad}
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and all("lora_" in n for n in got)
    for n in got:
        assert torch.equal(got[n], want[n]), n
    assert any(g.abs().sum() > 0 for n, g in got.items() if "lora_A" in n)


def test_lora_gradients_over_a_4bit_base_equal_those_over_its_dequantized_weights(tiny):
    """NF4 decoded by hand from its codes and scales."""
    assert_gradients_over_plain_weights(*tiny, is_nf4, lambda p, _: decoded_by_hand(p))


def test_quantized_base_weights_take_under_0_3x_their_fp32_bytes(tiny):
    """Measured: the bytes of the storages behind the parameters (an NF4Tensor's codes, scales and
    tables), each storage once, against the same model in fp32."""
    cfg, path = tiny
    q = build_configured_model(cfg, path, seed=0, device="cpu", lora=True, nf4=True)
    full = build_configured_model(cfg, path, seed=0, device="cpu", lora=True)
    names = {n for n, p in q.named_parameters() if is_nf4(p)}
    fp32 = dict(full.named_parameters())
    q_bytes = resident_bytes(p for n, p in q.named_parameters() if n in names)
    f_bytes = resident_bytes(fp32[n] for n in names)
    assert f_bytes == 4 * sum(fp32[n].numel() for n in names)
    assert q_bytes <= 0.3 * f_bytes, (q_bytes, f_bytes)
    # the plan's per-weight count is what torchao stores
    assert q_bytes == sum(cq.nf4_bytes(fp32[n].numel(), 64, 256, 4) for n in names)
    base_q = resident_bytes(p for n, p in q.named_parameters() if "lora_" not in n)
    base_f = resident_bytes(p for n, p in full.named_parameters() if "lora_" not in n)
    # the whole base, embeddings (tied head) and the unquantizable k/v projections in fp32 included
    print(f"quantized linears {q_bytes / f_bytes:.3f}x, whole base {base_q / base_f:.3f}x of fp32")
    assert base_q < base_f


def test_only_frozen_base_linears_are_quantized_and_fsdp_keeps_the_unsplittable_whole(tiny, tmp_path):
    cfg, path = tiny
    q = build_configured_model(cfg, path, seed=0, device="cpu", lora=True, nf4=True)
    names = [n for n, p in q.named_parameters() if is_nf4(p)]
    assert names and all(n.endswith("base_layer.weight") and not q.get_parameter(n).requires_grad for n in names)
    # every block linear: the builtin's k_proj and v_proj (128 x 64: 128 blocks) with scaler blocks of 128
    assert len(names) == 7 * 4
    assert {q.get_parameter(n).scaler_block_size for n in names if "k_proj" in n} == {128}
    # one rank: kept whole, torch's FSDP2 skips the all-gather that NF4's sharding hooks need
    assert unshardable(q, 1) == {p for p in q.parameters() if is_nf4(p)}
    # q_proj (128 x 128) has 1 second-level factor, the MLP's 3: none split evenly over 2 ranks, all stay whole
    assert unshardable(q, 2) == {p for p in q.parameters() if is_nf4(p)}
    # scaler blocks of 32: every block linear quantized, every one split evenly over 2 (and 4)
    cfg32 = make_cfg(tmp_path, actor={"lora": {**NF4, "quantize_scaler_block_size": 32}})
    q32 = build_configured_model(cfg32, path, seed=0, device="cpu", lora=True, nf4=True)
    assert len([p for p in q32.parameters() if is_nf4(p)]) == 7 * 4
    assert unshardable(q32, 2) == unshardable(q32, 4) == set()


def test_the_merge_is_into_the_dequantized_base(tiny, tmp_path):
    """The export's merged weights against W_deq + scale x B @ A computed here from the base folder."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from stages.runtime.saving.hf_export import _saved_adapters
    cfg, path = tiny
    model = build_configured_model(cfg, path, seed=0, device="cpu", lora=True, nf4=True)
    _nonzero_b(model)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    merged = _saved_adapters(adapters, cfg, path, tmp_path, merge=True)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    scale = NF4["alpha"] / NF4["r"]
    checked = 0
    for key, w in base.items():
        name = key.removesuffix(".weight")
        a = next((v for k, v in adapters.items() if k.endswith(f"{name}.lora_A.default.weight")), None)
        if a is None:
            assert torch.equal(merged[key], w), key
            continue
        b = next(v for k, v in adapters.items() if k.endswith(f"{name}.lora_B.default.weight"))
        quantized = cq.quantizable(w.numel(), 64, 256)
        want = (decoded_by_hand(cq.to_nf4(w, 64, 256)) if quantized else w) + scale * b @ a
        torch.testing.assert_close(merged[key], want, atol=1e-6, rtol=0)
        checked += quantized
    assert checked


def test_quantize_needs_lora_and_names_its_key(tmp_path):
    with pytest.raises(Exception, match="actor.lora.quantize=nf4 needs LoRA"):
        make_cfg(tmp_path, actor={"lora": {"quantize": "nf4"}})


def test_a_missing_torchao_is_one_line_naming_the_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization.quantize_.workflows.nf4.nf4_tensor", None)
    with pytest.raises(ConfigError, match=r"actor.lora.quantize: nf4 needs torchao .*pip install") as e:
        cq.torchao_nf4()
    assert "\n" not in str(e.value)


def test_the_record_and_the_model_card_say_the_base_trained_quantized(tmp_path):
    from stages.core.chat import model_card
    cfg = make_cfg(tmp_path, actor={"lora": NF4})
    record = cq.quantize_record(cfg)
    assert record == {"kind": "nf4", "block_size": 64, "scaler_block_size": 256, "modules": record["modules"]}
    assert cq.quantize_record(make_cfg(tmp_path, "plain.yaml", actor={"lora": {"r": 4}})) is None
    card = model_card.render("m", "base", {}, "", [], True, quantized=record)
    assert "base trained quantized (nf4, block 64, scaler block 256)" in card and "qlora" in card


# --------------------------------------------------------------------------- the plan (fast)


def test_the_plan_counts_4bit_weights_as_torchao_stores_them(tiny, tmp_path):
    """The plan's 4-bit parameter bytes against the measured bytes of the built model's quantized linears."""
    cfg, path = tiny
    hf = json.loads((Path(path) / "config.json").read_text())
    arch = mp.Arch.from_hf_config(hf)
    batch = mp.Batch(1, 64, "test")
    plain = mp.estimate(arch, world=1, precision="fp32", batch=batch, checkpointing=False, lora_r=4)
    nf4 = mp.estimate(arch, world=1, precision="fp32", batch=batch, checkpointing=False, lora_r=4, nf4=(64, 256))
    q = build_configured_model(cfg, path, seed=0, device="cpu", lora=True, nf4=True)
    quantized = [p for p in q.parameters() if is_nf4(p)]
    assert nf4.n_quantized == sum(p.numel() for p in quantized)
    assert plain.params - nf4.params == 4 * nf4.n_quantized - resident_bytes(quantized)
    assert nf4.dequant == mp.DEQUANT_BYTES * max(p.numel() for p in quantized)
    # under FSDP2 (gathered weights kept) the 4-bit layout is what is sharded and gathered, not a bf16 copy;
    # what the rank keeps whole (runtime's `unshardable` on the built model) is neither sharded nor gathered
    P, Pq = arch.n_params(), nf4.n_quantized
    for scaler in (256, 32):
        qs = build_configured_model(make_cfg(tmp_path, f"s{scaler}.yaml", actor={"lora": {
            **NF4, "quantize_scaler_block_size": scaler}}), path, seed=0, device="cpu", lora=True, nf4=True)
        whole = resident_bytes(unshardable(qs, 2))
        sharded = resident_bytes([p for p in qs.parameters() if is_nf4(p)]) - whole
        two = mp.estimate(arch, world=2, precision="bf16", batch=batch, checkpointing=False, lora_r=4,
                          nf4=(64, scaler))
        assert two.params == (4 * (P - Pq) + sharded) // 2 + whole + 2 * (P - Pq) + sharded, scaler
        assert (whole, sharded)[scaler == 32] > 0  # 256: every one whole on the builtin; 32: every one sharded


def test_the_dequantization_transient_is_what_torchao_allocates():
    """DEQUANT_BYTES against the bytes torch's CPU allocator reports at the peak of one dequantization."""
    nf4 = cq.torchao_nf4()
    w = nf4.to_nf4(torch.randn(512, 1024), 64, 256)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = w.get_original_weight()
    # an op's own allocations (net of its frees) when it ends; a free outside any op as it happens
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start if e.name == "[memory]" else e.time_range.end):
        live += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, live)
    assert live == out.numel() * 4  # what is left: the fp32 weight
    assert mp.DEQUANT_BYTES * 0.95 <= peak / w.numel() <= mp.DEQUANT_BYTES * 1.05, peak / w.numel()


def test_a_lora_plan_over_budget_names_nf4_when_it_fits(tmp_path):
    from test_memory_plan import SMOLLM2
    actor = {"lora": {"r": 8}, "nproc_per_node": 1, "micro_batch_size": 1, "global_batch_size": 1,
             "activation_checkpointing": True}
    gpu = mp.Device("cuda", "small", 8 * mp.GIB, (8, 0))
    cfg = make_cfg(tmp_path, actor=actor)
    plain, quant = mp.for_config(cfg, SMOLLM2, gpu), mp.for_config(cfg, SMOLLM2, gpu, quantize="nf4")
    assert quant.total < plain.total and quant.n_quantized > 0
    budget = (quant.total + plain.total) / 2 / mp.GIB
    verdict = mp.check_fits(make_cfg(tmp_path, "b.yaml", actor={**actor, "memory_budget_gb": budget}), SMOLLM2, gpu)
    assert verdict is not None and "actor.lora.quantize=nf4" in verdict.line


# --------------------------------------------------------------------------- torchrun (slow)


def _grads(tmp_path: Path, cfg, nproc: int) -> dict:
    p = plan(cfg)
    run_stage(p, "prepare")
    spec = {"config": cfg.model_dump(mode="json"), "model_path": base_model(cfg), "out_dir": str(tmp_path / "out"),
            "train_dir": str(p.folder("prepare") / "train"), "val_dir": None}
    (tmp_path / f"spec{nproc}.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "stages.launch.local_torchrun", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "dist" / "lora_grad_check.py"), str(tmp_path / f"spec{nproc}.json"),
           str(tmp_path / f"g{nproc}.pt")]
    proc = subprocess.run(cmd, env=worker_env(nproc), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(tmp_path / f"g{nproc}.pt")


@pytest.mark.slow
def test_one_process_equals_two_with_the_4bit_weights_sharded(tmp_path):
    """The same global batches on one process (no FSDP: fp32 alone has nothing to shard) and on two
    (FSDP2 over gloo, every 4-bit weight sharded: scaler blocks of 32 split evenly): the adapters
    after a step and the gradient of the next batch."""
    lora = {**NF4, "target_modules": "all-linear", "quantize_scaler_block_size": 32}
    one = _grads(tmp_path, make_cfg(tmp_path, "one.yaml", actor={"lora": lora, "nproc_per_node": 1}), 1)
    two = _grads(tmp_path, make_cfg(tmp_path, "two.yaml", actor={"lora": lora, "nproc_per_node": 2}), 2)
    assert one["batch"] == two["batch"]
    assert one["grads"].keys() == two["grads"].keys() and all("lora_" in n for n in one["grads"])
    assert_same_weights(one["adapters"], two["adapters"], atol=1e-6)
    for n, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][n], g, atol=1e-6, rtol=1e-5, msg=n)
    assert one["stats"]["loss"] == pytest.approx(two["stats"]["loss"], rel=1e-6)


QRESUME = dict(runner={"max_epochs": 1, "max_steps": 6, "save_interval": 2, "val_check_interval": 3,
                       "keep_checkpoints": 5},
               actor={"lora": {**NF4, "target_modules": ["q_proj", "v_proj", "up_proj"]}})


@pytest.mark.slow
# two processes, every 4-bit weight sharded (NF4 with scaler blocks of 32; Q4_1's rows always split);
# one process's resume is LoRA's (test_lora.py), whose path a quantized base does not change
@pytest.mark.parametrize("kind", ["nf4", "q4_1"])
def test_qlora_resume_after_sigkill_gives_the_weights_of_an_uninterrupted_run(tmp_path, kind):
    from safetensors.torch import load_file

    from stages.core import q4_1
    from stages.runtime.saving.checkpoint import read_metadata
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    blocks = {"quantize_scaler_block_size": 32} if kind == "nf4" else {}  # q4_1's blocks are GGUF's own
    sections = {**QRESUME, "actor": {"nproc_per_node": 2, "lora": {**QRESUME["actor"]["lora"], "quantize": kind,
                                                                    **blocks}}}
    ref_cfg = make_cfg(tmp_path / "ref", **sections)
    ref = train(ref_cfg)
    cfg = make_cfg(tmp_path / "run", **sections)
    partial = killed(cfg, "after_save:4")
    saved = read_metadata(partial / "checkpoints" / "step_00000004").state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)  # no 4-bit (or any frozen) weight written
    done = train(cfg)
    assert "resumed from" in (Path(done.path) / "train.log").read_text()
    a = load_file(str(Path(done.path) / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(Path(ref.path) / "adapter" / "adapter_model.safetensors"))
    assert_same_weights(a, b, atol=1e-6)
    # what loads (adapter + base.json: the loader merges into the dequantized base), not the original
    # weights plus the adapters
    from stages.inference.weights import load_merged
    merged = {n: load_merged(Path(r.path) / "adapter", roots=(c.artifacts_path,)).state_dict()
              for n, r, c in (("done", done, cfg), ("ref", ref, ref_cfg))}
    assert_same_weights(merged["done"], merged["ref"], atol=1e-6)
    base = load_file(str(Path(base_model(cfg)) / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"  # not a LoRA target here: its weight is the round trip alone
    assert torch.equal(merged["done"][key], cq.roundtrip(base[key], 64, 32) if kind == "nf4"
                       else q4_1.roundtrip(base[key]))
    assert not torch.equal(merged["done"][key], base[key])


def test_each_layer_takes_the_largest_scaler_block_that_divides_it():
    from test_memory_plan import SMOLLM2
    assert cq.scaler_block(576 * 576, 64, 256) == 216  # SmolLM2's q_proj: 5184 blocks = 24 x 216
    assert cq.scaler_block(576 * 192, 64, 256) == 216  # its k_proj: 1728 blocks = 8 x 216
    assert cq.scaler_block(576 * 1536, 64, 256) == 256
    assert cq.scaler_block(100, 64, 256) is None  # not whole blocks: stays in the training precision
    arch = mp.Arch.from_hf_config(SMOLLM2)
    assert len(arch.quantized_linears(64, 256)) == 7  # every linear of a SmolLM2 block
    w = torch.randn(576, 192)
    t = cq.to_nf4(w, 64, 256)
    assert t.scaler_block_size == 216 and resident_bytes([t]) == cq.nf4_bytes(w.numel(), 64, 256, 4)


def test_a_qlora_adapter_folder_loads_merged_into_the_dequantized_base(tiny, tmp_path):
    """A QLoRA version is stored as adapters (base.json names the base and the nf4 record): the one
    loader rebuilds what trained, W_deq + scale x B @ A, computed here from the base folder by hand."""
    from transformers import AutoModelForCausalLM

    from stages.core.cache import bases
    from stages.inference.weights import load_merged
    cfg, path = tiny
    model = build_configured_model(cfg, path, seed=0, device="cpu", lora=True, nf4=True)
    _nonzero_b(model)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    folder = tmp_path / "adapter"
    model.save_pretrained(folder)
    digest = bases.base_of_training(path, tmp_path / "artifacts")
    bases.write_ref(folder, digest, cq.quantize_record(cfg))
    assert bases.read_ref(folder)["quantize"]["kind"] == "nf4"
    merged = load_merged(folder, roots=(tmp_path / "artifacts",)).state_dict()
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    scale = NF4["alpha"] / NF4["r"]
    quantized = 0
    for key, w in base.items():
        name = key.removesuffix(".weight")
        a = next((v for k, v in adapters.items() if k.endswith(f"{name}.lora_A.default.weight")), None)
        q = key.endswith(".weight") and "lm_head" not in key and w.dim() == 2 and "embed" not in key \
            and cq.quantizable(w.numel(), 64, 256)
        want = decoded_by_hand(cq.to_nf4(w, 64, 256)) if q else w
        if a is not None:
            b = next(v for k, v in adapters.items() if k.endswith(f"{name}.lora_B.default.weight"))
            want = want + scale * b @ a
        torch.testing.assert_close(merged[key], want, atol=1e-6, rtol=0, msg=key)
        quantized += q
    assert quantized
