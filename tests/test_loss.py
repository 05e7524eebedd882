"""The token loss (stages/runtime/loss.py): the output head and the loss on the trained positions
only, in checkpointed chunks, against the full-logits arithmetic it replaces (values and gradients,
fp32), on tiny random-init Hugging Face models built here from their config classes: Llama with
a tied head, Qwen2 with an untied one, Gemma2 with final-logit softcapping, Cohere with
`logit_scale`; full and LoRA (peft, the head among the targets), padded and packed; the KL to the
base model too. `actor.loss: dft` against a per-token Python loop. Then the worker: one process
with gradient accumulation against one sample at a time, and FSDP2 over two ranks (gloo) with
each block's and the root's weights freed after forward (the GPU default), full and LoRA + KL."""

import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from stages.core.errors import ConfigError
from stages.runtime import loss
from stages.runtime.batches import collate_packed, collate_padded
from stages.runtime.loss import IGNORE_INDEX, model_loss, output_transform, reference_outputs, token_loss_sum

CHUNK = 5  # positions per chunk in these tests: every batch here spans several chunks and a partial one
ATOL, RTOL = 1e-5, 1e-4  # fp32, as the other gradient checks (tests/test_train.py)
KINDS = ["llama-tied", "qwen2-untied", "gemma2-softcap", "cohere-scale"]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(loss, "LOSS_CHUNK", CHUNK)


