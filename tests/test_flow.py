"""End to end through the CLI and Prefect: four stage folders, a registered MLflow version,
a fully cached second run, and single-stage re-runs."""

import json
from pathlib import Path

import pytest

from conftest import sftflow, tiny_config_dict, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]


def show(cfg_path: Path, cwd: Path) -> dict:
    proc = sftflow("show", "-c", str(cfg_path), "--json", cwd=cwd, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def summary_rows(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if cells and cells[0] in ("prepare", "train", "evaluate", "register"):
            rows[cells[0]] = cells
    return rows


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flow")
    cfg_path = write_config(tmp, tiny_config_dict(tmp))
    first = sftflow("run", "-c", str(cfg_path), cwd=tmp)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    return tmp, cfg_path, first


def test_full_flow_writes_four_complete_stage_folders(flow_run):
    tmp, cfg_path, first = flow_run
    info = show(cfg_path, tmp)
    for stage, st in info["stages"].items():
        assert st["status"] == "complete", stage
        manifest = json.loads((Path(st["path"]) / "manifest.json").read_text())
        assert manifest["fingerprint"] == st["fingerprint"] and manifest["stage"] == stage
    rows = summary_rows(first.stdout)
    assert set(rows) == {"prepare", "train", "evaluate", "register"}
    assert all(r[2] == "no" for r in rows.values()), first.stdout
    assert "held-out accuracy: base" in first.stdout

    prep = Path(info["stages"]["prepare"]["path"])
    assert sorted(p.name for p in (prep / "train").glob("*.arrow")) == ["shard-00000.arrow"]
    ev = json.loads((Path(info["stages"]["evaluate"]["path"]) / "metrics.json").read_text())
    preds = (Path(info["stages"]["evaluate"]["path"]) / "predictions.jsonl").read_text().splitlines()
    assert ev["total"] == 12 == len(preds)
    assert ev["correct"] == sum(json.loads(p)["correct"] for p in preds)
    assert ev["accuracy"] == pytest.approx(ev["correct"] / ev["total"])
    assert {"base_accuracy", "eval_loss"} <= set(ev)


def test_flow_run_publishes_summary_and_predictions_artifacts(flow_run):
    tmp, cfg_path, _ = flow_run
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    train_fp = show(cfg_path, tmp)["stages"]["train"]["fingerprint"]
    with get_client(sync_client=True) as client:
        def artifacts(key):
            return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
        # full-flow summaries of this config (stage-only runs elsewhere publish shorter ones)
        summaries = [a for a in artifacts("sftflow-summary") if train_fp in a.data and "Held-out accuracy" in a.data]
        assert summaries and all("MLflow" in a.data and "register" in a.data for a in summaries)
        assert artifacts("sftflow-eval-predictions")
        assert artifacts("sftflow-training")  # progress of the training steps


def test_model_is_registered_and_answers_through_pyfunc(flow_run):
    tmp, cfg_path, _ = flow_run
    import mlflow
    from mlflow.tracking import MlflowClient
    mlflow.set_tracking_uri(f"sqlite:///{tmp / 'artifacts' / 'mlflow.db'}")
    client = MlflowClient()
    versions = client.search_model_versions("name='test-model'")
    assert len(versions) == 1
    v = versions[0]
    assert "champion" in client.get_model_version("test-model", v.version).aliases
    run = client.get_run(v.run_id)
    assert run.data.params["actor.optim.lr"] == "0.001"
    history = client.get_metric_history(v.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2, 3, 4]
    assert "eval/accuracy" in run.data.metrics
    model = mlflow.pyfunc.load_model(f"models:/test-model/{v.version}")
    replies = model.predict(["Who are you?", "Repeat after me: apple river stone"])
    assert len(replies) == 2 and all(isinstance(r, str) for r in replies)


def test_second_run_is_fully_cached_and_registers_nothing_new(flow_run):
    tmp, cfg_path, _ = flow_run
    again = sftflow("run", "-c", str(cfg_path), cwd=tmp)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = summary_rows(again.stdout)
    assert all(r[2] == "yes" for r in rows.values()), again.stdout
    assert "training" not in again.stdout + again.stderr
    import mlflow
    from mlflow.tracking import MlflowClient
    mlflow.set_tracking_uri(f"sqlite:///{tmp / 'artifacts' / 'mlflow.db'}")
    assert len(MlflowClient().search_model_versions("name='test-model'")) == 1


def test_stage_evaluate_force_reruns_only_evaluate(flow_run):
    tmp, cfg_path, _ = flow_run
    info = show(cfg_path, tmp)
    before = {s: (Path(st["path"]) / "manifest.json").stat().st_mtime_ns for s, st in info["stages"].items()}
    proc = sftflow("stage", "evaluate", "-c", str(cfg_path), "--force", cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary_rows(proc.stdout)
    assert list(rows) == ["evaluate"] and rows["evaluate"][2] == "no"
    after = {s: (Path(st["path"]) / "manifest.json").stat().st_mtime_ns for s, st in info["stages"].items()}
    assert after["evaluate"] != before["evaluate"]
    assert all(after[s] == before[s] for s in ("prepare", "train", "register"))


def test_deleted_stage_folder_reruns_that_stage(flow_run):
    tmp, cfg_path, _ = flow_run
    import shutil
    info = show(cfg_path, tmp)
    shutil.rmtree(info["stages"]["evaluate"]["path"])
    proc = sftflow("run", "-c", str(cfg_path), cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary_rows(proc.stdout)
    assert rows["evaluate"][2] == "no" and rows["train"][2] == "yes" and rows["prepare"][2] == "yes"
    assert show(cfg_path, tmp)["stages"]["evaluate"]["status"] == "complete"


def test_eval_knob_changes_only_evaluate_and_register(flow_run):
    tmp, cfg_path, _ = flow_run
    proc = sftflow("run", "-c", str(cfg_path), "eval.max_new_tokens=6", cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary_rows(proc.stdout)
    assert [rows[s][2] for s in ("prepare", "train", "evaluate", "register")] == ["yes", "yes", "no", "no"]


def stage_status_after(tmp: Path, cfg_path: Path, *overrides: str) -> list[str]:
    proc = sftflow("run", "-c", str(cfg_path), *overrides, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = summary_rows(proc.stdout)
    return [rows[s][2] for s in ("prepare", "train", "evaluate", "register")]


def test_lr_change_reruns_train_evaluate_register(flow_run):
    tmp, cfg_path, _ = flow_run
    assert stage_status_after(tmp, cfg_path, "actor.optim.lr=2e-3") == ["yes", "no", "no", "no"]


def test_world_size_is_not_part_of_the_result(flow_run):
    tmp, cfg_path, _ = flow_run
    info = show(cfg_path, tmp)
    one = sftflow("show", "-c", str(cfg_path), "--json", "actor.nproc_per_node=1", cwd=tmp)
    assert json.loads(one.stdout)["stages"]["train"]["fingerprint"] == info["stages"]["train"]["fingerprint"]


def test_stage_with_upstream_runs_what_is_missing(flow_run):
    tmp, cfg_path, _ = flow_run
    proc = sftflow("stage", "evaluate", "-c", str(cfg_path), "runner.seed=99", cwd=tmp)
    assert proc.returncode == 2 and "--with-upstream" in proc.stderr
    proc = sftflow("stage", "evaluate", "-c", str(cfg_path), "runner.seed=99", "--with-upstream", cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary_rows(proc.stdout)
    assert [rows[s][2] for s in ("prepare", "train", "evaluate")] == ["yes", "no", "no"] and "register" not in rows


def test_edited_data_file_reruns_everything_and_touching_it_does_not(flow_run):
    tmp, cfg_path, _ = flow_run
    import os
    import time
    train = tmp / "train.jsonl"
    os.utime(train, (time.time() + 5, time.time() + 5))  # same bytes, new mtime
    assert stage_status_after(tmp, cfg_path) == ["yes", "yes", "yes", "yes"]
    lines = train.read_text(encoding="utf-8").splitlines()
    train.write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")  # one row fewer
    assert stage_status_after(tmp, cfg_path) == ["no", "no", "no", "no"]
