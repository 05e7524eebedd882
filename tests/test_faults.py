"""Faults from outside, in-process and fast: damaged stage folders, empty or unreadable shards,
corrupt checkpoints, torn metrics lines, edits the digest memo must see, and config errors
that must come before anything runs (issue: never a silent wrong result, one clear line)."""

import json
import os
import shutil

import pytest
import torch

from conftest import base_model, sftflow, tiny_config_dict, write_config
from stages.core.config import ConfigError, config_from_dict, load_config
from stages.core.errors import MissingUpstream
from stages.pipeline import plan, run_stage


@pytest.fixture
def prepared(tmp_path):
    cfg = load_config(write_config(tmp_path, tiny_config_dict(tmp_path, actor={"nproc_per_node": 1})))
    p = plan(cfg)
    run_stage(p, "prepare", on_line=lambda _: None)
    return p


def test_a_damaged_stage_folder_is_rebuilt_when_reused_and_named_when_read(prepared):
    p = prepared
    shard = p.folder("prepare") / "train" / "shard-00000.arrow"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])  # truncated on disk
    with pytest.raises(MissingUpstream,
                       match=rf"{p.folder('prepare')}, which is damaged \(train/shard-00000.arrow has"):
        run_stage(p, "train")  # a stage reading it names the folder and the fix, before torchrun starts
    lines = []
    again = run_stage(p, "prepare", on_line=lines.append)
    assert not again.cached and "is damaged" in lines[0] and "rebuilding it" in lines[0]
    assert shard.read_bytes() == good  # rebuilt, byte for byte
    (p.folder("prepare") / "manifest.json").write_text("{garbled")
    assert not run_stage(p, "prepare", on_line=lines.append).cached
    (p.folder("prepare") / "val" / "shard-00000.arrow").unlink()
    assert not run_stage(p, "prepare", on_line=lines.append).cached
    assert "val/shard-00000.arrow is missing" in lines[-1]
    assert run_stage(p, "prepare").cached  # whole again


def test_no_training_samples_or_no_eval_samples_is_an_error_naming_the_folder(prepared, tmp_path):
    from stages.evaluate import EvaluationError, run_evaluate
    from stages.train import TrainingFailed, run_train
    p = prepared
    broken = tmp_path / "broken-prepare"
    shutil.copytree(p.folder("prepare"), broken)
    for f in (broken / "train").glob("*.arrow"):
        f.unlink()
    with pytest.raises(TrainingFailed, match=rf"no training samples in {broken / 'train'}"):
        run_train(p.cfg, "fp-empty", base_model(p.cfg), str(broken), p.lineage({}))
    assert not (p.cfg.artifacts_path / "train" / ".fp-empty.partial" / "train.log").exists()  # torchrun never ran
    (broken / "val" / "shard-00000.arrow").write_bytes(b"not arrow")
    with pytest.raises(EvaluationError, match=rf"the shards in {broken / 'val'} can't be read"):
        run_evaluate(p.cfg, "fp-empty", base_model(p.cfg), "base", str(broken))


