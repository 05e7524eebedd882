"""The user's cache folder for what sftflow builds once per machine and copies after: the migrated
MLflow (stages/tracking/sqlite_store.py) and Prefect (flows/servers/prefect_database.py) databases."""

from __future__ import annotations

import os
from pathlib import Path

__fingerprint__ = False  # where a copy comes from never changes a stage folder


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/sftflow`, else `~/.cache/sftflow` (not made here)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sftflow"
