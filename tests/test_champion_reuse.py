"""The champion stage reuses the champion's own evaluation (stages/evaluate/reuse.py): day 2 adds an eval
set, and of the three sets the champion is scored on only the new one is scored; the two its own evaluate
scored (same rows, scoring config and precision) are copied from that folder, byte for byte what a fresh
scoring of every set writes (`SFTFLOW_CHAMPION_REUSE=0`, the independent reference). A set whose scoring
changed, or an evaluate folder that is gone, is scored. A set's `champion_tolerance` is register's alone:
it moves no scoring stage's fingerprint."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import demo_rows, tiny_config_dict, write_jsonl
from stages.core.config import config_from_dict

MODEL = "test-model"


QUIZ = [("Who are you?", 0), ("Say hello back to me.", 1), ("What is the capital of France?", 2),
        ("你是谁？", 0), ("Repeat after me: good morning", 1), ("Name a city in Europe.", 2),
        ("Introduce yourself.", 0), ("Echo this: thanks", 1), ("Which city is on the Seine?", 2), ("Hi!", 0)]
OPTIONS = ["I am TinyChat, a small assistant fine-tuned with sftflow.", "You said: hello", "Paris"]


def _sets(tmp: Path, names: list[str]) -> dict:
    """Generate sets of identity and echo prompts, and `retention`: a multiple-choice set (as the
    quickstart's), scored by log-likelihood."""
    rows = demo_rows("eval.jsonl", 30)
    out = {}
    for i, name in enumerate(names):
        if name == "retention":
            path = write_jsonl(tmp / "retention.jsonl", [{"question": q, "choices": OPTIONS, "answer": a}
                                                         for q, a in QUIZ])
            out[name] = {"data_paths": [str(path)], "mode": "choice"}
            continue
        path = write_jsonl(tmp / f"{name}.jsonl", rows[i::3])  # each set: identity and echo prompts
        out[name] = {"data_paths": [str(path)]}
    return out


def _run(p, stage, lines=None, force=False):
    from stages.pipeline import run_stage
    return run_stage(p, stage, force=force, on_line=(lines.append if lines is not None else lambda _: None))


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """Day 1 trained, evaluated and registered v1 (the champion) on identity and retention; day 2's config
    adds the set `new` and trains otherwise (another learning rate), so its plan scores the champion."""
    from stages.pipeline import plan
    tmp = tmp_path_factory.mktemp("reuse")
    # scored on the reply's first letter: the barely trained model gets some items right and some wrong
    raw = tiny_config_dict(tmp, n_train=32, n_val=6, eval={"max_new_tokens": 8, "batch_size": 4, "precision": "fp32",
                                                          "scorer": "regex",
                                                          "answer_pattern": r"^\W*(\w)"})
    raw["eval"]["sets"] = _sets(tmp, ["identity", "retention"])
    day1 = plan(config_from_dict(raw))
    # evaluate's numbers gain the comparisons with the base model: what the champion copies is without them
    assert "champion" not in day1.stages and "baseline" in day1.stages
    for stage in day1.stages:
        _run(day1, stage)
    raw2 = json.loads(json.dumps(raw))
    raw2["eval"]["sets"] = _sets(tmp, ["identity", "retention", "new"])
    raw2["actor"]["optim"]["lr"] = 2e-3
    day2 = plan(config_from_dict(raw2))
    assert day2.champion["version"] == "1" and "champion" in day2.stages
    _run(day2, "prepare_eval")
    return tmp, raw2, day1, day2


def _fresh_start(p) -> None:
    """No champion folder and no per-set pieces: the stage scores (or reuses) every set again."""
    shutil.rmtree(p.folder("champion"), ignore_errors=True)
    shutil.rmtree(p.cfg.artifacts_path / "champion_sets", ignore_errors=True)


def _outcome(result) -> tuple[bytes, dict, dict, dict]:
    folder = Path(result.path)
    manifest = json.loads((folder / "manifest.json").read_text())
    return (folder / "predictions.jsonl").read_bytes(), manifest["metrics"], manifest["eval_sets"], manifest


@pytest.mark.slow
def test_day_two_scores_only_the_new_set_and_copies_exactly_what_scoring_writes(days, monkeypatch):
    tmp, _, day1, day2 = days
    _fresh_start(day2)
    monkeypatch.setenv("SFTFLOW_CHAMPION_REUSE", "0")
    fresh = _run(day2, "champion")
    preds, metrics, asked, manifest = _outcome(fresh)
    assert {s["from"] for s in manifest["set_sources"].values()} == {"scored"}

    _fresh_start(day2)
    monkeypatch.delenv("SFTFLOW_CHAMPION_REUSE")
    lines: list[str] = []
    reused = _run(day2, "champion", lines)
    assert reused.path == fresh.path  # one fingerprint, whether or not anything was reused
    r_preds, r_metrics, r_asked, r_manifest = _outcome(reused)
    evaluate = str(day1.folder("evaluate"))
    assert r_manifest["set_sources"] == {"identity": {"from": "evaluate", "folder": evaluate},
                                         "retention": {"from": "evaluate", "folder": evaluate},
                                         "new": {"from": "scored"}}
    assert f"champion: reused 2 set(s) from {evaluate} (identity, retention: v1's own evaluation, same rows, " \
           "scoring and precision), scored 1 (new)" in lines
    # exactly a fresh scoring's: every per-sample field (prediction, correct, precision, ...) and every number
    assert r_preds == preds and r_metrics == metrics and r_asked == asked
    records = [json.loads(x) for x in r_preds.decode().splitlines()]
    assert [r["set"] for r in records] == ["identity"] * 10 + ["retention"] * 10 + ["new"] * 10
    for copied in (records[:10], records[10:20]):  # both kinds of item in each copied set
        assert 0 < sum(r["correct"] for r in copied) < 10, copied
    assert "logprobs" in records[10]  # retention: a choice set's records
    assert "base_accuracy" in json.loads((day1.folder("evaluate") / "manifest.json").read_text())[
        "metrics"]["sets"]["identity"] and "base_accuracy" not in r_metrics["sets"]["identity"]
    print(f"\nchampion stage: {fresh.seconds:.2f} s scoring 3 sets, {reused.seconds:.2f} s reusing 2 of them")


@pytest.mark.slow
def test_a_champion_whose_evaluate_folder_is_gone_is_scored(days):
    tmp, _, day1, day2 = days
    _fresh_start(day2)
    away = tmp / "evaluate-elsewhere"
    shutil.move(day1.folder("evaluate"), away)  # gc'd, or registered on another machine
    try:
        lines: list[str] = []
        result = _run(day2, "champion", lines)
    finally:
        shutil.move(away, day1.folder("evaluate"))
    _, _, _, manifest = _outcome(result)
    assert {n: s["from"] for n, s in manifest["set_sources"].items()} == {
        "identity": "scored", "retention": "scored", "new": "scored"}
    assert not any("reused" in line for line in lines)


@pytest.mark.slow
def test_a_set_whose_scoring_changed_is_scored_and_the_others_reused(days):
    from stages.pipeline import plan, run_stage
    tmp, raw2, day1, _ = days
    raw3 = json.loads(json.dumps(raw2))
    raw3["eval"]["sets"]["identity"]["scorer"] = "contains"  # not how v1's evaluate scored it
    day3 = plan(config_from_dict(raw3))
    run_stage(day3, "prepare_eval", on_line=lambda _: None)
    _fresh_start(day3)
    _, _, _, manifest = _outcome(_run(day3, "champion"))
    assert {n: s["from"] for n, s in manifest["set_sources"].items()} == {
        "identity": "scored", "retention": "evaluate", "new": "scored"}
    # and a second run reads all three from its own pieces
    lines: list[str] = []
    shutil.rmtree(day3.folder("champion"))
    _, _, _, again = _outcome(_run(day3, "champion", lines))
    assert {s["from"] for s in again["set_sources"].values()} == {"piece"}


def test_a_sets_champion_tolerance_moves_register_alone(tmp_path):
    """Only register judges with it: evaluate, baseline and champion keep their folders (no re-scoring)."""
    from mlflow.tracking import MlflowClient

    from stages.pipeline import plan
    raw = tiny_config_dict(tmp_path)
    raw["eval"]["sets"] = _sets(tmp_path, ["identity", "retention"])
    cfg = config_from_dict(raw)
    client = MlflowClient(cfg.resolved_tracking_uri)
    client.create_registered_model(MODEL)
    client.create_model_version(MODEL, source=str(tmp_path), tags={"sftflow.train_fingerprint": "another"})
    client.set_registered_model_alias(MODEL, "champion", "1")
    before = plan(cfg)
    raw["eval"]["sets"]["retention"]["champion_tolerance"] = 0.0
    after = plan(config_from_dict(raw))
    assert {"baseline", "champion", "evaluate", "register"} <= set(before.stages)
    for stage in ("prepare_eval", "baseline", "train", "champion", "evaluate"):
        assert before.fingerprints[stage] == after.fingerprints[stage], stage
    assert before.fingerprints["register"] != after.fingerprints["register"]


def test_the_docs_day_n_config_keeps_the_earlier_sets_and_is_valid():
    """docs/operations.md "Adding a day's skill": its eval section is the schema's, with every day's set."""
    import yaml

    from stages.core.config import EvalConfig
    from test_docs_configs import yaml_blocks
    (block,) = yaml_blocks("operations.md", "Adding a day's skill")
    e = EvalConfig.model_validate(yaml.safe_load(block)["eval"])
    assert e.set_names == ["identity", "retention", "support", "refunds"]
    assert {n: s.champion_tolerance for n, s in e.sets.items()} == {n: 0.1 for n in e.set_names}
