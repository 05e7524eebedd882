"""The MLflow run of a trained model: found or created before training, finished by register.

Observability only: nothing here changes what a stage writes (`__fingerprint__ = False`).

One run per train fingerprint, tagged `sftflow.train_fingerprint`: the train stage opens it
before torchrun starts (rank 0 then logs step and system metrics into it live, see
`stages/tracking/live.py`), and register adds eval metrics, artifacts and the model to the same run.
A train stage that runs again for the same fingerprint (a retry, a resume, a deleted folder)
continues that run; a fully cached flow run touches nothing.

Created with: a name people can tell apart (`run_name`), a description (`run_note`: what was
trained, a link to the Prefect flow run, later the registered version), params = the flattened
resolved config, tags = stage fingerprints, config hash, data digest, git commit and the Prefect
flow run id and URL, inputs = every data file as an MLflow dataset whose digest is the file's
content sha256. Also the MLflow UI's pages of a run, a version and an experiment's runs, and the
SQLite store's creation with every artifact location under the artifacts folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock

from stages.core.cache.artifacts import canonical_json, read_manifest
from stages.core.config import SFTConfig, flatten

from .live import read_metrics_file, sync_rows
from .sqlite_store import create_sqlite_store

__fingerprint__ = False

TAG = "sftflow."
RUN_TAG = TAG + "train_fingerprint"
SHIPPED_TAG = TAG + "shipped_step"
NOTE_TAG = "mlflow.note.content"  # the run's description in the UI
FLOW_RUN_ID, FLOW_RUN_URL = "prefect.flow_run_id", "prefect.flow_run_url"  # set by the flow (lineage.tags)
DIGEST_CHARS = 32  # MLflow allows at most 36 characters for a dataset digest

# The runs list shows no metric column until someone picks one, and a person's picks live in their
# browser only. MLflow's "share view" keeps a view in an experiment tag that a link names
# (`viewStateShareKey`); sftflow writes one that shows what tells runs apart, best first.
VIEW_KEY = "sftflow-runs"
VIEW_TAG = "mlflow.sharedViewState." + VIEW_KEY
VIEW_METRICS = ("eval/accuracy", "eval/base_accuracy", "eval/delta", "val/loss", "data.rows_quarantined")


def runs_view() -> str:
    """The shared view's state, in the UI's own keys (column ids are ``metrics.`<name>` ``)."""
    metrics = [f"metrics.`{m}`" for m in VIEW_METRICS]
    # the datasets column is the widest: without it the numbers fit a laptop's window
    return json.dumps({"selectedColumns": ["attributes.`Models`", *metrics], "columnOrder": metrics,
                       "orderByKey": "attributes.start_time", "orderByAsc": False}, separators=(",", ":"))


def setup_mlflow(cfg: SFTConfig):
    """The MLflow module pointed at the config's tracking URI and experiment (created if missing)."""
    import mlflow
    ensure_experiment(cfg.resolved_tracking_uri, cfg.registry.experiment, cfg.artifacts_path)
    mlflow.set_experiment(cfg.registry.experiment)
    return mlflow


def ensure_experiment(uri: str, name: str, artifacts_path: Path) -> str:
    """The id of experiment `name` at `uri`, created if missing. A SQLite store keeps every artifact
    under `artifacts_path/mlartifacts`, its "Default" experiment's included."""
    import mlflow
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    mlflow.set_tracking_uri(uri)
    sqlite = uri.startswith("sqlite:///")
    location = (artifacts_path / "mlartifacts").as_uri() if sqlite else None
    # Two runs on one artifacts dir would both create (migrate) a new database file at once and race
    # on its tables: the first does it under a lock, the second then finds it ready.
    with FileLock(uri[len("sqlite:///"):] + ".lock") if sqlite else nullcontext():
        if sqlite and not Path(uri[len("sqlite:///"):]).exists():
            # the client's own store would create "Default" at ./mlruns/0 under the working directory
            create_sqlite_store(Path(uri[len("sqlite:///"):]), location)
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            try:
                experiment_id = mlflow.create_experiment(name, artifact_location=location)
            except Exception:  # a server: created meanwhile by another process
                exp = mlflow.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp is None:
            exp = mlflow.get_experiment(experiment_id)
        if exp.tags.get(VIEW_TAG) != runs_view():
            mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, VIEW_TAG, runs_view())
    return exp.experiment_id


