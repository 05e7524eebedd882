"""Two runs of the same config at once never half-write a folder: one builds, the other
waits on the fingerprint's lock and then reuses the result."""

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_config_dict, write_config


def _prepare(cfg_path: str, barrier, out) -> None:
    from stages.core.config import load_config
    from stages.pipeline import plan, run_stage
    p = plan(load_config(cfg_path))
    barrier.wait()
    lines = []
    r = run_stage(p, "prepare", on_line=lines.append)
    out.put((r.cached, r.path, lines))


def test_concurrent_runs_share_one_result(tmp_path):
    cfg_path = str(write_config(tmp_path, tiny_config_dict(tmp_path)))
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_prepare, args=(cfg_path, barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    results = sorted(out.get(timeout=5) for _ in procs)
    assert [cached for cached, _, _ in results] == [False, True]
    assert results[0][1] == results[1][1]
    # the one that waited said so (both started together; building takes seconds)
    assert any("another run is building" in line and "waiting" in line for line in results[1][2]), results[1][2]
    folder = Path(results[0][1])
    assert (folder / "manifest.json").is_file()
    assert not list(folder.parent.glob(".*.partial")), "no half-written folder may remain"


@pytest.mark.slow
def test_two_different_configs_at_once_on_one_artifacts_dir_both_land(tmp_path):
    """Two configs started together on one artifacts dir, each CLI with its own temporary Prefect
    server on the shared Prefect home and database: both finish, each with its own train folder,
    MLflow run with every step's loss logged live, and model version (#13 item 13)."""
    import mlflow
    lrs = ["1e-3", "2e-3"]
    paths = []
    for lr in lrs:
        raw = tiny_config_dict(tmp_path, registry={"live_after_seconds": 0})
        raw["actor"]["optim"]["lr"] = float(lr)
        paths.append(write_config(tmp_path, raw, name=f"lr{lr}.yaml"))
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "-c", str(p)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
             for p in paths]
    outs = [proc.communicate(timeout=900)[0] for proc in procs]
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    artifacts = tmp_path / "artifacts"
    assert (artifacts / ".prefect").is_dir(), "both CLIs keep Prefect's home under artifacts_dir"
    assert len([d for d in (artifacts / "train").iterdir() if not d.name.startswith(".")]) == 2
    client = mlflow.MlflowClient(f"sqlite:///{artifacts / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("sftflow").experiment_id])
    assert sorted(r.data.params["actor.optim.lr"] for r in runs) == sorted(str(float(x)) for x in lrs)
    for r in runs:
        assert [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")] == [1, 2, 3, 4]
    assert sorted(int(v.version) for v in client.search_model_versions("name='test-model'")) == [1, 2]
