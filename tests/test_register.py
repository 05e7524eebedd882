"""MLflow bookkeeping without training: promotion policy, one metric point per step across a
resume, dataset digests and config hash, and training that goes on when MLflow is down.
(The flow against a real `mlflow server` is in tests/test_flow.py.)"""

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import stages.register
from conftest import tiny_config_dict
from stages.core.config import config_from_dict
from stages.register import CHALLENGER, CHAMPION, CODE_PATHS, decide_alias
from stages.pipeline import plan
from stages.tracking.run import Lineage, config_hash, data_digest, training_run
from stages.tracking.live import LiveMetrics, RankZeroMetrics, metric_name, new_points, sync_rows


class FakeRegistry:
    """get_model_version_by_alias of an MlflowClient with at most one champion."""

    def __init__(self, champion: dict | None):
        self.champion = champion

    def get_model_version_by_alias(self, name, alias):
        if self.champion is None:
            raise LookupError("no alias")
        return SimpleNamespace(version="3", tags={f"sftflow.{k}": str(v) for k, v in self.champion.items()})


CURRENT = {"eval_accuracy": 0.8, "train_fingerprint": "old"}


def versus(new: list[bool], champion: list[bool], version: str = "3", train: str = "old") -> dict:
    """register's `champion_comparison` of one set: the paired comparison with champion v`version` on the same items."""
    from stages.core.stats.paired import compare
    return {"version": version, "train_fingerprint": train, "accuracy": sum(champion) / len(champion),
            **compare(new, champion)}


SAME = versus([True] * 20 + [False] * 4, [True] * 20 + [False] * 4)
ONE_LOSS = versus([True] * 19 + [False] * 5, [True] * 20 + [False] * 4)       # -0.042, interval far below 0
FIVE_LOSSES = versus([True] * 15 + [False] * 9, [True] * 20 + [False] * 4)    # -0.208: significantly worse
BIG_SAME = versus([True] * 380 + [False] * 20, [True] * 380 + [False] * 20)   # 400 ties: interval +-0.0095


@pytest.mark.parametrize("policy, vs, tolerance, decide_on, expected", [
    ("if_better", SAME, 0, "estimate", None),                  # a tie: the alias stays where it is
    ("if_better", ONE_LOSS, 0.05, "estimate", None),           # tolerance is for new versions only
    ("if_better", versus([True] * 21 + [False] * 3, [True] * 20 + [False] * 4), 0, "estimate", CHAMPION),  # better
    ("if_better", versus([True] * 21 + [False] * 3, [True] * 20 + [False] * 4), 0, "interval", None),  # not shown
    ("always", SAME, 0, "estimate", None),
    ("never", SAME, 0, "estimate", None),
])
def test_a_version_registered_before_takes_the_alias_back_only_when_strictly_better(policy, vs, tolerance, decide_on,
                                                                                     expected):
    """Re-running an older config (its training registered already) or alternating two configs must not
    flip `champion` on a tie; a new version's tie promotes (decide_alias's docstring, docs/evaluation.md)."""
    alias, why = decide_alias(FakeRegistry(CURRENT), "m", policy, vs, "identity", "t", tolerance, decide_on,
                              reused=True)
    assert alias == expected and why
    new, _ = decide_alias(FakeRegistry(CURRENT), "m", "if_better", SAME, "identity", "t", 0, "estimate")
    assert new == CHAMPION