def config_hash(cfg: SFTConfig) -> str:
    """sha256 of the resolved config (every key, defaults filled in)."""
    return hashlib.sha256(canonical_json(cfg.model_dump(mode="json")).encode()).hexdigest()[:16]


@dataclass
class Lineage:
    """What a run records about where its model came from (built by the plan, passed by the stages)."""

    fingerprints: dict[str, str]
    dirs: dict[str, str] = field(default_factory=dict)             # upstream stage folders
    inputs: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # split -> [(input, sha256)]
    tags: dict[str, str] = field(default_factory=dict)             # e.g. git commit, Prefect flow run id
    start: str = ""  # where training started (models/start.py start_tag; "" the base model)


def data_digest(inputs: dict[str, list[tuple[str, str]]]) -> str:
    """One digest of every input's content (names and locations don't count)."""
    contents = {s: sorted(d for _, d in v) for s, v in inputs.items()}
    return hashlib.sha256(canonical_json(contents).encode()).hexdigest()[:16]


def _datasets(inputs: dict[str, list[tuple[str, str]]], prepare_dir: str | None) -> list:
    from mlflow.entities import Dataset, DatasetInput, InputTag
    splits = {}
    if prepare_dir and (Path(prepare_dir) / "manifest.json").is_file():
        splits = read_manifest(Path(prepare_dir)).get("splits") or {}
    context = {"train": "training", "val": "validation"}
    out = []
    for split, items in inputs.items():
        seen = set()
        for ref, digest in items:
            if (ref, digest) in seen:
                continue
            seen.add((ref, digest))
            p = Path(ref)
            source = p.resolve().as_uri() if p.exists() else ref
            profile = {"sha256": digest, "split": split,
                       **({"bytes": p.stat().st_size} if p.is_file() else {}),
                       **{f"split_{k}": v for k, v in (splits.get(split) or {}).items() if isinstance(v, int)}}
            ds = Dataset(name=p.name or ref, digest=digest[:DIGEST_CHARS], source_type="local" if p.exists() else "hub",
                         source=json.dumps({"uri": source}), profile=json.dumps(profile))
            out.append(DatasetInput(ds, tags=[InputTag("mlflow.data.context", context.get(split, split))]))
    return out


def redact_uri(uri: str) -> str:
    """The tracking URI as it may be logged or written: credentials in it replaced by `***`."""
    from urllib.parse import urlsplit, urlunsplit
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def ui_url(cfg: SFTConfig) -> str:
    """Where the MLflow UI of the config's tracking store is: the tracking server itself (without
    credentials), else `registry.ui_url` (what `make ui` serves over the SQLite store)."""
    from urllib.parse import urlsplit, urlunsplit
    parts = urlsplit(cfg.resolved_tracking_uri)
    if parts.scheme not in ("http", "https"):
        return cfg.registry.ui_url.rstrip("/")
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1])).rstrip("/")


def runs_url(ui: str, experiment_id: str, view: bool = True) -> str:
    """The experiment's runs list (MLflow 3 otherwise opens an experiment on its GenAI overview), in
    sftflow's view (`VIEW_TAG`) where the experiment has it: a link naming a missing view errors."""
    shared = f"&viewStateShareKey={VIEW_KEY}" if view else ""
    return f"{ui}/#/experiments/{experiment_id}/runs?workflowType=machine_learning{shared}"