def test_an_edit_that_keeps_size_and_mtime_is_seen(tmp_path):
    """`cp -p`, `rsync -t`, `tar x` put an old mtime back; the ctime they can't."""
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    before = plan(load_config(cfg_path)).fingerprints["prepare"]
    train = tmp_path / "train.jsonl"
    st = train.stat()
    text = train.read_text(encoding="utf-8")
    train.write_text(text.replace("TinyChat", "TinyChap"), encoding="utf-8")  # same size
    os.utime(train, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert train.stat().st_size == st.st_size and train.stat().st_mtime_ns == st.st_mtime_ns
    assert plan(load_config(cfg_path)).fingerprints["prepare"] != before


def test_a_corrupt_checkpoint_is_named_and_skipped(tmp_path):
    import torch.distributed.checkpoint as dcp
    from stages.runtime.saving.checkpoint import COMPLETE, checkpoint_problem, newest_usable
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        d = root / f"step_{step:08d}"
        dcp.save({"model": {"w": torch.arange(1000.0)}}, checkpoint_id=str(d), no_dist=True)
        (d / "trainer_state.json").write_text(json.dumps({"step": step, "data_position": {}, "scheduler": {}}))
        (d / COMPLETE).write_text(str(step))
    newest = root / "step_00000004"
    assert checkpoint_problem(newest) is None
    data = next(newest.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    assert "is truncated" in checkpoint_problem(newest)
    warnings = []
    assert newest_usable(root, warnings.append) == root / "step_00000002"
    assert str(newest) in warnings[0] and "is truncated" in warnings[0]
    (root / "step_00000002" / "trainer_state.json").write_text("{torn")
    assert "trainer_state.json can't be read" in checkpoint_problem(root / "step_00000002")
    assert newest_usable(root, warnings.append) is None  # none left: training starts from the beginning


def test_a_torn_metrics_line_is_left_out_and_the_first_failed_rank_is_reported(tmp_path):
    from stages.launch.launcher import failure_reason
    from stages.runtime.reporting import truncate_metrics
    from stages.tracking.live import read_metrics_file
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics_file(path)] == [1, 2]
    truncate_metrics(path, 2)  # what a resume from step 2 does
    assert path.read_text().splitlines() == ['{"step": 1, "loss": 2.0}', '{"step": 2, "loss": 1.5}']
    log = ["[rank0]: Traceback (most recent call last):", "[rank0]: KeyError: 'labels'",
           "[rank1]: Traceback (most recent call last):",
           "[rank1]: RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer",
           "Root Cause (first observed failure):", "[0]:", "  rank      : 0 (local_rank: 0)"]
    assert failure_reason(log) == "rank 0: KeyError: 'labels'"
    assert failure_reason(log[2:4] + log[:2]) == ("rank 1: RuntimeError: "
                                                  "[gloo/transport/tcp/pair.cc:534] Connection closed by peer")


def test_the_first_recorded_failure_names_its_rank_or_is_the_projects_own_line(tmp_path):
    """torch elastic's error files (`@record`), laid out as its agent lays them out: the file written
    first wins (a rank that failed because another one died writes later), the latest attempt only."""
    from stages.launch.launcher import recorded_failure

    def record(attempt: int, rank: int, message: str, at: int) -> None:
        f = tmp_path / "run_x" / f"attempt_{attempt}" / str(rank) / "error.json"
        f.parent.mkdir(parents=True)
        f.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "1700000000"}}}))
        os.utime(f, ns=(at, at))
        os.utime(f.parent.parent, ns=(attempt, attempt))

    assert recorded_failure(tmp_path) is None  # nothing recorded: the launcher reads the log instead
    record(0, 0, "ValueError: from the first attempt", 1)
    record(1, 0, "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer", 20)
    record(1, 1, "KeyError: 'labels'", 10)
    assert recorded_failure(tmp_path) == "rank 1: KeyError: 'labels'"
    assert recorded_failure(tmp_path, first_rank=4) == "rank 5: KeyError: 'labels'"  # node 2 of 2-process nodes
    record(1, 2, "ConfigError: actor.lora.target_modules: no module named q_proj", 5)
    assert recorded_failure(tmp_path) == "actor.lora.target_modules: no module named q_proj"


BAD_CODE_AND_PATHS = [
    ({"eval": {"scorer": "nosuchpkg.mod:fn"}}, "eval.scorer='nosuchpkg.mod:fn': cannot import"),
    ({"actor": {"worker": "nosuchpkg.mod:W"}}, "actor.worker='nosuchpkg.mod:W': cannot import"),
    ({"actor": {"model": {"model_type": "nosuch_lm"}}}, "actor.model.model_type: unknown 'nosuch_lm'"),
    ({"actor": {"model": {"model_path": "builtin:nope"}}}, "actor.model.model_path: unknown builtin 'nope'"),
    ({"actor": {"model": {"model_path": "/missing/dir"}}}, "actor.model.model_path: '/missing/dir' is not a folder"),
    ({"runner": {"resume": "/missing"}}, "runner.resume: '/missing' is not a complete checkpoint folder"),
]


@pytest.mark.parametrize("change, message", BAD_CODE_AND_PATHS, ids=[m.split(":")[0] for _, m in BAD_CODE_AND_PATHS])
def test_code_and_paths_the_config_names_are_checked_before_anything_runs(tmp_path, change, message):
    raw = tiny_config_dict(tmp_path, **change)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        plan(config_from_dict(raw))
    assert not (tmp_path / "artifacts").exists()  # not even the digest memos of the data files


