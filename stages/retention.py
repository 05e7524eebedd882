"""Retention: what a month of retraining keeps of `artifacts_dir`, and what it drops (`sftflow gc`,
and after every flow run with `retention.auto`; docs/operations.md, "A month of retraining: the disk").

Kept:
  - every registered version an alias points at (champion, challenger) and the `retention.keep_versions`
    newest, with every stage folder their lineage names (the `sftflow.<stage>_fingerprint` tags of the
    version and of its MLflow run: replay, prepare, prepare_eval, train, baseline, champion, evaluate,
    register), and the prepare pieces those prepare folders were assembled from;
  - every version of the store's other registered models with its lineage (configs sharing one
    artifacts folder: their keep rules are theirs, so all their versions count as kept);
  - the folders of the plan given as `protect` (the run that just finished, the config `gc` was given):
    what the next run reuses;
  - every stage folder used in the last `retention.keep_days` days (its mtime: the policy after a flow
    run marks the folders that run made or reused, `collect(used=True)`);
  - the base model (artifacts/models/<fp>/), digest memos, MLflow's store.
Dropped:
  - older versions: removed from the registry with their logged model's files (their run stays, with
    its metrics, eval tables and manifests);
  - with `retention.drop_checkpoints`, a complete training's checkpoints (it finished and exported
    `model/`): its manifest is rewritten without them, so the folder stays a sound cache hit;
  - other stage folders, reference-set pieces and partial folders unused for `keep_days`;
  - prepare pieces no kept prepare folder uses;
  - artifacts/models/start/*: copies of registered versions training started from (MLflow holds them;
    `start_folder` downloads one again when a run needs it).
Never: a folder whose stage lock a running flow holds (the lock is taken without waiting, and the
folder skipped when it is held), nor a version the registry's aliases point at. Anything dropped is
recomputed by the run that needs it, byte-identical (fingerprints name inputs, not history).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from .core.cache import bases
from .core.cache.artifacts import MANIFEST, is_complete, remove_tree
from .core.config import SFTConfig
from .graph import STAGES
from .tracking.registry import human_bytes
from .tracking.run import TAG, reachable

DAY = 86400.0
PIECES = "prepare_pieces"  # stages/prepare/pieces.py's PIECES_DIR: the layout, not its code
PIECE_MANIFEST = "piece.json"
START_COPIES = ("models", "start")  # stages/models/start.py's start_folder


@dataclass
class Drop:
    """One thing the policy frees: `path` (a folder), its bytes, why, and the lock a running flow
    would hold on it (`locks`: lock files; `busy`: stages any of whose locks, when held, keep it)."""

    path: Path
    size: int
    why: str
    locks: tuple[Path, ...] = ()
    busy: tuple[str, ...] = ()
    checkpoints_of: Path | None = None  # a train folder whose checkpoints these are (its manifest is rewritten)
    version: tuple[str, str] | None = None  # (model name, version) to remove from the registry first
    base_run: str | None = None  # an MLflow run holding a base node (core/cache/bases.py), deleted with its files
    done: bool = False  # freed (by `apply`)


@dataclass
class Report:
    drops: list[Drop] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # a kept stage folder -> why
    versions: list[str] = field(default_factory=list)  # the registered versions kept, with why
    freed: int = 0
    skipped: list[str] = field(default_factory=list)  # what a running flow held
    applied: bool = False

    @property
    def to_free(self) -> int:
        return sum(d.size for d in self.drops)

    def lines(self, root: Path) -> list[str]:
        out = [f"keep {v}" for v in self.versions]
        for d in self.drops:
            if d.done or not self.applied:
                out.append(f"{'freed' if d.done else 'free'} {human(d.size):>9}  {_rel(d.path, root)}: {d.why}")
        out += [f"skip {s}" for s in self.skipped]
        return out


def human(n: float) -> str:
    return human_bytes(n)


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def disk_usage(path: Path) -> int:
    """Bytes of every file under `path` (links not followed)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass  # deleted meanwhile
    return total


