"""Paths a registered version's lineage names (`sftflow.trained_on`, `sftflow.rehearsed`), stored relative to
the project (the folder sftflow runs in, as the config's own relative paths are), so a project moved or
cloned elsewhere continues from its champion. Lineage written before held absolute paths: one that still
exists is read as it is; one that is gone is found again under the project by its trailing path parts and
its content digest (the same file, wherever the project now is)."""

from __future__ import annotations

from pathlib import Path

from .artifacts import input_digest
from .inputs import HUB_PREFIX


def project_ref(ref: str, root: Path | None = None) -> str:
    """`ref` as lineage stores it: relative to the project when inside it; a hub dataset or a file outside
    the project (shared data, another disk) stays as it is."""
    if ref.startswith(HUB_PREFIX):
        return ref
    root = (root or Path.cwd()).resolve()
    path = Path(ref)
    if not path.is_absolute():
        return ref
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return ref


def locate(ref: str, digest: str | None, index_dir: Path | None = None, root: Path | None = None) -> str:
    """The absolute path a lineage `ref` names here: a relative one under the project; an absolute one that
    is gone, the file under the project with the same trailing parts and the same content (`digest`), the
    longest such tail first; else `ref` unchanged (the caller says it is gone)."""
    if ref.startswith(HUB_PREFIX):
        return ref
    root = (root or Path.cwd()).resolve()
    path = Path(ref)
    if not path.is_absolute():
        return str(root / path)
    if path.exists() or digest is None:
        return ref
    parts = path.parts[1:]
    for i in range(len(parts)):
        candidate = root.joinpath(*parts[i:])
        if candidate.exists() and input_digest(candidate, index_dir) == digest:
            return str(candidate)
    return ref
