"""Scored items -> numbers, and an evaluation's metrics in one shape (torch-free).

A scored set's numbers come from `counted` (accuracy = correct / total over every item), whatever
scored it: generation, multiple choice, a harness task or a worker's own counts. An evaluation's
metrics (metrics.json, the baseline/champion/evaluate manifests, what register and a sweep read)
are always per set, one unnamed run too (its set is "val"):

    {"primary_set": <name>, "sets": {<name>: {"accuracy", "correct", "total", "eval_loss", ...}},
     **<the primary set's numbers>}

The top level repeats the primary set's numbers (what promotion compares, the headline), and only
`by_set` writes it. docs/evaluation.md names every key.
"""

from __future__ import annotations


def counted(correct: float, total: float) -> dict:
    """A set's accuracy and counts: accuracy = correct / total (0.0 for no items)."""
    return {"accuracy": correct / total if total else 0.0, "correct": int(correct), "total": int(total)}


def by_set(sets: dict[str, dict], primary: str) -> dict:
    """An evaluation's metrics from its sets' numbers (`primary` first in report order)."""
    return {**sets[primary], "primary_set": primary, "sets": sets}


def named_sets(metrics: dict) -> dict[str, dict]:
    """The sets a run's config named (`eval.sets`); {} for a run whose one set is the val split, whose
    numbers the top level already holds (what MLflow charts and version tags per set)."""
    sets = metrics["sets"]
    return {} if list(sets) == ["val"] else sets
