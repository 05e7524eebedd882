"""End to end through the CLI and Prefect: four stage folders, a registered MLflow version,
a fully cached second run, and single-stage re-runs. MLflow here is a real `mlflow server` on
127.0.0.1 that the module starts (the default sqlite backend is what tests/test_demo.py uses).

Every test asserts effects (stage folders and their manifests, MLflow runs and versions), and
none depends on another having run: tests that change what is registered use a model name
(and data files) of their own."""

import json
import os
from pathlib import Path

import pytest

from conftest import mlflow_server as loopback_mlflow, sftflow, tiny_config_dict, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on loopback with its own sqlite store and served artifacts; its tracking URI."""
    with loopback_mlflow(tmp_path_factory.mktemp("mlflow-server")) as uri:
        yield uri


def mlflow_client(uri: str):
    import mlflow
    from mlflow.tracking import MlflowClient
    mlflow.set_tracking_uri(uri)
    return MlflowClient(uri)


def show(cfg_path: Path, cwd: Path, *overrides: str) -> dict:
    proc = sftflow("show", "-c", str(cfg_path), "--json", *overrides, cwd=cwd, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


STAGES = ("prepare", "train", "evaluate", "register")


def _stamps(stages: dict) -> dict[str, int | None]:
    """Each stage folder's manifest mtime (None: not complete): a stage that runs rewrites it."""
    return {s: (Path(st["path"]) / "manifest.json").stat().st_mtime_ns if st["status"] == "complete" else None
            for s, st in stages.items()}


def stages_of(cfg_path: Path, *overrides: str) -> dict:
    """What `sftflow show --json` reports per stage, computed in this process (no CLI start)."""
    from stages.core.config import load_config
    from stages.pipeline import plan
    p = plan(load_config(cfg_path, list(overrides)))
    return {s: {"fingerprint": p.fingerprints[s], "status": p.status(s), "path": str(p.folder(s))} for s in p.stages}


def run_and_see(tmp: Path, cfg_path: Path, *args: str, command=("run",)) -> dict[str, str]:
    """Runs the CLI; per stage of the config: "ran" (its folder was written now), "reused" (its
    complete folder was left as it was) or "-" (not part of the command)."""
    overrides = [a for a in args if "=" in a]
    before = _stamps(stages_of(cfg_path, *overrides))
    proc = sftflow(*command, "-c", str(cfg_path), *args, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = _stamps(stages_of(cfg_path, *overrides))
    return {s: "-" if after[s] is None else "reused" if after[s] == before[s] else "ran" for s in STAGES}


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory, mlflow_server, prefect_api_module):
    tmp = tmp_path_factory.mktemp("flow")
    # live from the first step (default: once training looks >= 10 s long), system metrics every second
    # (default 10 s), so that the few seconds of training show both
    registry = {"tracking_uri": mlflow_server, "live_after_seconds": 0}
    cfg_path = write_config(tmp, tiny_config_dict(tmp, registry=registry))
    first = sftflow("run", "-c", str(cfg_path), cwd=tmp, env={"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"})
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    return tmp, cfg_path, first


def test_full_flow_writes_four_complete_stage_folders(flow_run):
    tmp, cfg_path, first = flow_run
    info = show(cfg_path, tmp)
    for stage, st in info["stages"].items():
        assert st["status"] == "complete", stage
        manifest = json.loads((Path(st["path"]) / "manifest.json").read_text())
        assert manifest["fingerprint"] == st["fingerprint"] and manifest["stage"] == stage

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
    train_fp = stages_of(cfg_path)["train"]["fingerprint"]
    with get_client(sync_client=True) as client:
        def artifacts(key):
            return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
        # full-flow summaries of this config (stage-only runs elsewhere publish shorter ones)
        summaries = [a for a in artifacts("sftflow-summary") if train_fp in a.data and "Held-out accuracy" in a.data]
        assert summaries and all("MLflow" in a.data and "register" in a.data for a in summaries)
        assert artifacts("sftflow-eval-predictions")
        assert artifacts("sftflow-training")  # progress of the training steps


