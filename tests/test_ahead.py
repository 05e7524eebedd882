"""A one-process rank started ahead of the train stage (stages/launch/ahead.py): it trains exactly as a
rank started fresh, a launch whose environment differs where an import could read it starts one fresh,
and one that no launch takes is gone when its flow ends."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, live_processes_mentioning, sftflow, tiny_config_dict, write_config, write_jsonl

pytestmark = pytest.mark.slow


def _ahead_ranks(tmp) -> list[str]:
    """Live ranks started ahead by a CLI call of this test (their environment names its folder)."""
    from pathlib import Path
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "--ahead=" in cmd and str(tmp).encode() in (proc / "environ").read_bytes():
                found.append(cmd)
        except OSError:
            continue
    return found


def _run(tmp, env=None):
    tmp.mkdir()
    cfg = write_config(tmp, tiny_config_dict(tmp))
    proc = sftflow("run", "-c", str(cfg), cwd=tmp, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = next((tmp / "artifacts" / "train").glob("[!.]*"))
    return train, (train / "train.log").read_text()


def test_a_rank_started_ahead_trains_exactly_as_a_fresh_one(tmp_path, prefect_api):
    ahead, ahead_log = _run(tmp_path / "ahead")
    fresh, fresh_log = _run(tmp_path / "fresh", env={"SFTFLOW_LAUNCH_AHEAD": "0"})
    assert "was started ahead of the stage" in ahead_log, ahead_log
    assert "started ahead" not in fresh_log, fresh_log

    def steps(folder):
        return [{k: r[k] for k in ("step", "loss", "grad_norm", "lr")}
                for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())]
    assert steps(ahead) == steps(fresh)  # to the bit: same threads, same sums
    weights = "model/model.safetensors"
    assert (ahead / weights).read_bytes() == (fresh / weights).read_bytes()
    assert _ahead_ranks(tmp_path) == []


def test_an_ahead_rank_no_launch_takes_is_stopped_when_the_flow_ends(tmp_path, prefect_api):
    # train is planned (so a rank starts ahead) but prepare stops the flow: every row is bad
    raw = tiny_config_dict(tmp_path)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "no reply"}]}] * 20)
    raw["data"]["train_data_paths"] = [str(bad)]
    # every Python process the run starts with `--ahead=` in its command line leaves its pid here, from
    # outside the code under test (a sitecustomize on the children's PYTHONPATH)
    hook, marks = tmp_path / "hook", tmp_path / "ahead-pids.txt"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if any(a.startswith('--ahead=') for a in sys.argv):\n"
        "    open(os.environ['AHEAD_MARKS'], 'a').write(f'{os.getpid()}\\n')\n")
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    proc = sftflow("run", "-c", str(write_config(tmp_path, raw)), cwd=tmp_path,
                   env={"PYTHONPATH": path, "AHEAD_MARKS": str(marks)})
    assert proc.returncode != 0
    assert marks.is_file() and marks.read_text().split(), "no rank was started ahead: the test proves nothing"
    assert live_processes_mentioning(str(tmp_path)) == [] and _ahead_ranks(tmp_path) == []
    assert not list((tmp_path / "artifacts").glob("train/*")), "prepare failed: nothing trained"


def _launch(tmp, start_env, take_env):
    """A rank started ahead with `start_env`, then a launch with `take_env` running `-m probe`."""
    from stages.launch import ahead
    (tmp / "probe.py").write_text("import json, os, torch\n"
                                  "print(json.dumps({'threads': torch.get_num_threads(), 'x': os.environ.get('X')}))\n")
    cmd = [sys.executable, *ahead.ENTRY, f"--log-dir={tmp / 'logs'}", "-m", "probe"]
    handle = ahead.start(cmd, start_env, ["torch"])
    try:
        assert ahead.take([*cmd[:-1], "other"], take_env) is None  # another command: not this rank
        proc = ahead.take(cmd, take_env)
        taken = proc is not None
        if proc is None:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env=take_env, start_new_session=True)
        out = proc.stdout.read()
        assert proc.wait(timeout=60) == 0, out
        return taken, json.loads(out.strip().splitlines()[-1]), handle
    finally:
        handle.close()


def test_the_launch_gives_the_waiting_rank_its_environment_and_threads(tmp_path):
    base = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "2"}
    # differs only in what the rank reads when it runs: its threads and its MLflow run
    taken, seen, handle = _launch(tmp_path, base, {**base, "OMP_NUM_THREADS": "1", "MLFLOW_RUN_ID": "r"})
    assert taken and seen == {"threads": 1, "x": None}
    assert handle.proc.poll() is not None


def test_a_launch_whose_import_time_environment_differs_starts_fresh_and_the_waiting_one_stops(tmp_path):
    base = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    taken, seen, handle = _launch(tmp_path, base, {**base, "X": "read at import, maybe"})
    assert not taken and seen == {"threads": 1, "x": "read at import, maybe"}
    assert handle.proc.poll() is not None, "closed by its flow: not left waiting"
