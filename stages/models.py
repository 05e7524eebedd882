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

from .artifacts import StageBuild, code_version, file_digest, fingerprint, input_digest, is_complete, stage_lock, stage_dir
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
        corpus = [input_digest(p, cfg.artifacts_path) for p in expand_paths(cfg.data.train_data_paths, "data.train_data_paths")]
        return fingerprint("models", name=name, spec=BUILTINS.get(name), code=code_version("models", "prepare/readers"),
                           corpus=corpus, template=CHATML_TEMPLATE, format=cfg.data.format, columns=cfg.data.columns)
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
            build_tiny_chat(build.partial, corpus, fmt=cfg.data.format, columns=cfg.data.columns, **BUILTINS[name])
            build.commit({"builtin": name, "corpus": [str(p) for p in corpus]})
    return str(folder)


def _corpus_texts(paths: list[Path], fmt: str = "auto", columns: dict | None = None):
    from .prepare.readers import iter_conversations
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


def resolve_model_ref(ref: str, tracking_uri: str | None = None, dst_path: str | None = None) -> str:
    """A train stage folder, a Hugging Face folder or hub id, or `models:/name@alias|version` -> loadable path.
    A `models:/` model is downloaded (into `dst_path` when given, else a temporary folder)."""
    path = Path(ref).expanduser()
    if ref.startswith("models:/"):
        import mlflow
        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        try:
            local = Path(mlflow.artifacts.download_artifacts(ref, dst_path=dst_path))
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


# --------------------------------------------------------------------------- eval.model

REGISTRY_PREFIX = "models:/"


def model_folder(path: Path) -> tuple[str, Path] | None:
    """What a local folder holds: ("hf", it) a Hugging Face model, ("checkpoint", it) a DCP training
    checkpoint, ("state_dict", it) a non-HF export (model.safetensors); a train stage folder means its model/."""
    if (path / "config.json").is_file():
        return "hf", path
    if (path / "COMPLETE").is_file() or (path / ".metadata").is_file():
        return "checkpoint", path
    if (path / "model.safetensors").is_file():
        return "state_dict", path
    if (path / "model").is_dir():
        return model_folder(path / "model")
    return None


def _local_ref(ref: str) -> Path | None:
    """The folder `ref` names, or None for a hub id; a path-looking ref that is not a model is an error."""
    from .config import ConfigError
    path = Path(ref).expanduser()
    if not path.exists():
        if ref.startswith(("/", ".", "~")):
            raise ConfigError(f"eval.model: '{ref}' does not exist")
        return None
    if model_folder(path) is None:
        raise ConfigError(f"eval.model: '{ref}' is not a model folder (config.json or model.safetensors), "
                          "a train stage folder or a checkpoint folder")
    return path.resolve()


def registry_version(ref: str, tracking_uri: str) -> tuple[str, str]:
    """`models:/name@alias` or `models:/name/version` -> (name, version) as the registry has it now."""
    from .config import ConfigError
    from mlflow.tracking import MlflowClient
    body = ref[len(REGISTRY_PREFIX):]
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        if "@" in body:
            name, alias = body.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        elif "/" in body:
            name, number = body.rsplit("/", 1)
            version = client.get_model_version(name, number)
        else:
            raise ValueError("expected models:/name@alias or models:/name/version")
    except Exception as e:  # unknown name/alias/version, unreachable server
        raise ConfigError(f"eval.model: {ref}: {str(e).strip().splitlines()[0]}") from None
    return name, str(version.version)


def eval_model_identity(cfg: SFTConfig) -> dict | None:
    """What `eval.model` is, for the evaluate fingerprint: the base model's fingerprint, the digests of a
    folder's files, the registry version an alias points at now, or a hub id. None: the trained model."""
    ref = cfg.eval.model
    if ref is None:
        return None
    if ref == "base":
        return {"base": model_fingerprint(cfg)}
    if ref.startswith(REGISTRY_PREFIX):
        name, version = registry_version(ref, cfg.resolved_tracking_uri)
        return {"registry": cfg.resolved_tracking_uri, "name": name, "version": version}
    path = _local_ref(ref)
    if path is None:
        return {"hub_id": ref}
    kind, folder = model_folder(path)
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    return {"kind": kind, "files": {str(f.relative_to(folder)): file_digest(f, cfg.artifacts_path) for f in files}}


def resolve_eval_model(cfg: SFTConfig, ref: str, dst: Path) -> dict:
    """`{"kind": hf|checkpoint|state_dict, "path": ..., "source": ...}` for the evaluate workers. `ref` is `eval.model`
    or the train stage folder; a `models:/` model is downloaded into `dst` at the version it points at now."""
    source = None
    if ref == "base":
        ref = resolve_model(cfg)
    elif ref.startswith(REGISTRY_PREFIX):
        name, version = registry_version(ref, cfg.resolved_tracking_uri)
        source = f"{REGISTRY_PREFIX}{name}/{version}"
        try:
            ref = resolve_model_ref(source, cfg.resolved_tracking_uri, dst_path=str(dst))
        except ValueError as e:
            from .config import ConfigError
            raise ConfigError(f"eval.model: {e}") from None
    path = _local_ref(ref)
    if path is None:
        return {"kind": "hf", "path": ref, "source": ref}  # a hub id
    kind, folder = model_folder(path)
    return {"kind": kind, "path": str(folder), "source": source or str(folder)}
