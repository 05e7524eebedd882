"""The champion stage's reuse of the champion's own evaluation: a registered version was scored by the
evaluate stage of the training it holds, so a set that evaluation scored the way today's plan would score
it is copied from there rather than scored again; only the other sets are scored.

What a set's score depends on besides the model is its scoring key (`stages/pipeline/fingerprints.py`
`scoring_keys`: the champion stage's per-set key without the champion: the set's files and how they
are prepared, the scoring config of `eval` and `eval.sets.<set>`, the scorer's source, the resolved
precision, the evaluate code). evaluate records each set's key with the numbers it scored
(`scoring_record`, in its manifest's `scoring`); a set is reused when an evaluate folder of the
champion's training (`model: trained`, its `train_fingerprint`) holds today's key for it, asked the
same prompts and references today's prepared rows ask (`eval_sets`) and read them from the same rows
(each record's `source`). Folders written before keys were recorded are never reused. The copied
prediction lines are evaluate's own, byte for byte (tests/test_champion_reuse.py compares them with a
fresh scoring).

`SFTFLOW_CHAMPION_REUSE=0` turns it off (the test's fresh scoring). Torch-free.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Callable

from stages.core.cache.artifacts import damage, is_complete, read_manifest
from stages.core.config import SFTConfig

from . import pieces
from .sets import eval_samples, set_fingerprint

ENV = "SFTFLOW_CHAMPION_REUSE"
TRAINED = "trained"  # evaluate's `model` for the trained model (no eval.model)


def scoring_record(keys: dict[str, str] | None, sets: dict[str, dict]) -> dict[str, dict]:
    """evaluate's manifest `scoring`: each set's scoring key and the numbers scoring gave it, before the
    comparisons with the base model are added (what the champion stage's own scoring would give)."""
    return {name: {"key": keys[name], "numbers": copy.deepcopy(sets[name])}
            for name in sets if keys and name in keys}


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def own_evaluations(root: Path, train_fp: str) -> list[Path]:
    """The complete, sound evaluate folders that scored the training `train_fp` (sorted: one choice)."""
    out = []
    for manifest in sorted((Path(root) / "evaluate").glob("*/manifest.json")):
        folder = manifest.parent
        try:
            m = read_manifest(folder)
        except (OSError, ValueError):  # removed or being written meanwhile (gc): not a source
            continue
        if m.get("model") == TRAINED and m.get("train_fingerprint") == train_fp and m.get("scoring") \
                and is_complete(folder) and damage(folder) is None:
            out.append(folder)
    return out


def reusable(cfg: SFTConfig, prepare_dir: str, train_fp: str, keys: dict[str, str], names: list[str],
             on_line: Callable[[str], None]) -> dict[str, tuple[dict, list[str], Path, str]]:
    """set -> (its numbers, its prediction lines as evaluate wrote them, the evaluate folder, the model kind
    it scored) for each of `names` that an evaluation of the training `train_fp` scored with today's
    scoring key on today's rows. A folder that can't be read is passed over (then the set is scored)."""
    out: dict[str, tuple[dict, list[str], Path, str]] = {}
    for folder in own_evaluations(cfg.artifacts_path, train_fp):
        todo = [n for n in names if n not in out]
        if not todo:
            break
        try:
            m = read_manifest(folder)
            scoring, asked = m["scoring"], m.get("eval_sets") or {}
            same = [n for n in todo if n in scoring and n in keys and scoring[n]["key"] == keys[n] and n in asked]
            lines = pieces.lines_by_set(folder / "predictions.jsonl") if same else {}
        except (OSError, ValueError, KeyError, TypeError) as e:
            on_line(f"champion: the evaluation in {folder} could not be read ({e}); scoring its sets instead")
            continue
        for n in same:
            numbers = scoring[n]["numbers"]
            records = [json.loads(line) for line in lines.get(n, [])]
            if set_fingerprint(cfg, prepare_dir, n, numbers, records) != asked[n]:
                continue  # other prompts or references than today's rows: scored again
            if numbers.get("mode") in ("generate", "choice") and [r.get("source") for r in records] != [
                    r["source"] for r in eval_samples(prepare_dir, cfg.eval.max_samples, n, bool(cfg.eval.sets))]:
                continue  # other rows (a truncated file, the same rows read from elsewhere): as scoring would write
            out[n] = (numbers, lines.get(n, []), folder, m.get("model_kind", "hf"))
    return out
