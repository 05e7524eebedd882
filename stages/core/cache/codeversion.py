"""The code version of a stage: a hash of exactly the `stages` modules it runs.

Derived from the import graph, not from a hand-kept list: starting at the stage's package
(every module in it, `__main__` included, so the torchrun workers count), every `stages.*`
import (module level or inside a function) is followed. Each module is hashed as its syntax
tree without docstrings, so comments, docstrings and formatting never re-run a stage.

A module that declares `__fingerprint__ = False` only reports (MLflow logging, error
messages, the config schema whose *values* fingerprints hash anyway): it is left out, and
so is what only it imports, except for register, whose output is the MLflow record.
"""

from __future__ import annotations

import ast
import hashlib
import threading
from functools import lru_cache
from pathlib import Path

__fingerprint__ = False  # what it computes is the fingerprint's input, not a stage's output

STAGES_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "stages"

# CPython 3.11 keeps ast.parse's recursion counter per interpreter, not per thread, so two
# threads converting trees at once can fail with "AST constructor recursion depth mismatch"
# (python/cpython#106905). A Prefect worker's flow run plans in one thread while
# others run; the lock covers our own threads, the retry a parse racing someone else's.
_PARSE_LOCK = threading.RLock()  # re-entrant: a finalizer run mid-parse may plan too
_PARSE_TRIES = 5


def _parse_source(source: bytes, filename: str) -> ast.Module:
    for attempt in range(_PARSE_TRIES):
        try:
            with _PARSE_LOCK:
                return ast.parse(source, filename=filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == _PARSE_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _module_file(root: Path, dotted: str) -> Path | None:
    """`stages.a.b` -> root/a/b.py or root/a/b/__init__.py."""
    parts = dotted.split(".")[1:]
    base = root.joinpath(*parts) if parts else root
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


@lru_cache(maxsize=1024)
def _parse(path: Path, mtime_ns: int, size: int) -> tuple[str, bool, tuple[tuple[str, int, tuple[str, ...]], ...]]:
    """(normalized source, counts for fingerprints, imports as (module, level, names))."""
    tree = _parse_source(path.read_bytes(), str(path))
    counts = True
    imports = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                node.body = node.body[1:] or [ast.Pass()]
        if isinstance(node, ast.Import):
            imports += [(a.name, 0, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            imports.append((node.module or "", node.level, tuple(a.name for a in node.names)))
    for node in tree.body:
        if (isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__fingerprint__" for t in node.targets)
                and isinstance(node.value, ast.Constant) and node.value.value is False):
            counts = False
    return ast.dump(tree), counts, tuple(imports)


def _parsed(path: Path):
    st = path.stat()
    return _parse(path, st.st_mtime_ns, st.st_size)


def _dotted(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PACKAGE, *parts])


def imported_modules(root: Path, path: Path) -> set[str]:
    """The `stages.*` modules a file imports (relative imports resolved; `from pkg import mod` included)."""
    me = _dotted(root, path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for module, level, names in _parsed(path)[2]:
        if level:
            base = package.split(".")
            base = base[: len(base) - (level - 1)]
            module = ".".join([*base, module] if module else base)
        if module != PACKAGE and not module.startswith(PACKAGE + "."):
            continue
        out.add(module)
        out.update(f"{module}.{n}" for n in names if _module_file(root, f"{module}.{n}") is not None)
    return {m for m in out if _module_file(root, m) is not None}


def module_closure(entries: list[str], root: Path = STAGES_ROOT, neutral: bool = False) -> list[Path]:
    """Files of the `stages` modules reachable from `entries` (dotted, relative to `stages`);
    modules marked `__fingerprint__ = False` are skipped unless `neutral`."""
    todo = []
    for entry in entries:
        target = root.joinpath(*entry.split("."))
        todo += sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        if not neutral and not _parsed(path)[1]:
            continue
        seen.add(path)
        # a module's parent packages run on import too
        parent = path.parent
        while parent != root.parent and (parent / "__init__.py").is_file() and parent.is_relative_to(root):
            todo.append(parent / "__init__.py")
            parent = parent.parent
        todo += [_module_file(root, m) for m in imported_modules(root, path)]
    return sorted(seen)


def code_version(*entries: str, root: Path = STAGES_ROOT, neutral: bool = False) -> str:
    h = hashlib.sha256()
    for f in module_closure(list(entries), root, neutral):
        h.update(str(f.relative_to(root)).encode())
        h.update(_parsed(f)[0].encode())
    return h.hexdigest()[:16]
