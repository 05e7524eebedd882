"""LoRA (actor.lora) under torchrun + FSDP2, against references that share none of its code
path: peft on one process without FSDP (gradients), an uninterrupted run (resume), and peft's
own unmerged forward of the exported adapter (the merged model)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import ROOT, base_model
from stages.chatdata.shards import read_shards
from stages.core.cache import bases
from stages.pipeline import plan, run_stage
from stages.runtime.saving.checkpoint import read_metadata
from stages.launch.launcher import worker_env
from test_train_core import assert_same_weights, killed, make_cfg, train

pytestmark = pytest.mark.slow

LORA = {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}}
RESUME = dict(runner={"max_epochs": 1, "max_steps": 6, "save_interval": 2, "val_check_interval": 3,
                      "keep_checkpoints": 5},
              actor=LORA)


def peft_reference(model_path: str, lora: dict):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                            target_modules=lora["target_modules"], task_type="CAUSAL_LM"))


@pytest.mark.parametrize("kl_to_base", [0.0, 0.5])
def test_lora_gradients_equal_a_single_process_reference(tmp_path, kl_to_base):
    """World 2 x accumulation 2 with FSDP2 over frozen base weights: the adapters' gradient of a global
    batch equals plain peft on one process, one sample at a time, token-weighted over the batch. With
    `kl_to_base` the reference adds beta x KL(base || tuned) per trained token, the base being a separate
    plain model and the KL written out from its definition; the logged loss stays the cross-entropy."""
    # with KL: a big first step, so that the tuned model is far enough from the base for KL to matter
    optim = {"optim": {"lr": 0.05, "warmup": 0}} if kl_to_base else {}
    cfg = make_cfg(tmp_path, actor={**LORA, "kl_to_base": kl_to_base, **optim})
    p = plan(cfg)
    run_stage(p, "prepare")
    model_path = base_model(cfg)
    spec = {"config": cfg.model_dump(mode="json"), "model_path": model_path, "out_dir": str(tmp_path / "out"),
            "train_dir": str(p.folder("prepare") / "train"), "val_dir": None}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "stages.launch.local_torchrun", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist" / "lora_grad_check.py"), str(tmp_path / "spec.json"), str(tmp_path / "g.pt")]
    proc = subprocess.run(cmd, env=worker_env(2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(tmp_path / "g.pt")
    assert got["stats"]["micro_batches"] == 2  # accumulation really happens

    ref = peft_reference(model_path, LORA["lora"])
    missing, unexpected = ref.load_state_dict(got["adapters"], strict=False)
    assert not unexpected and not ({n for n, q in ref.named_parameters() if q.requires_grad} & set(missing))
    b = [v for k, v in got["adapters"].items() if "lora_B" in k]
    assert b and all(v.abs().sum() > 0 for v in b)  # B moved off its zero init
    rows = [r for i, r in enumerate(read_shards(p.folder("prepare") / "train").to_pylist()) if i in set(got["batch"])]
    total = sum(sum(r["loss_mask"]) for r in rows)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ce_total = kl_total = 0.0
    for r in rows:
        ids = torch.tensor([r["input_ids"]])
        labels = torch.tensor([[t if m else -100 for t, m in zip(r["input_ids"], r["loss_mask"])]])
        logits = ref(input_ids=ids).logits
        ce_total = ce_total + F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
        trained = labels[0, 1:] != -100
        with torch.no_grad():
            p_base = torch.softmax(base(input_ids=ids).logits[0, :-1][trained], dim=-1)
        kl_total = kl_total + (p_base * (p_base.log() - torch.log_softmax(logits[0, :-1][trained], dim=-1))).sum()
    adapters = [q for q in ref.parameters() if q.requires_grad]
    grads = torch.autograd.grad((ce_total + kl_to_base * kl_total) / total, adapters, retain_graph=True)
    assert got["stats"]["loss"] == pytest.approx(ce_total.item() / total, rel=1e-5)
    if kl_to_base:
        assert got["stats"]["kl"] == pytest.approx(kl_total.item() / total, rel=1e-3)
        kl_part = torch.autograd.grad(kl_to_base * kl_total / total, adapters)
        assert max(g.abs().max().item() for g in kl_part) > 1e-3  # far above the tolerance below
    for q, g in zip(adapters, grads):
        q.grad = g
    want = {n: q.grad for n, q in ref.named_parameters() if q.grad is not None}
    assert set(got["grads"]) == set(want) and want and all("lora_" in n for n in want)  # only adapters have gradients
    for name, g in got["grads"].items():
        torch.testing.assert_close(g, want[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.fixture(scope="module")
def lora_uninterrupted(tmp_path_factory):
    return train(make_cfg(tmp_path_factory.mktemp("lora-ref"), **RESUME))


def test_lora_resume_after_sigkill_gives_the_same_adapters(tmp_path, lora_uninterrupted):
    cfg = make_cfg(tmp_path, **RESUME)
    partial = killed(cfg, "after_save:4")
    ckpt = partial / "checkpoints" / "step_00000004"
    # a LoRA checkpoint holds the adapters and their optimizer state, not the frozen base weights
    size = sum(f.stat().st_size for f in ckpt.glob("*.distcp"))
    base_size = (Path(base_model(cfg)) / "model.safetensors").stat().st_size
    assert size < base_size / 2, (size, base_size)
    # no frozen weight under any name: the builtin model's tied output head was saved as lm_head.weight
    saved = read_metadata(ckpt).state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), [k for k in saved if "lora_" not in k][:3]
    done = train(cfg)
    assert "resumed from" in (Path(done.path) / "train.log").read_text()
    a = load_file(str(Path(done.path) / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(Path(lora_uninterrupted.path) / "adapter" / "adapter_model.safetensors"))
    assert a and all("lora_" in k for k in a)
    assert_same_weights(a, b, atol=1e-6)
    assert not (Path(done.path) / "model").exists()  # the adapter and its base reference, no merged copy
    assert bases.read_ref(Path(done.path) / "adapter") == bases.read_ref(Path(lora_uninterrupted.path) / "adapter")


def test_merged_model_logits_equal_base_plus_adapter(lora_uninterrupted, tmp_path):
    """`adapter/` loaded merged by the one loader (inference/weights.py: its base by content) against
    peft's unmerged forward of `adapter/` on the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from stages.inference.weights import load_merged
    folder = Path(lora_uninterrupted.path)
    cfg_path = json.loads((folder / "spec.json").read_text())["model_path"]
    base = AutoModelForCausalLM.from_pretrained(cfg_path, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(folder / "adapter")).eval()
    merged = load_merged(folder / "adapter", roots=(folder.parents[1],)).eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(input_ids=ids).logits, merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(cfg_path, dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - plain).abs().max() > 1e-3  # the adapters changed something