def tiny_lm(kind: str, lora: bool = False, seed: int = 0) -> nn.Module:
    """A 2-layer model of `kind`, random init large enough (std 0.2) that logits reach a few units,
    so softcapping (cap 2) and a logit scale (3) change them a lot. LoRA: peft on q_proj, v_proj and
    the output head, its B matrices random (fresh ones are zero: the adapters would change nothing)."""
    from transformers import (CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, LlamaConfig,
                              LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)
    dims = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    config_cls, model_cls, extra = {
        "llama-tied": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
        "qwen2-untied": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": False}),
        "gemma2-softcap": (Gemma2Config, Gemma2ForCausalLM, {"final_logit_softcapping": 2.0, "head_dim": 8}),
        "cohere-scale": (CohereConfig, CohereForCausalLM, {"logit_scale": 3.0}),
    }[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**dims, **extra)).float().train()
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"],
                                                 lora_dropout=0.0))
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def batch(shape: str, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """(inputs, labels) of samples with untrained prompts: `padded` rows of unequal length, or one
    `packed` row (per-sample position_ids); 20 to 30 trained positions."""
    rng = np.random.default_rng(seed)
    samples = []
    for n, prompt in [(14, 4), (9, 3), (11, 5)]:
        mask = np.r_[np.zeros(prompt), np.ones(n - prompt)].astype(np.int8)
        samples.append({"input_ids": rng.integers(3, 97, n), "loss_mask": mask})
    b = collate_padded(samples, pad_id=0) if shape == "padded" else collate_packed(samples)
    return {k: v for k, v in b.items() if k != "labels"}, b["labels"]


def trained(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def grads(value: torch.Tensor, params) -> list[torch.Tensor]:
    return list(torch.autograd.grad(value, params, retain_graph=True, allow_unused=True))


def assert_close_grads(got, want) -> None:
    assert len(got) == len(want)
    assert any(w is not None and w.abs().max() > 1e-3 for w in want)  # something really is compared
    for g, w in zip(got, want):
        if w is None:
            assert g is None or g.abs().max() == 0
        else:
            torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)


def per_token_loop(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sum of cross-entropy, sum of DFT's p x cross-entropy, tokens), one trained position at a time:
    cross-entropy as logsumexp - the target's logit, p = exp(-cross-entropy) as a Python float
    (a constant to autograd, i.e. detached)."""
    ce_total = dft_total = torch.zeros(())
    n = 0
    for b in range(labels.size(0)):
        for t in range(labels.size(1) - 1):
            y = int(labels[b, t + 1])
            if y == IGNORE_INDEX:
                continue
            z = logits[b, t].float()
            ce = torch.logsumexp(z, 0) - z[y]
            ce_total = ce_total + ce
            dft_total = dft_total + math.exp(-ce.item()) * ce
            n += 1
    return ce_total, dft_total, n


def kl_by_definition(logits: torch.Tensor, ref_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over the trained positions of KL(ref || model) = sum_v p_ref(v) (log p_ref(v) - log p(v))."""
    keep = labels[:, 1:] != IGNORE_INDEX
    p_ref = torch.softmax(ref_logits[:, :-1][keep].float(), dim=-1)
    logp = torch.log_softmax(logits[:, :-1][keep].float(), dim=-1)
    return (p_ref * (p_ref.log() - logp)).sum()


# --------------------------------------------------------------------------- the chunked path (fast)


@pytest.mark.parametrize("shape", ["padded", "packed"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_loss_equals_the_full_logits(kind, lora, shape):
    model = tiny_lm(kind, lora)
    inputs, labels = batch(shape)
    params = trained(model)
    sums = model_loss(model, inputs, labels, dft=True)
    assert sums.chunked
    logits = model(**inputs, use_cache=False).logits
    ce, n = token_loss_sum(logits, labels)
    _, dft, _ = per_token_loop(logits, labels)
    assert sums.n_tokens == n and n > 3 * CHUNK
    assert sums.ce.item() == pytest.approx(ce.item(), rel=1e-6)
    assert sums.dft.item() == pytest.approx(dft.item(), rel=1e-5)
    assert sums.kl.item() == 0.0
    assert_close_grads(grads(sums.ce, params), grads(ce, params))
    assert_close_grads(grads(sums.dft, params), grads(dft, params))


@pytest.mark.parametrize("kind", ["gemma2-softcap", "cohere-scale"])
def test_the_output_transforms_change_the_logits_a_lot(kind):
    """What makes the test above able to fail: without softcapping or the scale the head's result
    is far from the model's logits."""
    model = tiny_lm(kind)
    inputs, _ = batch("padded")
    with torch.no_grad():
        raw = model.get_output_embeddings()(model.model(**inputs).last_hidden_state)
        logits = model(**inputs).logits
    assert (raw - logits).abs().max() > 0.5
    torch.testing.assert_close(output_transform(model)(raw), logits, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_kl_to_base_chunked_equals_the_full_logits(kind):
    """LoRA with the head adapted: the base's predictions are its hidden states with every adapter
    off, and its head's adapter off when the chunks apply it."""
    from stages.runtime.lora import adapters_off
    model = tiny_lm(kind, lora=True)
    inputs, labels = batch("padded")
    params = trained(model)
    with torch.no_grad(), adapters_off(model):
        reference = reference_outputs(model, inputs, labels)
        base_logits = model(**inputs, use_cache=False).logits
    assert reference.hidden is not None and reference.logits is None
    sums = model_loss(model, inputs, labels, reference=reference)
    assert sums.chunked
    logits = model(**inputs, use_cache=False).logits
    kl = kl_by_definition(logits, base_logits, labels)
    assert kl.item() > 1.0  # the adapters moved the model well away from the base
    assert sums.kl.item() == pytest.approx(kl.item(), rel=1e-5)
    assert_close_grads(grads(sums.kl, params), grads(kl, params))
    # what the head's adapter being off changes: with it on, the reference would be another one
    with torch.no_grad():
        head_on = output_transform(model)(model.get_output_embeddings()(reference.hidden))
        other = model_loss(model, inputs, labels, reference=loss.Reference(logits=head_on))
    assert abs(other.kl.item() - kl.item()) > 0.1


@pytest.mark.parametrize("kind", ["llama-tied", "gemma2-softcap"])
def test_kl_on_some_rows_is_the_kl_of_those_rows_alone(kind):
    """A warm start's `data.rehearsal.kl_on: earlier`: the KL holds the earlier sources' rows only. By
    definition, that is the KL over the same batch with the other rows' tokens untrained, on the chunked
    path and the full-logits one; the cross-entropy still counts every row."""
    from stages.runtime.lora import adapters_off
    model = tiny_lm(kind, lora=True)
    inputs, labels = batch("padded")
    rows = torch.tensor([True, False, True])[:, None].expand_as(labels)
    params = trained(model)
    with torch.no_grad(), adapters_off(model):
        reference = reference_outputs(model, inputs, labels, kl_mask=rows)
        base_logits = model(**inputs, use_cache=False).logits
    sums = model_loss(model, inputs, labels, reference=reference)
    logits = model(**inputs, use_cache=False).logits
    kl = kl_by_definition(logits, base_logits, torch.where(rows, labels, IGNORE_INDEX))
    assert 0 < kl.item() < kl_by_definition(logits, base_logits, labels).item()
    assert sums.kl.item() == pytest.approx(kl.item(), rel=1e-5)
    assert sums.n_tokens == int((labels[:, 1:] != IGNORE_INDEX).sum())  # the CE counts every trained token
    assert_close_grads(grads(sums.kl, params), grads(kl, params))
    full = model_loss(model, inputs, labels, reference=loss.Reference(
        logits=base_logits[:, :-1][labels[:, 1:] != IGNORE_INDEX], weights=reference.weights))
    assert full.kl.item() == pytest.approx(kl.item(), rel=1e-5)


def test_backward_recomputes_the_head_one_chunk_at_a_time():
    """The head never sees more than a chunk of positions (besides the model's own call on each
    row's last position), and backward runs it again once per chunk: no chunk's logits are kept."""
    model = tiny_lm("llama-tied")
    inputs, labels = batch("padded")
    model_loss(model, inputs, labels)  # the first batch decides the path
    calls = []
    handle = model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: calls.append((torch.is_grad_enabled(), args[0].shape[:-1])))
    sums = model_loss(model, inputs, labels)
    n_chunks = math.ceil(sums.n_tokens / CHUNK)
    forward = list(calls)
    sums.ce.backward()
    handle.remove()
    assert forward[0][1] == (labels.size(0), 1)  # the model's own call: the last positions only
    assert [s for _, s in forward[1:]] == [(min(CHUNK, sums.n_tokens - k * CHUNK),) for k in range(n_chunks)]
    recomputed = calls[len(forward):]
    assert len(recomputed) == n_chunks and all(s[0] <= CHUNK for _, s in recomputed)
    # a single chunk is not recomputed: its logits would be held until its backward anyway
    calls.clear()
    handle = model.get_output_embeddings().register_forward_hook(lambda m, args, out: calls.append(args[0].shape))
    one = {k: v[:, :CHUNK] for k, v in inputs.items()}
    model_loss(model, one, labels[:, :CHUNK]).ce.backward()
    handle.remove()
    assert len(calls) == 2  # the model's own call and the chunk's; none in backward


@pytest.mark.parametrize("make", [lambda: tiny_lm("llama-tied"), lambda: NoHead()], ids=["chunked", "full"])
def test_a_batch_without_trained_tokens_is_zero_and_still_backpropagates(make):
    """(An empty micro-batch slot is weighted 0 by the loop; FSDP2 still needs its backward on every rank.)"""
    model = make()
    inputs, labels = batch("padded")
    model_loss(model, inputs, labels)  # the first batch decides the path
    sums = model_loss(model, inputs, torch.full_like(labels, IGNORE_INDEX), dft=True)
    assert sums.n_tokens == 0 and sums.ce.item() == sums.dft.item() == 0.0
    sums.ce.backward()
    assert all(p.grad is not None and p.grad.abs().max() == 0 for p in model.parameters())


class DoubledLogits(nn.Module):
    """A causal LM whose forward doubles its logits after the head: a transform loss.py doesn't know."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_lm("llama-tied")

    def get_output_embeddings(self):
        return self.lm.get_output_embeddings()

    def forward(self, **kw):
        out = self.lm(**kw)
        out.logits = out.logits * 2
        return out


class NoHead(nn.Module):
    """Not a Hugging Face model: logits from a forward, no `get_output_embeddings`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(97, 16), nn.Linear(16, 97)

    def forward(self, input_ids, use_cache=False, **_):
        return SimpleNamespace(logits=self.out(torch.tanh(self.emb(input_ids))))


@pytest.mark.parametrize("make, why", [(DoubledLogits, "not a transform of its output head's result"),
                                       (NoHead, "no output head")])
def test_models_loss_py_cannot_chunk_take_the_full_logits(make, why, capsys):
    model = make()
    inputs, labels = batch("padded")
    sums = model_loss(model, inputs, labels, dft=True)
    assert not sums.chunked and why in capsys.readouterr().out
    logits = model(**inputs, use_cache=False).logits
    ce, dft, n = per_token_loop(logits, labels)
    assert sums.n_tokens == n
    assert sums.ce.item() == pytest.approx(ce.item(), rel=1e-5)
    assert sums.dft.item() == pytest.approx(dft.item(), rel=1e-5)
    params = trained(model)
    assert_close_grads(grads(sums.dft, params), grads(dft, params))
    assert loss._VERDICTS[model] is not None  # decided once
    with torch.no_grad():
        reference = reference_outputs(model, inputs, labels)
    assert reference.logits is not None


@pytest.mark.parametrize("kind", ["llama-tied", "gemma2-softcap"])
def test_dft_equals_a_per_token_loop(kind):
    """`actor.loss: dft`: the sum of p x cross-entropy over the trained tokens, p detached; its
    gradient is not the cross-entropy's (it weighs each token by p)."""
    model = tiny_lm(kind)
    inputs, labels = batch("packed")
    params = trained(model)
    sums = model_loss(model, inputs, labels, dft=True)
    ce, dft, n = per_token_loop(model(**inputs, use_cache=False).logits, labels)
    assert sums.dft.item() == pytest.approx(dft.item(), rel=1e-5)
    got = grads(sums.dft, params)
    assert_close_grads(got, grads(dft, params))
    # p < 1: the DFT sum is below the cross-entropy's, and its gradient points elsewhere
    assert sums.dft.item() < sums.ce.item()
    g_ce = torch.cat([g.flatten() for g in grads(sums.ce, params)])
    g_dft = torch.cat([g.flatten() for g in got])
    assert F.cosine_similarity(g_ce, g_dft, dim=0) < 0.99


def one_sample_at_a_time(model, samples: list[dict]) -> dict:
    """The reference for evaluate's sums: each sample's own full forward, unpadded, its full logits."""
    loss_sum, tokens, correct = 0.0, 0, 0
    with torch.no_grad():
        for sample in samples:
            b = collate_padded([sample], 0)
            logits = model(input_ids=b["input_ids"]).logits
            ls, n = token_loss_sum(logits, b["labels"])
            loss_sum, tokens = loss_sum + ls.item(), tokens + n
            y = b["labels"][:, 1:]
            correct += int(((logits[:, :-1].argmax(-1) == y) & (y != IGNORE_INDEX)).sum())
    return {"loss_sum": loss_sum, "tokens": tokens, "token_correct": correct}


def test_evaluate_sums_equal_the_full_logits():
    """Evaluate's teacher-forced sums (chunked, no grad) against today's arithmetic: loss and argmax hits."""
    from stages.evaluate.losses import teacher_forced_sums
    model = tiny_lm("gemma2-softcap").eval()
    rng = np.random.default_rng(3)
    samples = [{"input_ids": rng.integers(3, 97, n), "loss_mask": (np.arange(n) >= 3).astype(np.int8)}
               for n in (12, 7, 15, 9, 13)]
    got = teacher_forced_sums(model, samples, pad_id=0, batch_size=2)
    assert got == pytest.approx(one_sample_at_a_time(model, samples), rel=1e-5)


@pytest.mark.parametrize("kind", ["llama-tied", "qwen2-untied", "cohere-scale", "gemma2-softcap"])
def test_evaluate_sums_with_the_shared_prefix_computed_once(kind, monkeypatch):
    """Samples that start alike (a system prompt): the loss pass computes the common tokens once and
    every batch attends to them; its sums equal each batch's full forward's. The prefix stops before
    the earliest trained token's predecessor (one sample is trained right after it); gemma2's
    sliding-window cache shares nothing."""
    import stages.evaluate.losses as losses
    model = tiny_lm(kind).eval()
    rng = np.random.default_rng(5)
    system = [5, 6, 7, 8, 9, 10, 11, 12]
    samples = []
    for n, first_trained in ((9, 4), (5, 2), (14, 3), (7, 7), (11, 1)):
        ids = np.array(system + list(rng.integers(13, 97, n)))
        trained = np.arange(len(ids)) >= len(system) + first_trained - 1
        samples.append({"input_ids": ids, "loss_mask": trained.astype(np.int8)})
    from stages.inference.generation import shared_prefix as prefix
    shared = []
    monkeypatch.setattr(losses, "shared_prefix", lambda *a, **k: shared.append(prefix(*a, **k)) or shared[-1])
    got = losses.teacher_forced_sums(model, samples, pad_id=0, batch_size=2)
    if kind == "gemma2-softcap":
        assert shared == []
    else:  # the earliest trained token is at 8 (1 after the system prompt): its predecessor 7 is not shared
        assert len(shared) == 1 and shared[0][1] == 7
    assert got == pytest.approx(one_sample_at_a_time(model, samples), rel=1e-5)


def test_a_changed_output_rule_after_the_first_batch_is_an_error():
    model = DoubledLogits()
    inputs, labels = batch("padded")
    loss._VERDICTS[model] = None  # as if its first batch had shown a known transform
    with pytest.raises(RuntimeError, match="unlike on its first one"):
        model_loss(model, inputs, labels)


# --------------------------------------------------------------------------- the worker


def naive_reference(model, rows, base=None, dft=False, beta=0.0):
    """(objective, cross-entropy, KL sums, tokens) of `rows` (prepared samples), one sample and one
    trained token at a time; KL(base || model) from its definition with `base` a separate model."""
    objective = ce_total = kl_total = torch.zeros(())
    total = 0
    for r in rows:
        ids = torch.tensor([r["input_ids"]])
        labels = torch.tensor([[t if m else IGNORE_INDEX for t, m in zip(r["input_ids"], r["loss_mask"])]])
        logits = model(input_ids=ids).logits
        ce, weighted, n = per_token_loop(logits, labels)
        total += n
        ce_total = ce_total + ce
        objective = objective + (weighted if dft else ce)
        if base is not None:
            keep = labels[0, 1:] != IGNORE_INDEX
            with torch.no_grad():
                p_base = torch.softmax(base(input_ids=ids).logits[0, :-1][keep], dim=-1)
            logp = torch.log_softmax(logits[0, :-1][keep], dim=-1)
            kl_total = kl_total + (p_base * (p_base.log() - logp)).sum()
    return objective + beta * kl_total, ce_total, kl_total, total


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from test_precision import specs_over_prepared_data
    return specs_over_prepared_data(tmp_path_factory.mktemp("loss"))


def test_worker_dft_with_accumulation_equals_one_sample_at_a_time(prepared):
    """One process, 2 micro-batches: the step's gradient and logged `loss` (DFT) and `ce` against a
    plain model, one sample and one token at a time, weighted by the whole batch's tokens."""
    from transformers import AutoModelForCausalLM

    from stages.chatdata.shards import read_shards
    from stages.runtime.batches import DataPosition
    from stages.runtime.worker import SFTWorker
    from test_precision import gloo_world_of_one
    spec = prepared("dft-one", precision="fp32", loss="dft")
    w = SFTWorker(spec)
    with gloo_world_of_one():
        w.setup()
        idx = w.sampler.global_batch(DataPosition())
        stats = w.forward_backward(idx)
        got = {n: p.grad.detach().clone() for n, p in w.model.named_parameters() if p.grad is not None}
    assert stats["micro_batches"] == 2
    table = read_shards(spec.train_dir).to_pylist()
    ref = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=torch.float32)
    objective, ce, _, total = naive_reference(ref, [table[i] for i in idx], dft=True)
    assert stats["trainable_tokens"] == total
    assert stats["loss"] == pytest.approx(objective.item() / total, rel=1e-5)
    assert stats["ce"] == pytest.approx(ce.item() / total, rel=1e-5)
    (objective / total).backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], atol=ATOL, rtol=RTOL, msg=name)


def test_dft_with_an_output_that_does_not_compute_it_stops_with_one_line(prepared):
    """A subclass's own output under `actor.loss: dft` would silently train the cross-entropy."""
    from stages.runtime.batches import DataPosition
    from stages.runtime.worker import SFTWorker, TrainOutput
    from test_precision import gloo_world_of_one

    class OwnLoss(SFTWorker):
        def get_train_model_output(self, batch):
            return TrainOutput(*self._token_loss_sum(batch))

    w = OwnLoss(prepared("dft-own", precision="fp32", loss="dft"))
    with gloo_world_of_one(), pytest.raises(ConfigError, match="actor.loss: OwnLoss.get_train_model_output does "
                                                              "not compute 'dft'"):
        w.setup()
        w.forward_backward(w.sampler.global_batch(DataPosition()))


@pytest.mark.slow
def test_fsdp2_two_ranks_with_weights_freed_after_forward_equal_one_sample_at_a_time(prepared, tmp_path):
    """FSDP2 over 2 ranks x 2 micro-batches, every unit's weights freed after its forward (the root's
    too: the chunks run inside the root's forward, and its pre-backward hook gathers them again):
    full fine-tuning with DFT, and LoRA on q, v and the tied head with DFT + KL to the base. After one
    optimizer step, the second batch's gradient and logged metrics against plain models one sample
    and one token at a time (the LoRA reference: peft with the trained adapters, the base a separate
    plain model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from conftest import ROOT
    from stages.chatdata.shards import read_shards
    from stages.launch.launcher import worker_env
    two = {"nproc_per_node": 2, "micro_batch_size": 4, "global_batch_size": 16, "precision": "fp32",
           "reshard_after_forward": True, "loss": "dft"}
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "lm_head"]}
    specs = {"full": prepared("fsdp-dft", **two),
             "lora": prepared("fsdp-lora-kl", **two, lora=lora, kl_to_base=0.5, optim={"lr": 0.05, "warmup": 0})}
    paths = {name: spec.write(tmp_path / f"{name}.json") for name, spec in specs.items()}
    cmd = [sys.executable, "-m", "stages.launch.local_torchrun", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist" / "loss_check.py"), str(tmp_path / "out.pt"), *map(str, paths.values())]
    proc = subprocess.run(cmd, env=worker_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("output head and loss on the trained positions only") >= 2, proc.stdout[-2000:]
    results = torch.load(tmp_path / "out.pt")
    table = read_shards(specs["full"].train_dir).to_pylist()
    model_path = specs["full"].model_path
    for name in specs:
        got = results[str(paths[name])]
        assert got["fsdp"] and not got["keep_gathered"] and got["stats"]["micro_batches"] == 2
        ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        base, beta = None, 0.0
        if name == "lora":
            ref = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules=lora["target_modules"],
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
            base, beta = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), 0.5
        missing, unexpected = ref.load_state_dict(got["trained"], strict=False)
        assert not unexpected and not ({n for n, p in ref.named_parameters() if p.requires_grad} & set(missing))
        objective, ce, kl, total = naive_reference(ref, [table[i] for i in got["batch"]], base=base, dft=True,
                                                   beta=beta)
        stats = got["stats"]
        assert stats["trainable_tokens"] == total
        assert stats["ce"] == pytest.approx(ce.item() / total, rel=1e-5)
        assert stats["loss"] == pytest.approx((objective - beta * kl).item() / total, rel=1e-5)
        if name == "lora":
            assert stats["kl"] == pytest.approx(kl.item() / total, rel=1e-3) and kl.item() / total > 1e-3
        (objective / total).backward()
        want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert set(got["grads"]) == set(want)
        if name == "lora":
            assert all("lora_" in n for n in want) and any("lm_head" in n for n in want)
        for n, g in got["grads"].items():
            torch.testing.assert_close(g, want[n], atol=ATOL, rtol=RTOL, msg=f"{name}: {n}")
