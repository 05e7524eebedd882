"""Batched greedy generation and teacher-forced loss for one Hugging Face model folder."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# End-of-turn markers of common templates; whichever the tokenizer knows stops generation.
END_OF_TURN = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>"]


def load(model_dir: str, trust_remote_code: bool = False, device: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
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
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts[i:i + batch_size]]
        enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                             pad_token_id=pad_id, use_cache=True)
        new = gen[:, enc["input_ids"].shape[1]:]
        for row in new:
            ids = row.tolist()
            n = next((k for k, t in enumerate(ids) if t in stops), len(ids))
            out.append({"text": tok.decode(ids[:n], skip_special_tokens=True), "new_tokens": n})
    return out


@torch.no_grad()
def teacher_forced_sums(model, samples: list[dict], pad_id: int, batch_size: int) -> dict:
    """Sums over the trainable tokens of every sample: cross-entropy, token count, argmax hits.
    Sums (not means) so that ranks add up exactly; `loss_metrics` divides once."""
    from stages.train.data import IGNORE_INDEX, collate_padded
    loss_sum, tokens, correct = 0.0, 0, 0
    for i in range(0, len(samples), batch_size):
        batch = {k: v.to(model.device) for k, v in collate_padded(samples[i:i + batch_size], pad_id).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        loss_sum += F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="sum").item()
        valid = labels != IGNORE_INDEX
        tokens += int(valid.sum())
        correct += int(((logits.argmax(-1) == labels) & valid).sum())
    return {"loss_sum": loss_sum, "tokens": tokens, "token_correct": correct}


def loss_metrics(sums: dict) -> dict:
    """eval_loss = sum of token losses / tokens over all samples; perplexity = exp(eval_loss)."""
    tokens = int(sums["tokens"])
    loss = sums["loss_sum"] / max(tokens, 1)
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "token_accuracy": sums["token_correct"] / max(tokens, 1), "eval_tokens": tokens}