@pytest.mark.parametrize("policy, champion, vs, tolerance, decide_on, expected", [
    ("never", CURRENT, SAME, 0, "estimate", None),
    ("never", None, None, 0, "estimate", None),
    ("always", CURRENT, FIVE_LOSSES, 0, "estimate", CHAMPION),
    ("always", None, None, 0, "estimate", CHAMPION),
    ("if_better", None, None, 0, "estimate", CHAMPION),                 # the first version
    ("if_better", CURRENT, SAME, 0, "estimate", CHAMPION),              # ties move it: >=
    ("if_better", CURRENT, ONE_LOSS, 0, "estimate", CHALLENGER),        # one item on 24
    ("if_better", CURRENT, ONE_LOSS, 0.05, "estimate", CHAMPION),       # ... within the tolerance
    ("if_better", CURRENT, ONE_LOSS, 0.05, "interval", CHALLENGER),     # ... but 24 items can't show it
    ("if_better", CURRENT, SAME, 0.05, "interval", CHALLENGER),         # not even with no change
    ("if_better", CURRENT, BIG_SAME, 0.05, "interval", CHAMPION),       # 400 items can
    ("if_better", CURRENT, FIVE_LOSSES, 0.05, "estimate", CHALLENGER),
    ("if_better", CURRENT, None, 0, "estimate", CHALLENGER),            # the champion was not scored in this run
    ("if_better", CURRENT, versus([True], [True], "2"), 0, "estimate", CHALLENGER),  # another champion was
    ("if_better", CURRENT, versus([True], [True], "3", "reset"), 0, "estimate", CHALLENGER),  # v3 of a reset registry
    ("if_better", {**CURRENT, "train_fingerprint": "t"}, None, 0, "estimate", CHAMPION),  # this training's own
    ("if_better", CURRENT, versus([False] * 24, [False] * 24), 0, "estimate", CHALLENGER),  # a tie at 0/24
    ("if_better", CURRENT, versus([False] * 24, [False] * 24), 0.05, "estimate", CHAMPION),  # ... tolerated
    ("if_better", CURRENT, versus([True] + [False] * 23, [False] * 24), 0, "estimate", CHAMPION),  # 1/24 beats 0
])
def test_decide_alias(policy, champion, vs, tolerance, decide_on, expected):
    alias, why = decide_alias(FakeRegistry(champion), "m", policy, vs, "identity", "t", tolerance, decide_on)
    assert alias == expected and why
    if (vs and policy == "if_better" and champion == CURRENT
            and (vs["version"], vs["train_fingerprint"]) == ("3", "old")):
        assert f"[{vs['delta_low']:+.3f}, {vs['delta_high']:+.3f}] vs champion v3" in why  # the numbers it decided on


def test_a_failed_retention_guard_holds_back_promotion(tmp_path):
    """Per set: delta = tuned - base, paired; a guarded set that fell more than max_drop (on the estimate,
    or on the interval's lower bound with decide_on: interval) keeps the version challenger."""
    from stages.evaluate import guard_sets
    from stages.core.stats.paired import compare
    from stages.register import failed_guards
    raw = tiny_config_dict(tmp_path)
    val = raw["data"]["val_data_paths"]

    def judged(decide_on: str, tuned: list[bool], base: list[bool]) -> dict:
        cfg = config_from_dict({**raw, "eval": {"sets": {
            "identity": {"data_paths": val},
            "retention": {"data_paths": val, "max_drop": 0.05, "decide_on": decide_on}}}})
        c = compare(tuned, base)
        sets = {"identity": {"accuracy": 1.0, "base_accuracy": 0.0, "delta": 1.0},
                "retention": {"accuracy": sum(tuned) / len(tuned), "base_accuracy": sum(base) / len(base),
                              "delta": c["delta"], "delta_low": c["delta_low"], "vs_base": c}}
        guard_sets(cfg, sets)
        assert "guard_ok" not in sets["identity"]
        return {"accuracy": 1.0, "sets": sets}

    base = [True] * 45 + [False] * 5
    fell = judged("estimate", [True] * 40 + [False] * 10, base)  # -0.100
    assert fell["sets"]["retention"]["guard_ok"] is False
    failed = failed_guards(fell)
    assert len(failed) == 1 and "'retention' accuracy 0.800 vs the base model's 0.900: -0.100 [" in failed[0]
    for policy in ("always", "if_better"):
        alias, why = decide_alias(FakeRegistry(None), "m", policy, None, "identity", "t", guards=failed)
        assert alias == CHALLENGER and "retention guard" in why
    close = [True] * 44 + [False] * 6  # -0.020 on 50 items: within 0.05, but the interval reaches -0.09
    assert not failed_guards(judged("estimate", close, base))
    assert failed_guards(judged("interval", close, base))
    big_base = [True] * 380 + [False] * 20
    big = [True] * 376 + [False] * 24  # -0.010 on 400 items (4 losses): the interval shows it is within 0.05
    assert not failed_guards(judged("interval", big, big_base))