def test_one_mlflow_run_holds_the_lineage_and_live_metrics(flow_run, mlflow_server):
    tmp, cfg_path, _ = flow_run
    import hashlib
    client = mlflow_client(mlflow_server)
    stages = stages_of(cfg_path)
    exp = client.get_experiment_by_name("sftflow")
    runs = client.search_runs([exp.experiment_id],
                              f"tags.`sftflow.train_fingerprint` = '{stages['train']['fingerprint']}'")
    assert len(runs) == 1  # one run for the one trained model
    run = client.get_run(runs[0].info.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name.endswith(f"-{stages['train']['fingerprint'][:8]}")
    p, tags = run.data.params, run.data.tags
    assert p["actor.optim.lr"] == "0.001" and p["runner.max_steps"] == "4"
    assert p["registry.tracking_uri"] == mlflow_server
    for stage, st in stages.items():
        assert tags[f"sftflow.{stage}_fingerprint"] == st["fingerprint"]
    assert len(tags["sftflow.git_commit"]) == 40 and tags["mlflow.source.git.commit"] == tags["sftflow.git_commit"]
    assert len(tags["prefect.flow_run_id"]) == 36  # the Prefect flow run's UUID
    assert len(tags["sftflow.config_hash"]) == 16 and len(tags["sftflow.data_digest"]) == 16

    # one point per step, sent by rank 0 as training ran: stamped before the train stage's manifest was written
    # (a backfill by the train stage or register would be stamped after it)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2, 3, 4]
    trained_at = (Path(stages["train"]["path"]) / "manifest.json").stat().st_mtime * 1000
    assert all(m.timestamp < trained_at for m in history)
    rows = [json.loads(line) for line in (Path(stages["train"]["path"]) / "metrics.jsonl").read_text().splitlines()]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in rows])
    for key in ("train/grad_norm", "train/lr", "train/tokens_per_s"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2, 3, 4], key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == [2, 4]
    assert any(k.startswith("system/") for k in run.data.metrics), sorted(run.data.metrics)
    assert "eval/accuracy" in run.data.metrics

    # the data files are the run's inputs, each with its content digest
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"train.jsonl", "val.jsonl"}
    for name, context in (("train.jsonl", "training"), ("val.jsonl", "validation")):
        digest = hashlib.sha256((tmp / name).read_bytes()).hexdigest()
        assert inputs[name].dataset.digest == digest[:32]
        assert [t.value for t in inputs[name].tags if t.key == "mlflow.data.context"] == [context]
    artifacts = {f.path for d in ("manifests", "eval", "train") for f in client.list_artifacts(run.info.run_id, d)}
    assert {"manifests/prepare", "manifests/train", "manifests/evaluate", "eval/predictions.jsonl",
            "eval/predictions.json", "eval/summary.json", "train/metrics.jsonl"} <= artifacts


