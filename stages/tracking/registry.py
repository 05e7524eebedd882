"""Look-ups in the MLflow model registry: what `models:/name@alias` points at, and its files."""

from __future__ import annotations

from pathlib import Path

from stages.core.errors import ConfigError

REGISTRY_PREFIX = "models:/"


def registry_version(ref: str, tracking_uri: str, key: str = "eval.model") -> tuple[str, str]:
    """`models:/name@alias` or `models:/name/version` -> (name, version) as the registry has it now."""
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
        raise ConfigError(f"{key}: {ref}: {str(e).strip().splitlines()[0]}") from None
    return name, str(version.version)


def download_model(ref: str, tracking_uri: str | None, dst_path: str | None = None) -> str:
    """The Hugging Face folder inside the logged model `ref` names, downloaded (into `dst_path` when
    given, else a temporary folder)."""
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
