"""What a model reference names: `base`, a Hugging Face folder, a train stage folder, a DCP
checkpoint, a plain state dict, `models:/name@alias`, or a hub id (`eval.model`,
`sftflow chat -m`)."""

from __future__ import annotations

from pathlib import Path

from stages.core.cache.artifacts import file_digest
from stages.core.cache.bases import is_adapter
from stages.core.config import SFTConfig
from stages.core.errors import ConfigError
from stages.tracking.registry import REGISTRY_PREFIX, download_model, registry_version


def resolve_model_ref(ref: str, tracking_uri: str | None = None, dst_path: str | None = None) -> str:
    """A train stage folder, a Hugging Face folder or hub id, or `models:/name@alias|version` -> loadable path."""
    if ref.startswith(REGISTRY_PREFIX):
        return download_model(ref, tracking_uri, dst_path)
    path = Path(ref).expanduser()
    if (path / "model" / "config.json").is_file():  # a train stage folder
        return str(path / "model")
    if is_adapter(path / "adapter"):  # a LoRA train stage folder
        return str(path / "adapter")
    if path.is_dir() and not (path / "config.json").is_file() and not is_adapter(path):
        raise ValueError(f"{ref}: neither a model folder (no config.json), a LoRA adapter folder (base.json) "
                         "nor a train stage folder")
    return str(path) if path.is_dir() else ref


def model_folder(path: Path) -> tuple[str, Path] | None:
    """What a local folder holds: ("hf", it) a Hugging Face model, ("adapter", it) a LoRA adapter with its
    base reference (base.json), ("checkpoint", it) a DCP training checkpoint, ("state_dict", it) a non-HF
    export (model.safetensors); a train stage folder means its model/ (LoRA: its adapter/)."""
    if (path / "config.json").is_file():
        return "hf", path
    if is_adapter(path):
        return "adapter", path
    if (path / "COMPLETE").is_file() or (path / ".metadata").is_file():
        return "checkpoint", path
    if (path / "model.safetensors").is_file():
        return "state_dict", path
    if (path / "model").is_dir():
        return model_folder(path / "model")
    if is_adapter(path / "adapter"):
        return "adapter", path / "adapter"
    return None


def _local_ref(ref: str) -> Path | None:
    """The folder `ref` names, or None for a hub id; a path-looking ref that is not a model is an error."""
    path = Path(ref).expanduser()
    if not path.exists():
        if ref.startswith(("/", ".", "~")):
            raise ConfigError(f"eval.model: '{ref}' does not exist")
        return None
    if model_folder(path) is None:
        raise ConfigError(f"eval.model: '{ref}' is not a model folder (config.json or model.safetensors), "
                          "a train stage folder or a checkpoint folder")
    return path.resolve()


def eval_model_identity(cfg: SFTConfig, base_fp: str) -> dict | None:
    """What `eval.model` is, for the evaluate fingerprint: the base model's fingerprint, the digests of a
    folder's files, the registry version an alias points at now, or a hub id. None: the trained model."""
    ref = cfg.eval.model
    if ref is None:
        return None
    if ref == "base":
        return {"base": base_fp}
    if ref.startswith(REGISTRY_PREFIX):
        name, version = registry_version(ref, cfg.resolved_tracking_uri)
        return {"registry": cfg.resolved_tracking_uri, "name": name, "version": version}
    path = _local_ref(ref)
    if path is None:
        return {"hub_id": ref}
    kind, folder = model_folder(path)
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    return {"kind": kind, "files": {str(f.relative_to(folder)): file_digest(f, cfg.artifacts_path) for f in files}}


def resolve_eval_model(cfg: SFTConfig, ref: str, dst: Path, base_model: str, identity: dict | None = None) -> dict:
    """`{"kind": hf|checkpoint|state_dict, "path": ..., "source": ...}` for the evaluate workers. `ref` is
    `eval.model`, the train stage folder or `base_model`; a `models:/` model is downloaded into `dst` at
    the version the plan saw (`identity`), so what is scored is what the fingerprint names."""
    source = None
    if ref == "base":
        ref = base_model
    elif ref.startswith(REGISTRY_PREFIX):
        if identity and "version" in identity:
            name, version = identity["name"], identity["version"]
        else:
            name, version = registry_version(ref, cfg.resolved_tracking_uri)
        source = f"{REGISTRY_PREFIX}{name}/{version}"
        try:
            ref = download_model(source, cfg.resolved_tracking_uri, dst_path=str(dst))
        except ValueError as e:
            raise ConfigError(f"eval.model: {e}") from None
    path = _local_ref(ref)
    if path is None:
        return {"kind": "hf", "path": ref, "source": ref}  # a hub id
    kind, folder = model_folder(path)
    return {"kind": kind, "path": str(folder), "source": source or str(folder)}