# --------------------------------------------------------------------------- the registry


def _client(cfg: SFTConfig):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=cfg.resolved_tracking_uri)


def _has_store(cfg: SFTConfig) -> bool:
    uri = cfg.resolved_tracking_uri
    return not uri.startswith("sqlite:///") or Path(uri.removeprefix("sqlite:///")).is_file()


def registered(cfg: SFTConfig) -> list:
    """Every version of the config's registered model, newest first ([] when none or no store). A
    tracking server that does not answer is an OSError in seconds (MLflow's client retries for minutes)."""
    if not _has_store(cfg):
        return []
    if not cfg.resolved_tracking_uri.startswith("sqlite:///"):
        reachable(cfg.resolved_tracking_uri)
    try:
        versions = _client(cfg).search_model_versions(f"name = '{cfg.registry.model_name}'")
    except Exception:  # noqa: BLE001 - no such model yet: nothing registered
        return []
    return sorted(versions, key=lambda v: -int(v.version))


def _all_versions(client) -> list:
    """Every version of every registered model in the store (a search without a filter, page by page)."""
    out, token = [], None
    while True:
        page = client.search_model_versions(max_results=1000, page_token=token)
        out += list(page)
        token = page.token
        if not token:
            return out


def others_versions(cfg: SFTConfig, client) -> list:
    """The versions of the store's other registered models: their folders share `artifacts_dir` (two configs,
    one folder) and their keep rules are their configs', which this one does not know, so every one of
    them is kept with its lineage; only that model's own gc removes its versions."""
    try:
        found = _all_versions(client)
    except Exception:  # noqa: BLE001 - a store without a registry yet: no other model
        return []
    return sorted((v for v in found if v.name != cfg.registry.model_name), key=lambda v: (v.name, -int(v.version)))


def lineage(client, version) -> dict[str, str]:
    """stage -> the fingerprint of its folder in a version's lineage: its own tags and its run's."""
    tags = dict(version.tags)
    if version.run_id:
        try:
            tags = {**client.get_run(version.run_id).data.tags, **tags}
        except Exception:  # noqa: BLE001 - the run was deleted: the version's own tags still name its folders
            pass
    return {s: tags[f"{TAG}{s}_fingerprint"] for s in STAGES if tags.get(f"{TAG}{s}_fingerprint")}


def _model_id(version) -> str | None:
    """The logged model a version holds: MLflow 3 names it in `source` (`models:/m-...`) and leaves
    `model_id` unset on versions read back from the store."""
    found = getattr(version, "model_id", None)
    source = getattr(version, "source", "") or ""
    if not found and source.startswith("models:/m-"):
        found = source.removeprefix("models:/").split("/", 1)[0]
    return found or None


def _model_files(client, version) -> Path | None:
    """The local folder of a version's logged model (MLflow 3: `<experiment>/models/<model id>`)."""
    model_id = _model_id(version)
    if not model_id:
        return None
    try:
        location = client.get_logged_model(model_id).artifact_location
    except Exception:  # noqa: BLE001 - gone already
        return None
    if location.startswith("file://"):
        location = location[len("file://"):]
    path = Path(location)
    # the model's own folder (artifact_location ends in .../models/<id>/artifacts)
    folder = path.parent if path.name == "artifacts" else path
    return folder if folder.is_dir() and "://" not in location else None


# --------------------------------------------------------------------------- locks


def _lock_file(root: Path, stage: str, fp: str) -> Path:
    return root / stage / f".{fp}.lock"  # core/cache/artifacts.py stage_lock's


def held(lock: Path) -> bool:
    """Whether a running flow holds this stage lock (asked without waiting)."""
    if not lock.exists():
        return False
    fl = FileLock(str(lock))
    try:
        fl.acquire(timeout=0)
    except Timeout:
        return True
    fl.release()
    return False


def busy_stages(root: Path) -> set[str]:
    """The stages that some running flow is working on now (any of their locks held)."""
    out = set()
    for stage in STAGES:
        folder = root / stage
        if folder.is_dir() and any(held(lock) for lock in folder.glob(".*.lock")):
            out.add(stage)
    return out