def test_metric_names_and_points_after_logged_steps():
    assert metric_name("loss") == "train/loss" and metric_name("val_loss") == "val/loss"
    rows = [{"step": s, "loss": 1.0 / s, "lr": 0.1, **({"val_loss": 2.0} if s % 2 == 0 else {})} for s in (1, 2, 3, 4)]
    points = new_points(rows, {"train/loss": 2, "val/loss": 2}, times_ms=[10, 20, 30, 40])
    got = sorted((p.key, p.step, p.timestamp) for p in points)
    assert got == [("loss/train", 1, 10), ("loss/train", 2, 20), ("loss/train", 3, 30), ("loss/train", 4, 40),
                   ("loss/val", 2, 20), ("loss/val", 4, 40),  # both losses in one section of charts too
                   ("train/loss", 3, 30), ("train/loss", 4, 40), ("train/lr", 1, 10), ("train/lr", 2, 20),
                   ("train/lr", 3, 30), ("train/lr", 4, 40), ("val/loss", 4, 40)]


def test_live_metrics_log_each_step_once_across_a_resume(tmp_path, monkeypatch):
    """Attempt 1 logs steps 1-3 and dies; the resume restarts from the step-2 checkpoint (metrics.jsonl
    truncated to steps 1-2, sent as backlog) and logs 3-4 again: MLflow holds steps 1-4 once each."""
    import json
    from mlflow.tracking import MlflowClient
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("x", artifact_location=(tmp_path / "a").as_uri())).info.run_id
    rows = [{"step": s, "loss": 10.0 - s, "tokens_per_s": 100.0 * s} for s in range(1, 5)]

    first = LiveMetrics(run_id, uri, system_metrics=False)
    for r in rows[:3]:
        first.log(r)
    first.close()
    assert first.failed is None

    # the worker's rank 0 side: live logging starts once training looks long enough, with the file's rows
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    short = RankZeroMetrics(metrics, 2, 4, after_seconds=3600)
    short.log(rows[2])
    assert short.sender is None  # a short run is logged when the train stage ends
    resumed = RankZeroMetrics(metrics, 2, 4, after_seconds=0)
    for r in rows[2:]:
        resumed.log(r)
    resumed.close()
    assert resumed.sender.failed is None
    assert resumed.sender.sent == 3  # step 4: train/loss, loss/train, train/tokens_per_s; steps 1-3 were there
    for key in ("train/loss", "train/tokens_per_s"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1, 2, 3, 4]
    assert sync_rows(client, run_id, rows) == 0  # register's backfill finds nothing missing

    broken = LiveMetrics("no-such-run", uri, system_metrics=False)  # a failure is reported, never raised
    broken.log(rows[0])
    broken.close(timeout=60)
    assert broken.failed


def test_training_goes_on_when_the_tracking_server_is_down(tmp_path, closed_port):
    cfg = config_from_dict(tiny_config_dict(tmp_path, registry={"tracking_uri": f"http://127.0.0.1:{closed_port}"}))
    lines = []
    with training_run(cfg, Lineage({"prepare": "p", "train": "t"}), on_line=lines.append) as env:
        pass
    assert env == {"MLFLOW_RUN_ID": ""} and "no live metrics" in lines[0]


