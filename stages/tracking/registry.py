"""Look-ups in the MLflow model registry: what `models:/name@alias` points at, and its files."""

from __future__ import annotations

import os
import socket
import time
import uuid
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Iterator

from stages.core.cache.bases import CHAIN_TAG
from stages.core.cache.bases import REF as BASE_REF
from stages.core.errors import ConfigError

from .run import TAG, reachable

REGISTRY_PREFIX = "models:/"
CHAMPION, CHALLENGER = "champion", "challenger"  # the aliases register moves
# what planning reads of the champion's version (`start`: where its training started, `models_fingerprint`: its
# base model; models/start.py)
VERSION_TAGS = ("train_fingerprint", "champion_fingerprint", "start", "models_fingerprint", "trained_on", "rehearsed")


# --------------------------------------------------------------------------- the promotion lock
# Moving `champion` is read-compare-write (read the champion, compare, set the alias): two registers finishing
# together would both read the same champion and both move the alias, the later write winning over a version it
# never compared with. MLflow has no compare-and-set on aliases, but its store creates a registered model under a
# name only once (the name is the table's key, in SQLite, PostgreSQL or MySQL alike; a second create gets
# RESOURCE_ALREADY_EXISTS): a registered model `<name>.promotion-lock` is a lock held by the registry itself, for
# every client of every machine, whatever its backend. Held for the seconds a decision and its writes take.
LOCK_SUFFIX = ".promotion-lock"
LOCK_HOLDER_TAG = TAG + "lock_holder"
LOCK_STALE_S = 120.0   # a lock seen unchanged this long is a dead holder's (a promotion takes seconds)
LOCK_WAIT_S = 600.0


class PromotionLockTimeout(RuntimeError):
    """Another promotion held the lock for longer than a caller waits."""


def _code(e: Exception) -> str:
    return str(getattr(e, "error_code", ""))


@contextmanager
def promotion_lock(client, name: str, wait_s: float = LOCK_WAIT_S, stale_s: float = LOCK_STALE_S,
                   poll_s: float = 0.2) -> Iterator[str]:
    """Held while an alias of registered model `name` is decided and moved (register, `sftflow champion`):
    the registered model `name + LOCK_SUFFIX`, created by one caller at a time and deleted on leaving.

    A lock seen unchanged (same creation time and holder) for `stale_s` seconds of this process's clock (no
    comparison of clocks across machines) is a holder's that died: it is broken by renaming it to a name made
    from that creation time and holder, which succeeds for one breaker only (a second one's rename finds the
    source gone, or the target taken), then deleted. Raises PromotionLockTimeout after `wait_s`."""
    lock = name + LOCK_SUFFIX
    me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + wait_s
    seen, seen_since = None, 0.0
    while True:
        try:
            client.create_registered_model(
                lock, tags={LOCK_HOLDER_TAG: me},
                description=f"sftflow: held while the aliases of '{name}' are decided and moved; deleted when done "
                            f"(one left for over {stale_s:g} s is a dead holder's and the next promotion breaks it)")
            break
        except Exception as e:
            if _code(e) != "RESOURCE_ALREADY_EXISTS":
                raise
        try:
            held = client.get_registered_model(lock)
            instance = (held.creation_timestamp, (held.tags or {}).get(LOCK_HOLDER_TAG, ""))
        except Exception as e:
            if _code(e) == "RESOURCE_DOES_NOT_EXIST":
                continue
            raise
        now = time.monotonic()
        if instance != seen:
            seen, seen_since = instance, now
        elif now - seen_since >= stale_s:
            _break_lock(client, lock, instance)
            seen = None
            continue
        if now > deadline:
            raise PromotionLockTimeout(f"registered model {lock} (held by {instance[1] or 'unknown'}) was not released "
                                       f"within {wait_s:g} s")
        time.sleep(poll_s)
    try:
        yield me
    finally:
        _release(client, lock, me)


def _break_lock(client, lock: str, instance: tuple) -> None:
    stale = f"{lock}.stale-{instance[0]}-{uuid.uuid5(uuid.NAMESPACE_OID, str(instance[1])).hex[:8]}"
    try:
        client.rename_registered_model(lock, stale)
    except Exception:  # noqa: BLE001 - another breaker was first, or the holder released it
        return
    try:
        client.delete_registered_model(stale)
    except Exception:  # noqa: BLE001 - best effort: a left stale lock holds nothing
        pass


def _release(client, lock: str, me: str) -> None:
    """Deletes the lock if it is still this holder's (one broken as stale may be another's now)."""
    try:
        if (client.get_registered_model(lock).tags or {}).get(LOCK_HOLDER_TAG) == me:
            client.delete_registered_model(lock)
    except Exception:  # noqa: BLE001 - gone already (broken as stale), or the registry is unreachable
        pass


