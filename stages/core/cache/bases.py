"""Base models stored once, by content, for LoRA versions: a LoRA training keeps its adapter (peft's
format, with the tokenizer and generation config) and `base.json`, a reference to the model the adapter
belongs to, instead of a merged copy of the whole model.

A *node* is a folder named by the digest of its files (README.md and manifest.json left out: a model
card or a stage manifest changes no weight): either a full Hugging Face model, or an adapter folder
whose own `base.json` names its base, so a warm start's adapter (trained over a LoRA version merged)
names that version's adapter node, and a chain of days is a chain of small nodes over one base.

    base.json = {"format": 1, "base": "<node digest>", "quantize": null | {...}}

`quantize`: how the base's weights were transformed before the adapter trained on them (QLoRA's
NF4 round trip); the loader applies the same transform before merging (inference/weights.py).

Nodes live in `artifacts/bases/<digest>/` (hard links where the source is on the same file system, so
the base model under artifacts/models/ costs no second copy) and, once a version that names them is
registered, in the MLflow store (a local file store: hard links again): one run per node in the
experiment `sftflow-bases`, tagged `sftflow.base_digest`, its files under the artifact path `model`.
A registered version loads on a fresh machine from the store alone (`locate` downloads what is
missing into the user's cache).
Retention keeps a node while a kept version's chain (`sftflow.base_chain`) or a kept train folder names it.

Shipped with the registered model's code (register's code_paths): stdlib and mlflow only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

REF = "base.json"
ADAPTER_CONFIG = "adapter_config.json"
BASES = "bases"
EXPERIMENT = "sftflow-bases"
DIGEST_TAG = "sftflow.base_digest"
CHAIN_TAG = "sftflow.base_chain"   # a registered version's tag: its nodes, nearest first (retention reads it)
ARTIFACT = "model"
START_NODE = "node.json"   # beside a warm start's merged folder (models/start.py): the node it merged
_NOT_CONTENT = {"README.md", "manifest.json"}


class BaseNotFound(RuntimeError):
    """A base node named by a reference is nowhere: not local, not in the MLflow store."""


def is_adapter(folder) -> bool:
    folder = Path(folder)
    return (folder / REF).is_file() and (folder / ADAPTER_CONFIG).is_file()


def read_ref(folder) -> dict:
    """An adapter folder's `base.json`; a ValueError names the file when it is not one."""
    path = Path(folder) / REF
    try:
        ref = json.loads(path.read_text())
        if not isinstance(ref.get("base"), str) or len(ref["base"]) != 64:
            raise ValueError("no 'base' digest")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a base reference ({e})") from None
    return ref


def write_ref(folder, digest: str, quantize: dict | None) -> None:
    (Path(folder) / REF).write_text(json.dumps({"format": 1, "base": digest, "quantize": quantize}, indent=2,
                                               sort_keys=True) + "\n")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def content_files(folder) -> list[Path]:
    folder = Path(folder)
    return sorted(f for f in folder.rglob("*")
                  if f.is_file() and f.name not in _NOT_CONTENT and not any(p.startswith(".") for p in
                                                                                f.relative_to(folder).parts))


def node_digest(folder, file_digest: Callable[[Path], str] | None = None) -> str:
    """The digest of a node's content: its files' relative paths and sha256 (`file_digest`: a memoized
    one, e.g. artifacts.file_digest with the artifacts folder's memo)."""
    folder = Path(folder)
    digest = file_digest or _sha256
    listing = {str(f.relative_to(folder)): digest(f) for f in content_files(folder)}
    return hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()


def _link_tree(src: Path, dest: Path) -> None:
    for f in content_files(src):
        target = dest / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, target)
        except OSError:  # another file system
            shutil.copy2(f, target)


