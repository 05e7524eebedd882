"""The weights training starts from (`actor.init_from`): what the plan fingerprints, and the folder
the train stage loads.

`base` is the base model (nothing is added to train's fingerprint, so configs that never set the
key keep their fingerprints). Anything else becomes a `start`:

    {"ref": what to load ("models:/name/N" or a local folder),
     "identity": what train's fingerprint holds (a registry version with the training it holds, or
                 a folder's file digests: content, not its path),
     "parent_version": the version number when it is a version of this config's registered model,
     "note": one line for `sftflow show` and the run's description}

`champion` is the champion when planning, or the base model while the registry has none (a
retraining loop's first day). A champion that this same training already produced (its version's
own start, fed to the same fingerprint, gives the champion's training again) is "caught up": the
plan keeps that start, so an unchanged retrain is a cache hit instead of a new model trained on
the same data from its own result every day.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from stages.core.artifacts import canonical_json, file_digest
from stages.core.config import SFTConfig
from stages.core.errors import ConfigError
from stages.tracking.registry import REGISTRY_PREFIX, current_champion, download_model, version_tags

from .refs import model_folder

KEY = "actor.init_from"


def _folder_start(cfg: SFTConfig, ref: str) -> dict:
    path = Path(ref).expanduser()
    found = model_folder(path) if path.is_dir() else None
    if found is None or found[0] != "hf":
        raise ConfigError(f"{KEY}: '{ref}' is not a Hugging Face model folder (config.json) or a train stage folder "
                          "with model/; base, champion and models:/name/N are the other choices")
    folder = found[1].resolve()
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    return {"ref": str(folder), "parent_version": None, "note": f"starting from {folder}",
            "identity": {"files": {str(f.relative_to(folder)): file_digest(f, cfg.artifacts_path) for f in files}}}


def _version_start(cfg: SFTConfig, name: str, version: str, tags: dict, model_fp: str) -> dict:
    base = tags.get("models_fingerprint")
    if base and base != model_fp:
        raise ConfigError(
            f"{KEY}={cfg.actor.init_from}: {name} v{version} was trained from another base model (fingerprint "
            f"{base[:12]}, this config's is {model_fp[:12]}), so its vocabulary need not match this data's tokens; "
            "a builtin model's tokenizer is built from data.train_data_paths unless actor.model.corpus_paths pins it")
    identity = {"registry": cfg.resolved_tracking_uri, "name": name, "version": str(version),
                "train_fingerprint": tags.get("train_fingerprint", "")}
    parent = str(version) if name == cfg.registry.model_name else None
    return {"ref": f"{REGISTRY_PREFIX}{name}/{version}", "identity": identity, "parent_version": parent,
            "own_start": tags.get("start", ""), "note": f"starting from {name} v{version}"}


def resolve_start(cfg: SFTConfig, model_fp: str) -> tuple[dict | None, str | None]:
    """(the start, or None for the base model; a note when `champion` falls back to the base model).
    A ConfigError names `actor.init_from` when what it names can't be found, or is a version trained
    from another base model than `model_fp` (the plan's)."""
    ref = cfg.actor.init_from
    if ref == "base":
        return None, None
    if ref == "champion":
        champ = current_champion(cfg.resolved_tracking_uri, cfg.registry.model_name)
        if champ is None:
            return None, f"{KEY}=champion: no champion yet, so training starts from the base model"
        return _version_start(cfg, champ["name"], champ["version"], champ, model_fp), None
    if ref.startswith(REGISTRY_PREFIX):
        from stages.tracking.registry import registry_version
        name, version = registry_version(ref, cfg.resolved_tracking_uri, KEY)
        return _version_start(cfg, name, version, version_tags(cfg.resolved_tracking_uri, name, version),
                              model_fp), None
    return _folder_start(cfg, ref), None


def caught_up(start: dict, train_fingerprint: Callable[[dict | None], str]) -> dict | None:
    """The start to plan with when `start` is a version whose own training is this one: its own start
    (None: the base model), so the plan names that version's training; else `start` unchanged.
    `train_fingerprint(identity or None)` is train's fingerprint from a start identity."""
    own = start.get("own_start")
    if own is None:
        return start
    parent = json.loads(own) if own else None
    if train_fingerprint(parent and parent.get("identity")) != start["identity"]["train_fingerprint"]:
        return start
    return parent and {**parent, "note": f"starting from {parent['ref']}"}


def start_tag(start: dict | None) -> str:
    """What a registered version records of where its training started (the version tag `start`):
    "" for the base model; planning reads it back (`caught_up`)."""
    if start is None:
        return ""
    return canonical_json({k: start[k] for k in ("ref", "identity", "parent_version")})


def start_folder(cfg: SFTConfig, start: dict, on_line: Callable[[str], None] = print) -> str:
    """The Hugging Face folder training loads: a folder as it is; a registry version downloaded once into
    artifacts/models/start/<identity digest>/ (atomically: a crash leaves no half folder)."""
    if not start["ref"].startswith(REGISTRY_PREFIX):
        return start["ref"]
    import hashlib
    key = hashlib.sha256(canonical_json(start["identity"]).encode()).hexdigest()[:16]
    dest = cfg.artifacts_path / "models" / "start" / key
    done = dest / "model"
    if (done / "config.json").is_file():
        return str(done)
    tmp = dest.parent / f".{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    on_line(f"train: downloading {start['ref']} to start from")
    try:
        found = Path(download_model(start["ref"], cfg.resolved_tracking_uri, str(tmp / "download")))
    except ValueError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"{KEY}: {e}") from None
    os.replace(found, tmp / "model")
    shutil.rmtree(tmp / "download", ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, dest)
    except OSError:  # another run downloaded it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return str(done)