def run_url(ui: str, experiment_id: str, run_id: str) -> str:
    return f"{ui}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def version_url(ui: str, name: str, version: str | int) -> str:
    return f"{ui}/{_version_page(name, version)}"


def _version_page(name: str, version: str | int) -> str:
    from urllib.parse import quote
    return f"#/models/{quote(name, safe='')}/versions/{version}"


def run_name(cfg: SFTConfig, train_fp: str) -> str:
    """`<model name>-lr<lr>-<epochs or steps>[-lora<r>]-<train fingerprint[:8]>`: tells runs apart in a list."""
    r, a = cfg.runner, cfg.actor
    length = f"{r.max_steps}steps" if r.max_steps > 0 else f"{r.max_epochs}ep"
    lora = f"-lora{a.lora.r}" if a.lora.r else ""
    return f"{cfg.registry.model_name}-lr{a.optim.lr:g}-{length}{lora}-{train_fp[:8]}"


def _flow_run_link(tags: dict[str, str], prefix: str) -> str | None:
    run_id, url = tags.get(f"{prefix}_id"), tags.get(f"{prefix}_url")
    if url:
        return f"[{run_id or url}]({url})"
    return f"`{run_id}`" if run_id else None


def run_note(cfg: SFTConfig, tags: dict[str, str], version: tuple[str, str] | None = None) -> str:
    """The run's description (`mlflow.note.content`, markdown): what was trained, by which Prefect
    flow run, and the registered version (`version`: (name, number)) once there is one."""
    a, r = cfg.actor, cfg.runner
    length = f"{r.max_steps} steps" if r.max_steps > 0 else f"{r.max_epochs} epoch(s)"
    method = f"LoRA r={a.lora.r}" if a.lora.r else "full fine-tuning"
    lines = [f"Supervised fine-tuning of `{a.model.model_path}` ({method}): lr {a.optim.lr:g}, {length}, "
             f"global batch {a.global_batch_size}.", ""]
    start = tags.get(TAG + "start")
    if start and start != "base":
        parent = tags.get(TAG + "parent_version")
        lines.append(f"- Started from: `{start}`" + (f" (continues v{parent})" if parent else ""))
    trained = _flow_run_link(tags, "prefect.flow_run")
    if trained:
        lines.append(f"- Prefect flow run: {trained}")
    registered = _flow_run_link(tags, "prefect.register_flow_run")
    if registered:
        lines.append(f"- Registered by Prefect flow run: {registered}")
    if version:
        name, number = version
        lines.append(f"- Model version: [{name} v{number}]({_version_page(name, number)})")
    lines.append(f"- Train fingerprint: `{tags.get(RUN_TAG, '')}`")
    return "\n".join(lines)


def reachable(uri: str) -> None:
    """Fail in seconds, not after minutes of client retries, when a tracking server is down."""
    if uri.startswith(("http://", "https://")):
        import urllib.request
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5).read()


def run_params(cfg: SFTConfig) -> dict[str, str]:
    """The run's params: the flattened resolved config, credentials redacted."""
    params = {k: str(v) for k, v in flatten(cfg.model_dump(mode="json")).items()}
    if cfg.registry.tracking_uri:
        params["registry.tracking_uri"] = redact_uri(cfg.registry.tracking_uri)
    return params


def find_run(client, experiment_id: str, train_fp: str):
    runs = client.search_runs([experiment_id], f"tags.`{RUN_TAG}` = '{train_fp}'", max_results=1,
                              order_by=["attributes.start_time DESC"])
    return runs[0] if runs else None