def alias_hint(ref: str) -> str:
    """"; the alias form is models:/name@champion" when `ref` puts an alias where a version number goes
    (MLflow says only "Parameter 'version' must be an integer"), else ""."""
    body = ref[len(REGISTRY_PREFIX):] if ref.startswith(REGISTRY_PREFIX) else ""
    name, _, last = body.rpartition("/")
    if not name or "@" in body or not last or last.isdigit() or last == "latest":
        return ""
    return f"; the alias form is {REGISTRY_PREFIX}{name}@{last}"


def registry_version(ref: str, tracking_uri: str, key: str = "eval.model") -> tuple[str, str]:
    """`models:/name@alias` or `models:/name/version` -> (name, version) as the registry has it now."""
    from mlflow.tracking import MlflowClient
    body = ref[len(REGISTRY_PREFIX):]
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        if "@" in body:
            name, alias = body.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        elif "/" in body:
            name, number = body.rsplit("/", 1)
            version = client.get_model_version(name, number)
        else:
            raise ValueError("expected models:/name@alias or models:/name/version")
    except Exception as e:  # noqa: BLE001 - unknown name/alias/version, unreachable server
        raise ConfigError(f"{key}: {ref}: {str(e).strip().splitlines()[0]}{alias_hint(ref)}") from None
    return name, str(version.version)


def version_tag(tracking_uri: str, name: str, version: str, key: str) -> str:
    """One `sftflow.` tag of a version ("" when missing)."""
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=tracking_uri).get_model_version(name, version).tags.get(TAG + key, "")


def version_tags(tracking_uri: str, name: str, version: str) -> dict[str, str]:
    """The `VERSION_TAGS` of a version (without the `sftflow.` prefix; "" when missing)."""
    from mlflow.tracking import MlflowClient
    tags = MlflowClient(tracking_uri=tracking_uri).get_model_version(name, version).tags
    return {k: tags.get(TAG + k, "") for k in VERSION_TAGS}


def download_model(ref: str, tracking_uri: str | None, dst_path: str | None = None) -> str:
    """The Hugging Face folder inside the logged model `ref` names, downloaded (into `dst_path` when
    given, else a temporary folder): a full model, or a LoRA version's adapter folder, whose base.json
    names its base by content (stages/core/cache/bases.py; the loaders fetch it from the same store)."""
    import mlflow
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    try:
        local = Path(mlflow.artifacts.download_artifacts(ref, dst_path=dst_path))
    except Exception as e:  # noqa: BLE001 - unknown name/alias/version, unreachable server
        raise ValueError(f"{ref}: {str(e).splitlines()[0]}{alias_hint(ref)}") from None
    found = next((p.parent for p in sorted([*local.rglob("config.json"), *local.rglob(BASE_REF)])
                  if (p.parent / "tokenizer_config.json").is_file()), None)
    if found is None:
        raise ValueError(f"{ref}: no Hugging Face model folder (nor LoRA adapter folder) inside the logged model")
    return str(found)


def current_champion(tracking_uri: str, name: str, alias: str = CHAMPION) -> dict | None:
    """`{"registry", "name", "version", "train_fingerprint", "champion_fingerprint"}` of the version `alias`
    points at now (`champion_fingerprint`: the champion stage its last registration compared it with), or None
    when there is none (no store yet, no such model or alias) or the registry can't be asked: then the
    register stage, which asks again, holds the new version back rather than compare with nothing."""
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri.removeprefix("sqlite:///"))
        if not db.is_file():
            return None  # no store yet: nothing registered
        found = _sqlite_alias(db, name, alias)
        if found is not False:
            return found and {"registry": tracking_uri, "name": name, **found}
    from mlflow.tracking import MlflowClient
    try:
        reachable(tracking_uri)  # a server that is down costs seconds here, not minutes of client retries
        version = MlflowClient(tracking_uri=tracking_uri).get_model_version_by_alias(name, alias)
    except Exception:  # noqa: BLE001 - no model, no alias, unreachable server
        return None
    return {"registry": tracking_uri, "name": name, "version": str(version.version),
            **{k: version.tags.get(TAG + k, "") for k in VERSION_TAGS}}


def _sqlite_alias(db: Path, name: str, alias: str) -> dict | None | bool:
    """The alias read straight from MLflow's SQLite store (importing MLflow and opening its store costs
    seconds on every plan); False when the tables are not what MLflow 3 writes, so the client is asked."""
    import sqlite3
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as con:
            row = con.execute("SELECT version FROM registered_model_aliases WHERE name = ? AND alias = ?",
                              (name, alias)).fetchone()
            if row is None:
                return None
            tags = dict(con.execute("SELECT key, value FROM model_version_tags WHERE name = ? AND version = ?",
                                    (name, row[0])).fetchall())
    except sqlite3.Error:
        return False
    return {"version": str(row[0]), **{k: tags.get(TAG + k, "") for k in VERSION_TAGS}}


