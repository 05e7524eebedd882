"""Fingerprinted stage folders.

A stage's output lives in `<artifacts>/<stage>/<fingerprint>/`. The fingerprint hashes the
stage name, the stage's code version, the config slice it reads, upstream fingerprints and
the *contents* of its input files. The folder is built under `.<fingerprint>.partial/` and
renamed into place after `manifest.json` is written, so a folder with a manifest is
complete by construction, and a half-written one is never mistaken for a result.
"""

from __future__ import annotations

import codecs
import contextvars
import hashlib
import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock, Timeout

from ..errors import DataError
from .inputs import HUB_PREFIX

MANIFEST = "manifest.json"


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# Digest memos found while planning, written only once the plan is valid: a config that fails
# validation leaves nothing behind (`deferred_digest_memos`).
_PENDING_MEMOS: contextvars.ContextVar[list | None] = contextvars.ContextVar("pending_memos", default=None)


@contextmanager
def deferred_digest_memos() -> Iterator[None]:
    """Inside: `file_digest` keeps new memos in memory; they are written when the block ends without
    an error, and dropped otherwise."""
    token = _PENDING_MEMOS.set([])
    try:
        yield
        for memo, digest in _PENDING_MEMOS.get():
            _write_memo(memo, digest)
    finally:
        _PENDING_MEMOS.reset(token)


def _write_memo(memo: Path, digest: str) -> None:
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(digest)
    os.replace(tmp, memo)


def file_digest(path: Path, index_dir: Path | None = None) -> str:
    """sha256 of a file's bytes, remembered per (path, inode, size, mtime, ctime) so unchanged files are
    not re-read. The ctime is what makes the memo safe: `cp -p`, `rsync -t` or `tar x` can set a file's
    mtime back to an old value, but any write sets its ctime to now, and no user tool can set it back.
    A CSV file is also checked to be UTF-8 on this one read (a bad byte fails the whole file, so it is
    a DataError here, at planning, rather than once a run has started)."""
    path = Path(path).resolve()
    st = path.stat()
    key = sha256_text(f"{path}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}")
    memo = (index_dir / "digests" / key) if index_dir else None
    if memo is not None and memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    utf8 = codecs.getincrementaldecoder("utf-8")() if path.suffix.lower() == ".csv" else None
    offset = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            if utf8 is not None:
                _check_utf8(utf8, chunk, offset, path)
            offset += len(chunk)
    if utf8 is not None:
        _check_utf8(utf8, b"", offset, path, final=True)
    digest = h.hexdigest()
    if memo is not None:
        pending = _PENDING_MEMOS.get()
        if pending is not None:
            pending.append((memo, digest))
        else:
            _write_memo(memo, digest)
    return digest


def _check_utf8(decoder, chunk: bytes, offset: int, path: Path, final: bool = False) -> None:
    try:
        decoder.decode(chunk, final)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 ({e.reason} at byte {offset + e.start}); "
                        "re-encode the file as UTF-8") from None


def input_digest(ref: Path | str, index_dir: Path | None = None) -> str:
    """Content digest of one input: a file, a folder (every file in it), or `hf:NAME` (its hub revision)."""
    if isinstance(ref, str) and ref.startswith(HUB_PREFIX):
        return hub_revision(ref)
    path = Path(ref)
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file())
        return sha256_text(canonical_json({str(f.relative_to(path)): file_digest(f, index_dir) for f in files}))
    return file_digest(path, index_dir)


def hub_revision(ref: str) -> str:
    """`hf:NAME[:split]` -> the dataset's current commit on the hub (network); offline, the name alone."""
    name = ref[len(HUB_PREFIX):].partition(":")[0]
    try:
        from huggingface_hub import HfApi
        return f"{ref}@{HfApi().dataset_info(name).sha}"
    except Exception:  # noqa: BLE001 - offline or unknown: the cache can't see hub edits, so say so in the key
        return f"{ref}@unresolved"


def fingerprint(stage: str, **parts: Any) -> str:
    return sha256_text(canonical_json({"stage": stage, **parts}))[:16]


@dataclass
class StageResult:
    """What a stage hands downstream: small, JSON-serializable, no tensors."""

    stage: str
    fingerprint: str
    path: str
    metrics: dict[str, Any] = field(default_factory=dict)
    cached: bool = False
    seconds: float = 0.0  # its work: what it `waited` for the machine's cores is left out
    waited: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def stage_dir(root: Path, stage: str, fp: str) -> Path:
    return Path(root) / stage / fp