def find_or_create_run(cfg: SFTConfig, lineage: Lineage, extra_tags: dict[str, str] | None = None) -> tuple[str, bool]:
    """(run id, created) of the run for this train fingerprint; a new run gets params, tags and inputs.
    Callers check `reachable` first: MLflow's client retries an unreachable server for minutes."""
    from mlflow.entities import Param, RunTag
    from mlflow.tracking import MlflowClient

    mlflow = setup_mlflow(cfg)
    client = MlflowClient()
    exp = mlflow.get_experiment_by_name(cfg.registry.experiment)
    fingerprints, inputs = lineage.fingerprints, lineage.inputs
    extra = {k: str(v) for k, v in {**lineage.tags, **(extra_tags or {})}.items() if v}
    mark_abandoned_runs(client, exp.experiment_id)
    run = find_run(client, exp.experiment_id, fingerprints["train"])
    if run is not None:
        # keep the record of the flow run that created it; add what is new (e.g. evaluate's fingerprint),
        # but not another flow run's Prefect tags (register records those as prefect.register_flow_run_*)
        have = run.data.tags
        other_flow = have.get(FLOW_RUN_ID, extra.get(FLOW_RUN_ID)) != extra.get(FLOW_RUN_ID)
        new = {k: v for k, v in extra.items() if k not in have and not (other_flow and k.startswith("prefect."))}
        if new:
            client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in new.items()])
        return run.info.run_id, False
    tags = {**{f"{TAG}{s}_fingerprint": fingerprints[s] for s in ("prepare", "train") if s in fingerprints},
            TAG + "config_hash": config_hash(cfg), TAG + "data_digest": data_digest(inputs), **extra}
    if extra.get(TAG + "git_commit"):
        tags.setdefault("mlflow.source.git.commit", extra[TAG + "git_commit"])
    tags.update({"mlflow.source.type": "JOB", "mlflow.source.name": "sftflow train stage"})
    tags[NOTE_TAG] = run_note(cfg, tags)
    run = client.create_run(exp.experiment_id, run_name=run_name(cfg, fingerprints["train"]), tags=tags)
    run_id = run.info.run_id
    params = [Param(k, v[:6000]) for k, v in run_params(cfg).items()]
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i:i + 100])
    datasets = _datasets(inputs, lineage.dirs.get("prepare"))
    if datasets:
        client.log_inputs(run_id, datasets=datasets)
    _log_quarantine(client, run_id, lineage.dirs.get("prepare"))
    return run_id, True


def _log_quarantine(client, run_id: str, prepare_dir: str | None) -> None:
    """The training rows prepare left out: `data.rows_quarantined` and one metric per reason (0 too:
    the runs list can sort on it), and the rows themselves (`quarantine.jsonl`) when there are any."""
    from stages.core.quarantine import FILE, dropped

    from .live import send_values
    if not prepare_dir:
        return
    counts = dropped(prepare_dir)
    send_values(client, run_id, {"data.rows_quarantined": sum(counts.values()),
                                 **{f"data.quarantined.{reason}": n for reason, n in sorted(counts.items())}})
    if counts and (Path(prepare_dir) / FILE).is_file():
        client.log_artifact(run_id, str(Path(prepare_dir) / FILE), artifact_path="data")


def log_runtime_params(cfg: SFTConfig, run_id: str, runtime: dict, on_line: Callable[[str], None] = print,
                       prefix: str = "runtime.") -> None:
    """The settings the workers resolved (`runtime.json`: attention kernel, precision, ...) as
    `runtime.*` params beside the config's own `auto`. A resumed run that resolved differently (on
    another machine) keeps the first value: MLflow params are write-once. Reported, never raised."""
    from mlflow.entities import Param, RunTag
    from mlflow.tracking import MlflowClient
    try:
        client = MlflowClient(cfg.resolved_tracking_uri)
        have = client.get_run(run_id).data.params
        new = [Param(f"{prefix}{k}", str(v)) for k, v in runtime.items() if f"{prefix}{k}" not in have]
        # the step whose weights model/ holds (early stopping, load_best_model_at_end), also a tag:
        # the runs list can show and filter on tags
        shipped = [RunTag(SHIPPED_TAG, str(runtime["shipped_step"]))] if "shipped_step" in runtime else []
        if new or shipped:
            client.log_batch(run_id, params=new, tags=shipped)
    except Exception as e:  # noqa: BLE001 - tracking must never fail a trained model
        on_line(f"mlflow: could not log the runtime params ({type(e).__name__}: {e})")


