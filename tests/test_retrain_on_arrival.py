"""Retraining you can leave running, four days of it, against a real `prefect server start` on
loopback: `sftflow serve --on-data` serves the flow, `sftflow notify` (a Prefect event) starts it.

Day 1 trains v1 (champion). Day 2 a file with a new skill arrives (a burst of two events: one run);
prepare tokenizes that file only, training starts from v1, v2 becomes champion. Day 3 a drop with
30% malformed rows is stopped by the data gate: a failed run, no version, the drop moved to
drops/rejected/. Day 4 a drop that teaches
a wrong answer for one set's questions: v3 is worse there and stays challenger. Then the way back
(`sftflow champion 1 --reason ...`) moves the alias, and the next run's register line reports it.

The data: two skills a tiny model learns in 30 steps ("What color is the X?" -> blue, "What sound does
the X make?" -> loud), with held-out nouns in the eval sets; the builtin tokenizer's corpus is pinned
(`actor.model.corpus_paths`) so new data keeps the base model."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]

NOUNS = ["cat", "dog", "tree", "car", "lamp", "house", "river", "cloud", "stone", "bird", "fish", "chair", "table",
         "door", "road", "boat", "train", "horse", "apple", "flower", "book", "phone", "cup", "shoe", "hat", "bell",
         "drum", "coin", "key", "ring", "star", "moon", "sun", "hill", "lake", "wolf", "bear", "frog", "goat", "duck"]
TRAIN, HELD_OUT = NOUNS[:30], NOUNS[30:]
# `serve --within`: events this soon after the one that started a run start none (a burst is one run);
# each day's drop comes later than that after the previous day's, as drops do
WITHIN = 4
COLOR, SOUND = "What color is the {}?", "What sound does the {} make?"


def rows(template: str, answer: str, nouns: list[str], times: int = 1) -> list[str]:
    return [json.dumps({"messages": [{"role": "user", "content": template.format(n)},
                                     {"role": "assistant", "content": answer}]})
            for _ in range(times) for n in nouns]


def write(path: Path, lines: list[str], broken_every: int = 0) -> Path:
    if broken_every:
        lines = ['{"messages": [broken' if i % broken_every == 1 else line for i, line in enumerate(lines)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def scenario_config(tmp: Path) -> Path:
    write(tmp / "corpus.jsonl", rows(COLOR, "blue", NOUNS) + rows(SOUND, "loud", NOUNS) + rows(COLOR, "red", NOUNS))
    write(tmp / "colors.jsonl", rows(COLOR, "blue", HELD_OUT))
    write(tmp / "sounds.jsonl", rows(SOUND, "loud", HELD_OUT))
    return write_config(tmp, {
        "artifacts_dir": str(tmp / "artifacts"),
        "runner": {"max_steps": 30, "val_check_interval": 0, "save_interval": 0, "log_interval": 5, "seed": 7},
        "actor": {"nproc_per_node": 1, "micro_batch_size": 8, "global_batch_size": 16, "init_from": "champion",
                  "model": {"corpus_paths": [str(tmp / "corpus.jsonl")]}, "optim": {"lr": 6e-3, "warmup": 2},
                  "precision": "fp32"},  # as tests/conftest.py's tiny config: the same arithmetic on every CI CPU
        "data": {"train_data_paths": [str(tmp / "drops" / "*.jsonl")], "format": "messages", "max_length": 64,
                 "max_bad_fraction": 0.1},
        "eval": {"max_new_tokens": 4, "batch_size": 16, "primary": "colors", "precision": "fp32",
                 "sets": {"colors": {"data_paths": [str(tmp / "colors.jsonl")]},
                          "sounds": {"data_paths": [str(tmp / "sounds.jsonl")]}}},
        "registry": {"model_name": "daily", "promote": "if_better"},
    })


def deployment_runs(name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[name])))
    return sorted(runs, key=lambda r: r.created)


def finished(name: str) -> list:
    return [r for r in deployment_runs(name) if r.state and r.state.is_final()]



def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def after_the_window(last_event: float) -> None:
    """Waits until `WITHIN` s (and one more) have passed since `last_event` (a time after it was sent)."""
    time.sleep(max(0.0, last_event + WITHIN + 1 - time.time()))


def wait(predicate, timeout: float, what: str, proc):
    return wait_for(predicate, timeout, what, proc, poll=1)


def versions(tmp: Path) -> dict[str, dict]:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp / 'artifacts' / 'mlflow.db'}")
    return {str(v.version): {"aliases": sorted(client.get_model_version("daily", v.version).aliases), "tags": v.tags}
            for v in client.search_model_versions("name='daily'")}


def prepare_manifest(tmp: Path, fingerprint: str) -> dict:
    return json.loads((tmp / "artifacts" / "prepare" / fingerprint / "manifest.json").read_text())


def run_tag(run, prefix: str) -> str:
    return next((t.split(":", 1)[1] for t in run.tags if t.startswith(prefix + ":")), "")


def test_four_days_of_retraining_on_arrival(tmp_path):
    from flows.events import emit_arrival
    cfg = scenario_config(tmp_path)
    drops = tmp_path / "drops"
    write(drops / "day1.jsonl", rows(COLOR, "blue", TRAIN, 2))
    name = f"arrivals-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect"), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "-c", str(cfg), "--on-data",
                             "--within", str(WITHIN), "--name", name], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        from prefect.client.orchestration import get_client
        def served() -> bool:
            with get_client(sync_client=True) as client:
                try:
                    return bool(client.read_deployment_by_name(f"sft_pipeline/{name}"))
                except Exception:  # noqa: BLE001 - not created yet
                    return False
        wait(served, 120, "the deployment", proc)
        time.sleep(3)  # the trigger's automation is created with the deployment; the runner starts polling

        # day 1: the CLI's event
        out = cli("notify", "-c", str(cfg), "-f", str(drops / "day1.jsonl"), env=env)
        last = time.time()
        assert out.returncode == 0 and "sent sftflow.data.arrived for 'daily'" in out.stdout, out.stderr
        wait(lambda: len(finished(name)) == 1, 240, "day 1's run", proc)
        assert finished(name)[0].state.is_completed()
        assert versions(tmp_path)["1"]["aliases"] == ["champion"]

        # day 2: a new skill; a burst of two events (one run)
        write(drops / "day2.jsonl", rows(SOUND, "loud", TRAIN, 2))
        after_the_window(last)
        for _ in range(2):
            emit_arrival("daily", [drops / "day2.jsonl"], cfg)
        last = time.time()
        wait(lambda: len(finished(name)) == 2, 240, "day 2's run", proc)
        time.sleep(4)  # a second run would have been created by now (trigger + 1 s polls)
        runs = deployment_runs(name)
        assert len(runs) == 2 and runs[1].state.is_completed(), [(r.name, r.state.type) for r in runs]
        v = versions(tmp_path)
        assert v["2"]["aliases"] == ["champion"] and v["2"]["tags"]["sftflow.parent_version"] == "1"
        pieces = prepare_manifest(tmp_path, v["2"]["tags"]["sftflow.prepare_fingerprint"])["pieces"]
        assert (pieces["built"], pieces["reused"]) == (1, 1)  # day 1's file was not tokenized again

        # day 3: a bad drop stops before training
        write(drops / "day3.jsonl", rows(SOUND, "loud", TRAIN[:10]), broken_every=3)  # 3 of 10 rows broken
        after_the_window(last)
        emit_arrival("daily", [drops / "day3.jsonl"], cfg)
        last = time.time()
        wait(lambda: len(finished(name)) == 3, 240, "day 3's run", proc)
        failed = finished(name)[2]
        assert failed.state.is_failed() and "data.max_bad_fraction" in failed.state.message, failed.state.message
        assert set(versions(tmp_path)) == {"1", "2"}
        # the served run took the drop out (the next runs would fail on it) and said where it went
        moved = drops / "rejected" / "day3.jsonl.rejected"
        assert not (drops / "day3.jsonl").exists() and moved.is_file() and str(moved) in failed.state.message

        # day 4: a drop that teaches another colour: worse on 'colors', so a challenger
        write(drops / "day4.jsonl", rows(COLOR, "red", TRAIN, 6))
        after_the_window(last)
        emit_arrival("daily", [drops / "day4.jsonl"], cfg)
        last = time.time()
        wait(lambda: len(finished(name)) == 4, 240, "day 4's run", proc)
        v = versions(tmp_path)
        assert v["3"]["aliases"] == ["challenger"] and v["2"]["aliases"] == ["champion"]
        assert "worse than the champion" in v["3"]["tags"]["sftflow.alias_reason"]

        # the way back, then the next run reports it
        out = cli("champion", "1", "--reason", "day 2 dropped a skill users rely on", "-c", str(cfg), env=env)
        assert out.returncode == 0 and "daily@champion -> v1 (was v2)" in out.stdout, out.stderr
        v = versions(tmp_path)
        assert v["1"]["aliases"] == ["champion"]
        assert json.loads(v["1"]["tags"]["sftflow.champion_set_by_hand"])["reason"] == \
            "day 2 dropped a skill users rely on"
        after_the_window(last)
        emit_arrival("daily", [], cfg)
        wait(lambda: len(finished(name)) == 5, 240, "the run after the way back", proc)
        v = versions(tmp_path)
        assert v["4"]["tags"]["sftflow.parent_version"] == "1"  # it started from the champion set by hand
        assert "champion v1 was set by hand" in v["4"]["tags"]["sftflow.alias_reason"]
        assert "day 2 dropped a skill users rely on" in v["4"]["tags"]["sftflow.alias_reason"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_notify_without_a_server_says_how_to_start_one(tmp_path):
    cfg = scenario_config(tmp_path)
    write(tmp_path / "drops" / "day1.jsonl", rows(COLOR, "blue", TRAIN))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / ".prefect")
    out = cli("notify", "-c", str(cfg), env=env)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "sftflow serve --on-data --start-server" in out.stderr
    out = cli("champion", "7", "--reason", "x", "-c", str(cfg), env=env)
    assert out.returncode == 2 and "nothing is logged" in out.stderr
