"""Promotion guards every skill (register's `promote_version`): each eval set is compared with the champion
item by item before the alias moves, from the scores files evaluate and the champion stage write, in a
real MLflow registry. A version that ties on the primary set but lost an earlier day's skill stays
challenger, the set named in its reason; one that lost an item within the set's tolerance moves it."""

import json
from pathlib import Path

import pytest

from conftest import tiny_config_dict
from stages.core.cache.artifacts import StageBuild
from stages.core.config import config_from_dict
from stages.core.stats.scores import by_set
from stages.register import CHALLENGER, CHAMPION, champion_comparison, promote_version

MODEL = "test-model"


def scored(root: Path, stage: str, fp: str, correct: dict[str, list[bool]], **manifest) -> str:
    """A scoring stage's folder as evaluate and the champion stage commit it: per-item records in
    predictions.jsonl (the same items for every model) and each set's numbers in the manifest."""
    build = StageBuild(root, stage, fp)
    sets, lines = {}, []
    for name, items in correct.items():
        sets[name] = {"accuracy": sum(items) / len(items), "correct": sum(items), "total": len(items)}
        lines += [json.dumps({"set": name, "prompt": [{"role": "user", "content": f"{name} question {i}"}],
                              "reference": f"answer {i}", "prediction": f"answer {i}" if ok else "no",
                              "correct": ok, "precision": "fp32"}) for i, ok in enumerate(items)]
    (build.partial / "predictions.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(build.commit({"metrics": by_set(sets, next(iter(correct))), **manifest}))


@pytest.fixture
def world(tmp_path):
    from mlflow.tracking import MlflowClient
    raw = tiny_config_dict(tmp_path)
    val = raw["data"]["val_data_paths"]
    raw["eval"]["sets"] = {"identity": {"data_paths": val}, "support": {"data_paths": val}}  # day 1's, day 2's
    cfg = config_from_dict(raw)
    client = MlflowClient(cfg.resolved_tracking_uri)
    client.create_registered_model(MODEL)
    # v1, the champion, scored on both sets by its own evaluate, and on a set this config no longer has
    client.create_model_version(MODEL, source=str(tmp_path), tags={
        "sftflow.train_fingerprint": "t1", "sftflow.eval_identity_accuracy": "0.833",
        "sftflow.eval_support_accuracy": "0.938", "sftflow.eval_faq_accuracy": "0.5"})
    client.set_registered_model_alias(MODEL, "champion", "1")
    champion = {"identity": [True] * 20 + [False] * 4, "support": [True] * 15 + [False]}
    champion_dir = scored(cfg.artifacts_path, "champion", "c1", champion, version=1, train_fingerprint="t1")
    return cfg, client, champion, champion_dir


def decide(world, fp: str, correct: dict[str, list[bool]]):
    """register's decision for a new version trained as `fp`, scored `correct`, from the files on disk."""
    cfg, client, _, champion_dir = world
    evaluate_dir = scored(cfg.artifacts_path, "evaluate", f"e_{fp}", correct)
    version = client.create_model_version(MODEL, source=str(cfg.artifacts_path), tags={"sftflow.train_fingerprint": fp})
    metrics = json.loads((Path(evaluate_dir) / "manifest.json").read_text())["metrics"]
    versus = champion_comparison(metrics, evaluate_dir, champion_dir)
    alias, why, aliases = promote_version(cfg, client, str(version.version), {"train": fp, "champion": "c1"},
                                          metrics, versus, reused=False)
    return str(version.version), alias, why, aliases


def test_a_version_that_lost_an_earlier_skill_stays_challenger(world):
    cfg, client, champion, _ = world
    forgot = {"identity": champion["identity"], "support": [True] * 3 + [False] * 13}  # ties, then 12 of 15 lost
    version, alias, why, aliases = decide(world, "t2", forgot)
    assert alias == CHALLENGER and aliases == ["challenger"]
    assert client.get_model_version_by_alias(MODEL, "champion").version in (1, "1")
    assert "'identity' +0.000" in why and "not worse than the champion" in why  # the primary set alone would pass
    assert ("'support' 0.188 vs the champion's 0.938: -0.750 [" in why
            and "worse by more than 0.1 (eval.sets.support.champion_tolerance)" in why)
    assert client.get_model_version(MODEL, version).tags["sftflow.alias_reason"] == why
    assert "not compared: 'faq' (champion v1 was scored on it, this run's eval.sets lack it)" in why


def test_a_loss_within_the_sets_tolerance_takes_the_alias(world):
    cfg, client, champion, _ = world
    one_less = {"identity": champion["identity"], "support": [True] * 14 + [False] * 2}  # -0.062: within 0.1
    version, alias, why, aliases = decide(world, "t3", one_less)
    assert alias == CHAMPION and aliases == ["champion"] and "lost ground" not in why
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) == version


def test_the_tolerance_is_the_sets_own(world):
    cfg, client, champion, champion_dir = world
    strict = config_from_dict({**cfg.model_dump(), "eval": {**cfg.eval.model_dump(), "sets": {
        **cfg.eval.model_dump()["sets"], "support": {**cfg.eval.sets["support"].model_dump(),
                                                     "champion_tolerance": 0.0}}}})
    one_less = {"identity": champion["identity"], "support": [True] * 14 + [False] * 2}
    version, alias, why, _ = decide((strict, client, champion, champion_dir), "t4", one_less)
    assert alias == CHALLENGER and "(eval.sets.support.champion_tolerance)" in why and "more than 0 " in why
