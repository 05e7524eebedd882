"""Batched greedy generation for a Hugging Face chat model (evaluate, `sftflow chat`, and the
registered pyfunc model, which ships this file as its code)."""

from __future__ import annotations

import torch

# End-of-turn markers of common templates; whichever the tokenizer knows stops generation.
END_OF_TURN = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>"]


def load(model_dir: str, trust_remote_code: bool = False, device: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    # what `actor.precision: auto` picks (stages/runtime/distributed.py); inlined because this file
    # also runs alone inside a logged model
    dtype = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=trust_remote_code, dtype=dtype).to(device)
    model.eval()
    return model, tok


def stop_ids(model, tok) -> list[int]:
    ids = set()
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    vocab = tok.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN if t in vocab)
    return sorted(ids)


@torch.no_grad()
def generate(model, tok, prompts: list[list[dict]], max_new_tokens: int, batch_size: int) -> list[dict]:
    """Greedy replies for chat prompts (left-padded batches, KV cache); special tokens stripped.

    Each reply ends at its first stop token (eos or the template's end-of-turn marker), which is
    neither decoded nor counted: `new_tokens` is the reply's length in tokens."""
    tok.padding_side = "left"
    if tok.pad_token is None:  # Llama-3, Mistral: no pad token; left pads are masked out anyway
        tok.pad_token = tok.eos_token
    pad_id = tok.pad_token_id
    stops = stop_ids(model, tok)
    out = []
    for i in range(0, len(prompts), batch_size):
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                 for p in prompts[i:i + batch_size]]
        enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                             pad_token_id=pad_id, use_cache=True)
        new = gen[:, enc["input_ids"].shape[1]:]
        for row in new:
            ids = row.tolist()
            n = next((k for k, t in enumerate(ids) if t in stops), len(ids))
            out.append({"text": tok.decode(ids[:n], skip_special_tokens=True), "new_tokens": n,
                        "stopped": n < len(ids)})
    return out
