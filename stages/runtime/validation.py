"""The validation loss of a training run (torchtitan's `Validator`): every rank scores its share
of the validation set with the worker's `get_eval_model_output`, and the sums add up across ranks.
`BestCheck` watches those checks: early stopping and which step's weights ship."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from stages.core.errors import ConfigError

from .contract import add_eval_output
from .sharding import reshard

SUMMED_FIRST = ["loss_sum", "n_tokens", "correct", "total"]  # then any other key of the outputs, sorted


def validate(model: torch.nn.Module, val_ds, score: Callable[[list], dict], hook: str, micro_batch_size: int,
             rank: int, world: int, device: torch.device, fsdp: bool) -> dict:
    """`val_loss` (= summed `loss_sum` / `n_tokens`), `val_tokens` and, when the outputs count
    `correct` / `total`, `val_accuracy`; {} without a validation set. `score(samples)` is the
    worker's output for a micro-batch of samples; every rank runs the same number of batches (the
    collectives inside the forward must match), an empty slot scoring sample 0 and adding nothing."""
    if val_ds is None or len(val_ds) == 0:
        return {}
    model.eval()
    mine = list(range(rank, len(val_ds), world))
    n_batches = math.ceil(math.ceil(len(val_ds) / world) / micro_batch_size)
    sums: dict[str, float] = {}
    with torch.no_grad():
        for k in range(n_batches):
            idx = mine[k * micro_batch_size: (k + 1) * micro_batch_size]
            out = score([val_ds[i] for i in (idx or [0])])
            if idx:
                add_eval_output(sums, out, hook)
    keys = SUMMED_FIRST + sorted(k for k in sums if k not in SUMMED_FIRST)
    stats = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64, device=device)
    if fsdp:
        reshard(model)
    dist.all_reduce(stats)
    model.train()
    total = dict(zip(keys, stats.tolist()))
    out = {"val_loss": total["loss_sum"] / max(total["n_tokens"], 1.0), "val_tokens": int(total["n_tokens"])}
    if total["total"] > 0:
        out["val_accuracy"] = total["correct"] / total["total"]
    return out


class BestCheck:
    """Early stopping and best-checkpoint selection over the validation checks, as HF Trainer's
    `EarlyStoppingCallback` (patience, threshold) and `load_best_model_at_end`, Axolotl's
    `early_stopping_patience`. One rule decides both: a check improves when it beats the best so far
    by more than `threshold` (Keras's min_delta); only an improvement becomes the best and resets the
    count of checks without one. HF moves its best on any gain but counts patience against the
    threshold, so a run of tiny gains there ships a step patience never credited; here they agree.

    Its state is plain JSON in every checkpoint (`state_dict`), so a resumed run decides as an
    uninterrupted one would. Every rank must observe the same value (the worker broadcasts rank 0's)."""

    def __init__(self, metric: str, patience: int, threshold: float, load_best: bool):
        self.metric, self.patience, self.threshold, self.load_best = metric, patience, threshold, load_best
        self.higher_is_better = metric == "val_accuracy"
        self.best: float | None = None
        self.best_step: int | None = None
        self.checks = 0
        self.since_best = 0               # checks in a row that did not improve
        self.stopped_at: int | None = None

    @classmethod
    def from_runner(cls, run) -> "BestCheck | None":
        """The runner section's rule; None when neither early stopping nor best selection is on."""
        if not (run.early_stopping_patience or run.load_best_model_at_end):
            return None
        return cls(run.metric_for_best_model, run.early_stopping_patience, run.early_stopping_threshold,
                   run.load_best_model_at_end)

    def value(self, metrics: dict, hook: str) -> float:
        """The watched metric of a check's `validate` output; a ConfigError when validation has none."""
        if self.metric not in metrics:
            needs = (f"{hook} to count `correct` and `total`" if self.metric == "val_accuracy"
                     else "a validation set (data.val_data_paths or data.val_fraction)")
            raise ConfigError(f"runner.metric_for_best_model: validation reported no {self.metric}; it needs {needs}")
        return float(metrics[self.metric])

    def observe(self, step: int, value: float) -> bool:
        """Counts the check at `step`; True when it is the new best (its weights are the ones to keep).
        A NaN never improves."""
        self.checks += 1
        if self.best is None:
            better = not math.isnan(value)
        elif self.higher_is_better:
            better = value > self.best + self.threshold
        else:
            better = value < self.best - self.threshold
        if better:
            self.best, self.best_step, self.since_best = value, step, 0
        else:
            self.since_best += 1
            if self.patience and self.since_best >= self.patience:
                self.stopped_at = step
        return better

    def shipped_step(self, last_step: int) -> int:
        return self.best_step if self.load_best and self.best_step is not None else last_step

    def state_dict(self) -> dict:
        return {"metric": self.metric, "best": self.best, "best_step": self.best_step, "checks": self.checks,
                "since_best": self.since_best, "stopped_at": self.stopped_at}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's state; one saved without it (or watching another metric) starts fresh."""
        if not state or state.get("metric") != self.metric:
            return
        self.best, self.best_step, self.checks = state["best"], state["best_step"], state["checks"]
        self.since_best, self.stopped_at = state["since_best"], state["stopped_at"]

    def report(self, last_step: int) -> dict:
        """What `runtime.json`, the train manifest and the MLflow run's `runtime.*` params record."""
        return {"metric_for_best_model": self.metric, "best_metric": self.best, "best_step": self.best_step,
                "checks": self.checks, "shipped_step": self.shipped_step(last_step), "stopped_at": self.stopped_at,
                "early_stopping_patience": self.patience}

    def summary(self, last_step: int, total_steps: int) -> str:
        """train.log's line saying which step ships and why."""
        shipped = self.shipped_step(last_step)
        if self.best_step is None:
            head = f"shipping step {shipped}: no check had a {self.metric}"
        elif shipped == self.best_step:
            head = f"shipping step {shipped}: {self.metric} {self.best:.6g}, best of {self.checks} checks"
        else:
            head = (f"shipping step {shipped}, the last (runner.load_best_model_at_end is off): the best of "
                    f"{self.checks} checks was step {self.best_step}, {self.metric} {self.best:.6g}")
        if self.stopped_at is not None:
            return f"{head}; stopped early at step {self.stopped_at} of {total_steps}, patience {self.patience}"
        why = f"patience {self.patience} never ran out" if self.patience else "no early stopping"
        return f"{head}; trained all {total_steps} steps ({why})"
