"""Sweeps: a grid of overrides, one trial per combination, every trial a plan of its own.

`sftflow sweep -c CONFIG actor.optim.lr=1e-4,3e-4 actor.lora.r=8,16 data.max_length=512` makes
a grid axis of each `KEY=V1,V2,...` (commas inside `[...]`, `{...}` or quotes don't split) and a
fixed override of each single value. Every trial is validated and planned before anything runs,
so a bad key or value stops the sweep with one line naming it. Trials share whatever their
fingerprints share: the prepare stage of a learning-rate sweep is built once, and a trial whose
train folder is complete is a cache hit (a sweep can be extended or resumed).

Picking the best trial is pure data: the evaluate metrics of each trial, by one metric, higher
is better except for losses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from .core.config import load_config
from .core.errors import ConfigError
from .pipeline import Plan, plan


def split_values(text: str) -> list[str]:
    """`1e-4,3e-4` -> ['1e-4', '3e-4']; `[a,b]` and `"x,y"` stay one value."""
    parts, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    return parts + [cur]


def parse_grid(args: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(fixed overrides, {key: values}) from the command line's `KEY=VALUE[,VALUE...]` arguments."""
    fixed: list[str] = []
    axes: dict[str, list[str]] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{arg}: expected KEY=VALUE or KEY=V1,V2,...")
        values = [v.strip() for v in split_values(value)]
        if any(v == "" for v in values):
            raise ConfigError(f"{key}: empty value in the sweep grid ({arg!r})")
        if key in axes or any(f.partition("=")[0].strip() == key for f in fixed):
            raise ConfigError(f"{key}: given twice")
        if len(values) > 1:
            if len(set(values)) < len(values):
                raise ConfigError(f"{key}: a value repeats in the sweep grid ({value})")
            axes[key] = values
        else:
            fixed.append(f"{key}={values[0]}")
    if not axes:
        raise ConfigError("a sweep needs at least one KEY=V1,V2,... with two or more values")
    return fixed, axes


@dataclass
class Trial:
    """One combination of the grid and its plan."""

    index: int
    values: dict[str, str]
    plan: Plan

    @property
    def label(self) -> str:
        return " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in self.values.items())

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.values.items()]


def plan_trials(config_path: str | Path, fixed: list[str], axes: dict[str, list[str]]) -> list[Trial]:
    """Every combination validated and planned; two combinations that would train the same model
    (a key no fingerprint holds, such as the world size) are an error naming the key."""
    combos = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]

    def each(step):
        for values in combos:
            try:
                yield values, step(values)
            except ConfigError as e:
                raise ConfigError(f"sweep trial {' '.join(f'{k}={v}' for k, v in values.items())}: {e}") from None
    # every trial's config is checked before any is planned (planning may build the base model)
    configs = [cfg for _, cfg in each(lambda values: load_config(config_path,
                                                                 fixed + [f"{k}={v}" for k, v in values.items()]))]
    trials: list[Trial] = []
    seen: dict[str, Trial] = {}
    for i, (values, p) in enumerate(each(lambda values: plan(configs[combos.index(values)]))):
        trial = Trial(i, values, p)
        twin = seen.get(p.fingerprints["train"])
        if twin is not None:
            same = [k for k in axes if twin.values[k] != values[k]]
            raise ConfigError(f"{', '.join(same)}: trials {twin.label} and {trial.label} train the same model "
                              "(the key is in no fingerprint); sweep keys that change training")
        seen[p.fingerprints["train"]] = trial
        trials.append(trial)
    return trials


def lower_is_better(metric: str) -> bool:
    return "loss" in metric or "perplexity" in metric


def metric_of(eval_metrics: dict, metric: str) -> float | None:
    """`accuracy` (the primary set's), `eval_loss`, or `<set>/<key>` for a named eval set."""
    if "/" in metric:
        name, key = metric.split("/", 1)
        value = eval_metrics["sets"].get(name, {}).get(key)
    else:
        value = eval_metrics.get(metric)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def ranked(scores: list[tuple[int, float | None]], metric: str) -> list[int]:
    """Trial indices best first (ties: the earlier trial); trials without the metric last."""
    sign = 1.0 if lower_is_better(metric) else -1.0
    return [i for i, _ in sorted(scores, key=lambda s: (s[1] is None, sign * (s[1] or 0.0), s[0]))]
