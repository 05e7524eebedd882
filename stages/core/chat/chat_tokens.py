"""Where a chat model's reply ends: the one rule that sftflow's generation (inference/generation.py)
stops at and that a GGUF export's Modelfile names as its stops (export/gguf.py).

Plain Python, no torch: the export needs it without torch, and the registered model ships this
file beside generation.py (register's `code_paths`), where it is imported by its bare name."""

from __future__ import annotations

# End-of-turn markers of common templates; whichever the tokenizer knows stops generation.
END_OF_TURN = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>"]


def stop_token_ids(tok, generation_eos: int | list[int] | None) -> list[int]:
    """The ids a reply stops at, sorted: the generation config's `eos_token_id` (one id or a list),
    the tokenizer's eos, and the end-of-turn markers its vocabulary has."""
    ids = set()
    if generation_eos is not None:
        ids.update(generation_eos if isinstance(generation_eos, (list, tuple)) else [generation_eos])
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    vocab = tok.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN if t in vocab)
    return sorted(ids)
