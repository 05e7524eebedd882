"""A LoRA checkpoint holds what trains: the adapters, their optimizer state, the data position and the
RNG streams; never a frozen weight, a tied one included (DCP's `ignore_frozen_params` lists a tied
weight under one name and kept the frozen output head under the other). Resume restores exactly: the
steps after a save-and-load equal the steps of a run that never stopped. (The same under torchrun,
killed and resumed: tests/test_lora.py.)"""

import json

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from stages.runtime.saving import checkpoint as ckpt
from stages.runtime.saving.checkpoint import load_checkpoint, read_metadata, save_checkpoint, trained_state


@pytest.fixture(scope="module", autouse=True)
def one_process_group(tmp_path_factory):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def lora_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def step(model, opt) -> float:
    ids = torch.randint(0, 4096, (2, 12))  # from torch's RNG: a resume that lost it would see other batches
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_a_lora_checkpoint_holds_no_frozen_weight(tmp_path):
    model, opt = lora_model()
    step(model, opt)
    path = save_checkpoint(tmp_path, 1, model, opt, {"step": 1, "data_position": {"epoch": 0, "consumed": 8},
                                                     "scheduler": {}}, keep=2)
    saved = read_metadata(path).state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert model_keys == trainable and all("lora_" in k for k in model_keys)
    assert "base_model.model.lm_head.weight" not in model_keys  # the tied frozen head that used to be saved
    assert set(trained_state(model)) == trainable
    # what else is in it: the adapters' optimizer state, the data position, every RNG stream
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in saved)
    assert json.loads((path / "trainer_state.json").read_text())["data_position"] == {"epoch": 0, "consumed": 8}
    assert set(json.loads((path / "rng_rank0.json").read_text())) >= {"torch", "numpy", "python"}
    # on disk: less than the frozen head alone (the adapters, their two AdamW moments and DCP's ~1 KB a tensor)
    head_bytes = model.get_output_embeddings().weight.numel() * 4
    assert sum(f.stat().st_size for f in path.glob("*.distcp")) < head_bytes


def test_lora_resume_equals_the_run_that_never_stopped(tmp_path):
    ref, ref_opt = lora_model()
    torch.manual_seed(1)
    want = [step(ref, ref_opt) for _ in range(4)]

    model, opt = lora_model()
    torch.manual_seed(1)
    got = [step(model, opt) for _ in range(2)]
    save_checkpoint(tmp_path, 2, model, opt, {"step": 2, "data_position": {"epoch": 0, "consumed": 4},
                                              "scheduler": {}, "world_size": 1}, keep=2)
    torch.manual_seed(99)  # the RNG moves on after the save: the resume must bring it back
    resumed, resumed_opt = lora_model()  # fresh adapters and optimizer, the same frozen base (seed 0)
    state, rng_ok = load_checkpoint(ckpt.newest_usable(tmp_path, warn=print), resumed, resumed_opt)
    assert rng_ok and state["step"] == 2
    got += [step(resumed, resumed_opt) for _ in range(2)]
    assert got == pytest.approx(want, abs=0)
    for (n, a), b in zip(ref.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=n)
