"""A warm start rehearses what its version trained on (`data.rehearsal`, models/start.py `rehearsal`):
which files are new and which are rehearsed, from the version's lineage (its `trained_on` tag), and an
epoch sized by the new rows (runtime/mixture.py `new_data_epoch`). In-process and fast; the flow from
a registered version is tests/test_init_from.py."""

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import demo_rows, tiny_config_dict, write_jsonl
from stages.core.cache.artifacts import input_digest
from stages.core.config import SFTConfig
from stages.core.errors import ConfigError
from stages.models.start import rehearsal
from stages.runtime.batches import GlobalBatchSampler
from stages.runtime.mixture import epoch_samples, new_data_epoch, quotas


def _start(entries: list[dict]) -> dict:
    return {"ref": "models:/m/3", "trained_on": json.dumps(entries)}


def _entry(path, cfg, source="train") -> dict:
    return {"ref": str(path), "digest": input_digest(path, cfg.artifacts_path), "format": "messages",
            "columns": {}, "source": source}


@pytest.fixture
def world(tmp_path):
    cfg = SFTConfig.model_validate(tiny_config_dict(tmp_path))
    old = write_jsonl(tmp_path / "day1.jsonl", demo_rows("train.jsonl", 8))
    older = write_jsonl(tmp_path / "day0.jsonl", demo_rows("train.jsonl", 4))
    new = write_jsonl(tmp_path / "day2.jsonl", demo_rows("eval.jsonl", 6))
    return cfg, old, older, new


def test_new_files_train_and_the_lineage_is_rehearsed(world):
    cfg, old, older, new = world
    start = _start([_entry(old, cfg), _entry(older, cfg, "rehearse")])
    train = [(str(p), input_digest(p, cfg.artifacts_path)) for p in (old, new)]  # a glob holds every day's file
    entries, fresh = rehearsal(cfg, start, train, others=set())
    assert fresh == [train[1]]  # day1.jsonl was trained on: it moves to the rehearse source
    assert [e["ref"] for e in entries] == [str(old), str(older)]
    assert {e["format"] for e in entries} == {"messages"}


def test_no_rehearsal_when_off_unnamed_or_nothing_new(world):
    cfg, old, older, new = world
    start = _start([_entry(old, cfg)])
    train = [(str(old), input_digest(old, cfg.artifacts_path))]
    assert rehearsal(cfg, start, train, set()) is None  # nothing new: train as configured
    both = train + [(str(new), input_digest(new, cfg.artifacts_path))]
    assert rehearsal(cfg, None, both, set()) is None  # the base model
    assert rehearsal(cfg, {"ref": "/some/folder", "trained_on": ""}, both, set()) is None  # no lineage named
    off = SFTConfig.model_validate({**cfg.model_dump(), "data": {**cfg.data.model_dump(), "rehearsal": {"weight": 0}}})
    assert rehearsal(off, start, both, set()) is None
    # a file another mixture source names stays that source's
    assert rehearsal(cfg, start, both, {input_digest(old, cfg.artifacts_path)})[0] == []


def test_a_file_the_lineage_names_that_is_gone_or_changed_is_one_line(world):
    cfg, old, older, new = world
    start = _start([_entry(old, cfg), _entry(older, cfg)])
    train = [(str(new), input_digest(new, cfg.artifacts_path))]
    older.write_text(older.read_text() + older.read_text().splitlines(True)[0])
    with pytest.raises(ConfigError, match=rf"data.rehearsal: models:/m/3 trained on {older}, which has changed since"):
        rehearsal(cfg, start, train, set())
    older.unlink()
    with pytest.raises(ConfigError, match=rf"trained on {older}, which is gone; put that file back, or set "
                                          r"data.rehearsal.weight=0"):
        rehearsal(cfg, start, train, set())