def test_unsupported_data_files_and_a_file_as_artifacts_dir(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"data.train_data_paths: '.*notes.txt' is not a data file sftflow reads"):
        config_from_dict(tiny_config_dict(tmp_path, data={"train_data_paths": [str(tmp_path / "notes.txt")]}))
    with pytest.raises(ConfigError, match="artifacts_dir: 'x' is a file"):
        (tmp_path / "x").write_text("")
        monkeypatch.chdir(tmp_path)
        config_from_dict({**tiny_config_dict(tmp_path), "artifacts_dir": "x"})


def test_a_rejected_config_writes_nothing_and_prefect_home_follows_artifacts_dir(tmp_path):
    cfg = tiny_config_dict(tmp_path, artifacts_dir=str(tmp_path / "elsewhere"))
    path = write_config(tmp_path, cfg)
    proc = sftflow("run", "-c", str(path), "eval.scorer=nosuchpkg.mod:fn", cwd=tmp_path, timeout=120,
                   env={"PREFECT_HOME": None})
    assert proc.returncode == 2 and proc.stderr.startswith("error: eval.scorer='nosuchpkg.mod:fn'"), proc.stderr
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "elsewhere" / ".prefect").exists()
    proc = sftflow("stage", "evaluate", "-c", str(path), cwd=tmp_path, timeout=120, env={"PREFECT_HOME": None})
    assert proc.returncode == 2  # valid config, missing upstream: still no Prefect home anywhere
    assert not (tmp_path / "artifacts").exists()


@pytest.mark.parametrize("change", [{"actor": {"model": {"model_path": "builtin:nope"}}},
                                    {"actor": {"model": {"model_path": "/missing/dir"}}}], ids=["builtin", "folder"])
def test_a_bad_model_from_the_cli_writes_nothing(tmp_path, change):
    path = write_config(tmp_path, tiny_config_dict(tmp_path, **change))
    proc = sftflow("run", "-c", str(path), cwd=tmp_path, timeout=120, env={"PREFECT_HOME": None})
    assert proc.returncode == 2 and proc.stderr.startswith("error: actor.model.model_path") and \
        len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "artifacts").exists()


def test_a_csv_that_is_not_utf8_is_refused_before_anything_runs(tmp_path):
    """The whole file fails to decode, so it is found while planning (its digest is computed on the same
    read): one line naming the file and the byte, exit 2, no Prefect server started, nothing written."""
    rows = ("messages\n" + '"[{""role"": ""user"", ""content"": ""hi""}, '
            '{""role"": ""assistant"", ""content"": ""h\xe9""}]"\n')
    (tmp_path / "latin1.csv").write_bytes(rows.encode("latin-1"))
    path = write_config(tmp_path, tiny_config_dict(tmp_path, data={"train_data_paths": [str(tmp_path / "latin1.csv")]}))
    proc = sftflow("run", "-c", str(path), cwd=tmp_path, timeout=120, env={"PREFECT_HOME": None})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'latin1.csv'}: not UTF-8 "
                                                "(invalid continuation byte "
                                                f"at byte {rows.index(chr(0xe9))}); re-encode the file as UTF-8"]
    assert not (tmp_path / "artifacts").exists()  # no Prefect home, no server, no digests
    (tmp_path / "latin1.csv").write_bytes(rows.encode("utf-8"))  # fixed: the same file plans
    from stages.core.config import load_config
    assert plan(load_config(path)).inputs["train"][0][0] == str(tmp_path / "latin1.csv")


def test_rng_states_are_json_and_restore_every_stream_exactly():
    """A checkpoint's RNG files are plain JSON (loading them runs no code, unlike torch.load)."""
    import random

    import numpy as np
    from stages.runtime.saving.checkpoint import rng_state, set_rng_state
    torch.manual_seed(3)
    np.random.seed(4)
    random.seed(5)
    saved = json.loads(json.dumps(rng_state()))
    first = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    set_rng_state(saved)
    again = (torch.rand(3), np.random.rand(3), random.random(), np.random.randn())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2:] == again[2:]