def _last_used(path: Path, lock: Path | None) -> float:
    times = [path.stat().st_mtime]
    if lock is not None and lock.exists():
        times.append(lock.stat().st_mtime)
    return max(times)


# --------------------------------------------------------------------------- the policy


def _fingerprint_of(name: str) -> str:
    """A stage folder's fingerprint: `<fp>`, or `.<fp>.partial`, `.<fp>.old.*`, `.<fp>.*.trash`."""
    return name[1:].split(".", 1)[0] if name.startswith(".") else name


def _stale(root: Path, protect: dict[str, str], keep_days: float, now: float) -> bool:
    """Whether some stage folder outside `protect` is unused for `keep_days`: one only a kept version's
    lineage could keep (stat calls only; True where unsure, which just asks the registry)."""
    for stage in STAGES:
        folder = root / stage
        for path in folder.iterdir() if folder.is_dir() else []:
            fp = _fingerprint_of(path.name)
            if not path.is_dir() or (protect.get(stage) == fp and not path.name.startswith(".")):
                continue
            if now - _last_used(path, _lock_file(root, stage, fp)) >= keep_days * DAY:
                return True
    return False


def plan_drops(cfg: SFTConfig, protect: dict[str, str] | None = None, now: float | None = None,
               versions_added: bool = True) -> Report:
    """What the policy would free now, and why (nothing is touched). `protect`: stage -> fingerprint of
    folders kept whatever their age (the plan a run just used, the config `gc` was given).
    `versions_added=False` (the policy after a run that registered nothing) asks the registry only when a
    folder is old enough to need a version's lineage: the versions are those the last policy left, and
    opening MLflow's store would be most of a cached run's time (`sftflow gc` always asks)."""
    r, root = cfg.retention, cfg.artifacts_path
    now = time.time() if now is None else now
    report = Report()
    kept_fps: dict[str, dict[str, str]] = {s: {} for s in STAGES}
    for stage, fp in (protect or {}).items():
        if stage in kept_fps:
            kept_fps[stage][fp] = "the current plan's"

    ask = versions_added or _stale(root, protect or {}, r.keep_days, now)
    versions = registered(cfg) if ask else []
    chains: set[str] | None = set() if ask and _has_store(cfg) else None  # base nodes kept versions name
    if versions:
        client = _client(cfg)
        name = cfg.registry.model_name
        # a search leaves each version's aliases empty: the registered model holds them (alias -> version)
        by_alias = client.get_registered_model(name).aliases or {}
        for i, v in enumerate(versions):
            aliases = sorted(a for a, n in by_alias.items() if str(n) == str(v.version))
            why = ("@" + ", @".join(aliases)) if aliases else (
                f"one of the {r.keep_versions} newest" if i < r.keep_versions else None)
            if why is None:
                folder = _model_files(client, v)
                report.drops.append(Drop(folder or root / f"<registry {name} v{v.version}>",
                                         disk_usage(folder) if folder else 0,
                                         f"{name} v{v.version}: no alias, older than the {r.keep_versions} newest "
                                         "(retention.keep_versions); removed from the registry with its model "
                                         "files, its run stays", version=(name, str(v.version))))
                continue
            report.versions.append(f"{name} v{v.version} ({why}) and its lineage")
            chains.update(_chain_of(v))
            for stage, fp in lineage(client, v).items():
                kept_fps[stage].setdefault(fp, f"v{v.version}'s lineage")
    if ask and _has_store(cfg):
        client = _client(cfg)
        by_model: dict[str, list[str]] = {}
        for v in others_versions(cfg, client):
            by_model.setdefault(v.name, []).append(f"v{v.version}")
            chains.update(_chain_of(v))
            for stage, fp in lineage(client, v).items():
                kept_fps[stage].setdefault(fp, f"{v.name} v{v.version}'s lineage (another registered model)")
        report.versions += [f"{other} {', '.join(vs)} (another registered model in this store: all its versions) "
                            "and their lineage" for other, vs in by_model.items()]

    for stage in STAGES:
        folder = root / stage
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if not path.is_dir():
                continue
            name = path.name
            fp = _fingerprint_of(name)
            lock = _lock_file(root, stage, fp)
            if name.startswith("."):  # .<fp>.partial (train's resumable work), .<fp>.old.*, .<fp>.*.trash
                if fp in kept_fps[stage] and name.endswith(".partial"):
                    continue
                if now - _last_used(path, lock) >= r.keep_days * DAY:
                    report.drops.append(Drop(path, disk_usage(path), f"unfinished or left-over folder unused for "
                                             f"{r.keep_days:g}+ days (retention.keep_days)", locks=(lock,)))
                continue
            if fp in kept_fps[stage]:
                report.kept[str(path)] = kept_fps[stage][fp]
                report.drops += _checkpoint_drops(cfg, stage, path, lock)
                continue
            if now - _last_used(path, lock) < r.keep_days * DAY:
                report.kept[str(path)] = f"used in the last {r.keep_days:g} days"
                report.drops += _checkpoint_drops(cfg, stage, path, lock)
                continue
            report.drops.append(Drop(path, disk_usage(path), f"no kept version's lineage names it, unused for "
                                     f"{r.keep_days:g}+ days (retention.keep_days)", locks=(lock,)))

    # reference stages' per-set scores (artifacts/<stage>_sets/<key>): small, kept while recently used
    for stage in ("baseline", "champion"):
        folder = root / f"{stage}_sets"
        for path in sorted(folder.iterdir()) if folder.is_dir() else []:
            if path.is_dir() and now - _last_used(path, None) >= r.keep_days * DAY:
                report.drops.append(Drop(path, disk_usage(path), f"{stage}'s per-set scores unused for "
                                         f"{r.keep_days:g}+ days", busy=(stage,)))

    report.drops += _piece_drops(root, [Path(p) for p in report.kept if Path(p).parent.name in
                                        ("prepare", "prepare_eval")], now, r.keep_days)

    report.drops += _base_drops(cfg, root, report, chains)

    start = root.joinpath(*START_COPIES)
    for path in sorted(start.iterdir()) if start.is_dir() else []:
        if path.is_dir():
            report.drops.append(Drop(path, disk_usage(path), "a copy of a registered version training started from: "
                                     "MLflow holds it (downloaded again when a run needs it)", busy=("train",)))
    return report