def version_state(tracking_uri: str, name: str, version: str | int) -> dict | None:
    """`{"exists": False}`, or `{"exists": True, "aliases": [...] (sorted), "train_fingerprint": ...}` for a
    registered version as the registry has it now; None when the registry can't tell."""
    if tracking_uri.startswith("sqlite:///"):
        import sqlite3
        db = Path(tracking_uri.removeprefix("sqlite:///"))
        if not db.is_file():
            return {"exists": False}
        try:
            with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as con:
                found = con.execute("SELECT 1 FROM model_versions WHERE name = ? AND version = ?",
                                    (name, int(version))).fetchone()
                aliases = con.execute("SELECT alias FROM registered_model_aliases WHERE name = ? AND version = ?",
                                      (name, int(version))).fetchall()
                tag = con.execute("SELECT value FROM model_version_tags WHERE name = ? AND version = ? AND key = ?",
                                  (name, int(version), TAG + "train_fingerprint")).fetchone()
            if found is None:
                return {"exists": False}
            return {"exists": True, "aliases": sorted(r[0] for r in aliases),
                    "train_fingerprint": tag[0] if tag else ""}
        except sqlite3.Error:
            pass
    from mlflow.tracking import MlflowClient
    try:
        reachable(tracking_uri)
        v = MlflowClient(tracking_uri=tracking_uri).get_model_version(name, str(version))
    except Exception:  # noqa: BLE001 - unreachable, or no such version (MLflow says so in several ways)
        return None
    return {"exists": True, "aliases": sorted(v.aliases),
            "train_fingerprint": v.tags.get(TAG + "train_fingerprint", "")}


def list_versions(tracking_uri: str, name: str, artifacts_path: Path | None = None) -> list[dict]:
    """Every version of registered model `name`, newest first (`sftflow models`, the flow's summary): its
    aliases, the version it continued from, held-out accuracy, why its aliases are what they are, when and
    from which run, the training files it added, the tokens it trained, the disk its train stage
    folder takes under `artifacts_path` ("" / None where unknown; a LoRA version's is its adapter) and
    the base nodes it names (`bases`, nearest first: stored once, not in `disk`). [] when none."""
    from mlflow.tracking import MlflowClient
    reachable(tracking_uri)
    client = MlflowClient(tracking_uri)
    versions = client.search_model_versions(f"name = '{name}'")
    if not versions:
        return []
    # Aliases as MLflow's UI reads them, from the registered model: the versions search_model_versions
    # returns carry none on a SQLite store (MLflow 3), so every row showed "-" with a champion set.
    aliases: dict[str, list[str]] = {}
    for alias, number in (client.get_registered_model(name).aliases or {}).items():
        aliases.setdefault(str(number), []).append(alias)
    out = []
    for v in sorted(versions, key=lambda v: -int(v.version)):
        tags = v.tags or {}
        fp = tags.get(TAG + "train_fingerprint", "")
        folder = artifacts_path / "train" / fp if artifacts_path is not None and fp else None
        out.append({"version": str(v.version), "aliases": sorted(aliases.get(str(v.version), [])),
                    "parent": tags.get(TAG + "parent_version", ""),
                    "accuracy": tags.get(TAG + "eval_accuracy", ""), "reason": tags.get(TAG + "alias_reason", ""),
                    "created": v.creation_timestamp, "run_id": v.run_id or "",
                    "data_files": _train_files(tags.get(TAG + "trained_on", "")),
                    "data_digest": tags.get(TAG + "data_digest", ""),
                    "tokens": _tokens_trained(client, v.run_id) if v.run_id else None,
                    "disk": _folder_bytes(folder) if folder is not None and folder.is_dir() else None,
                    "bases": [d for d in tags.get(CHAIN_TAG, "").split(",") if d]})
    return out


def _train_files(trained_on: str) -> tuple[int, int] | None:
    """(every file the version trained on, those that were new to it: `source` "train"; the others are
    earlier versions' data rehearsed and the mixture's own files; the replay stage's answers are not
    files); None without the tag."""
    import json
    try:
        refs = json.loads(trained_on) if trained_on else None
    except ValueError:
        return None
    if not isinstance(refs, list):
        return None
    refs = [r for r in refs if isinstance(r, dict)]
    return len(refs), sum(1 for r in refs if r.get("source") == "train")


