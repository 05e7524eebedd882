"""`builtin:tiny-chat`: a ~1M-parameter Qwen2 causal LM (random init) with a byte-level BPE
tokenizer trained on the run's training data and a ChatML template, built offline and
deterministically as an ordinary Hugging Face folder."""

from __future__ import annotations

import json
from pathlib import Path

from stages.chatdata.readers import iter_conversations

# A template with {% generation %} markers, so transformers' own assistant mask can serve as a
# reference in tests; sftflow's masking does not need them.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# initializer_range: the demo's skill that must generalize (repeating 3 random words) is a copy
# circuit in attention that grows out of a plateau whose length shrinks as the initial weights grow
# (a saddle's escape time goes like log(1/scale)). At transformers' default 0.02 it lasted from 200
# to more than 504 steps by seed and by the CPU's kernels (AVX2 vs AVX-512: 0.367 vs 1.000 held-out
# accuracy on one seed); at 0.05 the validation loss is below 0.1 by step ~100 on every seed, world
# size and thread count measured (docs/benchmarks.md, "The demo on any machine").
BUILTINS = {
    "tiny-chat": dict(
        vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.05,
        seed=0,
    ),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus_texts(paths: list[Path], fmt: str = "auto", columns: dict | None = None):
    for _, conv in iter_conversations(paths, fmt, columns):
        if isinstance(conv, list):
            for m in conv:
                yield m["content"]


def build_tiny_chat(out: Path, corpus: list[Path], *, vocab_size: int, seed: int, fmt: str = "auto",
                    columns: dict | None = None, **arch) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus_texts(corpus, fmt, columns), trainer=trainer)
    # no token_type_ids (transformers 4.x's default adds them, and `generate` refuses what a decoder doesn't take)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     bos_token=None, unk_token=None, model_max_length=arch["max_position_embeddings"],
                                     model_input_names=["input_ids", "attention_mask"])
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(out)

    eos, pad = hf_tok.convert_tokens_to_ids("<|im_end|>"), hf_tok.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(vocab_size=len(hf_tok), tie_word_embeddings=True, bos_token_id=pad, eos_token_id=eos,
                         pad_token_id=pad, use_cache=True, **arch)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    (out / "sftflow_builtin.json").write_text(json.dumps({"arch": arch, "vocab_size": len(hf_tok), "seed": seed}))