def _chain_of(version) -> list[str]:
    """The base nodes a registered LoRA version stands on (its tag `sftflow.base_chain`)."""
    return [d for d in (version.tags or {}).get(bases.CHAIN_TAG, "").split(",") if d]


def _base_drops(cfg: SFTConfig, root: Path, report: Report, chains: set[str] | None) -> list[Drop]:
    """Base nodes (artifacts/bases/<digest>/, and their runs in the MLflow store) that nothing kept names:
    no kept train folder's adapter/base.json (through its chain of nodes), no kept version's chain
    (of any registered model in the store). `chains` None: the registry was not asked (a run that
    registered nothing): nothing is dropped, the next policy that asks decides."""
    named: set[str] = set()
    for kept in report.kept:
        ref = Path(kept) / "adapter" / bases.REF
        if Path(kept).parent.name == "train" and ref.is_file():
            try:
                named.update(bases.local_chain(root, bases.read_ref(ref.parent)["base"]))
            except ValueError:
                continue
    for digest in chains or ():
        named.update(bases.local_chain(root, digest))
    out = []
    folder = root / bases.BASES
    local = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    for path in local:
        if path.name in named:
            report.kept[str(path)] = "a base a kept version or train folder names"
        elif chains is not None and not path.name.startswith("."):  # not asked: the next policy that asks decides
            out.append(Drop(path, disk_usage(path), "a base no kept version or train folder names (its "
                            "content stays where it came from: artifacts/models/, the MLflow store)",
                            busy=("train", "register")))
    if chains is not None:
        out += _base_run_drops(cfg, chains)
    return out