def _tokens_trained(client, run_id: str) -> int | None:
    """The tokens the run's training stepped over: the sum of its per-step `train/tokens` (one value a
    step: a resumed training logs the steps it redoes again); None when the run logged none."""
    try:
        history = client.get_metric_history(run_id, "train/tokens")
    except Exception:  # noqa: BLE001 - a deleted run
        return None
    per_step = {m.step: m.value for m in history}
    return int(sum(per_step.values())) if per_step else None


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


def human_bytes(n: float) -> str:
    """Bytes in binary units, as `sftflow models` and `sftflow gc` both print them (a folder reads the same
    in both)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _count(n: int) -> str:
    return f"{n}" if n < 1000 else f"{n / 1000:.1f}k" if n < 1_000_000 else f"{n / 1e6:.1f}M"


VERSION_COLUMNS = ("version", "aliases", "from", "registered", "data", "tokens", "accuracy", "disk", "why")


def version_cells(v: dict) -> list[str]:
    """A `list_versions` row as the text of `VERSION_COLUMNS` ("-" where unknown): what `sftflow models`
    and the flow run's artifact show. `from`: the version it continued from; `data`: the training files
    it trained on (`sftflow.trained_on`), with how many were new to it when it rehearsed others."""
    import time
    day = time.strftime("%Y-%m-%d", time.localtime(v["created"] / 1000)) if v.get("created") else "-"
    acc = f"{float(v['accuracy']):.3f}" if v.get("accuracy") else "-"
    files = v.get("data_files")
    if files is None:
        data = "-"
    else:
        total, new = files
        data = f"{total} file{'' if total == 1 else 's'}" + ("" if new == total else f" ({new} new)")
    return [v["version"], ", ".join(v["aliases"]) or "-", f"v{v['parent']}" if v.get("parent") else "-", day, data,
            _count(v["tokens"]) if v.get("tokens") is not None else "-", acc,
            human_bytes(v["disk"]) if v.get("disk") is not None else "-", v.get("reason") or "-"]


SET_BY_HAND = TAG + "champion_set_by_hand"  # JSON: who, when, the reason, the version it replaced


def set_champion(tracking_uri: str, name: str, version: str, reason: str) -> dict:
    """Moves `champion` to `version` by hand (`sftflow champion`), recording why on the version (tags
    `champion_set_by_hand` and `alias_reason`); the promotion rules apply from there: the next run
    compares its model with this version. Returns what was recorded; a ValueError names a missing
    version or an empty reason."""
    import getpass
    import json

    from mlflow.tracking import MlflowClient
    if not reason.strip():
        raise ValueError("--reason is required: it is recorded on the version and shown by the next run")
    reachable(tracking_uri)
    client = MlflowClient(tracking_uri)
    try:
        target = client.get_model_version(name, version)
    except Exception as e:  # noqa: BLE001 - no such model or version
        raise ValueError(f"{name} v{version}: {str(e).strip().splitlines()[0]}") from None
    with promotion_lock(client, name):  # not between a register's read of the champion and its write
        try:
            before = str(client.get_model_version_by_alias(name, CHAMPION).version)
        except Exception:  # noqa: BLE001 - no champion yet
            before = None
        record = {"reason": reason.strip(), "by": f"{getpass.getuser()}@{socket.gethostname()}",
                  "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "replaced": before}
        client.set_registered_model_alias(name, CHAMPION, str(target.version))
        client.set_model_version_tag(name, str(target.version), SET_BY_HAND, json.dumps(record))
        client.set_model_version_tag(name, str(target.version), TAG + "alias_reason",
                                     f"champion set by hand ({record['at'][:10]}, {record['by']}): {record['reason']}")
    return {"version": str(target.version), **record}


def set_by_hand(tags: dict[str, str]) -> dict | None:
    """What `set_champion` recorded on a version (its tags), or None."""
    import json
    raw = tags.get(SET_BY_HAND)
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def bases_note(versions: list[dict], artifacts_path: Path | None) -> list[str]:
    """One line per base model the LoRA versions of `versions` name (the last node of each chain), with
    its size where `artifacts_path/bases/` holds it: stored once, so no version's `disk` counts it."""
    roots: dict[str, list[str]] = {}
    for v in versions:
        if v.get("bases"):
            roots.setdefault(v["bases"][-1], []).append(f"v{v['version']}")
    out = []
    for digest, named in roots.items():
        folder = artifacts_path / "bases" / digest if artifacts_path is not None else None
        size = human_bytes(_folder_bytes(folder)) if folder is not None and folder.is_dir() else "in the MLflow store"
        out.append(f"base {digest[:12]} ({size}, stored once): the base of LoRA {', '.join(named)}; "
                   "their disk is the adapter's")
    return out
