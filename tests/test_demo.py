"""The embedded demo, exactly as `make run` runs it: held-out accuracy must visibly rise.

This is the slowest test (a few minutes on 2 cores): it is the promise the README makes.
"""

import json
import re

import pytest

from conftest import ROOT, sftflow

pytestmark = pytest.mark.slow


def test_default_config_learns_the_demo(tmp_path):
    # what a user gets: a fresh `python -m flows.cli` (no warm start), no Prefect server running, so
    # the CLI starts one it keeps (here for 20 s, not the default 10 minutes, so it is gone soon after)
    # and in the precision `auto` picks on this machine (bf16 where it measured faster: the suite's pin unset)
    env = {"PREFECT_HOME": str(tmp_path / ".prefect"), "PREFECT_API_URL": None, "SFTFLOW_KEEP_SERVER": "20",
           "SFTFLOW_CPU_BF16_SPEEDUP": None}
    proc = sftflow("run", "-c", str(ROOT / "configs" / "default.yaml"), f"artifacts_dir={tmp_path / 'artifacts'}",
                   cwd=ROOT, env=env, timeout=1200, fresh=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ev = next((tmp_path / "artifacts" / "evaluate").glob("[!.]*"))
    metrics = json.loads((ev / "metrics.json").read_text())
    # trained on 2 processes; scored in the stage's own (eval.launch: auto, a small evaluation on CPU)
    base = next((tmp_path / "artifacts" / "baseline").glob("[!.]*"))
    assert [json.loads((d / "manifest.json").read_text())["world_size"] for d in (ev, base)] == [1, 1]
    assert "scoring in this process (CPU, a small evaluation" in proc.stderr  # the run's log
    assert metrics["total"] == 60
    assert metrics["base_accuracy"] <= 0.1
    assert metrics["accuracy"] >= 0.9, metrics  # the README's promise (docs/benchmarks.md: 20 runs, all >= 0.9)
    # the eval table's row: set, samples, base, tuned (as printed on any terminal width)
    assert re.search(rf"│ val\s+│ 60\s+│ {metrics['base_accuracy']:.3f}\s+│ "
                     rf"{metrics['accuracy']:.3f}\s+│", proc.stdout), proc.stdout

    # The champion answers through MLflow and through `sftflow chat`.
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'artifacts' / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model("models:/tiny-chat-sft@champion")
    assert model.predict(["Who are you?"]) == ["I am TinyChat, a small assistant fine-tuned with sftflow."]
    chat = sftflow("chat", "-m", "models:/tiny-chat-sft@champion", "Repeat after me: apple river stone",
                   "--tracking-uri", f"sqlite:///{tmp_path / 'artifacts' / 'mlflow.db'}", cwd=tmp_path, env=env)
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert chat.stdout.strip() == "You said: apple river stone"
