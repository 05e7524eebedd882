"""Code named by the config as 'pkg.module:name' (`actor.worker`, `eval.scorer`).

Configs that name code run that code: treat a config like a script (docs/config.md).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from typing import Any

from ..errors import ConfigError


def is_import_path(text: str) -> bool:
    module, _, name = text.partition(":")
    return bool(module and name)


def import_object(path: str, key: str) -> Any:
    """The object 'pkg.module:name' names; a ConfigError naming `key` when it can't be imported."""
    if not is_import_path(path):
        raise ConfigError(f"{key}='{path}' must look like 'pkg.module:name'")
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}='{path}': cannot import ({e})") from None


def import_identity(path: str | None) -> str | None:
    """For fingerprints: 'pkg.module:name@<sha256 of the module's source>' (the name alone when the
    source can't be found), so editing a custom worker or scorer re-runs the stages that use it."""
    if not path:
        return None
    try:
        spec = importlib.util.find_spec(path.partition(":")[0])
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not spec.has_location:
        return path
    with open(spec.origin, "rb") as f:
        return f"{path}@{hashlib.sha256(f.read()).hexdigest()[:16]}"
