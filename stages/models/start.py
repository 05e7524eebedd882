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

from stages.core.cache.artifacts import canonical_json, file_digest, input_digest
from stages.core.cache.bases import is_adapter
from stages.core.config import SFTConfig
from stages.core.errors import ConfigError
from stages.core.cache.lineage_paths import locate
from stages.tracking.registry import REGISTRY_PREFIX, current_champion, download_model, version_tags

from .refs import model_folder

KEY = "actor.init_from"


def _folder_start(cfg: SFTConfig, ref: str) -> dict:
    path = Path(ref).expanduser()
    found = model_folder(path) if path.is_dir() else None
    if found is None or found[0] not in ("hf", "adapter"):
        raise ConfigError(f"{KEY}: '{ref}' is not a Hugging Face model folder (config.json), a LoRA adapter folder "
                          "(base.json) or a train stage folder with model/ or adapter/; base, champion and "
                          "models:/name/N are the other choices")
    folder = found[1].resolve()
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    return {"ref": str(folder), "parent_version": None, "note": f"starting from {folder}",
            "identity": {"files": {str(f.relative_to(folder)): file_digest(f, cfg.artifacts_path) for f in files}}}


def _version_start(cfg: SFTConfig, name: str, version: str, tags: dict, model_fp: str) -> dict:
    base = tags.get("models_fingerprint")
    if base and base != model_fp:
        corpus = cfg.actor.model.corpus_paths
        learned = [e["ref"] for e in json.loads(tags.get("trained_on") or "[]") if e.get("source") == "train"]
        built = (f"actor.model.corpus_paths={corpus}, not the corpus v{version}'s base model was built from" if corpus
                 else f"data.train_data_paths={cfg.data.train_data_paths} (actor.model.corpus_paths is unset), "
                      "which changes with each new file")
        hint = f", e.g. {learned[:1]}" if learned else ""
        raise ConfigError(
            f"{KEY}={cfg.actor.init_from}: {name} v{version} was trained from another base model (fingerprint "
            f"{base[:12]}, this config's is {model_fp[:12]}), so its vocabulary need not match this data's tokens; "
            f"a builtin model's tokenizer is built from {built}: set actor.model.corpus_paths to the files "
            f"v{version}'s tokenizer was built from{hint}")
    identity = {"registry": cfg.resolved_tracking_uri, "name": name, "version": str(version),
                "train_fingerprint": tags.get("train_fingerprint", "")}
    parent = str(version) if name == cfg.registry.model_name else None
    return {"ref": f"{REGISTRY_PREFIX}{name}/{version}", "identity": identity, "parent_version": parent,
            "own_start": tags.get("start", ""), "note": f"starting from {name} v{version}",
            "trained_on": tags.get("trained_on", ""), "rehearsed": tags.get("rehearsed", "")}


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
    `train_fingerprint(start or None)` is train's fingerprint from a start (what its version rehearsed is
    what it would rehearse: the `trained_on` of the parent as that version's training saw it)."""
    own = start.get("own_start")
    if own is None:
        return start
    parent = json.loads(own) if own else None
    if parent is not None:
        parent["trained_on"] = start.get("rehearsed", "")
    if train_fingerprint(parent) != start["identity"]["train_fingerprint"]:
        return start
    return parent and {**parent, "note": f"starting from {parent['ref']}"}


def rehearsal(cfg: SFTConfig, start: dict | None, train: list[tuple[str, str]],
              others: set[str]) -> tuple[list[dict], list[tuple[str, str]]] | None:
    """A warm start's rehearsal: (the `rehearse` source's files, the train inputs that start's version has
    not trained on), or None when nothing is rehearsed: `data.rehearsal.weight` 0, a start that names no
    training (the base model, a folder, a version registered before versions recorded it), or train files
    that version has all trained on already (then they train as configured). `train`: (ref, digest) of
    data.train_data_paths; `others`: digests of the other sources' files, which stay theirs. A file the
    version trained on that is gone or changed is a ConfigError naming it."""
    if start is None or cfg.data.rehearsal.weight == 0 or not start.get("trained_on"):
        return None
    learned = json.loads(start["trained_on"])
    seen = {e["digest"] for e in learned}
    new = [(ref, d) for ref, d in train if d not in seen]
    if not new:
        return None
    entries, kept = [], set(others)
    for e in learned:
        if e["digest"] in kept:
            continue
        kept.add(e["digest"])
        ref = locate(e["ref"], e["digest"], cfg.artifacts_path)
        if not ref.startswith("hf:"):
            path = Path(ref)
            now = input_digest(path, cfg.artifacts_path) if path.exists() else None
            if now != e["digest"]:
                what = "is gone" if now is None else "has changed since"
                raise ConfigError(
                    f"data.rehearsal: {start['ref']} trained on {e['ref']}, which {what}; put that file back, or set "
                    "data.rehearsal.weight=0 to train on the new data alone")
        entries.append({"ref": ref, **{k: e.get(k) for k in ("digest", "format", "columns")}})
    return entries, new


def start_tag(start: dict | None) -> str:
    """What a registered version records of where its training started (the version tag `start`):
    "" for the base model; planning reads it back (`caught_up`)."""
    if start is None:
        return ""
    return canonical_json({k: start[k] for k in ("ref", "identity", "parent_version")})


def start_folder(cfg: SFTConfig, start: dict, on_line: Callable[[str], None] = print) -> str:
    """The folder training starts from: a folder as it is; a registry version downloaded once into
    artifacts/models/start/<identity digest>/ (atomically: a crash leaves no half folder). A LoRA version
    is its adapter folder (base.json): the train call merges it (`inference.weights.merged_start`)."""
    if not start["ref"].startswith(REGISTRY_PREFIX):
        return start["ref"]
    import hashlib
    key = hashlib.sha256(canonical_json(start["identity"]).encode()).hexdigest()[:16]
    dest = cfg.artifacts_path / "models" / "start" / key
    done = dest / "model"
    if (done / "config.json").is_file() or is_adapter(done):
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
