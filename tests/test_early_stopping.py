"""Early stopping and best-checkpoint selection (`runner.early_stopping_*`, `runner.load_best_model_at_end`):
the rule on its own, the config's defaults, and under torchrun: patience ends the loop, the exported
weights are the best check's (against the checkpoint saved at that step), a run killed twice resumes
to the same choice and the same weights, one process and two gloo ranks choose alike, and the choice
is in train.log, runtime.json, the manifest and the MLflow run."""

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import live_processes_mentioning, tiny_config_dict, write_config
from stages.core.config import ConfigError, load_config
from stages.core.config.fields import hashed
from stages.pipeline import plan
from stages.runtime.validation import BestCheck
from stages.train import TrainingFailed
from test_train_core import train
from test_train_core import weights as exported


def make_cfg(tmp: Path, name: str = "config.yaml", **sections):
    return load_config(write_config(tmp, tiny_config_dict(tmp, **sections), name))


# --------------------------------------------------------------------------- the rule (fast)


def test_patience_counts_checks_without_an_improvement_above_the_threshold():
    rule = BestCheck("val_loss", patience=2, threshold=0.1, load_best=True)
    assert [rule.observe(s, v) for s, v in [(1, 3.0), (2, 2.95), (3, 2.5), (4, 2.45)]] == [True, False, True, False]
    assert (rule.best, rule.best_step, rule.since_best, rule.stopped_at) == (2.5, 3, 1, None)
    assert rule.observe(5, 2.41) is False  # 0.09 better: not by more than the threshold
    assert rule.stopped_at == 5 and rule.shipped_step(5) == 3
    assert rule.summary(5, 16) == ("shipping step 3: val_loss 2.5, best of 5 checks; stopped early at step 5 of 16, "
                                   "patience 2")


def test_accuracy_is_better_higher_and_nan_never_improves():
    rule = BestCheck("val_accuracy", patience=0, threshold=0.0, load_best=False)
    assert [rule.observe(s, v) for s, v in [(1, math.nan), (2, 0.5), (3, 0.5), (4, 0.75), (5, math.nan)]] == \
        [False, True, False, True, False]
    assert (rule.best_step, rule.checks, rule.stopped_at) == (4, 5, None)  # patience 0: never stops
    assert rule.shipped_step(9) == 9  # load_best off: the last step ships, the log says which was best
    assert rule.summary(9, 9).startswith("shipping step 9, the last (runner.load_best_model_at_end is off): "
                                         "the best of 5 checks was step 4, val_accuracy 0.75")


def test_the_state_resumes_the_same_decisions():
    values = [4.0, 3.0, 3.5, 2.9, 3.1, 3.2, 3.3]
    whole = BestCheck("val_loss", 3, 0.0, True)
    for s, v in enumerate(values, 1):
        whole.observe(s, v)
    first = BestCheck("val_loss", 3, 0.0, True)
    for s, v in enumerate(values[:4], 1):
        first.observe(s, v)
    resumed = BestCheck("val_loss", 3, 0.0, True)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as trainer_state.json holds it
    for s, v in enumerate(values[4:], 5):
        resumed.observe(s, v)
    assert resumed.state_dict() == whole.state_dict() and whole.stopped_at == 7 and whole.best_step == 4
    fresh = BestCheck("val_accuracy", 3, 0.0, True)
    fresh.load_state_dict(first.state_dict())  # another metric's state is not this rule's
    assert fresh.checks == 0


def test_off_by_default_and_then_outside_every_fingerprint(tmp_path):
    cfg = make_cfg(tmp_path)
    assert BestCheck.from_runner(cfg.runner) is None
    new = {"metric_for_best_model", "early_stopping_patience", "early_stopping_threshold", "load_best_model_at_end"}
    assert not new & set(hashed(cfg.runner))
    on = make_cfg(tmp_path, "on.yaml", runner={"early_stopping_patience": 2})
    assert set(hashed(on.runner)) - set(hashed(cfg.runner)) == {"early_stopping_patience"}


@pytest.mark.parametrize("key, value", [("early_stopping_patience", 2), ("load_best_model_at_end", True)])
def test_selection_needs_validation_during_training(tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"runner.{key} needs runner.val_check_interval > 0"):
        make_cfg(tmp_path, runner={"val_check_interval": 0, key: value})


# --------------------------------------------------------------------------- torchrun (slow)

# lr 3e-2 makes the tiny model's validation loss fall, then jump: with a check every step it is best
# at step 3 of 16 and no better for the next 3 checks, so patience 3 ends the loop at step 6
# (measured: 5.46 3.82 3.44 6.00 5.10 6.03). A checkpoint every step is the reference for each.
SELECT = dict(runner={"max_epochs": 3, "max_steps": 16, "val_check_interval": 1, "save_interval": 1,
                      "keep_checkpoints": 20, "early_stopping_patience": 3, "load_best_model_at_end": True},
              actor={"optim": {"lr": 3e-2, "warmup": 1}})
BEST, STOP = 3, 6


def checkpoint_weights(folder, step: int) -> dict:
    """The model half of the training checkpoint at `step`, read by DCP into a model built from the
    exported folder's config: what the loop held at that step, independent of the best-weights copy."""
    from transformers import AutoModelForCausalLM

    from stages.runtime.saving.checkpoint import load_model_weights
    model = AutoModelForCausalLM.from_pretrained(Path(folder) / "model", dtype=torch.float32)
    return load_model_weights(model, str(Path(folder) / "checkpoints" / f"step_{step:08d}"))


