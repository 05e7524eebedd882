"""The retention policy (stages/retention.py) on a stage tree laid out as the stages lay it out,
without training: what is kept, what is freed and why, the dry run, the stage locks of a running flow,
and `sftflow gc`'s one-line errors. The month it is for runs in tests/test_month.py."""

import json
import os
import time
from pathlib import Path

import pytest
from filelock import FileLock

from conftest import sftflow, tiny_config_dict, write_config
from stages.core.cache.artifacts import StageBuild, damage, read_manifest
from stages.core.config import config_from_dict
from stages.pipeline import plan
from stages.retention import collect

DAY = 86400


@pytest.fixture
def cfg(tmp_path):
    return config_from_dict(tiny_config_dict(tmp_path, retention={"keep_days": 7}))


def folder(cfg, stage: str, fp: str, files: dict[str, bytes], age_days: float = 0, **manifest) -> Path:
    build = StageBuild(cfg.artifacts_path, stage, fp)
    for name, data in files.items():
        (build.partial / name).parent.mkdir(parents=True, exist_ok=True)
        (build.partial / name).write_bytes(data)
    done = build.commit(manifest)
    old = time.time() - age_days * DAY
    os.utime(done, (old, old))
    return done


def piece(cfg, key: str, ref: str, rows: int, age_days: float = 30) -> Path:
    p = cfg.artifacts_path / "prepare_pieces" / key
    (p / "split-0").mkdir(parents=True)
    (p / "split-0" / "shard-00000.arrow").write_bytes(b"x" * 100)
    (p / "piece.json").write_text(json.dumps({"ref": ref, "split": "train", "format": "messages", "key": key,
                                              "splits": {"train": {"rows_read": rows, "rows_kept": rows}}}))
    old = time.time() - age_days * DAY
    os.utime(p, (old, old))
    return p


def source(ref: str, rows: int) -> dict:
    return {"ref": ref, "split": "train", "format": "messages", "rows_read": rows, "rows_kept": rows}


def test_the_policy_frees_what_no_kept_run_needs_and_says_why(cfg):
    art = cfg.artifacts_path
    train = folder(cfg, "train", "t1", {"model/model.safetensors": b"m" * 1000,
                                        "checkpoints/step_00000002/a.distcp": b"c" * 5000}, age_days=1)
    old_eval = folder(cfg, "evaluate", "e0", {"predictions.jsonl": b"p" * 300}, age_days=30)
    recent_eval = folder(cfg, "evaluate", "e1", {"predictions.jsonl": b"p" * 300}, age_days=1)
    protected = folder(cfg, "evaluate", "e2", {"predictions.jsonl": b"p" * 300}, age_days=30)
    prep = folder(cfg, "prepare", "p1", {"train/shard-00000.arrow": b"s" * 10}, age_days=1,
                  sources=[source("/data/a.jsonl", 4)])
    used, unused = piece(cfg, "k1", "/data/a.jsonl", 4), piece(cfg, "k2", "/data/gone.jsonl", 4)
    edited = piece(cfg, "k3", "/data/a.jsonl", 9)  # the same path, other contents (other counts)
    # a manifest that names its sources' pieces keeps exactly those, whatever their counts
    folder(cfg, "prepare", "p2", {"train/shard-00000.arrow": b"s" * 10}, age_days=1,
           sources=[{**source("/data/b.jsonl", 5), "piece": "k4"}])
    named = piece(cfg, "k4", "/data/b.jsonl", 7)
    start = art / "models" / "start" / "abc" / "model"
    start.mkdir(parents=True)
    (start / "model.safetensors").write_bytes(b"w" * 2000)
    lines = []

    report = collect(cfg, protect={"evaluate": "e2"}, on_line=lines.append)  # a dry run
    text = "\n".join(lines)
    assert (train / "checkpoints").is_dir() and old_eval.is_dir() and unused.is_dir() and start.is_dir()
    assert "would free" in lines[-1] and "--yes deletes" in lines[-1]
    assert "train/t1/checkpoints: checkpoints of a training that finished and exported model/" in text
    assert "evaluate/e0: no kept version's lineage names it, unused for 7+ days" in text
    assert "prepare_pieces/k2: a prepare piece no kept prepare folder uses" in text
    assert "models/start/abc: a copy of a registered version" in text
    assert {d.path for d in report.drops} == {train / "checkpoints", old_eval, unused, edited, start.parent}

    collect(cfg, protect={"evaluate": "e2"}, delete=True, on_line=lines.append)
    assert not (train / "checkpoints").exists() and not old_eval.exists() and not unused.exists()
    assert not edited.exists() and not start.parent.exists()
    assert recent_eval.is_dir() and protected.is_dir() and prep.is_dir() and used.is_dir() and named.is_dir()
    assert (train / "model" / "model.safetensors").is_file()
    # the manifest no longer lists the checkpoints: the folder is still a sound cache hit
    assert damage(train) is None and read_manifest(train)["retention"]["checkpoints_dropped"] == 5000
    assert not any(p.name.startswith(".") and p.name.endswith(".trash") for p in art.rglob("*"))  # none left aside
    assert collect(cfg, protect={"evaluate": "e2"}, delete=True, on_line=lines.append).drops == []


