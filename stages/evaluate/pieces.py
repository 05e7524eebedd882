"""A reference stage's scores kept per eval set, so that adding a set scores only that set.

A set's piece (`artifacts/<stage>_sets/<key>/`: its numbers and its rows of predictions.jsonl) is
keyed by what that set's score depends on (`stages/pipeline/fingerprints.py` `reference_set_keys`: the stage's
fingerprint as if the config named that set alone). The stage folder is assembled from the pieces in
report order, the same files a run that scored every set writes."""

from __future__ import annotations

import json
from pathlib import Path

from stages.core.cache.artifacts import StageBuild, damage, is_complete, stage_dir


def folder(root: Path, stage: str, key: str) -> Path:
    return stage_dir(root, f"{stage}_sets", key)


def read(root: Path, stage: str, key: str | None) -> tuple[dict, list[str], dict] | None:
    """(the set's numbers, its prediction lines, the model that scored it: kind and source) from a
    sound piece, else None."""
    if key is None:
        return None
    where = folder(root, stage, key)
    if not is_complete(where) or damage(where) is not None:
        return None
    lines = (where / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    model = json.loads((where / "manifest.json").read_text())["model"]
    return json.loads((where / "numbers.json").read_text()), [line for line in lines if line.strip()], model


def write(root: Path, stage: str, key: str, name: str, numbers: dict, lines: list[str], model: dict) -> None:
    build = StageBuild(root, f"{stage}_sets", key)
    (build.partial / "numbers.json").write_text(json.dumps(numbers, indent=2))
    (build.partial / "predictions.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    build.commit({"set": name, "model": {"kind": model["kind"], "source": model["source"]}})


def lines_by_set(path: Path) -> dict[str, list[str]]:
    """predictions.jsonl's lines by their set, as written (no re-serialization: byte-identical)."""
    out: dict[str, list[str]] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.setdefault(json.loads(line).get("set", "val"), []).append(line)
    return out
