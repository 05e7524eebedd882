"""The daily-retraining configs of the docs run as written past day 1: docs/operations.md's "Retrain when
data arrives" block and docs/your-data.md's config, saved where the page says and planned as a second
day's file arrives. A builtin model's tokenizer is built from its corpus (by default the training data),
so a config that does not pin it makes a new base model every day, and the first warm start from the
champion is refused (issue 57). Planning only: nothing is built or trained."""

from __future__ import annotations

import re

from conftest import ROOT, demo_rows, write_jsonl
from stages.core.config import load_config
from stages.pipeline import plan


def yaml_blocks(page: str, section: str | None = None) -> list[str]:
    text = (ROOT / "docs" / page).read_text()
    if section is not None:
        start = text.index(f"\n## {section}")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end != -1 else None]
    return re.findall(r"```yaml\n(.*?)```", text, re.S)


def base_model(config, *overrides: str) -> str:
    return plan(load_config(config, list(overrides))).fingerprints["models"]


def test_operations_retraining_config_keeps_its_base_model_as_drops_arrive(tmp_path, monkeypatch):
    (block,) = yaml_blocks("operations.md", "Retrain when data arrives")
    monkeypatch.chdir(tmp_path)  # the page's paths are relative to where `sftflow` runs
    (tmp_path / "drops").mkdir()
    config = tmp_path / "config.yaml"
    config.write_text(block)
    write_jsonl(tmp_path / "drops" / "2026-12-01.jsonl", demo_rows("train.jsonl", 40))
    write_jsonl(tmp_path / "eval.jsonl", demo_rows("eval.jsonl", 12))
    day1 = base_model(config)
    write_jsonl(tmp_path / "drops" / "2026-12-05.jsonl", demo_rows("train.jsonl", 80)[40:])
    p = plan(load_config(config, []))
    assert p.cfg.actor.init_from == "champion"
    assert p.fingerprints["models"] == day1, "day 5's drop made another base model: no warm start from v1"


def test_your_data_config_keeps_its_base_model_when_a_file_is_added(tmp_path, monkeypatch):
    (block,) = yaml_blocks("your-data.md")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mydata").mkdir()
    config = tmp_path / "mydata" / "config.yaml"
    config.write_text(block)
    write_jsonl(tmp_path / "mydata" / "train.jsonl", demo_rows("train.jsonl", 40))
    (tmp_path / "mydata" / "eval.csv").write_text("prompt,completion\nWho are you?,I am Ada\n")
    day1 = base_model(config)
    write_jsonl(tmp_path / "mydata" / "more.jsonl", demo_rows("train.jsonl", 80)[40:])
    later = base_model(config, "data.train_data_paths=[mydata/train.jsonl,mydata/more.jsonl]",
                       "actor.init_from=champion")
    assert later == day1, "a second file made another base model: no warm start from v1"
