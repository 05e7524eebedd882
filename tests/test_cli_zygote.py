"""The warm CLI of the tests (tests/cli_zygote.py) against `python -m flows.cli` started from scratch:
the same exit status, stdout and stderr, in the call's folder and environment; a call it must not
take runs from scratch; a timeout ends the child as subprocess.run's does."""

import json
import os
import signal
import subprocess
import threading

import pytest

import conftest
from conftest import sftflow, tiny_config_dict, write_config

pytestmark = pytest.mark.skipif(os.environ.get("SFTFLOW_TEST_FORK", "1") == "0", reason="SFTFLOW_TEST_FORK=0")


def _no_subprocess(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"ran as a subprocess: {args[0] if args else kwargs}; variables that differ from the "
                             f"warm process's: {conftest._warm_cli.refused}")
    monkeypatch.setattr(conftest.subprocess, "run", refuse)


def test_a_warm_call_answers_as_a_fresh_process_does(tmp_path, monkeypatch):
    path = write_config(tmp_path, tiny_config_dict(tmp_path))
    (tmp_path / "folder.yaml").mkdir()
    calls = [("show", "-c", "config.yaml", "--json"),  # a path relative to the call's folder
             ("show", "-c", str(path), "runner.max_steps=nope"),  # exit 2, one line
             ("run", "-c", str(tmp_path / "folder.yaml"))]
    fresh = [sftflow(*c, cwd=tmp_path, fresh=True) for c in calls]
    with monkeypatch.context() as m:
        _no_subprocess(m)
        warm = [sftflow(*c, cwd=tmp_path) for c in calls]
    for f, w in zip(fresh, warm):
        assert (w.returncode, w.stdout, w.stderr) == (f.returncode, f.stdout, f.stderr), w.args
    assert [w.returncode for w in warm] == [0, 2, 2]
    assert json.loads(warm[0].stdout)["stages"]["train"]["status"] == "missing"
    assert "is a folder" in warm[2].stderr


def test_a_warm_call_has_the_call_s_environment_and_imports_modules_from_its_folder(tmp_path, monkeypatch):
    """A custom worker next to the config imports (`python -m` puts the folder first on sys.path);
    SFTFLOW_KEEP_SERVER=bad from the call's environment reaches the CLI (its one-line error)."""
    (tmp_path / "myworker.py").write_text("from stages.runtime.worker import SFTWorker\n\n\n"
                                          "class MyWorker(SFTWorker):\n    pass\n")
    path = write_config(tmp_path, tiny_config_dict(tmp_path, actor={"worker": "myworker:MyWorker"}))
    _no_subprocess(monkeypatch)
    shown = sftflow("show", "-c", str(path), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    kept = sftflow("stage", "prepare", "-c", str(path), cwd=tmp_path,
                   env={"SFTFLOW_KEEP_SERVER": "bad", "PREFECT_API_URL": None})
    assert kept.returncode == 2 and "SFTFLOW_KEEP_SERVER" in kept.stderr, kept.stderr


def test_a_call_with_an_import_time_variable_changed_runs_from_scratch(tmp_path, monkeypatch):
    ran = []
    real = subprocess.run
    monkeypatch.setattr(conftest.subprocess, "run", lambda *a, **k: ran.append(a[0]) or real(*a, **k))
    path = write_config(tmp_path, tiny_config_dict(tmp_path))
    proc = sftflow("show", "-c", str(path), cwd=tmp_path, env={"HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 0 and len(ran) == 1 and ran[0][1:4] == ["-m", "flows.cli", "show"]


def test_a_warm_call_past_its_timeout_is_killed(tmp_path):
    path = write_config(tmp_path, tiny_config_dict(tmp_path))
    sftflow("show", "-c", str(path), cwd=tmp_path)  # the warm process is up: the timeout is the call's
    with pytest.raises(subprocess.TimeoutExpired):
        sftflow("run", "-c", str(path), cwd=tmp_path, timeout=2, env={"PREFECT_API_URL": None})
    assert conftest._warm_cli.proc.poll() is None  # the warm process itself lives on
    with pytest.raises(ProcessLookupError):  # the call's process was killed and reaped
        os.kill(conftest._warm_cli.child, 0)
    after = sftflow("show", "-c", str(path), cwd=tmp_path)
    assert after.returncode == 0, after.stderr


def test_a_warm_process_that_dies_during_a_call_is_named_and_replaced(tmp_path):
    path = write_config(tmp_path, tiny_config_dict(tmp_path))
    sftflow("show", "-c", str(path), cwd=tmp_path)
    warm = conftest._warm_cli.proc
    killer = threading.Timer(1.0, warm.kill)  # the call (a flow on its own Prefect server) takes longer
    killer.start()
    try:
        with pytest.raises(RuntimeError, match=r"warm CLI process \(tests/cli_zygote.py\) ended during a call"):
            sftflow("run", "-c", str(path), cwd=tmp_path, timeout=120, env={"PREFECT_API_URL": None})
    finally:
        killer.join()
        try:
            os.kill(conftest._warm_cli.child, signal.SIGKILL)  # the orphaned call (its server dies with it)
        except ProcessLookupError:
            pass
    after = sftflow("show", "-c", str(path), cwd=tmp_path)
    assert after.returncode == 0, after.stderr
    assert conftest._warm_cli.proc is not warm and conftest._warm_cli.proc.poll() is None
