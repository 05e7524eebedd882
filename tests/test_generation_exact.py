"""`generation.generate` (our greedy decode loop: rows leave at their stop token, freed slots are
refilled) against its independent reference: plain transformers `model.generate`, one prompt at a
time, no padding, greedy.

Every family of tests/dist/families_check.py as its tiny random model (logits spread by weights of
std 0.2, so rounding does not flip an argmax while a wrong mask or position does), on prompts of
different lengths with stop tokens chosen so that replies end at different steps: rows leave the
batch and, where the cache is plain full attention, freed slots are refilled mid-batch. The real
model on the quickstart's own eval sets: tests/test_real_model.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import ROOT
from stages.inference import generation
from stages.inference.generation import generate, stop_ids

_spec = importlib.util.spec_from_file_location("families_check", ROOT / "tests" / "dist" / "families_check.py")
families_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(families_check)

QUESTIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Repeat after me: light happy seven"}],
    [{"role": "user", "content": "Good morning! Tell me about yourself, and what you were made for."}],
    [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am TinyChat."},
     {"role": "user", "content": "Say it again, in other words please"}],
    [{"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Name three colours of the rainbow, then three animals that live in the sea."}],
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "ok"}],
    [{"role": "user", "content": "Translate 'good night' into French and Spanish"}],
    [{"role": "user", "content": "What is the capital of Japan?"}],
]
# one system prompt on every row, as SmolLM2's template adds its own: the shared prefix computed once
SYSTEM = {"role": "system", "content": "You are TinyChat, a small helpful assistant. Answer briefly."}
PROMPTS = [[SYSTEM, *q] for q in QUESTIONS]
NEW_TOKENS = 12


def one_at_a_time(model, tok, prompts, max_new_tokens) -> list[dict]:
    """The reference: `model.generate` per prompt (no batch, no padding); the reply up to its first stop."""
    stops = stop_ids(model, tok)
    out = []
    for p in prompts:
        enc = tok.apply_chat_template(p, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            row = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                                 pad_token_id=tok.pad_token_id)[0, enc["input_ids"].shape[1]:].tolist()
        n = next((k for k, t in enumerate(row) if t in stops), len(row))
        out.append({"text": tok.decode(row[:n], skip_special_tokens=True), "new_tokens": n, "stopped": n < len(row),
                    "ids": row[:n]})
    return out


def tiny_family(family: str, tok):
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    pad, eos = tok.pad_token_id, tok.convert_tokens_to_ids("<|im_end|>")
    try:
        config = AutoConfig.for_model(family, **{**families_check.DIMS, **families_check.FAMILIES[family]},
                                      vocab_size=len(tok), bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    except (KeyError, ValueError) as e:
        pytest.skip(f"{family} is not in this transformers: {e}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, do_sample=False)
    return model


def with_early_stops(model, tok, prompts) -> list[dict]:
    """Make some replies end early, at different steps: up to three tokens that no reply starts with,
    taken at step 2, 4 or 6 of a reply, become stop tokens. The reference under those stops."""
    free = one_at_a_time(model, tok, prompts, NEW_TOKENS)
    firsts = {f["ids"][0] for f in free if f["ids"]}
    extra = []
    for k, f in enumerate(free):
        step = 2 + 2 * (k % 3)
        if len(extra) < 3 and len(f["ids"]) > step and f["ids"][step] not in firsts:
            extra.append(f["ids"][step])
    model.generation_config.eos_token_id = sorted(set(model.generation_config.eos_token_id) | set(extra))
    return one_at_a_time(model, tok, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("family", list(families_check.FAMILIES))
def test_every_family_replies_as_one_prompt_at_a_time(family, tok, monkeypatch):
    model = tiny_family(family, tok)
    want = with_early_stops(model, tok, PROMPTS)
    lengths = [w["new_tokens"] for w in want]
    # the check must see rows leave at different steps and different replies, or it would be blind
    assert len(set(lengths)) >= 3 and min(lengths) < NEW_TOKENS, lengths
    assert len({w["text"] for w in want}) >= len(PROMPTS) // 2
    merges, shared = [], []
    merge, prefix = generation._merge, generation.shared_prefix
    monkeypatch.setattr(generation, "_merge", lambda *a: merges.append(1) or merge(*a))
    monkeypatch.setattr(generation, "shared_prefix", lambda *a: shared.append(prefix(*a)) or shared[-1])
    for batch_size in (1, 3, 4, len(PROMPTS)):
        got = generate(model, tok, PROMPTS, NEW_TOKENS, batch_size)
        assert got == [{k: w[k] for k in ("text", "new_tokens", "stopped")} for w in want], (family, batch_size)
    # a cache of plain full-attention layers refills freed slots (sliding windows keep fixed batches)
    layer_types = getattr(model.config, "layer_types", None) or []
    windowed = "sliding_attention" in layer_types or (
        getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True)
        and not layer_types)
    if not windowed:
        assert merges, f"{family}: no slot was refilled"
        assert shared and all(s is not None and s[1] >= 10 for s in shared), \
            f"{family}: the system prompt was not shared"


def test_prompts_without_a_shared_prefix(tok):
    """Rows with different system prompts (and none): nothing shared, each prompt prefilled whole."""
    model = tiny_family("llama", tok)
    prompts = [([{"role": "system", "content": f"You are bot number {i}."}] if i % 3 else []) + q
               for i, q in enumerate(QUESTIONS)]
    ids = [tok.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
    assert generation.shared_prefix(model, ids) is None
    want = with_early_stops(model, tok, prompts)
    for batch_size in (2, 4):
        assert generate(model, tok, prompts, NEW_TOKENS, batch_size) == [
            {k: w[k] for k in ("text", "new_tokens", "stopped")} for w in want]


def test_the_former_generate_path_gives_the_same_replies(tok):
    model = tiny_family("llama", tok)
    want = with_early_stops(model, tok, PROMPTS)
    got = generate(model, tok, PROMPTS, NEW_TOKENS, 4, loop="generate")
    assert got == [{k: w[k] for k in ("text", "new_tokens", "stopped")} for w in want]


def test_a_generation_config_that_changes_greedy_logits_goes_through_generate(tok):
    """Our loop applies no logits processor: a repetition penalty must still be applied (by `generate`)."""
    model = tiny_family("llama", tok)
    plain = one_at_a_time(model, tok, PROMPTS, NEW_TOKENS)
    model.generation_config.repetition_penalty = 5.0
    want = one_at_a_time(model, tok, PROMPTS, NEW_TOKENS)
    assert [w["text"] for w in want] != [p["text"] for p in plain]  # the penalty does change replies
    got = generate(model, tok, PROMPTS, NEW_TOKENS, 3)
    assert got == [{k: w[k] for k in ("text", "new_tokens", "stopped")} for w in want]


def test_no_prompts_and_one_prompt(tok):
    model = tiny_family("llama", tok)
    assert generate(model, tok, [], NEW_TOKENS, 4) == []
    want = one_at_a_time(model, tok, PROMPTS[:1], NEW_TOKENS)
    assert generate(model, tok, PROMPTS[:1], NEW_TOKENS, 4) == [
        {k: want[0][k] for k in ("text", "new_tokens", "stopped")}]


def prompt_ids(tok, prompt) -> list[int]:
    """The prompt's tokens as `generate` makes them."""
    return tok(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", list(families_check.FAMILIES))
def test_the_fp32_head_is_the_models_own_argmax_in_fp32(family, tok):
    """The head split from the body (`generation.Fp32Head`) picks what the whole model picks: forced
    onto an fp32 model, its replies are `model.generate`'s one prompt at a time (Gemma2's soft cap and
    Cohere's logit scale come after the head and never move an argmax)."""
    model = tiny_family(family, tok)
    assert generation.Fp32Head.of(model) is None  # an fp32 model's head is fp32 already
    head = generation.Fp32Head.of(model, fp32_too=True)
    assert head is not None, family
    want = with_early_stops(model, tok, PROMPTS)
    ids = [prompt_ids(tok, p) for p in PROMPTS]
    stops = set(stop_ids(model, tok))
    for batch_size in (1, 4, len(PROMPTS)):
        got = generation._decode(model, ids, stops, NEW_TOKENS, batch_size, head)
        assert [g[:w["new_tokens"] + 1] for g, w in zip(got, want)] == [
            (w["ids"] + [g[w["new_tokens"]]] if w["stopped"] else w["ids"]) for g, w in zip(got, want)], family
        assert all(g[-1] in stops or len(g) == NEW_TOKENS for g in got)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_bf16_model_picks_tokens_with_its_head_in_fp32(family, tok, monkeypatch):
    """In bf16 the next token is the argmax of the last hidden state (after the final norm, as the
    whole model's `output_hidden_states` gives it) times the head's weights, both in fp32: compared on
    one left-padded batch, the same shapes on both sides (so no CPU's rounding can tell them apart),
    and `generate` goes through it. Which replies bf16 then gives is measured, not asserted
    (docs/evaluation.md)."""
    model = tiny_family(family, tok).to(torch.bfloat16)
    head = generation.Fp32Head.of(model)
    assert head is not None
    rows = [prompt_ids(tok, p) for p in PROMPTS]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = head.argmax(generation._new_cache(model), ids, mask, pos)
        hidden = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True).hidden_states
        weight = model.get_output_embeddings().weight.float()
        want = torch.nn.functional.linear(hidden[-1][:, -1].float(), weight).argmax(-1)
    assert got.tolist() == want.tolist()
    calls = []
    monkeypatch.setattr(generation.Fp32Head, "argmax", lambda self, *a: calls.append(1) or head_argmax(self, *a))
    replies = generate(model, tok, PROMPTS, NEW_TOKENS, 4)
    assert len(replies) == len(PROMPTS) and calls


head_argmax = generation.Fp32Head.argmax
