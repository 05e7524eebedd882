"""The floor plan (docs/architecture.md) holds: who may import whom, and code versions that
follow exactly the code each stage runs."""

import ast
import shutil
from pathlib import Path

import pytest

from conftest import ROOT
from stages.core.codeversion import code_version, imported_modules, module_closure

STAGES_DIR = ROOT / "stages"
STAGE_PACKAGES = {"prepare", "train", "evaluate", "register"}
# package -> the packages it may import (besides itself); stages import only shared packages
ALLOWED = {
    "core": set(),
    "chatdata": {"core"},
    "tracking": {"core"},
    "models": {"core", "chatdata", "tracking"},
    "runtime": {"core", "chatdata", "tracking"},
    **{s: {"core", "chatdata", "models", "runtime", "tracking"} for s in STAGE_PACKAGES},
    "pipeline": {"core", "models", "runtime", "tracking", *STAGE_PACKAGES},
    "sweep": {"core", "pipeline"},
}


def _package(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else None


def _modules() -> list[Path]:
    return sorted(STAGES_DIR.rglob("*.py"))


def test_every_package_has_a_place_in_the_plan():
    top = {p.name for p in STAGES_DIR.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    top |= {p.stem for p in STAGES_DIR.glob("*.py") if p.stem != "__init__"}
    assert top == set(ALLOWED)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(STAGES_DIR)))
def test_imports_follow_the_floor_plan(path):
    me = path.relative_to(STAGES_DIR).parts[0].removesuffix(".py")
    if me == "__init__":
        return
    wrong = sorted(m for m in imported_modules(STAGES_DIR, path)
                   if _package(m) not in (None, me) and _package(m) not in ALLOWED[me])
    assert not wrong, f"stages/{path.relative_to(STAGES_DIR)} ({me}) imports {wrong}; allowed: {sorted(ALLOWED[me])}"


def _third_party_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_stages_never_import_prefect_and_flows_never_import_torch():
    assert not [p for p in _modules() if "prefect" in _third_party_imports(p)]
    flows = sorted((ROOT / "flows").glob("*.py"))
    assert not [p for p in flows if _third_party_imports(p) & {"torch", "transformers", "numpy"}]


# module edited -> the code versions that must change (all others must not)
EDITS = {
    "runtime/batches.py": {"train", "evaluate"},
    "runtime/generation.py": {"evaluate", "register"},
    "runtime/worker.py": {"train", "evaluate"},
    "chatdata/shards.py": {"prepare", "train", "evaluate"},
    "chatdata/readers.py": {"prepare", "evaluate", "models.builtin"},
    "prepare/masking.py": {"prepare"},
    "evaluate/scorers.py": {"evaluate"},
    "models/builtin.py": {"models.builtin"},
    "tracking/live.py": {"register"},   # live metrics never change a trained model
    "tracking/run.py": {"register"},
    "core/config.py": {"register"},     # the schema's values are hashed as data
}
ENTRIES = ("prepare", "train", "evaluate", "register", "models.builtin")


def _versions(root: Path) -> dict[str, str]:
    return {e: code_version(e, root=root, neutral=(e == "register")) for e in ENTRIES}


@pytest.fixture
def stages_copy(tmp_path) -> Path:
    copy = tmp_path / "stages"
    shutil.copytree(STAGES_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@pytest.mark.parametrize("module,expected", EDITS.items(), ids=list(EDITS))
def test_code_version_changes_exactly_when_code_the_stage_runs_changes(stages_copy, module, expected):
    before = _versions(stages_copy)
    with open(stages_copy / module, "a") as f:
        f.write("\n\ndef _an_edit():\n    return 1\n")
    after = _versions(stages_copy)
    assert {e for e in ENTRIES if before[e] != after[e]} == expected


def test_comments_docstrings_and_formatting_change_no_code_version(stages_copy):
    before = _versions(stages_copy)
    path = stages_copy / "runtime" / "worker.py"
    text = path.read_text()
    text = text.replace('"""The SFT worker', '"""Reworded: the SFT worker', 1).replace("\n\n\n", "\n\n\n# a comment\n", 1)
    path.write_text(text)
    assert _versions(stages_copy) == before


def test_the_real_tree_closures_hold_the_modules_each_stage_runs():
    names = {e: {str(f.relative_to(STAGES_DIR)) for f in module_closure([e])} for e in ("train", "evaluate")}
    # the torchrun entry points are part of the stage: the worker loop and the evaluation runner
    assert {"train/__main__.py", "runtime/worker.py", "runtime/batches.py", "runtime/checkpoint.py"} <= names["train"]
    assert {"evaluate/runner.py", "runtime/worker.py", "runtime/batches.py", "models/refs.py"} <= names["evaluate"]
    assert "tracking/live.py" not in names["train"]


def test_metrics_reach_mlflow_through_one_sender():
    """Only tracking/live.py sends metrics (live, the train stage's catch-up, register's backfill and
    eval metrics all go through its `send`)."""
    senders = sorted(str(p.relative_to(STAGES_DIR)) for p in _modules()
                     if any(call in p.read_text() for call in ("log_metric(", "log_metrics(", "metrics=")))
    assert senders == ["tracking/live.py"], senders
