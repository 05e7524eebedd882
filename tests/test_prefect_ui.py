"""What a person sees in the Prefect UI, checked through Prefect's API against a real server on
loopback: run names and tags, the run graph's edges, the summary, predictions and progress
artifacts, a train task log without MLflow's own lines, and a UI that calls its own server."""

import json
import re
import urllib.request

import pytest

from conftest import flow_runs, seed_prefect_home, sftflow, tiny_config_dict, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]

STAGES = ("prepare", "baseline", "train", "evaluate", "register")  # no champion: the first run registers it


def flow_runs_named(name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])),
                                     sort=FlowRunSort.START_TIME_ASC)


@pytest.fixture(scope="module")
def ui_runs(tmp_path_factory, prefect_api_module):
    """One config run twice: a training run, then a fully cached one."""
    from stages.core.config import load_config
    from stages.pipeline import plan
    tmp = tmp_path_factory.mktemp("prefect-ui")
    cfg_path = write_config(tmp, tiny_config_dict(tmp, registry={"live_after_seconds": 0}), name="ui-demo.yaml")
    env = {"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"}  # MLflow logs its monitor's lines into train.log
    for _ in range(2):
        proc = sftflow("run", "-c", str(cfg_path), cwd=tmp, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    p = plan(load_config(cfg_path))
    runs = flow_runs_named(f"ui-demo-{p.fingerprints['train'][:8]}")
    assert len(runs) == 2, [r.name for r in runs]
    return p, runs


def task_runs(flow_run_id) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    with get_client(sync_client=True) as client:
        found = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {t.name.rsplit("-", 1)[0]: t for t in found}  # "train-a1b" -> "train"


def test_runs_are_named_after_the_training_and_tagged_with_what_they_did(ui_runs):
    _, (first, second) = ui_runs
    assert first.tags[:4] == ["trained", "version:1", "alias:champion", "model:test-model"]
    assert second.tags[:4] == ["cached", "version:1", "alias:champion", "model:test-model"]
    assert not any(t == "trained" or t.startswith("ran:") for t in second.tags)


def test_a_run_that_only_evaluates_is_tagged_with_the_stages_it_ran():
    from flows.sft import run_tags
    results = [{"stage": "prepare", "cached": True}, {"stage": "train", "cached": True},
               {"stage": "evaluate", "cached": False},
               {"stage": "register", "cached": False, "metrics": {"version": 3, "aliases": ["challenger"]}}]
    assert run_tags(results) == ["ran:evaluate", "ran:register", "version:3", "alias:challenger"]


def test_the_run_graph_draws_the_pipeline(ui_runs):
    """Each stage's task waits on the stages it reads, so the graph has those edges (and no others): the
    baseline is a branch beside train."""
    from prefect.client.orchestration import get_client
    _, runs = ui_runs
    for run in runs:  # the training run and the fully cached one draw the same graph
        with get_client(sync_client=True) as client:
            graph = client._client.get(f"/flow_runs/{run.id}/graph-v2").json()
        label = {node_id: node["label"].rsplit("-", 1)[0] for node_id, node in graph["nodes"]}
        assert sorted(label.values()) == sorted(STAGES)
        edges = {(label[parent["id"]], label[node_id]) for node_id, node in graph["nodes"]
                 for parent in node["parents"]}
        assert edges == {("prepare", "train"), ("prepare", "baseline"), ("prepare", "evaluate"), ("train", "evaluate"),
                         ("baseline", "evaluate"), ("prepare", "register"), ("train", "register"),
                         ("evaluate", "register")}, run.name
        starts = {label[node_id]: node["start_time"] for node_id, node in graph["nodes"]}
        assert sorted(starts, key=lambda s: starts[s]) == ["prepare", "baseline", "train", "evaluate", "register"]


def artifacts_of(flow_run_id) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in found}


def test_artifacts_are_readable_and_honest(ui_runs):
    p, (first, _) = ui_runs
    arts = artifacts_of(first.id)
    summary = arts["sftflow-summary"].data
    assert not re.search(r"\d\.\d{6,}", summary), summary  # no raw floats
    assert "**MLflow**" in summary and "models:/test-model/1" in summary

    preds = [json.loads(line) for line in (p.folder("evaluate") / "predictions.jsonl").read_text().splitlines()]
    table = arts["sftflow-eval-predictions"]
    rows = json.loads(table.data)
    wrong = sum(not r["correct"] for r in preds)
    assert list(rows[0])[0] == "correct"
    assert [r["correct"] for r in rows] == ["no"] * wrong + ["yes"] * (len(preds) - wrong)
    assert (len(rows) == len(preds)
            and [r["prediction"] for r in rows[wrong:]] == [r["prediction"] for r in preds if r["correct"]])
    assert table.description.startswith(f"all {len(preds)} held-out predictions, wrong answers first ({wrong} wrong)")

    progress = arts["sftflow-training"]
    assert progress.data == 100 and progress.description == "training: step 4/4, done"


def test_the_train_task_log_holds_training_lines_not_mlflow_logging(ui_runs):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId
    from flows.sft import MLFLOW_LOG_LINE
    p, (first, _) = ui_runs
    train = task_runs(first.id)["train"]
    with get_client(sync_client=True) as client:
        logs = [log.message
                for log in client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[train.id])))]
    assert any(m.startswith("step 1/4") for m in logs)
    assert not [m for m in logs if MLFLOW_LOG_LINE.match(m)]
    train_log = (p.folder("train") / "train.log").read_text().splitlines()
    assert [line for line in train_log if MLFLOW_LOG_LINE.match(line)], "MLflow's lines stay in train.log"


def test_a_server_on_another_port_serves_a_ui_that_calls_it(tmp_path):
    # a port picked beforehand (`free_port`): the UI is told its API URL when it starts, as the kept
    # server's is (a server started with port 0 could not tell it)
    from flows.servers.prefect_server import free_port, local_server
    port = free_port()
    seed_prefect_home(tmp_path / "home")
    with local_server("127.0.0.1", port, tmp_path / "home", tmp_path / "server.log", ui=True) as api:
        settings = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=10).read())
    assert api == f"http://127.0.0.1:{port}/api" and settings["api_url"] == api


def test_cli_runs_use_a_running_server_of_their_prefect_home(tmp_path):
    """`serve --start-server` announces its server in the Prefect home; a CLI call on that home (no
    PREFECT_API_URL) runs on it instead of starting a temporary server, and the run is in its database."""
    from flows.servers.prefect_server import RUNNING_SERVER, local_server
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    home = tmp_path / ".prefect"  # the home `sftflow(...)` gives the CLI
    seed_prefect_home(home)
    with local_server("127.0.0.1", 0, home, tmp_path / "server.log", ui=False, shared=True) as api:
        assert (home / RUNNING_SERVER).is_file()
        proc = sftflow("stage", "prepare", "-c", str(cfg_path), cwd=tmp_path, env={"PREFECT_API_URL": None})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert [r["name"].split("-")[0] for r in flow_runs(api)] == ["config"]
    assert not (home / RUNNING_SERVER).exists()
    assert not (home / "temporary-server.log").exists(), "no temporary server was started"