def _base_run_drops(cfg: SFTConfig, chains: set[str]) -> list[Drop]:
    """The MLflow store's base runs (bases.py) that no remaining version of any registered model names."""
    client = _client(cfg)
    exp = client.get_experiment_by_name(bases.EXPERIMENT)
    if exp is None:
        return []
    out = []
    for run in client.search_runs([exp.experiment_id], max_results=10000):
        digest = run.data.tags.get(bases.DIGEST_TAG, "")
        if digest in chains:
            continue
        uri = run.info.artifact_uri
        path = Path(uri.removeprefix("file://")) if uri.startswith(("file://", "/")) else None
        out.append(Drop(path.parent if path is not None else cfg.artifacts_path / f"<base run {digest[:12]}>",
                        disk_usage(path) if path is not None and path.is_dir() else 0,
                        f"the MLflow store's base {digest[:12]}: no registered version names it",
                        busy=("register",), base_run=run.info.run_id))
    return out


def _checkpoint_drops(cfg: SFTConfig, stage: str, path: Path, lock: Path) -> list[Drop]:
    """A kept train folder's checkpoints once it finished and exported `model/` or, LoRA, `adapter/`
    (drop_checkpoints)."""
    ckpt = path / "checkpoints"
    if not (stage == "train" and cfg.retention.drop_checkpoints and ckpt.is_dir() and is_complete(path)
            and ((path / "model").is_dir() or bases.is_adapter(path / "adapter"))):
        return []
    return [Drop(ckpt, disk_usage(ckpt), "checkpoints of a training that finished and exported model/ "
                 "(retention.drop_checkpoints)", locks=(lock,), checkpoints_of=path)]


def _piece_drops(root: Path, prepares: list[Path], now: float, keep_days: float) -> list[Drop]:
    """Pieces no kept prepare folder uses: a prepare manifest names each source's piece (`piece`); one
    written before it did is matched by path, split, format and counts, which piece.json holds too (a
    content change under the same path with the same counts keeps a piece too many, never one too few)."""
    folder = root / PIECES
    if not folder.is_dir():
        return []
    used, named = set(), set()
    for p in prepares:
        try:
            for src in json.loads((p / MANIFEST).read_text()).get("sources") or []:
                if src.get("piece"):
                    named.add(src["piece"])
                    continue
                used.add((src.get("ref"), src.get("split"), src.get("format"), src.get("rows_read"),
                          src.get("rows_kept")))
        except (OSError, ValueError):
            continue
    out = []
    for path in sorted(folder.iterdir()):
        if not path.is_dir() or path.name.startswith("."):
            continue  # temporary folders: prepare's own clean_stale removes them
        try:
            m = json.loads((path / PIECE_MANIFEST).read_text())
            splits = m["splits"].values()
            ident = (m["ref"], m["split"], m["format"], sum(s["rows_read"] for s in splits),
                     sum(s["rows_kept"] for s in splits))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            ident = None
        if path.name in named or ident in used or now - _last_used(path, None) < keep_days * DAY:
            continue
        out.append(Drop(path, disk_usage(path), "a prepare piece no kept prepare folder uses (rebuilt by the "
                        "prepare that needs it)", busy=("prepare", "prepare_eval")))
    return out


