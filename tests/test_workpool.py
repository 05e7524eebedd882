"""The flow on a Prefect work pool, against a real `prefect server start` and a real
`prefect worker start` on loopback: `sftflow deploy`, runs triggered through the API with
parameter overrides, all cache hits the second time, and a cancel through the worker that
stops torchrun and its workers."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import live_processes_mentioning, sftflow, tiny_config_dict, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]


def wait_until(predicate, seconds: float, what: str):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def flow_run(run_id):
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def trigger(deployment: str, overrides: list[str]):
    from prefect.deployments import run_deployment
    return run_deployment(deployment, parameters={"overrides": overrides}, timeout=0)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, prefect_api_module):
    """A config deployed to a new `process` pool (created by `sftflow deploy`) and a worker for it."""
    tmp = tmp_path_factory.mktemp("workpool")
    (tmp / "data").mkdir()
    raw = tiny_config_dict(tmp / "data")
    raw["artifacts_dir"] = "artifacts"  # relative: resolved against the folder `deploy` ran in
    cfg_path = write_config(tmp, raw)
    pool, name = f"pool-{uuid.uuid4().hex[:6]}", "retrain"
    proc = sftflow("deploy", "-c", str(cfg_path), "--pool", pool, "--name", name, "--on-data", cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = {**os.environ, "PREFECT_HOME": str(tmp / "worker-home")}
    worker = subprocess.Popen([str(Path(sys.executable).with_name("prefect")), "worker", "start", "--pool", pool,
                               "--type", "process", "--prefetch-seconds", "5"],
                              cwd=tmp_path_factory.mktemp("elsewhere"), env=env, stdout=open(tmp / "worker.log", "w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    yield tmp, f"sft_pipeline/{name}"
    worker.send_signal(signal.SIGINT)  # a Prefect worker takes 30 s over a SIGTERM; nothing is checked here
    try:
        worker.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


def versions(tmp: Path) -> list:
    from mlflow.tracking import MlflowClient
    return MlflowClient(f"sqlite:///{tmp / 'artifacts' / 'mlflow.db'}").search_model_versions("name='test-model'")


def test_a_worker_runs_the_deployment_and_a_second_run_is_all_cache_hits(deployed):
    tmp, deployment = deployed
    first = trigger(deployment, ["actor.optim.lr=0.002"])
    done = wait_until(lambda: (r := flow_run(first.id)).state.is_final() and r, 600, "the first run")
    assert done.state.is_completed(), (done.state, (tmp / "worker.log").read_text()[-3000:])
    assert "trained" in done.tags
    assert len(versions(tmp)) == 1
    from mlflow.tracking import MlflowClient
    v = versions(tmp)[0]
    assert (MlflowClient(f"sqlite:///{tmp / 'artifacts' / 'mlflow.db'}").get_run(v.run_id).data.params["actor.optim.lr"]
            == "0.002")

    second = trigger(deployment, ["actor.optim.lr=0.002"])
    done = wait_until(lambda: (r := flow_run(second.id)).state.is_final() and r, 300, "the second run")
    assert done.state.is_completed() and done.tags[0] == "cached"
    assert len(versions(tmp)) == 1


def test_deploy_on_data_makes_notify_start_a_run_of_the_pool_deployment(deployed):
    """`deploy --on-data` gives the work-pool deployment the arrival trigger `serve --on-data` gives a served
    one: Prefect holds it as an automation that runs this deployment on `sftflow.data.arrived` for the model."""
    from prefect.client.orchestration import get_client
    tmp, deployment = deployed
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(deployment)
        automations = [a for a in client.read_automations()
                       if any(getattr(act, "deployment_id", None) == dep.id for act in a.actions)]
    assert len(automations) == 1, automations
    trig = automations[0].trigger
    assert trig.expect == {"sftflow.data.arrived"} and trig.threshold == 1
    match = getattr(trig.match, "root", trig.match)
    assert match["prefect.resource.id"] == "sftflow.data.test-model"


def test_cancelling_a_run_through_the_api_stops_torchrun_on_the_worker(deployed):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling
    tmp, deployment = deployed
    long = ["runner.max_steps=100000", "runner.max_epochs=1000", "runner.save_interval=0",
            "runner.val_check_interval=0", "actor.optim.lr=0.003"]
    run = trigger(deployment, long)
    marker = str(tmp / "artifacts" / "train")
    wait_until(lambda: any("stages.train" in c for c in live_processes_mentioning(marker)), 300, "training to start")
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling())
    wait_until(lambda: not live_processes_mentioning(marker), 120, "torchrun and its workers to stop")
    wait_until(lambda: flow_run(run.id).state.is_cancelled(), 120, "the run to be cancelled")
