"""Sweeps: a grid of trials as one Prefect flow run sharing cached stages, the best trial
registered, and MLflow's parent run with the trials as children."""

import json

import pytest

from conftest import sftflow, tiny_config_dict, write_config
from stages.core.stats.scores import by_set
from stages.core.errors import ConfigError
from stages.sweep import metric_of, parse_grid, plan_trials, ranked, split_values


def test_grid_arguments_split_into_axes_and_fixed_overrides():
    assert split_values('[a,b],"c,d",e') == ["[a,b]", '"c,d"', "e"]
    fixed, axes = parse_grid(["actor.optim.lr=1e-4,3e-4", "actor.lora.r=8,16", "runner.max_steps=4",
                              "data.train_data_paths=[x.jsonl,y.jsonl]"])
    assert axes == {"actor.optim.lr": ["1e-4", "3e-4"], "actor.lora.r": ["8", "16"]}
    assert fixed == ["runner.max_steps=4", "data.train_data_paths=[x.jsonl,y.jsonl]"]


@pytest.mark.parametrize("args, message", [
    (["actor.optim.lr="], "actor.optim.lr: empty value"),
    (["actor.optim.lr=1e-4,"], "actor.optim.lr: empty value"),
    (["actor.optim.lr=1e-4,1e-4"], "actor.optim.lr: a value repeats"),
    (["runner.max_steps=4"], "at least one KEY=V1,V2"),
    (["actor.optim.lr=1e-4,2e-4", "actor.optim.lr=3e-4"], "actor.optim.lr: given twice"),
    (["lr"], "expected KEY=VALUE"),
])
def test_bad_grids_are_one_line_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_grid(args)


@pytest.mark.parametrize("args, message", [
    (["actor.optim.nosuch=1,2"], "actor.optim.nosuch"),
    (["actor.optim.lr=1e-3,fast"], "actor.optim.lr"),
    (["actor.nproc_per_node=1,2", "actor.optim.lr=1e-3"], "actor.nproc_per_node: trials .* train the same model"),
])
def test_trials_are_validated_and_planned_before_anything_runs(tmp_path, args, message):
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    with pytest.raises(ConfigError, match=message):
        plan_trials(cfg_path, *parse_grid(args))
    assert not [s for s in ("prepare", "train") if (tmp_path / "artifacts" / s).exists()], "no stage ran"


def test_the_best_trial_is_ranked_by_its_metric():
    assert ranked([(0, 0.5), (1, 0.9), (2, None), (3, 0.9)], "accuracy") == [1, 3, 0, 2]
    assert ranked([(0, 0.5), (1, 0.2)], "eval_loss") == [1, 0]
    m = {"accuracy": 0.5, "sets": {"retention": {"accuracy": 0.75}}}
    assert metric_of(m, "accuracy") == 0.5 and metric_of(m, "retention/accuracy") == 0.75
    assert metric_of(m, "nosuch") is None
    assert metric_of(by_set({"val": {"accuracy": 0.25}}, "val"), "val/accuracy") == 0.25


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api")
def test_the_trial_table_has_each_column_once():
    """Ranked by accuracy (the default), the table has one accuracy column; by another metric, that
    metric's column first and accuracy beside it."""
    from flows.sweep import trial_table
    trials = [{"index": i, "values": {"actor.optim.lr": lr},
               "train": {"cached": False, "fingerprint": f"fp{i}"},
               "evaluate": {"metrics": {"accuracy": acc, "eval_loss": loss}}}
              for i, (lr, acc, loss) in enumerate([("1e-3", 0.5, 1.2), ("3e-3", 0.9, 0.4)])]
    head, rows = trial_table(trials, [1, 0], "accuracy")
    assert head == ["rank", "actor.optim.lr", "accuracy", "eval loss", "trained", "train fingerprint"]
    assert rows[0][:4] == ["1", "3e-3", "0.900", "0.400"]
    head, rows = trial_table(trials, [1, 0], "eval_loss")
    assert head == ["rank", "actor.optim.lr", "eval_loss", "accuracy", "trained", "train fingerprint"]
    assert len(head) == len(set(head)) and all(len(r) == len(head) for r in rows)


def test_a_two_by_two_sweep_shares_prepare_registers_the_best_and_resumes(tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient
    raw = tiny_config_dict(tmp_path, n_train=48, n_val=8)
    raw["actor"]["nproc_per_node"] = 1
    raw["actor"]["global_batch_size"] = 8
    cfg_path = write_config(tmp_path, raw)
    grid = ["actor.optim.lr=1e-3,3e-3", "runner.max_steps=2,3"]
    proc = sftflow("sweep", "-c", str(cfg_path), *grid, "--max-parallel", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    art = tmp_path / "artifacts"

    def folders(stage):
        return ({d.name: d for d in (art / stage).iterdir() if not d.name.startswith(".")}
                if (art / stage).is_dir() else {})
    assert len(folders("prepare")) == 1, "every trial shares one prepare folder"
    assert len(folders("train")) == 4 and len(folders("evaluate")) == 4 and len(folders("register")) == 1
    assert len(folders("baseline")) == 1, "the base model is scored once for the whole sweep"
    (baseline,) = folders("baseline").values()
    assert ({json.loads((d / "manifest.json").read_text())["baseline"] for d in folders("evaluate").values()}
            == {str(baseline)})

    # the best trial, found from the evaluate folders: highest accuracy, ties to the first in grid order
    trials = plan_trials(cfg_path, *parse_grid(grid))
    accuracy = [json.loads((t.plan.folder("evaluate") / "metrics.json").read_text())["accuracy"] for t in trials]
    best = trials[accuracy.index(max(accuracy))]
    client = MlflowClient(f"sqlite:///{art / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{art / 'mlflow.db'}")
    versions = client.search_model_versions("name='test-model'")
    assert len(versions) == 1
    runs = client.search_runs([client.get_experiment_by_name("sftflow").experiment_id])
    parent = [r for r in runs if "sftflow.sweep_id" in r.data.tags]
    assert len(parent) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    assert len(children) == 4
    assert {(r.data.params["actor.optim.lr"], r.data.params["runner.max_steps"]) for r in children} == \
        {("0.001", "2"), ("0.001", "3"), ("0.003", "2"), ("0.003", "3")}
    assert versions[0].tags["sftflow.train_fingerprint"] == best.plan.fingerprints["train"]
    assert versions[0].run_id == parent[0].data.tags["sftflow.best_run_id"]
    assert sorted(r.data.metrics["eval/accuracy"] for r in children) == sorted(accuracy)

    # one trial's training deleted: the re-run trains only that trial
    import shutil
    victim = sorted(folders("train"))[0]
    shutil.rmtree(folders("train")[victim])
    before = {n: (d / "manifest.json").stat().st_mtime_ns for n, d in folders("train").items()}
    proc = sftflow("sweep", "-c", str(cfg_path), *grid, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = {n: (d / "manifest.json").stat().st_mtime_ns for n, d in folders("train").items()}
    assert set(after) == set(before) | {victim}
    assert {n for n in after if before.get(n) != after[n]} == {victim}
    assert len(client.search_model_versions("name='test-model'")) == 1


def test_the_cli_rejects_a_bad_grid_with_one_line_and_exit_2(tmp_path):
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    proc = sftflow("sweep", "-c", str(cfg_path), "actor.optim.lr=1e-3,oops", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error:") and "actor.optim.lr" in errors[0], proc.stderr
    assert not (tmp_path / "artifacts").exists()
