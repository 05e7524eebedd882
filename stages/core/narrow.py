"""A config narrowed to some of its named eval sets: what one set's score depends on (the stage
table's per-set keys, stages/pipeline/fingerprints.py `reference_set_keys`) and what a reference stage scores
when the other sets' scores are already on disk (stages/evaluate/pieces.py)."""

from __future__ import annotations

from .config import SFTConfig


def with_sets(cfg: SFTConfig, names: list[str]) -> SFTConfig:
    """The config with only these named eval sets, in this order (the first is the primary)."""
    ev = cfg.eval.model_copy(update={"sets": {n: cfg.eval.sets[n] for n in names}, "primary": None})
    out = cfg.model_copy(update={"eval": ev})
    out.pin_inputs(cfg.inputs())  # the files the plan hashed, not a new glob
    return out