def test_model_is_registered_and_answers_through_pyfunc(flow_run, mlflow_server):
    tmp, cfg_path, _ = flow_run
    import mlflow
    client = mlflow_client(mlflow_server)
    versions = client.search_model_versions("name='test-model'")
    assert len(versions) == 1  # the tests that train other models register them under names of their own
    v = client.get_model_version("test-model", versions[0].version)
    assert v.aliases == ["champion"]
    assert client.get_model_version_by_alias("test-model", "champion").version == v.version
    stages = stages_of(cfg_path)
    ev = json.loads((Path(stages["evaluate"]["path"]) / "manifest.json").read_text())
    run_tags = client.get_run(v.run_id).data.tags
    assert v.tags["sftflow.train_fingerprint"] == stages["train"]["fingerprint"]
    assert float(v.tags["sftflow.eval_accuracy"]) == ev["metrics"]["accuracy"]
    assert v.tags["sftflow.eval_set_fingerprint"] == ev["eval_set_fingerprint"]
    assert v.tags["sftflow.data_digest"] == run_tags["sftflow.data_digest"]
    assert v.tags["sftflow.config_hash"] == run_tags["sftflow.config_hash"]

    # the champion answers a chat message exactly as the exported model does through its chat template
    model = mlflow.pyfunc.load_model("models:/test-model@champion")
    message = [{"role": "user", "content": "Who are you?"}]
    replies = model.predict([message, "Repeat after me: apple river stone"])
    assert len(replies) == 2 and all(isinstance(r, str) for r in replies)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = Path(stages["train"]["path"]) / "model"
    tok, hf = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    ids = tok(tok.apply_chat_template(message, tokenize=False, add_generation_prompt=True), add_special_tokens=False,
              return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=128, do_sample=False, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id or tok.eos_token_id)
    assert replies[0] == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_promotion_policies(flow_run, mlflow_server, tmp_path):
    """Re-registers the flow's trained model under made-up train fingerprints with made-up per-item
    results; `if_better` decides on the item-by-item comparison with the champion's folder."""
    tmp, cfg_path, _ = flow_run
    from stages.core.config import config_from_dict
    from stages.register import run_register
    from stages.tracking.run import Lineage
    client = mlflow_client(mlflow_server)
    stages = stages_of(cfg_path)
    ev = json.loads((Path(stages["evaluate"]["path"]) / "manifest.json").read_text())

    def scored(folder: Path, correct: list[bool], **extra) -> str:
        folder.mkdir(exist_ok=True)
        (folder / "predictions.jsonl").write_text("".join(
            json.dumps({"source": f"q:{i}", "prompt": [{"role": "user", "content": f"q{i}"}], "reference": "a",
                        "prediction": "a" if c else "b", "correct": c}) + "\n" for i, c in enumerate(correct)))
        metrics = {**ev["metrics"], "accuracy": sum(correct) / len(correct), "total": len(correct)}
        (folder / "manifest.json").write_text(json.dumps({**ev, **extra, "metrics": metrics}))
        return str(folder)

    def register(train_fp: str, promote: str, correct: list[bool], champion: tuple[str, list[bool]] | None = None,
                 **registry) -> dict:
        registry = {"tracking_uri": mlflow_server, "promote": promote, "model_name": "promo-model",
                    "experiment": "promo", **registry}
        cfg = config_from_dict(tiny_config_dict(tmp_path, registry=registry))
        fps = {"prepare": stages["prepare"]["fingerprint"], "train": train_fp, "evaluate": f"e-{train_fp}",
               "register": f"r-{train_fp}-{promote}"}
        dirs = {"prepare": stages["prepare"]["path"], "train": stages["train"]["path"],
                "evaluate": scored(tmp_path / f"evaluate-{train_fp}", correct)}
        if champion is not None:
            dirs["champion"] = scored(tmp_path / f"champion-{train_fp}", champion[1], version=champion[0],
                                      train_fingerprint=f"t{champion[0]}")  # v<N> was registered by training t<N>
        return run_register(cfg, fps["register"], Lineage(fps, dirs))

    half, quarter = [True, False] * 4, [True, False, False, False] * 2
    assert register("t1", "if_better", half)["aliases"] == ["champion"]                     # the first version
    worse = register("t2", "if_better", quarter, ("1", half))
    assert worse["aliases"] == ["challenger"] and "-0.250 [" in worse["alias_reason"]        # paired, with its interval
    assert worse["vs_champion"]["val"]["losses"] == 2 and worse["vs_champion"]["val"]["version"] == "1"
    assert register("t3", "never", [True] * 8)["aliases"] == []
    assert register("t4", "always", [False] * 8)["aliases"] == ["champion"]                 # moved, though worse
    again = register("t4", "if_better", [False] * 8)                                         # same train fingerprint
    assert again["reused_version"] and again["version"] == 4
    stale = register("t5", "if_better", [True] * 8, ("1", half))  # compared with v1, but v4 is champion now
    assert stale["aliases"] == ["challenger"] and "champion v4 was not compared" in stale["alias_reason"]
    within = register("t6", "if_better", [False] * 7 + [True], ("4", [False] * 8), tolerance=0.0)
    assert within["aliases"] == ["champion"]  # one win, no loss
    assert len(client.search_model_versions("name='promo-model'")) == 6
    assert client.get_model_version_by_alias("promo-model", "champion").version == "6"
    assert client.get_model_version_by_alias("promo-model", "challenger").version == "5"


