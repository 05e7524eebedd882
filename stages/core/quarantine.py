"""The rows prepare left out, as a person reads them: counts per reason over every split, and the
file that holds each row with its file, line, reason and raw text (`quarantine.jsonl` in the stage
folder). The run summary, the Prefect run's page, the MLflow run and `sftflow show` print this."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from stages.core.artifacts import read_manifest

FILE = "quarantine.jsonl"


def dropped(folder: str | Path) -> Counter:
    """Rows left out per reason, over the splits of a complete prepare (or prepare_eval) folder."""
    try:
        splits = read_manifest(Path(folder)).get("splits") or {}
    except (OSError, ValueError):
        return Counter()
    out: Counter = Counter()
    for split in splits.values():
        out.update(split.get("dropped") or {})
    return out


def note(folder: str | Path) -> str | None:
    """"3 rows quarantined (malformed_json 1, missing_column 2): <folder>/quarantine.jsonl", or None."""
    counts = dropped(folder)
    if not counts:
        return None
    total = sum(counts.values())
    reasons = ", ".join(f"{reason} {n}" for reason, n in counts.most_common())
    return f"{total} row{'s' if total > 1 else ''} quarantined ({reasons}): {Path(folder) / FILE}"
