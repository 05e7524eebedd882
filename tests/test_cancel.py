"""Stopping a run stops all of it: no torchrun agent or worker survives a SIGTERM of the CLI
(what Prefect sends when a flow run is cancelled) or a task timeout."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import descendants, left_alive, live_processes_mentioning, sftflow, tiny_config_dict, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]

LONG = ["runner.max_steps=100000", "runner.max_epochs=1000", "runner.save_interval=0", "runner.val_check_interval=0"]


def wait_gone(text: str, seconds: float = 30) -> list[str]:
    deadline = time.time() + seconds
    while time.time() < deadline:
        left = live_processes_mentioning(text)
        if not left:
            return []
        time.sleep(0.5)
    return live_processes_mentioning(text)


def listening_addresses(text: str) -> list[tuple[str, str]]:
    """(command line, address) of every listening TCP socket of the processes mentioning `text`."""
    import psutil
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if text in cmd:
            try:
                found += [(cmd, c.laddr.ip) for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
            except psutil.Error:
                pass
    return found


def test_sigterm_mid_training_leaves_no_process_alive(tmp_path):
    """Also: a one-machine run listens on loopback only (torchrun --standalone hosts its stores on `::`),
    its gloo listeners too (two ranks)."""
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path, actor={"nproc_per_node": 2}))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}  # PREFECT_API_URL: the session server
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "stage", "train", "-c", str(cfg_path),
                             "--with-upstream", *LONG], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    marker = str(tmp_path / "artifacts" / "train")
    try:
        for line in proc.stdout:
            if "step 1/" in line:
                break
        assert live_processes_mentioning(marker), "training should be running"
        listening = listening_addresses(marker)
        assert len(listening) >= 3, listening  # the run's store + a gloo listener per rank
        assert {ip for _, ip in listening} <= {"127.0.0.1", "::1"}, listening
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=240)  # keep draining (a full pipe would block the CLI); slow on a loaded box
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert wait_gone(marker) == []


def test_task_timeout_kills_the_torchrun_tree(tmp_path):
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    proc = sftflow("stage", "train", "-c", str(cfg_path), "--with-upstream", *LONG, "flow.timeout_seconds=25",
                   cwd=tmp_path)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and "time" in errors[0].lower(), proc.stderr[-2000:]
    assert wait_gone(str(tmp_path / "artifacts" / "train")) == []


def test_task_retry_resumes_training_from_the_last_checkpoint(tmp_path):
    cfg_path = write_config(tmp_path, tiny_config_dict(tmp_path))
    # the first attempt is SIGKILLed (torchrun and workers) right after the step-2 checkpoint
    proc = sftflow("stage", "train", "-c", str(cfg_path), "--with-upstream", "flow.retries=1",
                   "flow.retry_delay_seconds=0", cwd=tmp_path, env={"SFTFLOW_FAULT": "after_save:2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    folder = next(p for p in (tmp_path / "artifacts" / "train").iterdir() if not p.name.startswith("."))
    log = (folder / "train.log").read_text()
    assert "SFTFLOW_FAULT" in log and "at step 2 (epoch 0, 32 samples into it)" in log
    steps = [line.split('"step": ')[1].split(",")[0] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert steps == ["1", "2", "3", "4"]
    # the retry continued the MLflow run the killed attempt opened, and every step is in it once
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp_path / 'artifacts' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("sftflow").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")] == [1, 2, 3, 4]


def _start_training(tmp_path, own_server: bool = False, nproc: int = 1, **popen) -> tuple[subprocess.Popen, str]:
    """The CLI training until step 1 on `nproc` processes; with `own_server`, on its temporary Prefect server."""
    cfg = tiny_config_dict(tmp_path)
    cfg["actor"]["nproc_per_node"] = nproc
    cfg_path = write_config(tmp_path, cfg)
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect")}
    if own_server:
        env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "stage", "train", "-c", str(cfg_path),
                             "--with-upstream", *LONG], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, **popen)
    marker = str(tmp_path / "artifacts" / "train")
    for line in proc.stdout:
        if "step 1/" in line:
            break
    assert live_processes_mentioning(marker), "training should be running"
    return proc, marker


def test_sigkill_of_the_cli_leaves_nothing_behind(tmp_path):
    """Nothing the CLI started (torchrun, its workers, the temporary Prefect server) lives on after
    the CLI is SIGKILLed: parent-death signals, not cleanup code that a SIGKILL never runs."""
    proc, marker = _start_training(tmp_path, own_server=True)
    try:
        tree = descendants(proc.pid)
        assert any("server" in p.cmdline() for p in tree), [p.cmdline()[:5] for p in tree]
        proc.kill()
        proc.wait(timeout=30)
        assert left_alive(tree) == []
        assert wait_gone(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_in_a_terminal_stops_everything_within_seconds(tmp_path):
    """Ctrl-C sends SIGINT to the terminal's whole process group. The temporary Prefect server runs
    in a session of its own, so it is still there to hear that the run crashed: exit 130, quickly."""
    import time
    proc, marker = _start_training(tmp_path, own_server=True, start_new_session=True)
    try:
        tree = descendants(proc.pid)
        t0 = time.time()
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=120)
        assert proc.returncode == 130 and time.time() - t0 < 60
        assert left_alive(tree) == [] and wait_gone(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killing_only_torchrun_stops_its_workers(tmp_path):
    """SIGKILL to torchrun's agent alone (not its process group): its workers stop too, and the CLI
    reports the failure instead of waiting on workers that train unsupervised. (One process runs
    without an agent: launch/one_process.py.)"""
    import psutil
    proc, marker = _start_training(tmp_path, nproc=2)
    try:
        agents = [p for p in psutil.Process(proc.pid).children() if "local_torchrun" in " ".join(p.cmdline())]
        assert len(agents) == 1
        agents[0].kill()
        proc.communicate(timeout=240)
        assert proc.returncode == 1
        assert wait_gone(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
