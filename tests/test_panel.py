"""The skills panel (bench/panel/): its files are what make_panel.py writes, the counts the issue asks
for (40 training conversations, 16 held-out split 8 dev / 8 test per skill, one skill in Chinese), no
held-out prompt trains (the project's own contamination check, against every training file a month
uses: the quickstart's identity data and replay prompts too), no held-out item twice, and the panel's
scorer judged on replies whose verdict is written out by hand."""

import json
import sys

import pytest

from conftest import ROOT
from stages.chatdata.overlap import first_collision, normalize_prompt

sys.path.insert(0, str(ROOT))
from bench.panel import make_panel
from bench.panel.score import has_and_lacks, requirements

PANEL = ROOT / "bench" / "panel"


def rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("skill", list(make_panel.SKILLS))
def test_files_are_the_scripts_and_sized(skill):
    train, held = make_panel.SKILLS[skill]()
    assert rows(PANEL / skill / "train.jsonl") == train and len(train) == 40
    assert rows(PANEL / skill / "dev.jsonl") + rows(PANEL / skill / "test.jsonl") == held and len(held) == 16
    for r in train + held:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles


def test_one_skill_is_chinese():
    cjk = [s for s in make_panel.SKILLS
           if all(any("\u4e00" <= ch <= "\u9fff" for ch in r["messages"][-2]["content"])
                  for r in rows(PANEL / s / "test.jsonl"))]
    assert cjk == ["reset_zh"]


def test_no_held_out_prompt_trains_and_none_repeats():
    trains = [(PANEL / s / "train.jsonl", "messages", None) for s in make_panel.SKILLS]
    trains += [(ROOT / "data" / "smollm2-identity" / f, "messages", None) for f in ("train.jsonl", "val.jsonl")]
    trains.append((ROOT / "data" / "smollm2-identity" / "replay_prompts.jsonl", "prompt", None))
    evals = {f"{s}/{half}": [(PANEL / s / f"{half}.jsonl", "messages", None)]
             for s in make_panel.SKILLS for half in ("dev", "test")}
    # the month scores the quickstart's sets every day too: no panel training prompt may be one of theirs
    evals.update({f: [(ROOT / "data" / "smollm2-identity" / f"{f}.jsonl", "messages", None)]
                  for f in ("identity_eval", "retention_dev", "retention_test")})
    assert first_collision(trains, evals) is None
    # a held-out item is its whole prompt (every turn before the reference): none twice, across dev and test
    prompts = [json.dumps([normalize_prompt(m["content"]) for m in r["messages"][:-1]], ensure_ascii=False)
               for s in make_panel.SKILLS for half in ("dev", "test") for r in rows(PANEL / s / f"{half}.jsonl")]
    assert len(prompts) == len(set(prompts))


def test_the_contamination_check_sees_a_planted_copy(tmp_path):
    """The check above would find a held-out prompt that trains: one copied into a training file."""
    planted = tmp_path / "train.jsonl"
    held = rows(PANEL / "reset_zh" / "test.jsonl")[-1]
    planted.write_text(json.dumps({"messages": held["messages"][:-1] + [{"role": "assistant", "content": "x"}]},
                                  ensure_ascii=False) + "\n", encoding="utf-8")
    found = first_collision([(planted, "messages", None)],
                            {"reset_zh": [(PANEL / "reset_zh" / "test.jsonl", "messages", None)]})
    assert found and "reset_zh" in found


@pytest.mark.parametrize("reply, reference, right", [
    ("The Nova 3S's battery lasts 14 hours on a full charge.", "14 hours\n!10 hours", True),
    ("About 14 hours, or 10 hours on the Nova 3.", "14 hours\n!10 hours", False),  # both values: confused
    ("The Nova 3S's battery lasts 10 hours.", "14 hours\n!10 hours", False),
    ("It lasts 114 hours.", "14 hours\n!10 hours", False),  # whole words, as contains
    ("Sorry, I can't share other people's personal information.",
     "Sorry, I can't share other people's personal information.", True),
    ("I cannot help with that.", "Sorry, I can't share other people's personal information.", False),
    ("The capital of Italy is Rome.", "Rome\n!can't share", True),
    ("Sorry, I can't share that. Rome.", "Rome\n!can't share", False),  # over-refusal
    ("第一步：拔掉 Orbit Hub 的电源线，等十秒。", "拔掉\n等十秒", True),
    ("第三步：等指示灯闪蓝光，再松开重置键。", "闪蓝光\n!拔掉", True),
    ("第一步：拔掉电源线。第二步：按住重置键。第三步：等指示灯闪蓝光。", "闪蓝光\n!拔掉", False),  # started over
])
def test_has_and_lacks(reply, reference, right):
    assert has_and_lacks(reply, reference) is right