OWNER_HOST, OWNER_PID = TAG + "owner_host", TAG + "owner_pid"


def _set_status(cfg: SFTConfig, run_id: str, status: str) -> None:
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient
    client = MlflowClient(cfg.resolved_tracking_uri)
    if status == "RUNNING":  # who keeps it RUNNING: a later run can tell when that process is gone
        client.log_batch(run_id, tags=[RunTag(OWNER_HOST, socket.gethostname()), RunTag(OWNER_PID, str(os.getpid()))])
        client.update_run(run_id, status="RUNNING")
    else:
        client.set_terminated(run_id, status)
        for tag in (OWNER_HOST, OWNER_PID):  # bookkeeping of a RUNNING run, not something to show
            try:
                client.delete_tag(run_id, tag)
            except Exception:  # noqa: BLE001 - a run marked RUNNING by another version has none
                pass


def mark_abandoned_runs(client, experiment_id: str) -> list[str]:
    """Runs left RUNNING by a process of this host that no longer exists (SIGKILLed, power loss)
    become KILLED; returns their ids."""
    import psutil
    host = socket.gethostname()
    runs = client.search_runs([experiment_id], f"attributes.status = 'RUNNING' and tags.`{OWNER_HOST}` = '{host}'")
    dead = [r.info.run_id for r in runs if not psutil.pid_exists(int(r.data.tags.get(OWNER_PID, "0") or 0))]
    for run_id in dead:
        client.set_terminated(run_id, "KILLED")
    return dead


@contextmanager
def training_run(cfg: SFTConfig, lineage: Lineage, on_line: Callable[[str], None] = print,
                 metrics_file: Path | None = None) -> Iterator[dict[str, str]]:
    """Around the train stage: yields the env (`MLFLOW_RUN_ID`, `MLFLOW_TRACKING_URI`) for torchrun's
    workers; when training succeeded, sends the rows of `metrics_file` that rank 0 did not (a run too
    short for live logging). MLflow problems are reported, never raised."""
    env = {"MLFLOW_RUN_ID": ""}  # without a run, never log into one inherited from the caller's environment
    run_id = None
    try:
        reachable(cfg.resolved_tracking_uri)
        run_id, created = find_or_create_run(cfg, lineage)
        _set_status(cfg, run_id, "RUNNING")  # system metrics are only logged into a RUNNING run
        env = {"MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": cfg.resolved_tracking_uri}
        on_line(f"mlflow: {'created' if created else 'continuing'} run {run_id} "
                f"(experiment '{cfg.registry.experiment}' at {redact_uri(cfg.resolved_tracking_uri)}); "
                "metrics go there live")
    except Exception as e:  # noqa: BLE001 - tracking must never stop training
        on_line(f"mlflow: no live metrics ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                "training goes on, register logs the metrics afterwards")
    status = "FINISHED"
    try:
        yield env
        if run_id and metrics_file is not None and metrics_file.exists():
            from mlflow.tracking import MlflowClient
            try:
                sync_rows(MlflowClient(cfg.resolved_tracking_uri), run_id, read_metrics_file(metrics_file))
            except Exception as e:  # noqa: BLE001 - register backfills again
                on_line(f"mlflow: could not log the step metrics ({type(e).__name__}: {e})")
    except BaseException as e:  # a crash is FAILED; a cancel, timeout or Ctrl-C is KILLED
        status = "FAILED" if isinstance(e, Exception) else "KILLED"
        raise
    finally:
        if run_id:
            try:
                _set_status(cfg, run_id, status)
            except Exception:  # noqa: BLE001
                pass