def test_data_digest_is_the_content_and_config_hash_the_resolved_config(tmp_path):
    cfg = config_from_dict(tiny_config_dict(tmp_path))
    inputs = plan(cfg).inputs
    train_file = tmp_path / "train.jsonl"
    assert [d for _, d in inputs["train"]] and all(len(d) == 64 for _, d in inputs["train"] + inputs["val"])
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(train_file.read_bytes())
    same = config_from_dict(tiny_config_dict(tmp_path, data={"train_data_paths": [str(moved)]}))
    assert data_digest(plan(same).inputs) == data_digest(inputs)  # where the data lives doesn't count
    moved.write_text(train_file.read_text().replace("TinyChat", "TinyChap"))
    assert data_digest(plan(same).inputs) != data_digest(inputs)
    assert config_hash(cfg) == config_hash(config_from_dict(tiny_config_dict(tmp_path)))
    assert config_hash(cfg) != config_hash(config_from_dict(tiny_config_dict(tmp_path, eval={"max_new_tokens": 9})))


def test_only_chart_worthy_eval_numbers_are_metrics_and_all_are_in_the_summary():
    from stages.register import eval_metric_values, eval_summary
    m = {"accuracy": 0.5, "correct": 1, "total": 2, "eval_loss": 1.5, "base_accuracy": 0.0, "primary_set": "a",
         "sets": {"a": {"accuracy": 0.5, "correct": 1, "total": 2, "base_accuracy": 0.0, "delta": 0.5},
                  "b": {"accuracy": 1.0, "correct": 3, "total": 3, "base_accuracy": 1.0, "delta": 0.0, "max_drop": 0.1,
                        "guard_ok": True}}}
    assert eval_metric_values(m) == {"eval/accuracy": 0.5, "eval/reference_loss": 1.5, "eval/base_accuracy": 0.0,
                                     "eval/a/accuracy": 0.5, "eval/a/base_accuracy": 0.0, "eval/a/delta": 0.5,
                                     "eval/b/accuracy": 1.0, "eval/b/base_accuracy": 1.0, "eval/b/delta": 0.0}
    summary = eval_summary(m)
    assert [r["set"] for r in summary] == ["a", "b"] and summary[1]["total"] == 3
    assert list(summary[1]) == ["set", "accuracy", "base_accuracy", "delta", "correct", "total", "max_drop"]


def test_ui_url_is_the_tracking_server_without_credentials(tmp_path):
    from stages.core.config import config_from_dict
    from stages.tracking.run import ui_url

    def url(**registry):
        return ui_url(config_from_dict(tiny_config_dict(tmp_path, registry=registry)))
    assert url() == "http://127.0.0.1:5000"
    assert url(ui_url="http://mlflow.lan:8080/") == "http://mlflow.lan:8080"
    assert url(tracking_uri="https://bob:secret@mlflow.example.com/") == "https://mlflow.example.com"


def test_predictions_table_puts_wrong_answers_first(tmp_path):
    from conftest import write_jsonl
    from stages.register import predictions_table
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q3"}]
    rows = [{"set": s, "source": "f:1", "prompt": q, "reference": "r", "prediction": p, "correct": p == "r",
             "new_tokens": 1} for s, q, p in (("a", [{"role": "user", "content": "q1"}], "r"),
                                              ("a", [{"role": "user", "content": "q2"}], "x"), ("b", chat, "y"))]
    table = predictions_table(write_jsonl(tmp_path / "predictions.jsonl", rows))
    assert list(table.columns) == ["correct", "set", "prompt", "reference", "prediction"]
    assert table["prompt"].tolist() == ["q2", "system: s\nuser: q3", "q1"]  # wrong ones first, in file order
    assert table["correct"].tolist() == [False, False, True]