def test_second_run_is_fully_cached_and_registers_nothing_new(flow_run, mlflow_server):
    tmp, cfg_path, _ = flow_run
    client = mlflow_client(mlflow_server)
    exp = client.get_experiment_by_name("sftflow").experiment_id
    versions, runs = len(client.search_model_versions("name='test-model'")), len(client.search_runs([exp]))
    assert run_and_see(tmp, cfg_path) == dict.fromkeys(STAGES, "reused")
    assert len(client.search_model_versions("name='test-model'")) == versions
    assert len(client.search_runs([exp])) == runs  # no empty run


def test_a_flow_run_validates_and_plans_once(flow_run, monkeypatch):
    """In-process, so every call is seen: the CLI validates and plans; the flow and its tasks use that plan."""
    tmp, cfg_path, _ = flow_run
    monkeypatch.chdir(tmp)
    monkeypatch.setenv("PREFECT_HOME", str(tmp / ".prefect"))
    from typer.testing import CliRunner

    import flows.cli
    import flows.cli.common
    import flows.sft
    import stages.core.config
    calls = {"load_config": 0, "plan": 0, "expand_paths": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper
    for module in (flows.cli.common, flows.sft):  # the CLI's commands load and plan in flows/cli/common.py
        monkeypatch.setattr(module, "load_config", counted("load_config", module.load_config))
        monkeypatch.setattr(module, "plan", counted("plan", module.plan))
    monkeypatch.setattr(stages.core.config, "expand_paths", counted("expand_paths", stages.core.config.expand_paths))
    result = CliRunner().invoke(flows.cli.app, ["run", "-c", str(cfg_path)])
    assert result.exit_code == 0, result.output
    assert calls == {"load_config": 1, "plan": 1, "expand_paths": 2}  # expand_paths: train and val


def test_stage_evaluate_force_reruns_only_evaluate(flow_run):
    tmp, cfg_path, _ = flow_run
    seen = run_and_see(tmp, cfg_path, "--force", command=("stage", "evaluate"))
    assert seen == {"prepare": "reused", "train": "reused", "evaluate": "ran", "register": "reused"}


def test_deleted_stage_folder_reruns_that_stage(flow_run):
    tmp, cfg_path, _ = flow_run
    import shutil
    shutil.rmtree(stages_of(cfg_path)["evaluate"]["path"])
    assert run_and_see(tmp, cfg_path) == {"prepare": "reused", "train": "reused", "evaluate": "ran",
                                          "register": "reused"}
    assert stages_of(cfg_path)["evaluate"]["status"] == "complete"


def test_eval_knob_changes_only_evaluate_and_register(flow_run, mlflow_server):
    tmp, cfg_path, _ = flow_run
    client = mlflow_client(mlflow_server)
    versions = len(client.search_model_versions("name='test-model'"))
    seen = run_and_see(tmp, cfg_path, "eval.max_new_tokens=6")
    assert seen == {"prepare": "reused", "train": "reused", "evaluate": "ran", "register": "ran"}
    # same train fingerprint: the registered version is reused, nothing is added
    assert len(client.search_model_versions("name='test-model'")) == versions
    reg = json.loads((Path(stages_of(cfg_path, "eval.max_new_tokens=6")["register"]["path"])
                      / "manifest.json").read_text())
    assert reg["metrics"]["reused_version"] is True


def test_lr_change_reruns_train_evaluate_register(flow_run):
    tmp, cfg_path, _ = flow_run
    seen = run_and_see(tmp, cfg_path, "actor.optim.lr=2e-3", "registry.model_name=test-model-lr")
    assert seen == {"prepare": "reused", "train": "ran", "evaluate": "ran", "register": "ran"}


def test_world_size_is_not_part_of_the_result(flow_run):
    tmp, cfg_path, _ = flow_run
    info = show(cfg_path, tmp)
    assert show(cfg_path, tmp, "actor.nproc_per_node=2")["stages"]["train"]["fingerprint"] == \
        info["stages"]["train"]["fingerprint"]


def test_stage_with_upstream_runs_what_is_missing(flow_run):
    tmp, cfg_path, _ = flow_run
    proc = sftflow("stage", "evaluate", "-c", str(cfg_path), "runner.seed=99", cwd=tmp)
    assert proc.returncode == 2 and "--with-upstream" in proc.stderr
    seen = run_and_see(tmp, cfg_path, "runner.seed=99", "--with-upstream", command=("stage", "evaluate"))
    assert seen == {"prepare": "reused", "train": "ran", "evaluate": "ran", "register": "-"}


def test_adding_an_eval_set_rescores_and_never_retrains(flow_run):
    """The commonest event of a scheduled retrain, the eval data growing, re-runs only what scores: the
    named set is prepared apart (prepare_eval), the trained model is reused (its folder and train.log
    untouched: no torchrun for training), the base and trained models are scored on it."""
    tmp, cfg_path, _ = flow_run
    from conftest import demo_rows, write_jsonl
    extra = write_jsonl(tmp / "extra-set.jsonl", demo_rows("eval.jsonl", 20)[12:])
    own = (f"eval.sets.extra.data_paths=[{extra}]", "registry.model_name=test-model-evalset")
    before, after = stages_of(cfg_path), stages_of(cfg_path, *own)
    assert after["train"]["fingerprint"] == before["train"]["fingerprint"]
    assert after["prepare"]["fingerprint"] == before["prepare"]["fingerprint"]
    assert "prepare_eval" in after and "prepare_eval" not in before
    train_log = Path(before["train"]["path"]) / "train.log"
    stamp = train_log.stat().st_mtime_ns
    trained = sorted(p.name for p in (tmp / "artifacts" / "train").iterdir())
    assert run_and_see(tmp, cfg_path, *own) == {"prepare": "reused", "train": "reused", "evaluate": "ran",
                                                "register": "ran"}
    assert (train_log.stat().st_mtime_ns == stamp
            and sorted(p.name for p in (tmp / "artifacts" / "train").iterdir()) == trained)
    done = stages_of(cfg_path, *own)
    assert done["prepare_eval"]["status"] == "complete" and done["baseline"]["status"] == "complete"
    metrics = json.loads((Path(done["evaluate"]["path"]) / "metrics.json").read_text())
    assert metrics["sets"]["extra"]["total"] == 8


def test_every_set_name_the_schema_accepts_scores_end_to_end(flow_run):
    """Names that are also split names (val, train, eval) are ordinary eval sets: each is prepared
    under prepare_eval's eval/<name> and scored there, not read from the prepare stage's val split."""
    tmp, cfg_path, _ = flow_run
    from conftest import demo_rows, write_jsonl
    files = {name: write_jsonl(tmp / f"set-{name}.jsonl", demo_rows("eval.jsonl", 20)[i:i + 5])
             for i, name in enumerate(("val", "train", "eval"))}
    own = [f"eval.sets.{name}.data_paths=[{path}]" for name, path in files.items()]
    own += ["eval.primary=val", "registry.model_name=test-model-setnames"]
    proc = sftflow("run", "-c", str(cfg_path), *own, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = stages_of(cfg_path, *own)
    assert sorted(d.name for d in (Path(done["prepare_eval"]["path"]) / "eval").iterdir()) == ["eval", "train", "val"]
    metrics = json.loads((Path(done["evaluate"]["path"]) / "metrics.json").read_text())
    assert list(metrics["sets"]) == ["val", "train", "eval"] and all(
        metrics["sets"][n]["total"] == 5 for n in files)
    records = [json.loads(x) for x in (Path(done["evaluate"]["path"]) / "predictions.jsonl").read_text().splitlines()]
    assert {r["set"] for r in records} == {"val", "train", "eval"}
    # each set's rows are its own file's, not the prepare stage's val split
    assert {r["source"].split(":")[0] for r in records if r["set"] == "val"} == {str(files["val"])}


def test_edited_data_file_reruns_everything_and_touching_it_does_not(flow_run):
    """On a copy of the training file, so the other tests' data stays as it was."""
    tmp, cfg_path, _ = flow_run
    import time
    train = tmp / "train-copy.jsonl"
    train.write_bytes((tmp / "train.jsonl").read_bytes())
    own = (f"data.train_data_paths=[{train}]", "registry.model_name=test-model-data")
    seen = run_and_see(tmp, cfg_path, *own)
    assert seen == {"prepare": "reused", "train": "reused", "evaluate": "reused", "register": "ran"}  # same contents
    os.utime(train, (time.time() + 5, time.time() + 5))  # same bytes, new mtime
    assert run_and_see(tmp, cfg_path, *own) == dict.fromkeys(STAGES, "reused")
    lines = train.read_text(encoding="utf-8").splitlines()
    train.write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")  # one row fewer
    assert run_and_see(tmp, cfg_path, *own) == dict.fromkeys(STAGES, "ran")


def test_grown_eval_data_rescores_the_champion_on_the_new_items(tmp_path):
    """Retraining after the eval data grew: the champion is scored on today's (larger) eval set by the
    champion stage and compared item by item with the new version, which can displace it (before, a
    champion scored on another eval set was never displaced). A third run is fully cached."""
    from stages.core.config import load_config
    from stages.pipeline import plan
    from conftest import demo_rows, write_jsonl
    raw = tiny_config_dict(tmp_path, n_val=8, registry={"model_name": "grow-model", "tolerance": 1.0})
    cfg_path = write_config(tmp_path, raw)
    assert run_and_see(tmp_path, cfg_path) == dict.fromkeys(STAGES, "ran")
    art = tmp_path / "artifacts"
    assert not (art / "champion").exists()  # nothing to compare with yet
    write_jsonl(Path(raw["data"]["val_data_paths"][0]), demo_rows("eval.jsonl", 12))  # 4 more held-out prompts
    p = plan(load_config(cfg_path))
    assert p.champion["version"] == "1" and "champion" in p.stages
    assert run_and_see(tmp_path, cfg_path) == dict.fromkeys(STAGES, "ran")

    champion = json.loads((p.folder("champion") / "manifest.json").read_text())
    assert champion["version"] == "1" and champion["metrics"]["total"] == 12  # v1, re-scored on the 12 items
    scored = [json.loads(line) for line in (p.folder("champion") / "predictions.jsonl").read_text().splitlines()]
    mine = [json.loads(line) for line in (p.folder("evaluate") / "predictions.jsonl").read_text().splitlines()]
    assert [r["reference"] for r in scored] == [r["reference"] for r in mine] and len(mine) == 12
    register = json.loads((p.folder("register") / "manifest.json").read_text())["metrics"]
    vs = register["vs_champion"]["val"]
    assert vs["version"] == "1" and vs["n"] == 12
    assert vs["wins"] == sum(a["correct"] and not b["correct"] for a, b in zip(mine, scored))
    assert vs["losses"] == sum(b["correct"] and not a["correct"] for a, b in zip(mine, scored))
    assert register["aliases"] == ["champion"] and "vs champion v1 on 12 items" in register["alias_reason"]
    assert (art / "baseline").is_dir() and len(list((art / "baseline").glob("[!.]*"))) == 2  # base, on each eval set

    again = plan(load_config(cfg_path))
    assert "champion" not in again.stages and again.folder("register") == p.folder("register")  # v2 is itself
    assert run_and_see(tmp_path, cfg_path) == dict.fromkeys(STAGES, "reused")