def test_a_running_flow_keeps_what_it_holds(tmp_path):
    """A folder whose stage lock is held (run_stage holds it while the stage runs or reuses it) is
    skipped, and so are pieces while a prepare runs and start copies while a training runs. (Taking a
    lock marks the folder used, which `keep_days` alone would keep: 0 here, so only the lock does.)"""
    cfg = config_from_dict(tiny_config_dict(tmp_path, retention={"keep_days": 0}))
    art = cfg.artifacts_path
    old = folder(cfg, "train", "t0", {"model/model.safetensors": b"m" * 100}, age_days=30)
    free = folder(cfg, "evaluate", "e0", {"predictions.jsonl": b"p"}, age_days=30)
    partial = art / "train" / ".t9.partial" / "checkpoints"
    partial.mkdir(parents=True)
    os.utime(partial.parent, (time.time() - 30 * DAY,) * 2)
    unused = piece(cfg, "k2", "/data/gone.jsonl", 4)
    start = art / "models" / "start" / "abc"
    start.mkdir(parents=True)
    locks = [FileLock(str(art / "train" / f".{fp}.lock")) for fp in ("t0", "t9")]
    locks.append(FileLock(str(art / "prepare" / ".p5.lock")))
    (art / "prepare").mkdir(exist_ok=True)
    lines = []
    for lock in locks:
        lock.acquire(timeout=0)
    try:
        report = collect(cfg, delete=True, on_line=lines.append)
    finally:
        for lock in locks:
            lock.release()
    assert old.is_dir() and partial.is_dir() and unused.is_dir() and start.is_dir()
    assert not free.exists()
    skipped = "\n".join(report.skipped)
    assert "train/t0: a running flow holds its lock" in skipped and "train/.t9.partial" in skipped
    assert "prepare_pieces/k2: a running flow is in prepare" in skipped
    assert "models/start/abc: a running flow is in train" in skipped
    collect(cfg, delete=True, on_line=lines.append)  # the flow ended: now they go
    assert not old.exists() and not partial.parent.exists() and not unused.exists() and not start.exists()


def test_drop_checkpoints_off_keeps_them(tmp_path):
    cfg = config_from_dict(tiny_config_dict(tmp_path, retention={"drop_checkpoints": False}))
    train = folder(cfg, "train", "t1", {"model/m": b"m", "checkpoints/step_1/a": b"c"})
    assert collect(cfg, protect={"train": "t1"}, delete=True, on_line=lambda line: None).drops == []
    assert (train / "checkpoints" / "step_1" / "a").is_file()


def test_retention_changes_no_fingerprint(tmp_path):
    a = plan(config_from_dict(tiny_config_dict(tmp_path))).fingerprints
    b = plan(config_from_dict(tiny_config_dict(tmp_path, retention={"keep_versions": 9, "keep_days": 1,
                                                                    "drop_checkpoints": False,
                                                                    "auto": False}))).fingerprints
    assert a == b