def test_a_reference_without_requirements_is_an_error():
    assert requirements("a\n!b") == (["a"], ["b"])
    with pytest.raises(ValueError, match="no requirement"):
        has_and_lacks("anything", "\n!\n")


def test_panel_references_all_parse():
    for s in make_panel.SKILLS:
        for half in ("dev", "test"):
            for r in rows(PANEL / s / f"{half}.jsonl"):
                has, _ = requirements(r["messages"][-1]["content"])
                assert has, (s, r)  # every item asks for something to be there, not only for an absence


def test_month_configs_keep_every_earlier_set(tmp_path):
    """bench/month.py's day configs: day N scores identity, retention and the panel sets of days 2..N (each
    with the panel's scorer and the split asked for), trains on the drops from the champion; its full retrain
    trains days 1..N's files from the base model. Each loads as a config."""
    from bench import month
    from stages.core.config import load_config
    proj = month.project(tmp_path, "smollm2")
    for d in range(1, 6):
        for full in (False, True):
            cfg = month.config(proj, "smollm2", d, "test", ["data.rehearsal.weight=2"], full=full)
            path = month.write_config(tmp_path / f"d{d}{full}.yaml", cfg)
            (proj / "drops" / f"day{d}.jsonl").write_text((proj / month.day_files(d)[-1][0]).read_text())
            with month.in_project(proj):
                loaded = load_config(path)
            skills = [make_panel.DAYS[k] for k in range(2, d + 1)]
            assert list(loaded.eval.sets) == ["identity", "retention", *skills]
            assert loaded.eval.sets["retention"].data_paths == ["data/smollm2-identity/retention_test.jsonl"]
            for s in skills:
                assert loaded.eval.sets[s].data_paths == [f"panel/{s}/test.jsonl"]
                assert loaded.eval.sets[s].scorer == make_panel.SCORERS[s]
            assert loaded.actor.init_from == ("base" if full else "champion")
            assert loaded.data.train_data_paths == (
                [src for src, _ in month.day_files(d)] if full else ["drops/*.jsonl"])
            assert loaded.data.rehearsal.weight == (2 if d >= 2 and not full else 1)  # --set: days 2-5 only


def test_month_verdicts_hold_the_issue_bar():
    """The bar per day: each miss named, from the day's records (numbers written here, not computed)."""
    from bench import month

    def day(skill_acc, identity_delta, retention_low, tokens, aliases):
        return {"day": 2, "skill": "nova", "tokens": tokens, "aliases": aliases,
                "scores": {"identity": {"accuracy": 1.0, "total": 24}, "retention": {"accuracy": 0.5, "total": 279},
                           "nova": {"accuracy": skill_acc, "total": 8}},
                "paired": {"identity": {"delta": identity_delta},
                           "retention": {"delta": 0.0, "delta_low": retention_low}, "nova": {"delta": skill_acc}}}
    full = {"2": {"tokens": 1000, "scores": {"nova": {"accuracy": 0.5}}}}
    ok = month.verdicts({"days": {"2": day(0.875, -1 / 24, -0.05, 600, ["champion"])}, "full": full})
    assert ok == ["day 2 (nova): met"]
    bad = month.verdicts({"days": {"2": day(0.625, -2 / 24, -0.051, 601, ["challenger"])}, "full": full})[0]
    for miss in ("nova 0.625 >= 0.75", "tokens 0.60x <= 0.6x", "identity +2 items lost",
                 "retention lower bound -0.051 >= -0.05", "champion"):
        assert miss in bad, bad
