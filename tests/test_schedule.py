"""Scheduled retraining against a real `prefect server start` on loopback: a served
deployment with a short interval completes flow runs; unchanged data adds no model version;
a data change between two scheduled runs registers a new one."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import tiny_config_dict, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]


def completed_runs(deployment: str, after: float = 0.0) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])))
    return [r for r in runs if r.state and r.state.is_completed() and r.start_time and r.start_time.timestamp() > after]



def versions(tmp_path) -> int:
    import mlflow
    from mlflow.tracking import MlflowClient
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'artifacts' / 'mlflow.db'}")
    return len(MlflowClient().search_model_versions("name='test-model'"))


def test_served_deployment_retrains_when_data_changes(tmp_path):
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    name = f"retrain-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect"), "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "-c", str(cfg_path), "--interval", "10",
                             "--name", name], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: completed_runs(name), 240, "a first completed scheduled run", proc)
        assert versions(tmp_path) == 1
        first_done = time.time()
        wait_for(lambda: completed_runs(name, after=first_done), 120, "a cached scheduled run", proc)
        assert versions(tmp_path) == 1  # unchanged data: every stage cached, nothing new registered

        train = tmp_path / "train.jsonl"
        lines = train.read_text(encoding="utf-8").splitlines()
        train.write_text("\n".join(lines[:-2]) + "\n", encoding="utf-8")
        edited = time.time()
        wait_for(lambda: completed_runs(name, after=edited) and versions(tmp_path) == 2, 240,
                 "a retrain on the edited data", proc)
        runs = sorted(completed_runs(name), key=lambda r: r.start_time)
        trained = {d.name[:8] for d in (tmp_path / "artifacts" / "train").iterdir() if not d.name.startswith(".")}
        assert {r.name for r in runs} == {"config"}  # named once, as they started (no rename: no flicker)
        assert ({t for r in runs for t in r.tags if t.startswith("fingerprint:")}
                == {f"fingerprint:{fp}" for fp in trained})
        assert "trained" in runs[0].tags and "cached" in runs[1].tags and "model:test-model" in runs[0].tags
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    # nothing serves it any more, and the UI must not say "Ready"
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as client:
        assert client.read_deployment_by_name(f"sft_pipeline/{name}").paused