def store_local(root, folder, digest: str) -> Path:
    """`root/bases/<digest>/`: the node's files (hard links, else copies), put in place atomically; a node
    already there is kept as it is."""
    dest = Path(root) / BASES / digest
    if dest.is_dir():
        return dest
    tmp = dest.parent / f".{digest}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    _link_tree(Path(folder), tmp)
    try:
        os.replace(tmp, dest)
    except OSError:  # stored meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def user_bases() -> Path:
    """Where nodes downloaded from an MLflow store are kept on this machine (`~/.cache/sftflow/bases`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sftflow" / BASES


def find_run(client, digest: str):
    """The MLflow run holding node `digest` (None when the store has none)."""
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{DIGEST_TAG}` = '{digest}'",
                              max_results=1)
    return runs[0] if runs else None


def locate(digest: str, roots=(), tracking_uri: str | None = None) -> Path:
    """The local folder of node `digest`: under `roots` (artifacts folders: `<root>/bases/<digest>`) or
    the user's cache, else downloaded from the MLflow store at `tracking_uri` (default: MLflow's current
    one, which is the store a `models:/` load reads) into the user's cache."""
    for where in [Path(r) / BASES for r in roots] + [user_bases()]:
        if (where / digest).is_dir():
            return where / digest
    try:
        import mlflow
        from mlflow.tracking import MlflowClient
        client = MlflowClient(tracking_uri or mlflow.get_tracking_uri())
        run = find_run(client, digest)
    except Exception as e:  # noqa: BLE001 - no store, unreachable server
        raise BaseNotFound(f"base model {digest[:12]}: not stored locally and the MLflow store can't be asked "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if run is None:
        raise BaseNotFound(f"base model {digest[:12]}: not stored locally nor in the MLflow store "
                           f"{client.tracking_uri} (experiment {EXPERIMENT})")
    dest = user_bases() / digest
    tmp = dest.parent / f".{digest}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    local = Path(client.download_artifacts(run.info.run_id, ARTIFACT, str(tmp)))
    if node_digest(local) != digest:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BaseNotFound(f"base model {digest[:12]}: the MLflow run {run.info.run_id} holds other files")
    try:
        os.replace(local, dest)
    except OSError:  # downloaded meanwhile by another process
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    return dest


def chain(folder, roots=(), tracking_uri: str | None = None) -> list[str]:
    """The digests of the nodes an adapter folder stands on, nearest first (its base, that base's base...)."""
    out = []
    while is_adapter(folder):
        digest = read_ref(folder)["base"]
        if digest in out:
            raise ValueError(f"{folder}: its base chain loops at {digest[:12]}")
        out.append(digest)
        folder = locate(digest, roots, tracking_uri)
    return out


def local_chain(root, digest: str) -> list[str]:
    """`digest` and the nodes under it that `root/bases/` holds (retention: no download, no store)."""
    out = []
    while digest and digest not in out:
        out.append(digest)
        folder = Path(root) / BASES / digest
        try:
            digest = read_ref(folder)["base"] if is_adapter(folder) else ""
        except ValueError:
            digest = ""
    return out


def _local_artifacts(uri: str) -> Path | None:
    """A run's artifact folder when the store keeps artifacts as local files, else None."""
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse
        return Path(unquote(urlparse(uri).path))
    return Path(uri) if uri.startswith("/") else None


def publish(client, digest: str, roots=(), artifact_location: str | None = None) -> list[str]:
    """Logs node `digest` and every node under it to the MLflow store, each once (a run already tagged
    with its digest is reused). Returns the chain, nearest first. `artifact_location`: the experiment's,
    when it is created (a SQLite store keeps its artifacts beside it, not under the working directory)."""
    out = []
    while digest:
        out.append(digest)
        folder = locate(digest, roots, client.tracking_uri)
        if find_run(client, digest) is None:
            exp = client.get_experiment_by_name(EXPERIMENT)
            exp_id = (exp.experiment_id if exp is not None
                      else client.create_experiment(EXPERIMENT, artifact_location=artifact_location))
            kind = "adapter" if is_adapter(folder) else "model"
            run = client.create_run(exp_id, run_name=f"sftflow base {digest[:12]}",
                                    tags={DIGEST_TAG: digest, "sftflow.base_kind": kind,
                                          "mlflow.note.content": "A base that registered LoRA versions name by "
                                                                 "content (stages/core/cache/bases.py); kept by "
                                                                 "retention while a kept version names it."})
            local = _local_artifacts(run.info.artifact_uri)
            if local is not None:  # a file store: hard links where it shares the file system (no second copy)
                _link_tree(folder, local / ARTIFACT)
            else:
                import tempfile
                with tempfile.TemporaryDirectory() as scratch:
                    _link_tree(folder, Path(scratch) / ARTIFACT)  # its content files only
                    client.log_artifacts(run.info.run_id, str(Path(scratch) / ARTIFACT), ARTIFACT)
            client.set_terminated(run.info.run_id)
        digest = read_ref(folder)["base"] if is_adapter(folder) else ""
    return out


def base_of_training(model_path: str, root, file_digest: Callable[[Path], str] | None = None) -> str:
    """The node digest of the weights a LoRA training started from, stored under `root/bases/`: a warm
    start's merged folder names the node it merged (`START_NODE` beside it, stored by models/start.py);
    a model folder (or a hub id's cached snapshot) is digested and linked in."""
    path = Path(model_path)
    marker = path.parent / START_NODE
    if marker.is_file():
        return json.loads(marker.read_text())["digest"]
    if not path.is_dir():
        from huggingface_hub import snapshot_download
        path = Path(snapshot_download(str(model_path), local_files_only=True))
    digest = node_digest(path, file_digest)
    store_local(root, path, digest)
    return digest
