"""The validation checks of a training run (torchtitan's `Validator`): every rank scores its share
of the validation set with the worker's `get_eval_model_output`, and the sums add up across ranks:
the loss, the replies' teacher-forced token accuracy, the share of rows whose replies greedy
decoding reproduces token for token and, from a worker that counts them, its own
accuracy; with a mixture, also per source (each source's held-out rows scored apart, so the sums
are exact per source). `BestCheck` watches those checks: early stopping, the guards a check must
keep to ship, and which step's weights ship."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from stages.core.config import HIGHER_IS_BETTER
from stages.core.errors import ConfigError

from .contract import add_eval_output
from .sharding import reshard

SUMMED_FIRST = ["loss_sum", "n_tokens", "correct", "total"]  # then any other key of the outputs, sorted


def held_out_blocks(n_rows: int, groups: list[dict] | None) -> list[tuple[str | None, int, int]]:
    """(source, first row, end) of each source's held-out rows, in the val split's order (prepare writes
    them source after source: its manifest's `val_mix`); one unnamed block without a mixture. Sources
    with no held-out rows are left out."""
    if not groups:
        return [(None, 0, n_rows)]
    if sum(g["rows"] for g in groups) != n_rows:
        raise ConfigError(f"validation: the val split holds {n_rows} rows, its sources {sum(g['rows'] for g in groups)}"
                          " (prepare's manifest `val_mix`); rebuild it with `sftflow stage prepare --force`")
    out, lo = [], 0
    for g in groups:
        if g["rows"]:
            out.append((g["source"], lo, lo + g["rows"]))
        lo += g["rows"]
    return out


class Joined:
    """Several datasets read as one, in order (the mixture sources' held-out rows: `val/` then each
    `heldout/<source>/`); `len()` and `ds[i]`, what `validate` reads."""

    def __init__(self, parts: list):
        self.parts = parts
        self.starts = np.cumsum([0, *(len(p) for p in parts)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int):
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k][int(i - self.starts[k])]


def _metrics(total: dict, suffix: str = "") -> dict:
    out = {f"val_loss{suffix}": total["loss_sum"] / max(total["n_tokens"], 1.0),
           f"val_tokens{suffix}": int(total["n_tokens"])}
    if "token_correct" in total and total["n_tokens"] > 0:
        out[f"val_token_accuracy{suffix}"] = total["token_correct"] / total["n_tokens"]
    if total.get("reply_total", 0) > 0:
        out[f"val_reply_accuracy{suffix}"] = total["reply_correct"] / total["reply_total"]
    if total["total"] > 0:
        out[f"val_accuracy{suffix}"] = total["correct"] / total["total"]
    return out


def validate(model: torch.nn.Module, val_ds, score: Callable[[list], dict], hook: str, micro_batch_size: int,
             rank: int, world: int, device: torch.device, fsdp: bool, groups: list[dict] | None = None) -> dict:
    """`val_loss` (= summed `loss_sum` / `n_tokens`), `val_tokens`, `val_token_accuracy` (= summed
    `token_correct` / `n_tokens`) and `val_reply_accuracy` (= summed `reply_correct` / `reply_total`:
    the rows greedy decoding answers exactly), when the outputs count them (the default worker's do),
    and, when they count `correct` / `total`, `val_accuracy`; {} without a validation set. With `groups` (the mixture
    sources' held-out rows, `held_out_blocks`) the same metrics of each source too, as
    `val_loss/<source>`, ...; the overall ones are the sources' sums together.

    `score(samples)` is the worker's output for a micro-batch of samples; a micro-batch never mixes
    sources. Every rank runs the same number of batches (the collectives inside the forward must
    match), an empty slot scoring the block's first sample and adding zeros of the same keys."""
    if val_ds is None or len(val_ds) == 0:
        return {}
    blocks = held_out_blocks(len(val_ds), groups)
    model.eval()
    per_block: list[dict[str, float]] = []
    with torch.no_grad():
        for _, lo, hi in blocks:
            sums: dict[str, float] = {}
            mine = list(range(lo + rank, hi, world))
            for k in range(math.ceil(math.ceil((hi - lo) / world) / micro_batch_size)):
                idx = mine[k * micro_batch_size: (k + 1) * micro_batch_size]
                out = score([val_ds[i] for i in (idx or [lo])])
                if idx:
                    add_eval_output(sums, out, hook)
                else:  # the same keys as the ranks that scored rows: the reduced vectors must line up
                    scratch: dict[str, float] = {}
                    add_eval_output(scratch, out, hook)
                    for key in scratch:
                        sums.setdefault(key, 0.0)
            per_block.append(sums)
    keys = SUMMED_FIRST + sorted({k for sums in per_block for k in sums} - set(SUMMED_FIRST))
    stats = torch.tensor([[sums.get(k, 0.0) for k in keys] for sums in per_block], dtype=torch.float64,
                         device=device)
    if fsdp:
        reshard(model)
    dist.all_reduce(stats)
    model.train()
    rows = [dict(zip(keys, r)) for r in stats.tolist()]
    out = _metrics({k: sum(r[k] for r in rows) for k in keys})
    if groups:
        for (source, _, _), r in zip(blocks, rows):
            out.update(_metrics(r, f"/{source}"))
    return out


def higher_is_better(metric: str) -> bool:
    return metric.split("/", 1)[0] in HIGHER_IS_BETTER


# A metric that moves a whole row at a time ties across most checks while the replies get closer, and
# patience would run out before the first row is exact; between its steps the same rows' token
# accuracy says whether they are getting there.
TIE_BREAKERS = {"val_reply_accuracy": "val_token_accuracy"}


def tie_breaker(metric: str) -> str | None:
    """The metric that orders checks whose `metric` ties (same source), or None."""
    name, sep, source = metric.partition("/")
    return TIE_BREAKERS[name] + sep + source if name in TIE_BREAKERS else None


class BestCheck:
    """Early stopping and best-checkpoint selection over the validation checks, as HF Trainer's
    `EarlyStoppingCallback` (patience, threshold) and `load_best_model_at_end`, Axolotl's
    `early_stopping_patience`. One rule decides both: a check improves when it is eligible (below) and
    beats the best so far by more than `threshold` (Keras's min_delta); only an improvement becomes the
    best and resets the count of checks without one. HF moves its best on any gain but counts patience
    against the threshold, so a run of tiny gains there ships a step patience never credited; here
    they agree. A metric with a tie-breaker (`val_reply_accuracy`: `val_token_accuracy` of the same
    rows) is compared first and the tie-breaker decides between equal values: a check that reproduces
    no more rows exactly but gets more of their tokens right improves, so patience counts checks where
    neither moved.

    Guards (`runner.best_model_guard`): a check is eligible only when each guard's metric (e.g.
    `val_loss/rehearse`) is at most its `max_drop` worse than at the start. The start is a check of its
    own, step 0, validated before the first step: its guard values are the bounds' origin, and as a
    candidate it is what ships when no trained check is eligible and better, the weights the run
    started from (a day that could not learn its rows without forgetting keeps what it had). Without
    guards there is no step-0 check, as before.

    Its state is plain JSON in every checkpoint (`state_dict`), so a resumed run decides as an
    uninterrupted one would. Every rank must observe the same values (the worker broadcasts rank 0's)."""

    def __init__(self, metric: str, patience: int, threshold: float, load_best: bool, guards: list | tuple = ()):
        self.metric, self.patience, self.threshold, self.load_best = metric, patience, threshold, load_best
        self.higher_is_better = higher_is_better(metric)
        self.tie = tie_breaker(metric)
        self.best_tie: float | None = None
        # (key in validation's output, max_drop)
        self.guards: list[tuple[str, float]] = [(g.key, float(g.max_drop)) if hasattr(g, "key") else tuple(g)
                                                for g in guards]
        self.best: float | None = None
        self.best_step: int | None = None
        self.checks = 0
        self.since_best = 0               # checks in a row that did not improve
        self.stopped_at: int | None = None
        self.start: dict[str, float] | None = None  # the guards' values at step 0
        self.eligible_checks = 0
        self.rejected: list[dict] = []    # checks a guard kept from shipping: step, value, the guard broken

    @classmethod
    def from_runner(cls, run) -> "BestCheck | None":
        """The runner section's rule; None when neither early stopping nor best selection is on."""
        if not (run.early_stopping_patience or run.load_best_model_at_end):
            return None
        return cls(run.metric_for_best_model, run.early_stopping_patience, run.early_stopping_threshold,
                   run.load_best_model_at_end, run.best_model_guard)

    @property
    def needs_start(self) -> bool:
        """Whether the run validates once before its first step (step 0)."""
        return bool(self.guards)

    def keys(self) -> list[str]:
        """The metrics a check reads: the watched one, its tie-breaker, then each guard's."""
        return [self.metric, *([self.tie] if self.tie else []), *(key for key, _ in self.guards)]

    def split(self, values: list[float]) -> tuple[float, float | None, dict[str, float] | None]:
        """`values()`'s list as `observe` takes it: (value, tie-breaker's value, the guards' values)."""
        value, rest = values[0], list(values[1:])
        tie = rest.pop(0) if self.tie else None
        return value, tie, dict(zip((k for k, _ in self.guards), rest)) if self.guards else None

    def values(self, metrics: dict, hook: str) -> list[float]:
        """`keys()`'s values in a check's `validate` output; a ConfigError naming the key when validation
        has none."""
        out = []
        for i, key in enumerate(self.keys()):
            if key not in metrics:
                name, _, source = key.partition("/")
                needs = (f"{hook} to count `correct` and `total`" if name == "val_accuracy"
                         else f"{hook} to count `token_correct`" if name == "val_token_accuracy"
                         else f"{hook} to count `reply_correct` and `reply_total`" if name == "val_reply_accuracy"
                         else "a validation set (data.val_data_paths or data.val_fraction)")
                if source:
                    needs = (f"held-out rows of the mixture source '{source}' (data.val_fraction with a mixture or a "
                             f"warm start's rehearsal; sources held out: {_sources(metrics) or 'none'}) and {needs}")
                what = ("runner.metric_for_best_model" if i == 0 else
                        "runner.metric_for_best_model's tie-breaker" if key == self.tie and i == 1
                        else "runner.best_model_guard")
                raise ConfigError(f"{what}: validation reported no {key}; it needs {needs}")
            out.append(float(metrics[key]))
        return out

    def _worse_by(self, key: str, value: float) -> float:
        start = self.start[key]
        return start - value if higher_is_better(key) else value - start

    def broken_guard(self, guard_values: dict[str, float]) -> str | None:
        """None when every guard holds, else the first broken one, said as train.log says it."""
        for key, max_drop in self.guards:
            v = guard_values[key]
            worse = self._worse_by(key, v)
            if not worse <= max_drop:  # a NaN breaks it
                return (f"{key} {v:.6g} is {worse:.4g} worse than the start's {self.start[key]:.6g} "
                        f"(max_drop {max_drop:g})")
        return None

    def observe(self, step: int, value: float, guard_values: dict[str, float] | None = None,
                tie: float | None = None) -> bool:
        """Counts the check at `step`; True when it is the new best (its weights are the ones to keep).
        A NaN never improves; nor does a check that breaks a guard. With guards, the first check
        (step 0) sets the start. `tie`: the tie-breaker's value (a metric that has one)."""
        if self.tie and tie is None:
            raise ValueError(f"BestCheck.observe: {self.metric} needs its tie-breaker's value ({self.tie})")
        if self.guards:
            if guard_values is None or set(guard_values) != {k for k, _ in self.guards}:
                raise ValueError(f"BestCheck.observe: the guards' values are needed ({[k for k, _ in self.guards]})")
            if self.start is None:
                if step != 0:
                    raise ConfigError("runner.best_model_guard: no start values (step 0's check) to bound the "
                                      f"check of step {step}; was the run resumed from a checkpoint without them? "
                                      "runner.resume=never starts afresh")
                self.start = dict(guard_values)
        self.checks += 1
        broken = self.broken_guard(guard_values) if self.guards else None
        if broken is not None:
            self.rejected.append({"step": step, "value": value, "guard": broken})
        else:
            self.eligible_checks += 1
        if broken is not None:
            better = False
        elif self.best is None:
            better = not math.isnan(value)
        elif self.higher_is_better:
            better = value > self.best + self.threshold
        else:
            better = value < self.best - self.threshold
        if not better and broken is None and self.tie and self.best is not None and value == self.best:
            # the tie-breakers are accuracies (higher is better); a check saved before it counted one loses
            better = tie > (-math.inf if self.best_tie is None else self.best_tie) + self.threshold
        if better:
            self.best, self.best_step, self.since_best, self.best_tie = value, step, 0, tie
        elif step > 0:  # the start is a candidate, never a check without an improvement
            self.since_best += 1
            if self.patience and self.since_best >= self.patience:
                self.stopped_at = step
        return better

    def shipped_step(self, last_step: int) -> int:
        return self.best_step if self.load_best and self.best_step is not None else last_step

    def _rule(self) -> dict:
        return {"metric": self.metric, "guards": [list(g) for g in self.guards]}

    def state_dict(self) -> dict:
        return {**self._rule(), "best": self.best, "best_tie": self.best_tie, "best_step": self.best_step,
                "checks": self.checks,
                "since_best": self.since_best, "stopped_at": self.stopped_at, "start": self.start,
                "eligible_checks": self.eligible_checks, "rejected": self.rejected}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's state; one saved without it (or by another rule) starts fresh."""
        if not state or state.get("metric") != self.metric or state.get("guards", []) != self._rule()["guards"]:
            return
        self.best, self.best_step, self.checks = state["best"], state["best_step"], state["checks"]
        self.best_tie = state.get("best_tie")
        self.since_best, self.stopped_at = state["since_best"], state["stopped_at"]
        self.start = state.get("start")
        self.eligible_checks = state.get("eligible_checks", self.checks)
        self.rejected = state.get("rejected", [])

    def report(self, last_step: int) -> dict:
        """What `runtime.json`, the train manifest and the MLflow run's `runtime.*` params record."""
        out = {"metric_for_best_model": self.metric, "best_metric": self.best, "best_step": self.best_step,
               "checks": self.checks, "shipped_step": self.shipped_step(last_step), "stopped_at": self.stopped_at,
               "early_stopping_patience": self.patience}
        if self.tie:
            out.update(tie_breaker=self.tie, best_tie=self.best_tie)
        if self.guards:
            out.update(best_model_guard=", ".join(f"{k} within {d:g} of the start" for k, d in self.guards),
                       guard_start=self.start, eligible_checks=self.eligible_checks,
                       rejected_steps=[r["step"] for r in self.rejected],
                       shipped_start=self.shipped_step(last_step) == 0)
        return out

    def summary(self, last_step: int, total_steps: int) -> str:
        """train.log's line saying which step ships and why."""
        shipped = self.shipped_step(last_step)
        kept = (f"; {self.eligible_checks} of {self.checks} checks kept "
                + " and ".join(f"{k} within {d:g} of the start's {self.start[k]:.6g}" for k, d in self.guards)
                if self.guards and self.start is not None else "")
        if self.best_step is None:
            head = f"shipping step {shipped}: no check had a {self.metric}{kept}"
        elif shipped == self.best_step == 0 and self.guards:
            head = (f"shipping step 0, the start (the weights training began from): no trained check was eligible "
                    f"and better than its {self.metric} {self.best:.6g}{kept}")
        elif shipped == self.best_step:
            tie = f" ({self.tie} {self.best_tie:.6g})" if self.tie and self.best_tie is not None else ""
            head = f"shipping step {shipped}: {self.metric} {self.best:.6g}{tie}, best of {self.checks} checks{kept}"
        else:
            head = (f"shipping step {shipped}, the last (runner.load_best_model_at_end is off): the best of "
                    f"{self.checks} checks was step {self.best_step}, {self.metric} {self.best:.6g}")
        if self.stopped_at is not None:
            return f"{head}; stopped early at step {self.stopped_at} of {total_steps}, patience {self.patience}"
        why = f"patience {self.patience} never ran out" if self.patience else "no early stopping"
        return f"{head}; trained all {total_steps} steps ({why})"


def _sources(metrics: dict) -> str:
    return ", ".join(sorted({k.split("/", 1)[1] for k in metrics if "/" in k}))
