"""Where the base model comes from.

`actor.model.model_path` is one of
  * `builtin:tiny-chat` — a ~1M-parameter Qwen2 causal LM (random init) with a byte-level
    BPE tokenizer trained on the run's training data and a ChatML template, built offline
    and deterministically into `<artifacts>/models/<fingerprint>/` as an ordinary Hugging
    Face folder;
  * a local Hugging Face folder;
  * a hub id (needs network; never used by tests or the default run).
Everything downstream loads the result with `AutoTokenizer` / `AutoModelForCausalLM`.
"""

from __future__ import annotations

import json
from pathlib import Path

from .artifacts import StageBuild, code_version, file_digest, fingerprint, is_complete, stage_lock, stage_dir
from .config import SFTConfig, expand_paths

BUILTIN_PREFIX = "builtin:"

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

BUILTINS = {
    "tiny-chat": dict(
        vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, seed=0,
    ),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def model_fingerprint(cfg: SFTConfig) -> str:
    path = cfg.actor.model.model_path
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        corpus = [file_digest(p, cfg.artifacts_path) for p in expand_paths(cfg.data.train_data_paths, "data.train_data_paths")]
        return fingerprint("models", name=name, spec=BUILTINS.get(name), code=code_version("models", "prepare/readers"),
                           corpus=corpus, template=CHATML_TEMPLATE)
    local = Path(path).expanduser()
    if local.is_dir():
        files = sorted(f for f in local.rglob("*") if f.is_file())
        return fingerprint("models", files={str(f.relative_to(local)): file_digest(f, cfg.artifacts_path) for f in files})
    return fingerprint("models", hub_id=path)


def resolve_model(cfg: SFTConfig) -> str:
    """A path or hub id that `from_pretrained` accepts; builds the builtin model if needed."""
    path = cfg.actor.model.model_path
    if not path.startswith(BUILTIN_PREFIX):
        local = Path(path).expanduser()
        return str(local.resolve()) if local.is_dir() else path
    name = path[len(BUILTIN_PREFIX):]
    if name not in BUILTINS:
        from .config import ConfigError
        raise ConfigError(f"actor.model.model_path: unknown builtin '{name}'; available: {', '.join(BUILTINS)}")
    fp = model_fingerprint(cfg)
    root = cfg.artifacts_path
    folder = stage_dir(root, "models", fp)
    with stage_lock(root, "models", fp):
        if not is_complete(folder):
            build = StageBuild(root, "models", fp)
            corpus = expand_paths(cfg.data.train_data_paths, "data.train_data_paths")
            build_tiny_chat(build.partial, corpus, **BUILTINS[name])
            build.commit({"builtin": name, "corpus": [str(p) for p in corpus]})
    return str(folder)


def _corpus_texts(paths: list[Path]):
    from .prepare.readers import iter_conversations
    for _, conv in iter_conversations(paths):
        if isinstance(conv, list):
            for m in conv:
                yield m["content"]


def build_tiny_chat(out: Path, corpus: list[Path], *, vocab_size: int, seed: int, **arch) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus_texts(corpus), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     bos_token=None, unk_token=None, model_max_length=arch["max_position_embeddings"])
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


def resolve_model_ref(ref: str, tracking_uri: str | None = None) -> str:
    """A train stage folder, a Hugging Face folder or hub id, or `models:/name@alias|version` -> loadable path."""
    path = Path(ref).expanduser()
    if ref.startswith("models:/"):
        import mlflow
        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        try:
            local = Path(mlflow.artifacts.download_artifacts(ref))
        except Exception as e:  # unknown name/alias/version, unreachable server
            raise ValueError(f"{ref}: {str(e).splitlines()[0]}") from None
        found = next((p.parent for p in sorted(local.rglob("config.json")) if (p.parent / "tokenizer_config.json").is_file()), None)
        if found is None:
            raise ValueError(f"{ref}: no Hugging Face model folder inside the logged model")
        return str(found)
    if (path / "model" / "config.json").is_file():  # a train stage folder
        return str(path / "model")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{ref}: neither a model folder (no config.json) nor a train stage folder")
    return str(path) if path.is_dir() else ref
