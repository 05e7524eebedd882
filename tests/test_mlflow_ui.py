"""What a person finds in the MLflow UI after a run, checked through MLflow's API (no browser): the
runs page `make ui` prints, a readable run name and a description linking the Prefect flow run,
chart-worthy metrics only, a named logged model with a signature and an input example, the
predictions as a table, links in registration.json, every artifact location under artifacts_dir,
and the champion served over REST by `make serve-model`.

One tiny flow per module on the default SQLite store, through the CLI."""

import json
import os
import shutil
import subprocess
import sys
import urllib.request

import pytest

from conftest import ROOT, sftflow, start_server, tiny_config_dict, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]


@pytest.fixture(scope="module")
def flow(tmp_path_factory, prefect_api_module):
    """(folder the CLI ran in, config, resolved plan) of one tiny flow on the default SQLite store."""
    from stages.core.config import load_config
    from stages.pipeline import plan
    tmp = tmp_path_factory.mktemp("mlflow-ui")
    cfg_path = write_config(tmp, tiny_config_dict(tmp))
    proc = sftflow("run", "-c", str(cfg_path), cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return tmp, cfg_path, plan(load_config(cfg_path))


@pytest.fixture(scope="module")
def client(flow):
    import mlflow
    from mlflow.tracking import MlflowClient
    uri = flow[2].cfg.resolved_tracking_uri
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("sftflow")  # where mlflow.load_table looks
    return MlflowClient(uri)


def registration(p) -> dict:
    return json.loads((p.folder("register") / "registration.json").read_text())


def the_run(client, p):
    return client.get_run(registration(p)["run_id"])


def test_make_ui_prints_the_runs_page_of_the_config_s_experiment(flow, client):
    _, cfg_path, _ = flow
    out = subprocess.run([sys.executable, "-m", "stages.tracking.ui", str(cfg_path), "--port", "5000", "--print-only"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    exp = client.get_experiment_by_name("sftflow")
    link = f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
    assert link + "&viewStateShareKey=sftflow-runs" in out.stdout.split()
    assert {e.name for e in client.search_experiments()} == {"Default", "sftflow"}  # it created none


def test_the_runs_page_opens_on_a_view_whose_columns_the_runs_have(flow, client):
    """The link's view is the experiment tag MLflow's "share view" reads; every metric column it
    selects is one a run of the flow logged (a misspelt one would be an empty column)."""
    _, _, p = flow
    view = json.loads(client.get_experiment_by_name("sftflow").tags["mlflow.sharedViewState.sftflow-runs"])
    metrics = [c.removeprefix("metrics.`").removesuffix("`") for c in view["selectedColumns"]
               if c.startswith("metrics.")]
    assert "eval/accuracy" in metrics and "data.rows_quarantined" in metrics
    assert set(metrics) <= set(the_run(client, p).data.metrics)
    assert view["orderByKey"] == "attributes.start_time" and view["orderByAsc"] is False


def test_every_artifact_location_is_under_artifacts_dir(flow, client):
    tmp, _, p = flow
    root = p.cfg.artifacts_path.as_uri() + "/"
    experiments = client.search_experiments()
    assert {e.name for e in experiments} >= {"Default", "sftflow"}
    assert all(e.artifact_location.startswith(root) for e in experiments), [e.artifact_location for e in experiments]
    import mlflow
    model = client.get_logged_model(mlflow.models.get_model_info("models:/test-model/1").model_id)
    assert model.artifact_location.startswith(root)
    assert not (tmp / "mlruns").exists() and not (ROOT / "mlruns").exists()


def test_run_has_a_readable_name_and_a_description_linking_the_flow_run(flow, client):
    _, _, p = flow
    run = the_run(client, p)
    assert run.info.run_name == f"test-model-lr0.001-4steps-{p.fingerprints['train'][:8]}"
    tags = run.data.tags
    assert tags["sftflow.train_fingerprint"] == p.fingerprints["train"]
    assert run.info.status == "FINISHED" and not {"sftflow.owner_host", "sftflow.owner_pid"} & set(tags)
    note = tags["mlflow.note.content"]
    flow_run = tags["prefect.flow_run_id"]
    assert flow_run in note and p.fingerprints["train"] in note
    if "prefect.flow_run_url" in tags:  # the flow knows its UI
        assert f"[{flow_run}]({tags['prefect.flow_run_url']})" in note and flow_run in tags["prefect.flow_run_url"]
    assert "[test-model v1](#/models/test-model/versions/1)" in note
    assert tags["mlflow.source.name"]


def test_registration_links_the_run_and_version_pages(flow, client):
    _, _, p = flow
    reg = registration(p)
    exp = client.get_experiment_by_name("sftflow").experiment_id
    assert reg["run_url"] == f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{reg['run_id']}?workflowType=machine_learning"
    assert reg["version_url"] == "http://127.0.0.1:5000/#/models/test-model/versions/1"


def test_metrics_are_the_ones_worth_a_chart(flow, client):
    _, _, p = flow
    run = the_run(client, p)
    keys = set(run.data.metrics)
    assert {"train/loss", "val/loss", "eval/accuracy", "eval/base_accuracy", "eval/reference_loss"} <= keys
    for key, twin in (("train/loss", "loss/train"), ("val/loss", "loss/val")):  # one section holds both losses
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert history and [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, twin)] == history
    assert {k for k in keys if k.startswith("eval/")} == {f"eval/{k}" for k in (
        "accuracy", "base_accuracy", "reference_loss", "delta", "delta_low", "delta_high", "wins", "losses", "p_value")}
    import mlflow
    summary = mlflow.load_table("eval/summary.json", run_ids=[run.info.run_id])
    metrics = json.loads((p.folder("evaluate") / "metrics.json").read_text())
    assert summary["set"].tolist() == ["val"]
    assert summary["correct"].tolist() == [metrics["correct"]] and summary["total"].tolist() == [metrics["total"]]
    assert summary["base_total"].tolist() == [metrics["base_total"]]


def test_logged_model_is_named_typed_and_has_an_input_example(flow, client):
    _, _, p = flow
    import mlflow
    info = mlflow.models.get_model_info("models:/test-model/1")
    assert client.get_logged_model(info.model_id).name == "test-model"
    sig = info.signature
    assert sig.inputs.to_dict() and sig.outputs.to_dict() == [{"type": "string", "required": True}]
    assert [(s.name, s.default) for s in sig.params] == [("max_new_tokens", 128)]
    # every documented input shape reaches the same replies
    import pandas as pd
    model = mlflow.pyfunc.load_model("models:/test-model@champion")
    assert model.input_example[0] == "Who are you?" and model.input_example[1][0]["role"] == "user"
    message = [{"role": "user", "content": "Who are you?"}]
    params = {"max_new_tokens": 8}
    want = model.predict(["Who are you?"], params=params)
    assert len(want) == 1 and isinstance(want[0], str)
    assert model.predict([message], params=params) == want
    assert model.predict(pd.DataFrame({"messages": [message]}), params=params) == want
    assert model.predict(pd.DataFrame({"prompt": ["Who are you?"]}), params=params) == want


def test_predictions_are_a_table_wrong_answers_first(flow, client):
    _, _, p = flow
    import mlflow
    run_id = registration(p)["run_id"]
    table = mlflow.load_table("eval/predictions.json", run_ids=[run_id])
    assert list(table.columns)[:4] == ["correct", "prompt", "reference", "prediction"]  # no `set`: one eval set
    rows = [json.loads(line) for line in (p.folder("evaluate") / "predictions.jsonl").read_text().splitlines()]
    assert len(table) == len(rows) and table["correct"].tolist() == sorted(r["correct"] for r in rows)
    assert {f.path for f in client.list_artifacts(run_id, "eval")} >= {"eval/predictions.jsonl",
                                                                       "eval/predictions.json"}


def test_register_links_the_prefect_flow_run_it_is_given(flow, tmp_path):
    """Register without a run from training: the run it opens describes the flow run from lineage.tags."""
    _, _, p = flow
    from stages.core.config import config_from_dict
    from stages.register import run_register
    from stages.tracking.run import Lineage
    from mlflow.tracking import MlflowClient
    raw = tiny_config_dict(tmp_path, registry={"model_name": "linked-model",
                                               "tracking_uri": p.cfg.resolved_tracking_uri})
    cfg = config_from_dict({**raw, "artifacts_dir": str(p.cfg.artifacts_path)})
    fps = {**p.fingerprints, "train": "t-linked", "register": "r-linked"}
    dirs = {s: str(p.folder(s)) for s in ("prepare", "train", "evaluate")}
    url = "http://127.0.0.1:4200/runs/flow-run/0b1c"
    run_register(cfg, fps["register"], Lineage(fps, dirs, p.inputs, {"prefect.flow_run_id": "0b1c",
                                                                    "prefect.flow_run_url": url}))
    reg = json.loads((cfg.artifacts_path / "register" / "r-linked" / "registration.json").read_text())
    note = MlflowClient(p.cfg.resolved_tracking_uri).get_run(reg["run_id"]).data.tags["mlflow.note.content"]
    assert f"[0b1c]({url})" in note and "[linked-model v1](#/models/linked-model/versions/1)" in note


def test_make_serve_model_answers_like_the_pyfunc(flow):
    """`make serve-model` with a PATH that lacks the venv (what a user's shell has): the reply to the
    documented payload equals the pyfunc's own."""
    _, _, p = flow
    import mlflow
    db = p.cfg.resolved_tracking_uri.removeprefix("sqlite:///")
    log = p.cfg.artifacts_path / "serve-model.log"
    env = {**os.environ, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    proc, url = start_server([shutil.which("make"), "-s", "-C", str(ROOT), "serve-model",
                              "MODEL=models:/test-model@champion", "PORT=0", f"MLFLOW_DB={db}"], log, "/ping",
                             env=env, timeout=240)
    port = url.rsplit(":", 1)[1]
    try:
        payload = {"inputs": ["Who are you?"], "params": {"max_new_tokens": 16}}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
        local = mlflow.pyfunc.load_model("models:/test-model@champion").predict(["Who are you?"],
                                                                               params={"max_new_tokens": 16})
        assert reply == {"predictions": local}
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