def test_a_moved_project_continues_from_its_champion(tmp_path, monkeypatch):
    """Lineage names the files a version trained on relative to the project: registered in one folder, the
    folder copied elsewhere and the original gone, planning there rehearses the copy's files. A version
    whose lineage was written before (absolute paths into the old folder) finds them again by content."""
    import shutil

    from mlflow.tracking import MlflowClient

    from conftest import write_config
    from stages.core.chat import model_card
    from stages.core.config import load_config
    from stages.pipeline import plan
    old = tmp_path / "a"
    old.mkdir()
    monkeypatch.chdir(old)
    raw = tiny_config_dict(old)
    raw.update(artifacts_dir="artifacts")
    raw["data"].update(train_data_paths=["data/*.jsonl"], val_data_paths=["val.jsonl"])
    raw["actor"].update(init_from="champion", model={"corpus_paths": ["data/day1.jsonl"]})
    (old / "data").mkdir()
    day1 = write_jsonl(old / "data" / "day1.jsonl", demo_rows("train.jsonl", 8))
    cfg = load_config(write_config(old, raw))
    digest = input_digest(day1, cfg.artifacts_path)
    prepared = old / "artifacts" / "prepare" / "p1"
    prepared.mkdir(parents=True)
    (prepared / "manifest.json").write_text(json.dumps(
        {"sources": [{"ref": str(day1), "split": "train", "format": "messages"}]}))
    learned = model_card.trained_on(cfg, str(prepared), {"train": [(str(day1), digest)]})
    assert [e["ref"] for e in learned] == ["data/day1.jsonl"]
    client = MlflowClient(cfg.resolved_tracking_uri)
    client.create_registered_model("test-model")
    client.create_model_version("test-model", source=str(old), tags={"sftflow.trained_on": json.dumps(learned)})
    client.set_registered_model_alias("test-model", "champion", "1")

    new = tmp_path / "b"
    shutil.copytree(old, new)
    shutil.rmtree(old)
    monkeypatch.chdir(new)
    write_jsonl(new / "data" / "day2.jsonl", demo_rows("eval.jsonl", 6))
    p = plan(load_config(new / "config.yaml"))
    assert p.start["ref"] == "models:/test-model/1"
    assert [e["ref"] for e in p.rehearsal] == [str(new / "data" / "day1.jsonl")]
    assert [Path(ref).name for ref, _ in p.inputs["train"]] == ["day2.jsonl"]

    client = MlflowClient(p.cfg.resolved_tracking_uri)
    absolute = [{**e, "ref": str(day1)} for e in learned]  # as lineage was written before: the old folder's path
    client.create_model_version("test-model", source=str(new), tags={"sftflow.trained_on": json.dumps(absolute)})
    client.set_registered_model_alias("test-model", "champion", "2")
    p = plan(load_config(new / "config.yaml"))
    assert p.start["ref"] == "models:/test-model/2"
    assert [e["ref"] for e in p.rehearsal] == [str(new / "data" / "day1.jsonl")]


@pytest.mark.parametrize("weights,sizes,passes", [([1.0, 0.5], [16, 96], 1.0), ([0.5, 0.5, 0.5], [40, 149, 141], 1.0),
                                                  ([0.5, 0.5, 0.25], [40, 149, 141], 2.0), ([1, 1], [3, 1000], 1.5)])
def test_an_epoch_sized_by_its_new_rows(weights, sizes, passes):
    total = new_data_epoch(weights, sizes, passes)
    q = quotas(weights, sizes, total)
    assert sum(q) == total
    assert abs(q[0] - passes * sizes[0]) <= 1  # the new rows, `passes` times each
    share = np.asarray(weights) / sum(weights)  # the others: their weights' shares of the epoch, to a sample
    assert np.all(np.abs(np.asarray(q) - share * total) <= 1)
    # each epoch takes every new row before any repeats, and the sampler's epoch is that long
    picks = epoch_samples(5, 0, weights, sizes, total)
    news = picks[picks < sizes[0]]
    assert len(news) == q[0] and len(set(news.tolist())) == min(q[0], sizes[0])
    sampler = GlobalBatchSampler(np.full(sum(sizes), 8), 4, 4, 1, 5, mixture=(weights, sizes, total))
    assert len(sampler.permutation(0)) == total and sampler.steps_per_epoch == -(-total // 4)


def test_collated_batches_mark_the_rows_the_kl_holds():
    from stages.runtime.batches import collate_packed, collate_padded
    samples = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "kl": False},
               {"input_ids": [8, 9], "loss_mask": [0, 1], "kl": True}]
    packed = collate_packed(samples)
    assert packed["kl_mask"].tolist() == [[False, False, False, True, True]]
    padded = collate_padded(samples, pad_id=0)
    assert padded["kl_mask"].tolist() == [[False] * 3, [True] * 3]
    assert "kl_mask" not in collate_packed([{k: v for k, v in s.items() if k != "kl"} for s in samples])


def test_the_log_counts_the_epoch_the_mixture_has():
    """A warm start's epoch is sized by its new rows (40 new among 319 prepared: 120 samples): train.log says
    so, and each step's epoch is its share of those 120, not of the 319 rows (0.35 then 1.00 before)."""
    from stages.runtime.batches import DataPosition
    from stages.runtime.reporting import epochs_done, samples_said
    weights, sizes = [0.5, 0.5, 0.5], [40, 141, 138]
    total = new_data_epoch(weights, sizes, 1.0)
    sampler = GlobalBatchSampler(np.full(sum(sizes), 8), 16, 4, 1, 5, mixture=(weights, sizes, total))
    assert sampler.n == total == 120
    assert samples_said(sampler.n, sum(sizes)) == "120 samples an epoch (drawn from 319 prepared rows)"
    assert samples_said(96, 96) == "96 samples an epoch"
    pos, epochs = DataPosition(0, 0), []
    for _ in range(2 * sampler.steps_per_epoch):
        pos = sampler.advance(pos, len(sampler.global_batch(pos)))
        epochs.append(epochs_done(pos.epoch, pos.consumed, sampler.n))
    per_step = round(16 / 120, 4)
    assert epochs[:8] == [round((i + 1) * 16 / 120, 4) for i in range(7)] + [1.0]
    assert epochs[-1] == 2.0 and all(0 < b - a <= per_step + 1e-4 for a, b in zip(epochs, epochs[1:]))
