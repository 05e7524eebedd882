"""What `data.*_paths` name: files, globs, directories, `datasets` folders, `hf:` datasets.

Shared by the config check, the plan (content digests), prepare and the builtin tokenizer,
so every one of them sees the same ordered list of inputs.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from ..errors import ConfigError

JSONL_SUFFIXES = {".jsonl", ".ndjson"}
SUFFIXES = JSONL_SUFFIXES | {".json", ".parquet", ".csv"}
HUB_PREFIX = "hf:"


def is_datasets_folder(path: Path) -> bool:
    """A folder written by `datasets`' `save_to_disk` (a Dataset or a DatasetDict)."""
    return path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json"))


def _folder_inputs(p: Path) -> list[Path]:
    # `datasets` folders inside are one input each; their own .json files are not data
    datasets = {f.parent for f in p.rglob("*.json") if is_datasets_folder(f.parent)}
    return sorted([d for d in datasets if not any(a in d.parents for a in datasets)] + [
        f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES
        and not any(part.startswith(".") for part in f.relative_to(p).parts)
        and not any(d in f.parents for d in datasets)])


def expand_paths(patterns: list[str], key: str) -> list[Path | str]:
    """Inputs named by paths, globs or directories, sorted; an empty match is an error.

    A directory means the data files under it (by suffix), unless it is a `datasets`
    save_to_disk folder, which is one input; `hf:NAME` (a hub dataset) passes through."""
    files: list[Path | str] = []
    for pattern in patterns:
        if pattern.startswith(HUB_PREFIX):
            files.append(pattern)
            continue
        p = Path(pattern).expanduser()
        if any(ch in pattern for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True)
                             if Path(m).is_file() or is_datasets_folder(Path(m)))
        elif is_datasets_folder(p):
            matches = [p]
        elif p.is_dir():
            matches = _folder_inputs(p)
            if not matches:
                raise ConfigError(f"{key}: directory '{pattern}' holds no data files ({', '.join(sorted(SUFFIXES))})")
        elif p.is_file():
            matches = [p]
        else:
            matches = []
        unsupported = [m for m in matches if m.is_file() and m.suffix.lower() not in SUFFIXES]
        if unsupported:
            raise ConfigError(f"{key}: '{unsupported[0]}' is not a data file sftflow reads "
                              f"({', '.join(sorted(SUFFIXES))}, or a `datasets` folder)")
        if not matches:
            raise ConfigError(f"{key}: '{pattern}' does not exist (cwd: {os.getcwd()}); "
                              "fix the path or run from the project root")
        files.extend(m.resolve() for m in matches)
    return files
