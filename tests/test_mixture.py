"""Weighted data mixtures (data.mix): the epochs' contents against a direct count, config errors as one
line, the counts in the manifests, and (slow) resume mid-epoch and world size against an
uninterrupted one-configuration run."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import demo_rows, tiny_config_dict, write_config, write_jsonl
from stages.core.config import ConfigError, load_config
from stages.pipeline import plan, run_stage
from stages.runtime.batches import DataPosition, GlobalBatchSampler
from stages.runtime.mixture import epoch_samples, quotas


def test_quotas_split_an_epoch_by_weight_exactly():
    assert quotas([0.7, 0.3], [100, 20]) == [84, 36]
    assert sum(quotas([1, 1, 1], [10, 10, 11])) == 31
    assert quotas([1.0], [17]) == [17]


@pytest.mark.parametrize("weights, sizes", [([0.7, 0.3], [100, 20]), ([1, 3, 1], [50, 7, 200])])
def test_an_epoch_holds_each_source_in_its_share(weights, sizes):
    """Counted directly from the samples: each source's share of every epoch is its quota (its weight's
    share of all rows, within one sample), and the rows it shows are the next window of the source's
    stream, which is whole shuffles of its rows one after another (every row once per shuffle, so
    every row before any repeats, downsampled or up)."""
    from stages.runtime.mixture import _stream
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    want = quotas(weights, sizes)
    total = sum(sizes)
    assert sum(want) == total
    assert all(abs(k - w / sum(weights) * total) < 1 for k, w in zip(want, weights))
    epochs = 5
    for i, (size, k) in enumerate(zip(sizes, want)):
        stream = _stream(11, i, size, 0, epochs * k)
        for start in range(0, len(stream) - size + 1, size):
            assert sorted(stream[start:start + size].tolist()) == list(range(size))
    for epoch in range(epochs):
        picks = epoch_samples(11, epoch, weights, sizes)
        assert len(picks) == total
        source = np.searchsorted(offsets, picks, side="right") - 1
        assert [int((source == i).sum()) for i in range(len(sizes))] == want
        for i, (size, k) in enumerate(zip(sizes, want)):
            window = _stream(11, i, size, epoch * k, k)
            assert Counter((picks[source == i] - offsets[i]).tolist()) == Counter(window.tolist())
    assert not np.array_equal(epoch_samples(11, 0, weights, sizes), np.arange(total))  # shuffled together


def test_epochs_are_a_pure_function_of_seed_epoch_weights_and_sizes():
    a = epoch_samples(3, 2, [0.5, 0.5], [30, 10])
    assert np.array_equal(a, epoch_samples(3, 2, [0.5, 0.5], [30, 10]))
    assert not np.array_equal(a, epoch_samples(3, 1, [0.5, 0.5], [30, 10]))
    assert not np.array_equal(a, epoch_samples(4, 2, [0.5, 0.5], [30, 10]))


def test_one_and_two_ranks_see_the_same_global_samples():
    """A mixture's global batches do not depend on the world size: the ranks' micro-batches together
    are the step's samples, for 1 and 2 ranks alike, and so is the data position after each step."""
    lengths = np.random.default_rng(0).integers(5, 200, 90)
    mixture = ([0.6, 0.4], [70, 20])
    seen = {}
    for world in (1, 2):
        s = GlobalBatchSampler(lengths, 16, 4 // world, world, 5, mixture=mixture)
        pos, steps = DataPosition(), []
        for _ in range(2 * s.steps_per_epoch):
            batch = s.global_batch(pos)
            ranks = [np.concatenate(s.rank_micro_batches(batch, r)) for r in range(world)]
            assert sorted(np.concatenate(ranks).tolist()) == sorted(batch.tolist())
            steps.append((pos.to_dict(), sorted(batch.tolist())))
            pos = s.advance(pos, len(batch))
        seen[world] = steps
    assert seen[1] == seen[2]


def mix_cfg(tmp: Path, name: str = "config.yaml", extra_rows: int = 24, **sections):
    extra = write_jsonl(tmp / "extra.jsonl", demo_rows("eval.jsonl", extra_rows)[::-1])
    raw = tiny_config_dict(tmp, **sections)
    raw["data"]["mix"] = {"train": {"weight": 0.5}, "extra": {"paths": [str(extra)], "weight": 0.5}}
    return raw


@pytest.mark.parametrize("mix, message", [
    ({"train": {"weight": 0}}, "mix.train.weight"),
    ({"train": {"weight": -1}}, "mix.train.weight"),
    ({"extra": {"weight": 1, "paths": ["X"]}}, "mix needs a weight for 'train'"),
    ({"train": {"weight": 1}, "extra": {"weight": 1}}, "mix.extra has no paths"),
    ({"train": {"weight": 1, "paths": ["X"]}}, "mix.train reads data.train_data_paths"),
    ({"train": {"weight": 1}, "replay": {"weight": 1}}, "data.mix.replay needs a `replay` section"),
    ({"train": {"weight": 1}, "extra": {"weight": 1, "paths": ["/nonexistent/x.jsonl"]}}, "does not exist"),
])
def test_a_bad_mixture_is_one_line(tmp_path, mix, message):
    raw = tiny_config_dict(tmp_path)
    raw["data"]["mix"] = mix
    with pytest.raises(ConfigError, match=message) as e:
        load_config(write_config(tmp_path, raw))
    assert "\n" not in str(e.value)


def test_an_empty_source_and_a_file_in_two_sources_are_one_line(tmp_path):
    raw = mix_cfg(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    raw["data"]["mix"]["extra"]["paths"] = [str(tmp_path / "empty.jsonl")]
    with pytest.raises(ConfigError, match="data.mix.extra.*empty"):
        plan(load_config(write_config(tmp_path, raw)))
    raw["data"]["mix"]["extra"]["paths"] = raw["data"]["train_data_paths"]
    with pytest.raises(ConfigError, match="is in both data.train_data_paths and data.mix.extra.paths"):
        plan(load_config(write_config(tmp_path, raw)))


def test_prepare_counts_each_source_and_the_weights_never_reprepare(tmp_path):
    """The train split holds the sources in order, counted per source in the manifest; changing a
    weight changes what trains (train's fingerprint), not what was prepared, nor the baseline."""
    cfg = load_config(write_config(tmp_path, mix_cfg(tmp_path)))
    p = plan(cfg)
    run_stage(p, "prepare", on_line=lambda line: None)
    manifest = json.loads((p.folder("prepare") / "manifest.json").read_text())
    assert manifest["mix"] == [{"source": "train", "rows": 96}, {"source": "extra", "rows": 24}]
    assert manifest["splits"]["train"]["rows_kept"] == 120
    raw = mix_cfg(tmp_path)
    raw["data"]["mix"]["extra"]["weight"] = 0.25
    other = plan(load_config(write_config(tmp_path, raw, "other.yaml")))
    assert other.fingerprints["train"] != p.fingerprints["train"]
    assert other.fingerprints["prepare"] == p.fingerprints["prepare"]  # the same rows: prepared once
    baseline = {f: plan(load_config(write_config(tmp_path, r, f"{f}.yaml"))).fingerprints.get("baseline")
                for f, r in (("a", mix_cfg(tmp_path)), ("b", raw))}
    assert baseline["a"] == baseline["b"] and baseline["a"] is not None  # the base model's scores: reused


# --------------------------------------------------------------------------- torchrun (slow)


@pytest.mark.slow
def test_a_mixture_resumed_mid_epoch_on_another_world_size_equals_the_uninterrupted_run(tmp_path):
    """120 rows (96 + 24, weights 0.5 / 0.5: the small source upsampled x2.5) = 8 steps an epoch; killed
    after the checkpoint at step 3 (48 samples into epoch 0) on 1 process, resumed on 2: the same
    losses and weights as 2 processes without interruption, and the per-source counts in train.log and
    the manifest. (test_train_core resumes 2 -> 1; together, both directions.)"""
    from stages.train import TrainingFailed
    from test_train_core import assert_same_weights, weights
    from test_train_core import train as _train

    steps = dict(runner={"max_epochs": 2, "max_steps": 6, "save_interval": 3, "keep_checkpoints": 5})
    (tmp_path / "ref").mkdir()
    two_procs = {"nproc_per_node": 2, "micro_batch_size": 4, "global_batch_size": 16}
    ref = _train(load_config(write_config(tmp_path / "ref", mix_cfg(tmp_path / "ref", **steps, actor=two_procs))))
    two = load_config(write_config(tmp_path, mix_cfg(tmp_path, **steps, actor=two_procs), "two.yaml"))
    one_raw = mix_cfg(tmp_path, **steps, actor={"nproc_per_node": 1, "micro_batch_size": 4, "global_batch_size": 16})
    one = load_config(write_config(tmp_path, one_raw, "one.yaml"))
    assert plan(one).fingerprints["train"] == plan(two).fingerprints["train"]
    with pytest.raises(TrainingFailed):
        _train(one, {"SFTFLOW_FAULT": "after_save:3"})
    done = _train(two)
    log = (Path(done.path) / "train.log").read_text()
    assert "mixture: 120 samples per epoch: train 60 (50%, 96 rows x0.625), extra 60 (50%, 24 rows x2.5)" in log
    assert "at step 3 (epoch 0, 48 samples into it); world size 1 -> 2" in log
    rows = [json.loads(line) for line in (Path(done.path) / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(line) for line in (Path(ref.path) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref_rows], abs=1e-5)
    assert_same_weights(weights(done.path), weights(ref.path), atol=1e-4)
    manifest = json.loads((Path(done.path) / "manifest.json").read_text())
    assert manifest["metrics"]["mix_extra_per_epoch"] == 60 and manifest["mixture"][1]["passes"] == 2.5
    from mlflow.tracking import MlflowClient
    params = MlflowClient(two.resolved_tracking_uri).get_run(manifest["mlflow_run_id"]).data.params
    assert (params["mix.extra.per_epoch"], params["mix.train.rows"],
            params["data.mix.extra.weight"]) == ("60", "96", "0.5")


def test_show_preview_names_each_sample_s_source_in_training_order(tmp_path):
    """From the prepared shards: the first samples of epoch 0 as training takes them, each named by its
    mixture source (a direct count of epoch_samples' first picks says which)."""
    from conftest import sftflow
    cfg_path = write_config(tmp_path, mix_cfg(tmp_path))
    cfg = load_config(cfg_path)
    p = plan(cfg)
    run_stage(p, "prepare", on_line=lambda line: None)
    proc = sftflow("show", "-c", str(cfg_path), "--preview", "8", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = [line.split(":", 1)[0].strip(" ─-") for line in proc.stdout.splitlines()
             if line.strip(" ─-").startswith(("train: ", "extra: "))]
    first = epoch_samples(cfg.runner.seed, 0, [0.5, 0.5], [96, 24])[:8]
    assert shown == ["train" if i < 96 else "extra" for i in first]