def is_complete(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def read_manifest(folder: Path) -> dict[str, Any]:
    return json.loads((Path(folder) / MANIFEST).read_text())


def _file_sizes(folder: Path) -> dict[str, int]:
    return {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*"))
            if f.is_file() and f.name not in (MANIFEST, MANIFEST + ".tmp")}


def partial_dir(root: Path, stage: str, fp: str) -> Path:
    """Where a stage folder is built (and where train's checkpoints wait for a resume)."""
    return Path(root) / stage / f".{fp}.partial"


def _checked_manifest(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) for a sound complete folder, else (None, what is wrong): the manifest must
    parse and every file it lists must exist with the size it recorded (sizes, not contents)."""
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as e:
        return None, f"{MANIFEST} can't be read ({type(e).__name__})"
    for name, size in (manifest.get("files") or {}).items():
        path = folder / name
        if not path.is_file():
            return None, f"{name} is missing"
        if path.stat().st_size != size:
            return None, f"{name} has {path.stat().st_size} bytes, the manifest recorded {size}"
    return manifest, None


def damage(folder: Path) -> str | None:
    """What is wrong with a complete stage folder, or None."""
    return _checked_manifest(Path(folder))[1]


def cached_result(root: Path, stage: str, fp: str, warn=print) -> StageResult | None:
    """The complete folder's result; a damaged one is reported (`warn`) and becomes the stage's
    partial folder again, so the stage rebuilds it (train resumes from its checkpoints)."""
    folder = stage_dir(root, stage, fp)
    if not is_complete(folder):
        return None
    manifest, problem = _checked_manifest(folder)
    if problem is not None:
        warn(f"{stage}: the stage folder {folder} is damaged ({problem}); rebuilding it")
        partial = partial_dir(root, stage, fp)
        if partial.exists():
            shutil.rmtree(partial)
        os.replace(folder, partial)
        (partial / MANIFEST).unlink(missing_ok=True)
        return None
    return StageResult(stage, fp, str(folder), manifest.get("metrics", {}), cached=True)


@contextmanager
def stage_lock(root: Path, stage: str, fp: str, warn=None) -> Iterator[None]:
    """Serializes work on one fingerprint: a second caller waits (saying so through `warn`), then
    finds the result."""
    lock_path = Path(root) / stage / f".{fp}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if warn is not None:
            warn(f"{stage}: another run is building {stage_dir(root, stage, fp)}; waiting for it to finish")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


WAITED = "waited_for_cores_seconds"  # a manifest's time queued for the machine's cores (core/machine/cores.py)


class StageBuild:
    """The folder a stage is writing. `partial` survives a crash (train resumes from it)."""

    def __init__(self, root: Path, stage: str, fp: str, keep_partial: bool = False):
        self.stage, self.fingerprint = stage, fp
        self.final = stage_dir(root, stage, fp)
        self.partial = partial_dir(root, stage, fp)
        if self.partial.exists() and not keep_partial:
            shutil.rmtree(self.partial)
        self.partial.mkdir(parents=True, exist_ok=True)
        self.started = time.time()

    def commit(self, manifest: dict[str, Any], waited: float = 0.0) -> Path:
        """`waited`: seconds the stage queued for the machine's cores, kept out of its `seconds` (its work)."""
        manifest = {
            "stage": self.stage,
            "fingerprint": self.fingerprint,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(max(0.0, time.time() - self.started - waited), 3),
            **({WAITED: round(waited, 3)} if waited else {}),
            **manifest,
            "files": _file_sizes(self.partial),  # what `damage` checks when the folder is reused
        }
        tmp = self.partial / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        os.replace(tmp, self.partial / MANIFEST)
        if self.final.exists():  # --force: swap the old result out only once the new one is whole
            trash = self.final.parent / f".{self.fingerprint}.old.{os.getpid()}"
            os.replace(self.final, trash)
            os.replace(self.partial, self.final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.partial, self.final)
        return self.final


def remove_tree(path: Path) -> None:
    """Deletes a folder whole: renamed aside first (`.<name>.<pid>.<random>.trash`), so that no reader
    ever sees it half-deleted under its name; gone already is fine."""
    trash = path.parent / f".{path.name.lstrip('.')}.{os.getpid()}.{uuid.uuid4().hex[:8]}.trash"
    try:
        os.replace(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