def test_gc_bad_config_is_one_line(tmp_path):
    path = write_config(tmp_path, tiny_config_dict(tmp_path, retention={"keep_versions": 0}))
    proc = sftflow("gc", "-c", str(path), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {path}: retention.keep_versions: Input should be greater than or equal to 1 (got 0)"]
    assert not (tmp_path / "artifacts").exists()


def test_gc_dry_run_deletes_nothing_and_yes_deletes(tmp_path):
    path = write_config(tmp_path, tiny_config_dict(tmp_path))
    cfg = config_from_dict(tiny_config_dict(tmp_path))
    old = folder(cfg, "evaluate", "e0", {"predictions.jsonl": b"p" * 2048}, age_days=30)
    dry = sftflow("gc", "-c", str(path), cwd=tmp_path, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert "evaluate/e0: no kept version's lineage names it, unused for 7+ days" in dry.stdout
    assert "would free 2.2 KiB" in dry.stdout and old.is_dir()
    done = sftflow("gc", "-c", str(path), "--yes", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "freed 2.2 KiB" in done.stdout and not old.exists()


def test_a_run_marks_what_it_used_and_keep_days_counts_from_there(cfg):
    """The policy after a flow run stamps the folders that run used (a lock taken changes no file's
    time); `keep_days` later, unneeded by any kept version, they go."""
    used = folder(cfg, "evaluate", "e0", {"predictions.jsonl": b"p"}, age_days=30)
    collect(cfg, protect={"evaluate": "e0"}, delete=True, used=True, on_line=lambda line: None)
    assert collect(cfg, delete=True, on_line=lambda line: None).drops == [] and used.is_dir()
    later = collect(cfg, now=time.time() + 8 * DAY, on_line=lambda line: None)
    assert [d.path for d in later.drops] == [used]


def test_a_run_that_registered_nothing_opens_the_registry_only_for_an_old_folder(cfg, monkeypatch):
    """The policy after a fully cached run: the registry holds what the last policy left, so MLflow's
    store (most of such a run's time) is opened only when a folder is old enough that a version's
    lineage alone could keep it, and then that lineage keeps it. A run that registered asks always."""
    import stages.retention as retention
    from mlflow.tracking import MlflowClient

    from flows.sft import _apply_retention
    client = MlflowClient(tracking_uri=cfg.resolved_tracking_uri)
    client.create_registered_model("test-model")
    client.create_model_version("test-model", source=str(cfg.artifacts_path),
                                tags={f"{retention.TAG}evaluate_fingerprint": "e_named"})
    asked = []
    real = retention.registered
    monkeypatch.setattr(retention, "registered", lambda c: asked.append(1) or real(c))
    quiet = {"on_line": lambda line: None, "delete": True, "used": True}

    recent = folder(cfg, "evaluate", "e1", {"predictions.jsonl": b"p"}, age_days=1)
    assert collect(cfg, protect={"evaluate": "e1"}, versions_added=False, **quiet).drops == [] and asked == []
    collect(cfg, protect={"evaluate": "e1"}, versions_added=True, **quiet)
    assert asked == [1]

    named = folder(cfg, "evaluate", "e_named", {"predictions.jsonl": b"p"}, age_days=30)
    unnamed = folder(cfg, "evaluate", "e_unnamed", {"predictions.jsonl": b"p"}, age_days=30)
    report = collect(cfg, protect={"evaluate": "e1"}, versions_added=False, **quiet)
    assert asked == [1, 1] and [d.path for d in report.drops] == [unnamed]
    assert named.is_dir() and recent.is_dir() and not unnamed.exists()

    # the flow's policy knows from the run's stages whether register registered
    p = plan(cfg)
    seen = []
    monkeypatch.setattr(retention, "collect", lambda *a, **kw: seen.append(kw["versions_added"]))
    for results in (None, [{"stage": "register", "cached": False}], [{"stage": "register", "cached": True}],
                    [{"stage": "evaluate", "cached": False}]):
        _apply_retention(p, results)
    assert seen == [True, True, False, False]


def test_two_models_in_one_folder_keep_each_others_lineage(tmp_path):
    """Two configs share one artifacts folder and MLflow store: gc of one frees its own old version and
    the folders only that version named, never a folder any version of the other model names in its
    lineage (the version's tags or its run's), whatever its age."""
    from mlflow.tracking import MlflowClient

    from stages.tracking.run import TAG
    cfg = config_from_dict(tiny_config_dict(tmp_path, retention={"keep_versions": 1, "keep_days": 0},
                                            registry={"model_name": "day-model"}))
    client = MlflowClient(tracking_uri=cfg.resolved_tracking_uri)
    experiment = client.create_experiment("shared")
    for model in ("day-model", "other-model"):
        client.create_registered_model(model)
    trains = {fp: folder(cfg, "train", fp, {"model/model.safetensors": b"m" * 100}, age_days=30)
              for fp in ("t_day1", "t_day2", "t_other1", "t_other2", "t_other_run")}
    evals = {fp: folder(cfg, "evaluate", fp, {"predictions.jsonl": b"p"}, age_days=30) for fp in ("e_day1", "e_other1")}
    client.create_model_version("day-model", source=str(tmp_path),
                                tags={f"{TAG}train_fingerprint": "t_day1", f"{TAG}evaluate_fingerprint": "e_day1"})
    client.create_model_version("day-model", source=str(tmp_path), tags={f"{TAG}train_fingerprint": "t_day2"})
    client.set_registered_model_alias("day-model", "champion", "2")
    client.create_model_version("other-model", source=str(tmp_path),
                                tags={f"{TAG}train_fingerprint": "t_other1", f"{TAG}evaluate_fingerprint": "e_other1"})
    run = client.create_run(experiment, tags={f"{TAG}train_fingerprint": "t_other_run"})  # named by its run only
    client.create_model_version("other-model", source=str(tmp_path), run_id=run.info.run_id,
                                tags={f"{TAG}prepare_fingerprint": "p_other"})
    client.create_model_version("other-model", source=str(tmp_path), tags={f"{TAG}train_fingerprint": "t_other2"})
    lines = []

    report = collect(cfg, delete=True, on_line=lines.append)
    assert not trains["t_day1"].exists() and not evals["e_day1"].exists()
    assert all(trains[fp].is_dir() for fp in ("t_day2", "t_other1", "t_other2", "t_other_run"))
    assert evals["e_other1"].is_dir()
    assert [str(v.version) for v in client.search_model_versions("name = 'day-model'")] == ["2"]
    assert sorted(str(v.version) for v in client.search_model_versions("name = 'other-model'")) == ["1", "2", "3"]
    assert "other-model v3, v2, v1 (another registered model in this store: all its versions)" in "\n".join(lines)
    assert report.kept[str(trains["t_other_run"])] == "other-model v2's lineage (another registered model)"
