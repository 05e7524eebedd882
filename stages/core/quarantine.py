"""The rows prepare left out, as a person reads them: counts per reason over every split, and the
file that holds each row with its file, line, reason and raw text (`quarantine.jsonl` in the stage
folder). The run summary, the Prefect run's page, the MLflow run and `sftflow show` print this.

Also the data gate's rule and its one-line error (data.max_bad_fraction): prepare and prepare_eval
apply it to their pieces' counts while they run (stages/prepare/stage.py), and `check_folder` to a
complete folder's counts when it is reused (stages/pipeline/calls.py), so a gate tightened on unchanged
data holds on the cached folder too."""

from __future__ import annotations

import json
import re
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Iterable

from stages.core.cache.artifacts import read_manifest
from stages.core.errors import DataError

# The gate decides whether a stage finishes, never what it writes (data.max_bad_fraction is in no
# fingerprint), and the rest only reports: a change here re-runs nothing.
__fingerprint__ = False

FILE = "quarantine.jsonl"

_SOURCE = re.compile(r"(?P<file>.*):(?P<line>\d+)(?:#\d+)?", re.S)  # a kept row's `source`: file:line[#k]
Check = tuple[str, int, Counter]  # (what: a file, or "the <split> split"; rows read; rows quarantined per reason)


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


# --------------------------------------------------------------------------- the data gate


def breach(checks: Iterable[Check], limit: float | None) -> Check | None:
    """The first check above the gate: more than `limit` of its rows quarantined (exactly: a share at
    the limit passes, whatever the float product would round to); None when all pass or `limit` is None."""
    if limit is None:
        return None
    bound = Fraction(repr(float(limit)))
    for what, rows_read, bad in checks:
        if rows_read and Fraction(sum(bad.values()), rows_read) > bound:
            return what, rows_read, bad
    return None


def gate_error(stage: str, found: Check, limit: float, quarantine_file: Path) -> DataError:
    """The gate's one line: the stage, the counts, what they are of, the reasons, the quarantine file."""
    what, rows_read, bad = found
    n = sum(bad.values())
    reasons = ", ".join(f"{reason} {k}" for reason, k in bad.most_common())
    error = DataError(f"{stage}: {n} of {rows_read} rows ({100 * n / rows_read:.1f}%) in {what} were quarantined, "
                      f"above data.max_bad_fraction={limit} ({reasons}); nothing was trained; see {quarantine_file}")
    # what the flow records in MLflow and, in a served run, moves aside (flows/sft.py): the line alone
    # would have to be parsed back
    error.gate = {"stage": stage, "what": str(what), "rows_read": rows_read, "dropped": dict(bad.most_common()),
                  "limit": limit, "quarantine_file": str(quarantine_file)}
    return error


def folder_checks(folder: str | Path) -> list[Check]:
    """What the gate checks in a complete prepare (or prepare_eval) folder: each source file's counts
    (the manifest's `sources`), in order, then each split's (`splits`). A folder written before the
    sources held their counts: each file's quarantined rows from its quarantine.jsonl, its rows read
    as the distinct records among those and its kept rows (the shards' `source` column)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    sources = manifest.get("sources") or []
    splits = manifest.get("splits") or {}
    if all("rows_read" in s for s in sources):
        files = [(s["ref"], int(s["rows_read"]), Counter(s.get("dropped") or {})) for s in sources]
    else:
        files = _counted_files(folder, [s["ref"] for s in sources], list(splits))
    return [*files, *((f"the {name} split", int(st["rows_read"]), Counter(st.get("dropped") or {}))
                      for name, st in splits.items())]


def _counted_files(folder: Path, refs: list[str], splits: list[str]) -> list[Check]:
    import pyarrow as pa  # only for a folder written before the manifest held each file's counts

    records: dict[str, set] = {ref: set() for ref in refs}
    bad: dict[str, Counter] = {ref: Counter() for ref in refs}
    with open(folder / FILE, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            records.setdefault(row["file"], set()).add(row["line"])
            bad.setdefault(row["file"], Counter())[row["reason"]] += 1
    for split in splits:
        for shard in sorted((folder / split).glob("shard-*.arrow")):
            table = pa.ipc.open_file(pa.memory_map(str(shard), "r")).read_all().select(["source"])
            for source in table.column("source").to_pylist():
                m = _SOURCE.fullmatch(source)
                if m is not None:
                    records.setdefault(m["file"], set()).add(int(m["line"]))
    return [(ref, len(records[ref]), bad[ref]) for ref in refs]


def check_folder(folder: str | Path, stage: str, limit: float | None) -> None:
    """The data gate on a complete folder being reused: the DataError a prepare of the same data would
    raise under `limit`, naming the folder's own quarantine.jsonl; nothing is deleted."""
    if limit is None:
        return
    found = breach(folder_checks(folder), limit)
    if found is not None:
        raise gate_error(stage, found, limit, Path(folder) / FILE)
