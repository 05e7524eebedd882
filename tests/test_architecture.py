"""The floor plan (docs/architecture.md) holds: who may import whom, and code versions that
follow exactly the code each stage runs."""

import ast
import gc
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from stages.core.cache import codeversion
from stages.core.cache.codeversion import code_version, imported_modules, module_closure

STAGES_DIR = ROOT / "stages"
STAGE_PACKAGES = {"replay", "prepare", "train", "evaluate", "register"}
# package -> the packages it may import (besides itself); stages import only shared packages
ALLOWED = {
    "core": set(),
    "chatdata": {"core"},
    "tracking": {"core"},
    "models": {"core", "chatdata", "tracking"},
    # the runtime's floor plan: planning decides (torch-free), launch starts processes, runtime is the loop
    # inside a rank (never launching), inference generates (evaluate, replay, chat, the logged model)
    "planning": {"core", "chatdata", "runtime"},  # runtime only inside the rank-side helpers' functions
    "launch": {"core"},
    "runtime": {"core", "chatdata", "tracking", "planning"},
    "inference": {"core"},
    **{s: {"core", "chatdata", "models", "planning", "launch", "runtime", "inference", "tracking"}
       for s in STAGE_PACKAGES},
    "graph": {"core"},  # the stage table: data about stages, no stage code
    # the stages' own functions by the stage table's names (importlib); replay (its rows' file), train (the
    # rank started ahead) and evaluate (where evaluation runs, for the launch report) by import
    "pipeline": {"core", "chatdata", "graph", "models", "planning", "runtime", "inference", "tracking",
                 "replay", "train", "evaluate"},
    "sweep": {"core", "pipeline"},
    "export": {"core", "inference"},  # a model folder -> GGUF (a LoRA folder merged by inference.weights first)
    "retention": {"core", "graph", "tracking"},  # the disk policy: folders, locks, the registry
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


MAX_MODULES = 15  # .py files directly in one folder of flows/ or stages/


def _folders() -> list[Path]:
    return sorted({p.parent for root in (STAGES_DIR, ROOT / "flows") for p in root.rglob("*.py")})


def test_no_folder_holds_more_than_fifteen_modules():
    """A folder past 15 modules is a drawer a newcomer can't name: split it by concern into packages
    (stages/core/ became config/, machine/, cache/, stats/ and chat/; stages/runtime/ gave saving/ its
    checkpoints; flows/ has cli/ and servers/)."""
    crowded = {str(f.relative_to(ROOT)): n for f in _folders() if (n := len(list(f.glob("*.py")))) > MAX_MODULES}
    assert not crowded, f"folders over {MAX_MODULES} modules: {crowded}"


def _stages_folders() -> set[str]:
    return {p.name for p in STAGES_DIR.iterdir() if (p / "__init__.py").is_file()}


def _top_level_imports(path: Path) -> set[str]:
    """The top-level names of stages/ (packages and modules) that `path` imports, at module level or inside
    a function, its own left out."""
    me = path.relative_to(STAGES_DIR).parts[0].removesuffix(".py")
    return {_package(m) for m in imported_modules(STAGES_DIR, path)} - {None, me}


def test_no_module_imports_more_than_half_of_the_stages_folders():
    """No hub: a module that imports most of stages/ is where every change meets (pipeline.py imported 13
    of the 17 other folders and modules of stages/). Each module imports at most half as many of stages/'
    top-level packages and modules as stages/ has folders, function-local imports included."""
    limit = len(_stages_folders()) // 2
    hubs = {str(p.relative_to(STAGES_DIR)): sorted(used) for p in _modules()
            if len(used := _top_level_imports(p)) > limit}
    assert not hubs, f"modules importing more than {limit} of stages/: {hubs}"


def test_the_hub_counter_sees_function_local_imports():
    path = STAGES_DIR / "pipeline" / "checks.py"
    assert {"runtime", "chatdata"} <= _top_level_imports(path)  # both only inside functions there
    assert "pipeline" not in _top_level_imports(path)


def _packages() -> list[Path]:
    return sorted(p for root in (STAGES_DIR, ROOT / "flows") for p in root.rglob("__init__.py"))


def test_every_package_says_what_it_owns():
    """Each package's `__init__` opens with a docstring (what it owns, who may import it)."""
    bare = [str(p.relative_to(ROOT)) for p in _packages() if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not bare, f"packages without a docstring: {bare}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(STAGES_DIR)))
def test_imports_follow_the_floor_plan(path):
    me = path.relative_to(STAGES_DIR).parts[0].removesuffix(".py")
    if me == "__init__":
        return
    wrong = sorted(m for m in imported_modules(STAGES_DIR, path)
                   if _package(m) not in (None, me) and _package(m) not in ALLOWED[me])
    assert not wrong, f"stages/{path.relative_to(STAGES_DIR)} ({me}) imports {wrong}; allowed: {sorted(ALLOWED[me])}"


def _own_imports(root: Path, path: Path, packages: tuple[str, ...]) -> set[str]:
    """The modules of `packages` (under `root`) that `path` imports anywhere: at module level or inside
    a function (a function-local import is a cycle that waits for its first call). `from pkg import mod`
    counts as pkg.mod; `from pkg import name` (not a module) as pkg; relative imports resolved."""
    rel = path.relative_to(root).with_suffix("").parts
    me = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]

    def is_module(dotted: str) -> bool:
        target = root.joinpath(*dotted.split("."))
        return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            subs = [f"{base}.{a.name}" for a in node.names if is_module(f"{base}.{a.name}")]
            found |= set(subs) if subs else {base}
    return {m for m in found if m.split(".")[0] in packages and is_module(m) and m != me}


def import_cycles(root: Path, packages: tuple[str, ...]) -> list[list[str]]:
    """Every group of modules that import each other, directly or around a circle (Tarjan's strongly
    connected components of the import graph, function-local imports included)."""
    files = [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]
    graph = {}
    for p in files:
        rel = p.relative_to(root).with_suffix("").parts
        graph[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = _own_imports(root, p, packages)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_itself_around_a_circle():
    """No import cycle in stages/ or flows/, function-local imports included (they only hide one)."""
    assert import_cycles(ROOT, ("stages", "flows")) == []


def test_the_cycle_finder_sees_function_local_and_relative_imports(tmp_path):
    pkg = tmp_path / "stages" / "room"
    pkg.mkdir(parents=True)
    (tmp_path / "stages" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("def run():\n    from .runner import go\n    return go()\n")
    (pkg / "runner.py").write_text("from . import helper\n\ndef go():\n    return helper.x\n")
    (pkg / "helper.py").write_text("x = 1\n")
    assert import_cycles(tmp_path, ("stages",)) == []
    (pkg / "helper.py").write_text("def late():\n    from stages.room import run\n    return run\n")
    assert import_cycles(tmp_path, ("stages",)) == [["stages.room", "stages.room.helper", "stages.room.runner"]]


def _third_party_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ["planning", "launch"])
def test_planning_and_launching_load_no_torch_at_import(package):
    """What the CLI plans and launches with runs before any torch import (seconds, gigabytes): no
    module-level torch, transformers or numpy in stages/planning and stages/launch."""
    heavy = {p.name: _module_level_imports(p) & {"torch", "transformers", "numpy"}
             for p in sorted((STAGES_DIR / package).glob("*.py"))}
    assert not {k: v for k, v in heavy.items() if v}, heavy


def test_no_two_modules_share_a_name_across_the_runtime_packages():
    """`runtime/export.py` beside `stages/export/`, `checkpoint.py` beside `checkpointing.py`,
    `models/gguf.py` (reading) beside `export/gguf.py` (writing) read as the same thing: each name once."""
    names: dict[str, list[str]] = {}
    # a stage's own may repeat
    shared = ("core", "planning", "launch", "runtime", "inference", "models", "export", "pipeline")
    for p in _modules():
        if p.stem not in ("__init__", "__main__") and p.relative_to(STAGES_DIR).parts[0] in shared:
            names.setdefault(p.stem, []).append(str(p.relative_to(STAGES_DIR)))
    packages = {p.name for p in STAGES_DIR.iterdir() if (p / "__init__.py").is_file()}
    assert not {n: w for n, w in names.items() if len(w) > 1}
    assert not sorted(n for n in names if n in packages), "a module named like a package"


def test_stages_never_import_prefect_and_flows_never_import_torch():
    assert not [p for p in _modules() if "prefect" in _third_party_imports(p)]
    flows = sorted((ROOT / "flows").rglob("*.py"))
    assert not [p for p in flows if _third_party_imports(p) & {"torch", "transformers", "numpy"}]


# --------------------------------------------------------------------------- flows/ -> stages/

FLOWS_DIR = ROOT / "flows"
FLOWS_MODULES = ("flows.cli", "flows.sft", "flows.sweep", "flows.serve", "flows.deploy", "flows.servers.prefect_server")
# What flows/ imports from stages when it is imported: a module, or a package and every module in it.
# The `flows` row of docs/architecture.md's table.
FLOWS_MAY_IMPORT = {
    "stages.pipeline": "the stage graph: plan, Plan, run_stage, KEY_METRIC",
    "stages.sweep": "a sweep's trials and their ranking",
    "stages.core": "config and errors",
    "stages.evaluate.report": "the eval-set table as text cells (pure data, printed by the CLI and the flow summary)",
    "stages.launch.launcher": "the CLI's Ctrl-C / SIGTERM handler tells running torchrun trees to stop",
}
# What flows/ may import only inside the function that needs it (the command that uses it), and why.
FLOWS_MAY_IMPORT_LAZILY = {
    "stages.inference.generation": "`sftflow chat` loads and runs the model (torch)",
    "stages.models.refs": "`sftflow chat -m`: a train folder, checkpoint or models:/ ref -> a model folder",
    "stages.models.base": "`sftflow show --preview`: the base model's tokenizer (builds a builtin one on first use)",
    "stages.prepare.stage": "`sftflow show --preview`: prepared samples (tokenizers)",
    "stages.planning.memory_plan": "`sftflow show`: the memory plan table (arithmetic, no torch)",
    "stages.tracking.sweep": "the sweep flow's MLflow parent run",
    "stages.tracking.registry": "`sftflow models` and the flow's versions table: the registered versions, their "
                                "aliases and reasons; `export`/`chat`: the version an alias names",
    "stages.tracking.gate": "a drop the data gate stopped, recorded in MLflow (the flow's prepare task)",
    "stages.export.gguf": "`sftflow export`: a model folder -> GGUF and an Ollama Modelfile",
    "stages.retention": "`sftflow gc` and the policy after a flow run: what is kept, what is freed",
}
# The lazy imports that load torch, and the only functions they may be in.
FLOWS_TORCH_IMPORTS = {"stages.inference.generation": {("cli/registry.py", "chat")}}


def _allowed(module: str, allowed) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


def _stages_imports(path: Path) -> list[tuple[str, str | None]]:
    """(`stages.*` module, the function it is imported in, or None at module level) for every import
    in `path`; `from stages.x import y` counts as `stages.x.y` when y is a module."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, function or getattr(child, "name", "<lambda>"))
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
                subs = [f"{child.module}.{a.name}" for a in child.names]
                modules = [m for m in subs if (ROOT.joinpath(*m.split(".")).with_suffix(".py")).is_file()
                           or (ROOT.joinpath(*m.split(".")) / "__init__.py").is_file()]
                names = modules or [child.module]
            found.extend((n, function) for n in names if n == "stages" or n.startswith("stages."))
            visit(child, function)

    visit(ast.parse(path.read_text()), None)
    return found


def _flows_files() -> list[Path]:
    return sorted(FLOWS_DIR.rglob("*.py"))


@pytest.mark.parametrize("path", _flows_files(), ids=lambda p: str(p.relative_to(FLOWS_DIR)))
def test_flows_import_from_stages_only_what_the_floor_plan_allows(path):
    imports = _stages_imports(path)
    name = str(path.relative_to(FLOWS_DIR))
    eager = sorted({m for m, fn in imports if fn is None and not _allowed(m, FLOWS_MAY_IMPORT)})
    assert not eager, (f"flows/{name} imports {eager} when imported; allowed: {sorted(FLOWS_MAY_IMPORT)} "
                       f"(or import it inside the function that needs it, listed in FLOWS_MAY_IMPORT_LAZILY)")
    lazy = sorted({f"{m} (in {fn})" for m, fn in imports
                   if fn is not None and not _allowed(m, FLOWS_MAY_IMPORT) and m not in FLOWS_MAY_IMPORT_LAZILY})
    assert not lazy, f"flows/{name} imports {lazy}; allowed lazily: {sorted(FLOWS_MAY_IMPORT_LAZILY)}"
    torch = sorted(f"{m} (in {fn or 'module level'})" for m, fn in imports
                   if m in FLOWS_TORCH_IMPORTS and (name, fn) not in FLOWS_TORCH_IMPORTS[m])
    assert not torch, f"flows/{name} imports {torch}, which load torch; only in {FLOWS_TORCH_IMPORTS}"


def test_the_flows_rooms_import_one_way():
    """flows/ is three rooms: the CLI (flows/cli/) imports the flows and the servers, the Prefect flows
    (flows/*.py) the servers, and the servers (flows/servers/) neither (function-local imports included)."""
    def room(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in ("cli", "servers") else "flows"
    may = {"cli": {"cli", "flows", "servers"}, "flows": {"flows", "servers"}, "servers": {"servers"}}
    wrong = sorted(f"{p.relative_to(ROOT)} imports {m}" for p in _flows_files()
                   for m in _own_imports(ROOT, p, ("flows",))
                   if room(m) not in may[room(".".join(p.relative_to(ROOT).with_suffix("").parts))])
    assert not wrong, wrong


def test_the_flows_allowances_are_all_used():
    """An allowance nothing needs any more is drift: the table would promise more than flows/ does."""
    used = {m for p in _flows_files() for m, _ in _stages_imports(p)}
    unused = sorted(a for a in [*FLOWS_MAY_IMPORT, *FLOWS_MAY_IMPORT_LAZILY] if not any(_allowed(m, [a]) for m in used))
    assert not unused, f"allowed but never imported by flows/: {unused}"


def test_importing_flows_loads_no_torch(tmp_path):
    """The CLI, the flows and the deployments load no torch (seconds, gigabytes) when imported, nor
    does any lazy import but the ones FLOWS_TORCH_IMPORTS names (`sftflow chat`)."""
    lazy = [m for m in FLOWS_MAY_IMPORT_LAZILY if m not in FLOWS_TORCH_IMPORTS]
    code = ("import importlib, json, sys\n"
            f"for m in {list(FLOWS_MODULES)!r}: importlib.import_module(m)\n"
            "flows = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            f"for m in {lazy!r}: importlib.import_module(m)\n"
            "lazy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            "print(json.dumps([flows, lazy]))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    flows, lazy_loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert flows == [], f"importing {', '.join(FLOWS_MODULES)} loads {flows}"
    assert lazy_loaded == [], f"one of the lazy imports {lazy} loads {lazy_loaded}; list it in FLOWS_TORCH_IMPORTS"


# module edited -> the code versions that must change (all others must not)
EDITS = {
    "runtime/batches.py": {"train", "evaluate"},
    "inference/generation.py": {"evaluate", "register"},
    "core/chat/chat_tokens.py": {"evaluate", "register"},  # where generation stops
    "runtime/worker.py": {"train", "evaluate"},
    "chatdata/shards.py": {"prepare", "train", "evaluate"},
    "chatdata/readers.py": {"prepare", "evaluate", "models.builtin"},
    "prepare/masking.py": {"prepare"},
    "evaluate/scorers.py": {"evaluate"},
    "models/builtin.py": {"models.builtin"},
    "tracking/live.py": {"register"},   # live metrics never change a trained model
    "tracking/run.py": {"register"},
    "core/config/__init__.py": {"register"},     # the schema's values are hashed as data
    "core/config/fields.py": {"register"},  # the config's sections, split by part of the config
    "core/config/actor.py": {"register"},
    "core/config/data.py": {"register"},
    "core/config/eval.py": {"register"},
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
    text = (text.replace('"""The SFT worker', '"""Reworded: the SFT worker', 1)
            .replace("\n\n\n", "\n\n\n# a comment\n", 1))
    path.write_text(text)
    assert _versions(stages_copy) == before


class _ParsesWhenCollected:
    def __del__(self):
        ast.parse("x = 1")


def _parse_with_a_foreign_parse_inside(parse, src: bytes):
    """Interleave another parse with `parse` the way a second thread does: the collector runs
    finalizers while the tree is being converted, and this finalizer parses."""
    gc.collect()
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for _ in range(20):
            cycle = _ParsesWhenCollected()
            cycle.me = cycle
        del cycle
        return parse(src)
    finally:
        gc.set_threshold(*threshold)


def test_a_parse_that_loses_the_interpreter_race_is_retried(monkeypatch):
    """CPython 3.11's ast.parse fails spuriously when another parse interleaves with it
    (python/cpython#106905); a Prefect worker's flow run hit it while planning."""
    src = (STAGES_DIR / "export" / "gguf.py").read_bytes()
    want = ast.dump(ast.parse(src))
    if sys.version_info < (3, 12):   # the reference: the interleaving breaks a bare ast.parse
        with pytest.raises(SystemError, match="recursion depth mismatch"):
            _parse_with_a_foreign_parse_inside(ast.parse, src)
    tree = _parse_with_a_foreign_parse_inside(lambda b: codeversion._parse_source(b, "gguf.py"), src)
    assert ast.dump(tree) == want

    def other(*a, **k):
        raise SystemError("another failure")

    monkeypatch.setattr(codeversion.ast, "parse", other)
    with pytest.raises(SystemError, match="another failure"):
        codeversion._parse_source(src, "gguf.py")


def test_the_real_tree_closures_hold_the_modules_each_stage_runs():
    names = {e: {str(f.relative_to(STAGES_DIR)) for f in module_closure([e])} for e in ("train", "evaluate")}
    # the torchrun entry points are part of the stage: the worker loop and the evaluation runner
    assert {"train/__main__.py", "runtime/worker.py", "runtime/batches.py",
            "runtime/saving/checkpoint.py"} <= names["train"]
    assert {"evaluate/runner.py", "runtime/worker.py", "runtime/batches.py", "models/refs.py"} <= names["evaluate"]
    assert "tracking/live.py" not in names["train"]


def test_metrics_reach_mlflow_through_one_sender():
    """Only tracking/live.py sends metrics (live, the train stage's catch-up, register's backfill and
    eval metrics all go through its `send`)."""
    senders = sorted(str(p.relative_to(STAGES_DIR)) for p in _modules()
                     if any(call in p.read_text() for call in ("log_metric(", "log_metrics(", "metrics=")))
    assert senders == ["tracking/live.py"], senders


# --------------------------------------------------------------------------- the road to the loop

ROAD_ROW = re.compile(r"^\| (\d+|–) \| (\w+) \| ([\w/\\.]+) \| (.+?) \| `(\w+)`")


def _road() -> list[dict]:
    """docs/architecture.md's table "From the CLI to the training loop", row by row."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## From the CLI to the training loop", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = ROAD_ROW.match(line)
        if m:
            fn = re.match(r"`(\w+)`", m.group(4))
            rows.append({"file": ROOT / m.group(3).replace("\\", ""), "function": fn.group(1) if fn else None,
                         "calls": m.group(5)})
    return rows


def _body(path: Path, function: str | None) -> ast.AST:
    """A function defined anywhere in `path` (nested ones too), or the module's own statements."""
    tree = ast.parse(path.read_text())
    if function is None:
        return ast.Module(body=[n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))],
                          type_ignores=[])
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
    assert found, f"{path.relative_to(ROOT)} defines no {function}() (docs/architecture.md's road)"
    return found[0]


def _calls(node: ast.AST) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call)]


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def test_the_road_from_the_cli_to_the_loop_is_walked_as_written():
    """Every row's function exists in its file and calls what the row says; each call reaches the
    next row: by name, or through the hop the row names (the stage's Prefect task, the torchrun
    launch)."""
    road = _road()
    assert [r["function"] for r in road] == ["run", "sft_pipeline", "run_stage_task", "task_fn", "run_stage",
                                             "run_train", "run_torchrun", None]
    assert len(road) <= 8, "the CLI reaches the training loop in at most 8 calls (issue 34)"
    for row, nxt in zip(road, [*road[1:], None]):
        body = _body(row["file"], row["function"])
        calls = [c for c in _calls(body) if _callee(c) == row["calls"]]
        assert calls, f"{row['function'] or row['file'].name} makes no call to {row['calls']}"
        if nxt is None:
            assert row["calls"] == "fit" and _body(ROOT / "stages" / "runtime" / "worker.py", "fit")
        elif row["calls"] == "t":  # the stage's task: configured_task hands out TASKS[stage], made by _stage_task
            assert "TASKS[stage]" in ast.unparse(_body(row["file"], "configured_task"))
            assert "TASKS = {stage: _stage_task(stage)" in row["file"].read_text()
            assert _body(row["file"], "_stage_task") and nxt["function"] == "task_fn"
        elif row["calls"] == "call":  # the stage's function (its row's `run`), readied by the function its `call` names
            from stages.graph import BY_NAME
            assert "CALLS[BY_NAME[stage].call]" in ast.unparse(body)
            train = BY_NAME["train"]
            module, _, function = train.run.partition(":")
            assert function == nxt["function"] and nxt["file"] == ROOT.joinpath(*module.split(".")) / "__init__.py"
            readies = _body(row["file"], train.call)
            assert f"{function} = stage_function(stage)" in ast.unparse(readies)
            assert any(_callee(c) == "partial" and c.args and ast.unparse(c.args[0]) == nxt["function"]
                       for c in _calls(readies)), f"{train.call} readies no {nxt['function']}"
        elif row["calls"] == "Popen":  # torchrun runs `-m <module> spec.json`; run_train names stages.train
            import stages.train

            def named(node) -> object:  # a literal, or a module-level constant of stages/train; else None
                if isinstance(node, ast.Constant):
                    return node.value
                return getattr(stages.train, node.id, None) if isinstance(node, ast.Name) else None
            assert any(named(k.value) == "stages.train"
                       for c in _calls(_body(ROOT / "stages" / "train" / "__init__.py", "run_train"))
                       for k in c.keywords if k.arg == "module")
            launcher = ROOT / "stages" / "launch" / "launcher.py"
            assert "['-m', module" in ast.unparse(_body(launcher, "torchrun_command"))
            assert nxt["file"] == ROOT / "stages" / "train" / "__main__.py" and nxt["function"] is None
        else:
            assert row["calls"] == nxt["function"], f"{row['function']} calls {row['calls']}, the next row is " \
                                                    f"{nxt['function']}"
    # the rank's module calls fit on the worker load_worker builds, inside rank_entry (the error file)
    entry = ast.parse((ROOT / "stages" / "train" / "__main__.py").read_text())
    [with_] = [n for n in entry.body if isinstance(n, ast.With)]
    assert ast.unparse(with_.items[0].context_expr) == "rank_entry()"
    assert ast.unparse(with_.body[0]) == "load_worker(sys.argv[1]).fit()"
    assert _body(ROOT / "stages" / "runtime" / "worker.py", "load_worker")
    assert _body(ROOT / "stages" / "runtime" / "distributed.py", "rank_entry")


# --------------------------------------------------------------------------- nothing happens at import

ENV_MUTATORS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}
# Process-wide state besides the environment, which belongs where a process starts as the environment
# does: a signal or exit handler installed by an import runs in every process that imports it (the CLI,
# a Prefect worker, a rank), and a logger or warnings filter configured there hides or prints for all of them.
PROCESS_HOOKS = {
    "signal.signal": "sets a signal handler", "signal.siginterrupt": "changes a signal's restart",
    "signal.set_wakeup_fd": "sets the signal wake-up fd", "atexit.register": "registers an exit handler",
    "logging.basicConfig": "configures logging", "logging.disable": "configures logging",
    "logging.captureWarnings": "configures logging", "logging.config.dictConfig": "configures logging",
    "logging.config.fileConfig": "configures logging", "logging.setLoggerClass": "configures logging",
    "logging.setLogRecordFactory": "configures logging", "warnings.filterwarnings": "changes the warnings filters",
    "warnings.simplefilter": "changes the warnings filters", "warnings.resetwarnings": "changes the warnings filters",
    "faulthandler.enable": "enables faulthandler",
}
LOGGER_CONFIG = {"addFilter", "removeFilter", "addHandler", "removeHandler", "setLevel"}


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os")


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _names_imported(nodes) -> dict[str, str]:
    """name bound -> what it names, dotted: `import logging.config` binds logging (logging), `from atexit
    import register as r` binds r (atexit.register); a relative import's names stand for themselves."""
    names = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                      for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = f"{node.module}." if node.module and not node.level else ""
            names |= {a.asname or a.name: base + a.name for a in node.names}
    return names


def _dotted(node: ast.AST, imported: dict[str, str]) -> str | None:
    """What `a.b.c` names when `a` was imported (`signal.signal`, `logging.config.dictConfig`), else None."""
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
        return imported.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, imported)
        return f"{base}.{node.attr}" if base else None
    return None


def _runs_when_reached(stmts: list[ast.stmt]):
    """The nodes that run when `stmts` run: not the bodies of the functions they define (their
    decorators and defaults do run), nor an `if __name__ == "__main__":` block."""
    todo = list(stmts)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += [*node.decorator_list, *(d for d in (*node.args.defaults, *node.args.kw_defaults) if d)]
            continue
        if isinstance(node, ast.Lambda):
            continue
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
                and node.test.left.id == "__name__"):
            continue
        yield node
        todo += list(ast.iter_child_nodes(node))


def import_time_effects(source: str) -> list[tuple[int, str]]:
    """(line, what) for each change to the process that importing `source` makes: os.environ written
    (`[...] =`, `del`, setdefault/update/pop/..., handed to a function), os.putenv/unsetenv, an
    attribute of an imported module (or of anything imported) set or `setattr`, a process hook
    installed (`PROCESS_HOOKS`: signal and exit handlers, logging and warnings configuration; called, or
    as a decorator) or a logger configured (`LOGGER_CONFIG`); also inside the module's own functions that
    its import-time code calls."""
    tree = ast.parse(source)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found: set[tuple[int, str]] = set()
    followed: set[str] = set()

    def scan(stmts: list[ast.stmt], imported: dict[str, str], via: str) -> None:
        for node in _runs_when_reached(stmts):
            hook = _dotted(node, imported)
            if hook in PROCESS_HOOKS:
                found.add((node.lineno, f"{PROCESS_HOOKS[hook]} ({hook}){via}"))
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Subscript) and _is_environ(t.value):
                        found.add((node.lineno, f"writes os.environ{via}"))
                    elif isinstance(t, ast.Attribute) and _root_name(t) in imported:
                        found.add((node.lineno, f"sets {ast.unparse(t)}, an attribute of an import{via}"))
            elif isinstance(node, ast.Call):
                f, args = node.func, [*node.args, *(k.value for k in node.keywords)]
                if isinstance(f, ast.Attribute) and _is_environ(f.value) and f.attr in ENV_MUTATORS:
                    found.add((node.lineno, f"calls os.environ.{f.attr}{via}"))
                elif isinstance(f, ast.Attribute) and f.attr in ("putenv", "unsetenv") and _root_name(f) == "os":
                    found.add((node.lineno, f"calls os.{f.attr}{via}"))
                elif isinstance(f, ast.Name) and f.id == "setattr" and args and _root_name(args[0]) in imported:
                    found.add((node.lineno, f"setattr on {ast.unparse(args[0])}, an import{via}"))
                elif any(_is_environ(a) for a in args):
                    found.add((node.lineno, f"hands os.environ to {ast.unparse(f)}{via}"))
                elif isinstance(f, ast.Attribute) and f.attr in LOGGER_CONFIG:
                    found.add((node.lineno, f"configures a logger ({ast.unparse(f)}){via}"))
                elif isinstance(f, ast.Name) and f.id in functions and f.id not in followed:
                    followed.add(f.id)
                    fn = functions[f.id]
                    scan(fn.body, imported | _names_imported(ast.walk(fn)), f" (in {f.id}, called at import)")

    scan(tree.body, _names_imported(_runs_when_reached(tree.body)), "")
    return sorted(found)


def test_importing_a_module_changes_nothing_in_the_process():
    """No module of flows/ or stages/ sets environment variables, patches another module, installs a
    signal or exit handler or configures logging or warnings when it is imported: that happens where a
    process starts (stages/core/machine/process_env.py, the CLI's callback,
    a flow's start, the launcher's child environment; tests/test_threads.py runs it). `__main__.py`
    modules and `if __name__ == "__main__":` blocks are entries, left out."""
    wrong = [f"{path.relative_to(ROOT)}:{line}: {what}"
             for path in [*_flows_files(), *_modules()] if path.name != "__main__.py"
             for line, what in import_time_effects(path.read_text(encoding="utf-8"))]
    assert not wrong, "at import:\n" + "\n".join(wrong)


def test_the_import_scan_sees_what_an_import_changes():
    source = '''
import os
import prefect.utilities.engine as engine
from logging import root

os.environ["A"] = "1"
os.environ.setdefault("B", "1")
os.putenv("C", "1")
engine._handler = print
setattr(root, "level", 10)


def _patch():
    import torch
    torch.backends.flag = True


def policy(env):
    env["D"] = "1"


_patch()
policy(os.environ)
TABLE = {k: v for k, v in os.environ.items()}  # reading is fine


def later():
    os.environ["E"] = "1"
    engine._handler = None


class Holder:
    handler = engine._handler  # reading is fine


if __name__ == "__main__":
    os.environ["F"] = "1"
'''
    assert [line for line, _ in import_time_effects(source)] == [6, 7, 8, 9, 10, 15, 23]
    assert dict(import_time_effects(source))[15] == "sets torch.backends.flag, an attribute of an import (in _patch, " \
                                                    "called at import)"


def test_the_import_scan_sees_process_hooks_and_logging_configuration():
    """Signal and exit handlers, logger filters, levels and handlers, and logging's or warnings'
    configuration, set when a module is imported: called or as a decorator, under any name they were
    imported as, and in the module's functions its import calls; not in a function nothing calls at
    import, nor a filter that only lasts a `with` block."""
    source = '''
import atexit
import logging
import logging.config
import signal as sig
import warnings
from atexit import register
from mlflow.utils.logging_utils import suppress_logs

logging.getLogger("mlflow").addFilter(lambda r: True)
log = logging.getLogger(__name__)
log.setLevel(logging.INFO)
logging.basicConfig(level=logging.INFO)
logging.config.dictConfig({})
sig.signal(sig.SIGTERM, sig.SIG_DFL)
atexit.register(print)
warnings.filterwarnings("ignore")


@register
def at_exit():
    pass


def _install():
    logging.getLogger().addHandler(logging.NullHandler())


_install()
with suppress_logs("mlflow", None):
    pass


def later():
    sig.signal(sig.SIGINT, sig.SIG_DFL)
    logging.getLogger().setLevel(10)
    atexit.register(print)
'''
    found = import_time_effects(source)
    assert [line for line, _ in found] == [10, 12, 13, 14, 15, 16, 17, 20, 26], found
    said = dict(found)
    assert said[15] == "sets a signal handler (signal.signal)"
    assert said[20] == "registers an exit handler (atexit.register)"
    assert said[26] == "configures a logger (logging.getLogger().addHandler) (in _install, called at import)"


# --------------------------------------------------------------------------- the doc's floor plan

def _names(cell: str) -> list[str]:
    """A cell's names: the notes in parentheses left out, split at commas and "and"."""
    depth, text = 0, []
    for ch in cell:
        depth += ch == "("
        if not depth:
            text.append(ch)
        depth -= ch == ")" and depth > 0
    return [n.strip(" `") for part in "".join(text).split(",") for n in part.split(" and ") if n.strip(" `")]


def _package_table() -> dict[str, str]:
    """docs/architecture.md's table "package | may import": its first column's packages -> the second column."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The floor plan", 1)[1].split("\n## ", 1)[0]
    rows = section.split("| package | may import (besides itself) |", 1)[1].split("\n\n", 1)[0]
    table = {}
    for line in rows.strip().splitlines()[1:]:
        first, second = (c.strip() for c in line.strip().strip("|").split(" | ", 1))
        for package in _names(first):
            assert package not in table, f"{package} has two rows"
            table[package] = second
    return table


def test_the_docs_package_table_is_the_tests():
    """docs/architecture.md's package table says what ALLOWED (and, for its `flows` row, FLOWS_MAY_IMPORT and
    FLOWS_MAY_IMPORT_LAZILY) enforce: the same packages, each allowed the same ones; so neither can change
    without the other."""
    table = _package_table()
    flows = table.pop("flows")
    documented = {p: set() if cell == "—" else set(_names(cell)) for p, cell in table.items()}
    for allowed in documented.values():
        if "the stages" in allowed:
            allowed.remove("the stages")
            allowed |= STAGE_PACKAGES
    assert documented == ALLOWED
    eager, _, lazy = flows.partition("; only inside the function that needs it:")
    eager = eager.removeprefix("from `stages`:")
    assert {f"stages.{n}" for n in _names(eager)} == set(FLOWS_MAY_IMPORT)
    assert {f"stages.{n}" for n in _names(lazy)} == set(FLOWS_MAY_IMPORT_LAZILY)


def test_the_docs_cite_tests_that_exist():
    """Every `tests/<file>.py::<test>` docs/architecture.md names (what guards each mechanism that stands in
    for a library, among others) is a test of that file: a renamed test leaves no stale pointer."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    cited = sorted(set(re.findall(r"tests/(\w+\.py)::(\w+)", text)))
    assert len(cited) >= 7
    missing = [f"{f}::{name}" for f, name in cited
               if not re.search(rf"^def {name}\(", (ROOT / "tests" / f).read_text(), re.M)]
    assert not missing, missing
