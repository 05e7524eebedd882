"""Every process sftflow starts gets the defaults of stages/core/machine/process_env.py (telemetry off, no
progress bars, OpenMP threads that spin 1,000 times before they sleep, unless the user set a policy),
where it starts: the CLI's entry, a flow run's start, each torchrun worker's environment. Importing a
module of flows/ or stages/ sets nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import ROOT
from stages.core.errors import StageError
from stages.core.machine.process_env import DEFAULTS
from stages.core.machine.threads import SPIN_COUNT
from stages.launch.launcher import run_torchrun, worker_env

POLICY = (*DEFAULTS, "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def _bare_env(**extra) -> dict[str, str]:
    """This environment without anything the policy sets (conftest sets some for the whole suite)."""
    return {**{k: v for k, v in os.environ.items() if k not in POLICY}, **extra}


@pytest.fixture
def bare(monkeypatch):
    """os.environ without the policy's variables for one test, restored after it."""
    for key in POLICY:
        monkeypatch.setenv(key, "")  # recorded, so that what the test leaves is undone
        monkeypatch.delenv(key)


def _python(code: str, **extra) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=_bare_env(**extra), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def _modules() -> list[str]:
    found = []
    for pkg in ("flows", "stages"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name == "__main__.py":  # an entry: running it is its purpose
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def test_importing_any_module_of_flows_or_stages_changes_no_environment():
    modules = _modules()
    assert "flows.cli" in modules and "stages.launch.launcher" in modules and len(modules) > 50
    code = ("import importlib, json, os\n"
            "before = dict(os.environ)\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "after = dict(os.environ)\n"
            "print(json.dumps(sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))))\n")
    changed = json.loads(_python(code))
    assert changed == [], f"importing flows/ and stages/ set {changed}; set them where a process starts " \
                          "(stages/core/machine/process_env.py apply_process_policy)"


PROBE = ("import json, os\n"
         "from flows.cli import main\n"
         "import sys; sys.argv = ['sftflow', 'show', '-c', 'no-such-config.yaml']\n"
         "try:\n"
         "    main()\n"
         "except SystemExit:\n"
         "    pass\n"
         f"print(json.dumps({{k: os.environ.get(k) for k in {list(POLICY)!r}}}))\n")


def _cli_env(**extra) -> dict:
    return json.loads(_python(PROBE, **extra))


def test_the_cli_entry_applies_the_policy_unless_the_user_chose():
    env = _cli_env()
    assert {k: env[k] for k in DEFAULTS} == DEFAULTS
    assert (env["GOMP_SPINCOUNT"], env["OMP_WAIT_POLICY"]) == (SPIN_COUNT, None)
    assert (lambda e: (e["GOMP_SPINCOUNT"], e["OMP_WAIT_POLICY"]))(_cli_env(OMP_WAIT_POLICY="PASSIVE")) == \
        (None, "PASSIVE")
    chosen = _cli_env(GOMP_SPINCOUNT="5", HF_HUB_DISABLE_PROGRESS_BARS="0")
    assert (chosen["GOMP_SPINCOUNT"], chosen["HF_HUB_DISABLE_PROGRESS_BARS"]) == ("5", "0")


def test_a_command_run_through_the_cli_runner_gets_the_policy(bare):
    """The app's callback applies it, so tests driving `flows.cli.app` in-process get what `sftflow` gets."""
    from flows.cli import app
    result = CliRunner().invoke(app, ["show", "-c", "no-such-config.yaml"])
    assert result.exit_code == 2
    assert {k: os.environ.get(k) for k in DEFAULTS} == DEFAULTS and os.environ["GOMP_SPINCOUNT"] == SPIN_COUNT


def test_a_flow_run_applies_it_at_its_start():
    """A deployment's run starts in a process that no CLI entry prepared: the flow applies it first."""
    code = ("import json, os\n"
            "import flows.sft\n"
            f"before = {{k: os.environ.get(k) for k in {list(POLICY)!r}}}\n"
            "flows.sft.at_flow_start()\n"
            f"print(json.dumps([before, {{k: os.environ.get(k) for k in {list(POLICY)!r}}}]))\n")
    before, after = json.loads(_python(code))
    assert set(before.values()) == {None}
    assert after == {**DEFAULTS, "GOMP_SPINCOUNT": SPIN_COUNT, "OMP_WAIT_POLICY": None}


def test_torchrun_workers_get_the_same_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert worker_env(2)["GOMP_SPINCOUNT"] == SPIN_COUNT
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    env = worker_env(2)
    assert "GOMP_SPINCOUNT" not in env and env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_launched_child_gets_the_policy_from_a_process_that_never_applied_it(bare, tmp_path: Path):
    """A library user's process (no CLI, no flow) that runs a stage: torchrun's tree still starts with it."""
    lines: list[str] = []
    probe = [sys.executable, "-c",
             f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {list(POLICY)!r}}}))"]
    run_torchrun(probe, tmp_path / "probe.log", StageError, "probe", lines.append)
    assert json.loads(lines[-1]) == {**DEFAULTS, "GOMP_SPINCOUNT": SPIN_COUNT, "OMP_WAIT_POLICY": None}
    assert all(os.environ.get(k) is None for k in POLICY)  # the parent itself was left alone


@pytest.mark.parametrize("entry", ["flows.cli.main", "flows.sft.at_flow_start"])
def test_a_process_sftflow_starts_exits_with_its_objects_frozen_after_its_atexit_handlers(entry, tmp_path: Path):
    """Python's finalization then skips full collections over torch's and Prefect's objects (seconds); the
    process's own atexit handlers, registered before, still run, and see the objects frozen."""
    module, name = entry.rsplit(".", 1)
    seen = tmp_path / "seen"
    code = ("import atexit, gc, sys\n"
            "from pathlib import Path\n"
            f"atexit.register(lambda: Path({str(seen)!r}).write_text(str(gc.get_freeze_count())))\n"
            f"import {module}\n"
            + (f"sys.argv = ['sftflow', '--help']\n{module}.{name}()\n" if name == "main"
               else f"{module}.{name}(); {module}.{name}()\n"))
    proc = subprocess.run([sys.executable, "-c", code], env=_bare_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(seen.read_text()) > 10_000  # every module's objects, not a handful
    assert "Exception ignored" not in proc.stderr