def test_make_ui_follows_the_config_and_creates_nothing(tmp_path):
    """`make ui CONFIG=...` looks up the config's own experiment; with nothing logged yet it says so, and
    it never creates the store or the experiment (a link to an empty experiment it made leads nowhere)."""
    import subprocess
    import sys
    from conftest import ROOT, write_config
    raw = tiny_config_dict(tmp_path, registry={"experiment": "my-exp"})
    cfg_path = write_config(tmp_path, raw)
    out = subprocess.run([sys.executable, "-m", "stages.tracking.ui", str(cfg_path), "--port", "5123", "--print-only"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "nothing logged to experiment 'my-exp' yet" in out.stdout and "http://127.0.0.1:5123" in out.stdout
    assert not (tmp_path / "artifacts").exists()


def test_registry_reads_from_sqlite_agree_with_mlflow_s_client(tmp_path):
    """Planning reads the champion (and a cached register the aliases) straight from MLflow's SQLite store,
    without importing MLflow; the answers must be the client's."""
    from mlflow.tracking import MlflowClient
    from stages.tracking import registry
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert registry.current_champion(uri, "m") is None and not (tmp_path / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=uri)
    client.create_registered_model("m")
    for fp in ("a", "b"):
        v = client.create_model_version("m", str(tmp_path), tags={"sftflow.train_fingerprint": fp})
    assert registry.current_champion(uri, "m") is None  # no alias yet
    client.set_registered_model_alias("m", "champion", "2")
    client.set_registered_model_alias("m", "challenger", "1")
    client.set_model_version_tag("m", "2", "sftflow.champion_fingerprint", "c123")
    fast = registry.current_champion(uri, "m")
    assert fast == {"registry": uri, "name": "m", "version": str(v.version), "train_fingerprint": "b",
                    "champion_fingerprint": "c123", "start": "", "models_fingerprint": "", "trained_on": "",
                    "rehearsed": ""}
    assert registry._sqlite_alias(tmp_path / "mlflow.db", "m", "champion") is not False  # the fast path answered
    for version in ("1", "2"):
        v = client.get_model_version("m", version)
        assert registry.version_state(uri, "m", version) == {"exists": True, "aliases": sorted(v.aliases),
                                                             "train_fingerprint": v.tags["sftflow.train_fingerprint"]}
    assert registry.version_state(uri, "m", 3) == {"exists": False}
    assert registry.current_champion(uri, "other") is None
    # a tracking server that is down: no champion known at planning (register asks again and holds back)
    assert registry.current_champion("http://127.0.0.1:9", "m") is None
    assert registry.version_state("http://127.0.0.1:9", "m", 1) is None


def test_the_logged_model_imports_its_code_without_the_project(tmp_path):
    """The registered model's code (register's CODE_PATHS, MLflow's `code_paths`) imports where no
    `stages` package is: generation.py finds the precision rule and the stop tokens beside it. Its
    definition (chat_model.py, which MLflow loads beside them) loads without MLflow's warning about its
    union hint and leaves the process's logging as it was: no filter stays on MLflow's logger."""
    for path in [*CODE_PATHS, str(Path(stages.register.__file__).parent / "chat_model.py")]:
        shutil.copy(path, tmp_path)
    code = ("import sys\n"
            "sys.modules['stages'] = None  # `import stages...` fails, as in a served model's environment\n"
            "import generation\n"
            "class Tok:\n"
            "    eos_token_id = 2\n"
            "    def get_vocab(self):\n"
            "        return {'<|im_end|>': 7, 'a': 1}\n"
            "class Model:\n"
            "    class generation_config:\n"
            "        eos_token_id = [2, 3]\n"
            "print(generation.stop_ids(Model, Tok()), generation.resolve_precision.__module__)\n"
            "import logging\n"
            "import chat_model\n"
            "print(chat_model.ChatModel.__name__, logging.getLogger('mlflow.types.type_hints').filters)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-3:-1] == ["[2, 3, 7] precision", "ChatModel []"], proc.stdout
    assert "Union type hint" not in proc.stderr