def apply(cfg: SFTConfig, report: Report, on_line: Callable[[str], None] = print, quiet: bool = False) -> Report:
    """Frees what `plan_drops` found, each under its stage lock taken without waiting: a folder whose
    lock a running flow holds (or, for pieces and copies, whose stage is running) is skipped. `quiet`
    (after a flow run): only what was freed or skipped is said, and nothing when there was none."""
    root = cfg.artifacts_path
    busy = busy_stages(root)
    report.applied = True
    client = None
    for d in report.drops:
        if d.version is not None:
            client = client or _client(cfg)
            name, number = d.version
            try:
                v = client.get_model_version(name, number)
            except Exception:  # noqa: BLE001 - removed meanwhile
                continue
            if getattr(v, "aliases", None):  # an alias moved onto it since planning: the registry points to it
                report.skipped.append(f"{name} v{number}: it has an alias now")
                continue
            client.delete_model_version(name, number)
            model_id = _model_id(v)
            if model_id:
                try:
                    client.delete_logged_model(model_id)
                except Exception:  # noqa: BLE001 - an MLflow without logged-model deletion: the files still go
                    pass
            _removed(d, report)
            continue
        if set(d.busy) & busy:
            report.skipped.append(f"{_rel(d.path, root)}: a running flow is in {'/'.join(sorted(set(d.busy) & busy))}")
            continue
        if d.base_run is not None:
            client = client or _client(cfg)
            try:
                client.delete_run(d.base_run)
            except Exception:  # noqa: BLE001 - deleted meanwhile
                continue
            _removed(d, report)
            continue
        locks = [FileLock(str(lock)) for lock in d.locks]
        taken = []
        try:
            for lock in locks:
                Path(lock.lock_file).parent.mkdir(parents=True, exist_ok=True)
                lock.acquire(timeout=0)
                taken.append(lock)
        except Timeout:
            report.skipped.append(f"{_rel(d.path, root)}: a running flow holds its lock")
            continue
        finally:
            if len(taken) != len(locks):
                for lock in taken:
                    lock.release()
        try:
            if not d.path.exists():
                continue
            if d.checkpoints_of is not None:
                _forget_checkpoints(d.checkpoints_of, d.size)
            remove_tree(d.path)
            report.freed += d.size
            d.done = True
        finally:
            for lock in taken:
                lock.release()
    if quiet and not report.freed and not report.skipped:
        return report  # after a run that left nothing to free, nothing to say
    for line in report.lines(root):
        if not (quiet and line.startswith("keep ")):
            on_line(f"retention: {line}")
    on_line(f"retention: freed {human(report.freed)}")
    return report


def _forget_checkpoints(train: Path, size: int) -> None:
    """The train folder's manifest without its checkpoints (written first: a crash before they are
    deleted leaves files the manifest doesn't list, which a reuse ignores; the other order would leave
    a folder whose reuse rebuilds it)."""
    manifest = json.loads((train / MANIFEST).read_text())
    manifest["files"] = {k: v for k, v in manifest.get("files", {}).items() if not k.startswith("checkpoints/")}
    manifest["retention"] = {"checkpoints_dropped": size, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = train / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
    os.replace(tmp, train / MANIFEST)


def mark_used(cfg: SFTConfig, fingerprints: dict[str, str]) -> None:
    """Stamps the folders a run made or reused as used now (their mtime; a lock taken doesn't change
    its file's): what `keep_days` counts from."""
    for stage, fp in fingerprints.items():
        folder = cfg.artifacts_path / stage / fp
        if stage in STAGES and folder.is_dir():
            os.utime(folder)


def collect(cfg: SFTConfig, protect: dict[str, str] | None = None, delete: bool = False,
            on_line: Callable[[str], None] = print, now: float | None = None, used: bool = False,
            versions_added: bool = True) -> Report:
    """`sftflow gc` and the automatic policy: what would be freed (printed), and with `delete` freed.
    `used`: `protect` names the folders a run just used (the policy after a flow run), stamped so.
    `versions_added`: whether that run registered a version (`plan_drops`)."""
    if used and protect:
        mark_used(cfg, protect)
    report = plan_drops(cfg, protect, now, versions_added)
    if delete:
        return apply(cfg, report, on_line, quiet=used)
    for line in report.lines(cfg.artifacts_path):
        on_line(line)
    on_line(f"would free {human(report.to_free)} (a dry run: --yes deletes)")
    return report


def _removed(d, report) -> None:
    """`d`'s folder deleted (a registry entry it belonged to is gone already) and counted as freed."""
    if d.path.is_dir():
        shutil.rmtree(d.path, ignore_errors=True)
    report.freed += d.size
    d.done = True