def test_credentials_in_the_tracking_uri_are_never_logged(tmp_path):
    from stages.tracking.run import redact_uri, run_params
    uri = "https://alice:s3cret@mlflow.example.com:5000/path"
    assert redact_uri(uri) == "https://***@mlflow.example.com:5000/path"
    assert redact_uri("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    cfg = config_from_dict(tiny_config_dict(tmp_path, registry={"tracking_uri": uri}))
    params = run_params(cfg)
    assert params["registry.tracking_uri"] == "https://***@mlflow.example.com:5000/path"
    assert not any("s3cret" in v for v in params.values())


def test_register_fails_fast_with_one_line_when_mlflow_is_down(tmp_path, closed_port):
    import time

    from stages.core.errors import StageError
    from stages.register import run_register
    from stages.tracking.run import Lineage
    cfg = config_from_dict(tiny_config_dict(tmp_path, registry={"tracking_uri": f"http://127.0.0.1:{closed_port}"}))
    t0 = time.time()
    with pytest.raises(StageError, match=r"register: MLflow at http://127.0.0.1:\d+ can't be reached") as e:
        run_register(cfg, "fp", Lineage({"prepare": "p", "train": "t", "evaluate": "e"}))
    assert time.time() - t0 < 30 and "\n" not in str(e.value)


def _open_tracking(cfg_dict: dict, barrier, out) -> None:
    from stages.core.config import config_from_dict
    from stages.tracking.run import setup_mlflow
    cfg = config_from_dict(cfg_dict)
    barrier.wait()
    try:
        setup_mlflow(cfg).get_experiment_by_name(cfg.registry.experiment)
        out.put("ok")
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put(f"{type(e).__name__}: {e}")


def test_two_runs_creating_one_mlflow_database_at_once_both_succeed(tmp_path):
    """Two configs started together on one artifacts dir both create the sqlite store's tables."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    raw = [tiny_config_dict(tmp_path, registry={"experiment": f"exp{i}"}) for i in range(2)]
    procs = [ctx.Process(target=_open_tracking, args=(r, barrier, out)) for r in raw]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert sorted(out.get(timeout=5) for _ in procs) == ["ok", "ok"]


def test_a_served_deployment_keeps_its_config_and_protected_keys(tmp_path, monkeypatch):
    """Runs started through the Prefect API can't point the deployment at another config, hand it a
    ready-made plan, or override keys that run code or send data elsewhere (unless allowed)."""
    from flows.sft import PROTECTED_ENV, SERVED_CONFIG_ENV, _plan_from
    from stages.core.config import SERVE_PROTECTED
    path = write_config(tmp_path, tiny_config_dict(tmp_path))
    monkeypatch.setenv(SERVED_CONFIG_ENV, str(path.resolve()))
    monkeypatch.setenv(PROTECTED_ENV, ",".join(k for k in SERVE_PROTECTED if k != "runner.resume"))
    assert _plan_from(str(path), ["actor.optim.lr=2e-3"], None).cfg.actor.optim.lr == 2e-3
    for bad in (["eval.scorer=evil.mod:fn"], ["actor.worker=evil.mod:W"], ["actor.model={trust_remote_code: true}"],
                ["registry.tracking_uri=http://elsewhere"], ["actor={worker: 'evil.mod:W'}"],
                ["actor.model.model_type=evil.mod:build"]):
        with pytest.raises(ConfigError, match="can't be set by the runs of this deployment"):
            _plan_from(str(path), bad, None)
    with pytest.raises(ConfigError, match="not a complete checkpoint"):  # allowed, so only validated
        _plan_from(str(path), ["runner.resume=/nowhere"], None)
    other = write_config(tmp_path, tiny_config_dict(tmp_path), "other.yaml")
    with pytest.raises(ConfigError, match="runs of this deployment use its config"):
        _plan_from(str(other), [], None)
    with pytest.raises(ConfigError, match="runs of this deployment use its config"):
        _plan_from(str(path), [], plan(load_config(path)).to_dict())


def test_a_run_left_running_by_a_dead_process_is_marked_killed(tmp_path):
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient
    from stages.tracking.run import OWNER_HOST, OWNER_PID, mark_abandoned_runs, setup_mlflow
    cfg = config_from_dict(tiny_config_dict(tmp_path))
    setup_mlflow(cfg)
    client = MlflowClient(cfg.resolved_tracking_uri)
    exp = client.get_experiment_by_name(cfg.registry.experiment).experiment_id
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket
    runs = {}
    for name, pid in (("dead", int(dead.stdout)), ("alive", os.getpid())):
        run = client.create_run(exp, run_name=name, tags={OWNER_HOST: socket.gethostname(), OWNER_PID: str(pid)})
        runs[name] = run.info.run_id
    assert mark_abandoned_runs(client, exp) == [runs["dead"]]
    assert client.get_run(runs["dead"]).info.status == "KILLED"
    assert client.get_run(runs["alive"]).info.status == "RUNNING"