def val_losses(folder) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in rows}


def selecting(tmp: Path, nproc: int, name: str = "config.yaml"):
    return make_cfg(tmp, name, runner=SELECT["runner"],
                    actor={**SELECT["actor"], "nproc_per_node": nproc, "micro_batch_size": 4, "global_batch_size": 16})


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The SELECT run on two gloo ranks, uninterrupted."""
    return train(selecting(tmp_path_factory.mktemp("two"), 2))


@pytest.mark.slow
def test_patience_stops_the_loop_and_the_best_check_ships(tmp_path, two_ranks):
    done = train(selecting(tmp_path, 1))
    folder = Path(done.path)
    losses = val_losses(folder)
    assert list(losses) == list(range(1, STOP + 1))  # a check every step, none after the stop
    assert min(losses, key=losses.get) == BEST and all(losses[s] >= losses[BEST] for s in range(BEST + 1, STOP + 1))
    log = (folder / "train.log").read_text()
    assert (f"shipping step {BEST}: val_loss {losses[BEST]:.6g}, best of {STOP} checks; stopped early at step "
            f"{STOP} of 16, patience 3") in log
    runtime = json.loads((folder / "runtime.json").read_text())
    assert {k: runtime[k] for k in ("shipped_step", "best_step", "stopped_at", "checks")} == \
        {"shipped_step": BEST, "best_step": BEST, "stopped_at": STOP, "checks": STOP}
    assert runtime["best_metric"] == losses[BEST]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["metrics"]["shipped_step"] == BEST and manifest["metrics"]["stopped_at"] == STOP
    assert manifest["metrics"]["steps"] == STOP
    # the exported weights are those the loop held at the best check, not at its last step
    got, best, last = exported(folder), checkpoint_weights(folder, BEST), checkpoint_weights(folder, STOP)
    assert set(got) <= set(best)  # the checkpoint also names the tied output head
    assert all(torch.equal(got[k], best[k]) for k in got)
    assert not all(torch.equal(got[k], last[k]) for k in got)
    # only the shipped best's copy is left beside the checkpoints
    assert [p.name for p in (folder / "checkpoints" / "best").iterdir()] == [f"step_{BEST:08d}"]
    # MLflow: the step that shipped is a tag and a runtime param of the model's run
    from mlflow.tracking import MlflowClient
    run = MlflowClient(selecting(tmp_path, 1).resolved_tracking_uri).get_run(manifest["mlflow_run_id"])
    assert run.data.tags["sftflow.shipped_step"] == str(BEST)
    assert run.data.params["runtime.shipped_step"] == str(BEST)
    # two gloo ranks choose the same step from the same (reduced) losses, and ship the same weights
    other = Path(two_ranks.path)
    assert json.loads((other / "runtime.json").read_text())["shipped_step"] == BEST
    assert val_losses(other) == pytest.approx(losses, rel=1e-5)  # the reduction order differs
    theirs = exported(other)
    assert max((theirs[k] - got[k]).abs().max().item() for k in got) <= 1e-4


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_choice_and_weights(tmp_path, two_ranks):
    cfg = selecting(tmp_path, 2)
    p = plan(cfg)
    # killed after the checkpoint of step 4 (the best, step 3, is one check back), while saving step 6
    # (where patience stops: the third start resumes from step 5 and must stop at once), and after
    # saving it (the fourth start trains nothing and exports the best)
    for fault in ("after_save:4", f"save:{STOP}", f"after_save:{STOP}"):
        with pytest.raises(TrainingFailed, match="killed by SIGKILL|training failed"):
            train(cfg, {"SFTFLOW_FAULT": fault}, p)
    partial = next(cfg.artifacts_path.joinpath("train").glob(".*.partial"))
    assert not live_processes_mentioning(str(partial)), "a killed run left workers behind"
    state = json.loads((partial / "checkpoints" / "step_00000005" / "trainer_state.json").read_text())["selection"]
    assert (state["best_step"], state["since_best"], state["stopped_at"]) == (BEST, 2, None)
    done = train(cfg, p=p)
    folder = Path(done.path)
    log = (folder / "train.log").read_text()
    assert "at step 4 (epoch 0, 64 samples into it)" in log and "at step 5 (epoch 0, 80 samples into it)" in log
    assert f"at step {STOP} (epoch 1, 0 samples into it)" in log
    assert f"(resumed: {STOP} checks, best val_loss" in log and f"at step {BEST})" in log
    assert f"shipping step {BEST}: " in log and f"stopped early at step {STOP} of 16, patience 3" in log
    ref = Path(two_ranks.path)
    assert json.loads((folder / "runtime.json").read_text()) == json.loads((ref / "runtime.json").read_text())
    assert val_losses(folder) == pytest.approx(val_losses(ref), abs=1e-6)
    got, want = exported(folder), exported(ref)
    assert got.keys() == want.keys()
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6


def test_without_a_validation_set_it_stops_before_torchrun(tmp_path):
    # the held-out rows are a named eval set only: evaluate has prompts, training no validation loss
    cfg = make_cfg(tmp_path, runner={"early_stopping_patience": 2}, data={"val_data_paths": []},
                   eval={"sets": {"held": {"data_paths": [str(tmp_path / "val.jsonl")]}}})
    with pytest.raises(ConfigError, match="need a validation set"):
        train(cfg)
    assert not list(cfg.artifacts_path.joinpath("train").glob("*/train.log"))
