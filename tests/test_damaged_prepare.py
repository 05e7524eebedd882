"""A truncated prepare shard before the flow starts (issue 34): every CLI entry point that reads the
prepare folder before the flow (the memory plan's prepared lengths: `run`, `stage train
--with-upstream`, `show`) asks the same damage question as the flow, so a damaged folder means "no
prepared lengths yet", never a pyarrow traceback; the flow then rebuilds it with its warning."""

import json

import pyarrow as pa
import pytest

from conftest import sftflow, tiny_config_dict, write_config
from stages.core.config import load_config
from stages.pipeline import plan, run_stage


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A cheap config (one process, two steps, four eval rows) whose prepare stage has run; `good`:
    the train shard's bytes."""
    tmp = tmp_path_factory.mktemp("damaged")
    path = write_config(tmp, tiny_config_dict(tmp, n_train=48, n_val=4, actor={"nproc_per_node": 1},
                                              runner={"max_steps": 2}, eval={"max_new_tokens": 4}))
    p = plan(load_config(path))
    run_stage(p, "prepare", on_line=lambda _: None)
    shard = p.folder("prepare") / "train" / "shard-00000.arrow"
    return {"tmp": tmp, "path": path, "plan": p, "shard": shard, "good": shard.read_bytes()}


def truncate(prepared) -> str:
    """Cuts the train shard to half its size; the warning the flow prints when it finds it."""
    good = prepared["good"]
    prepared["shard"].write_bytes(good[: len(good) // 2])
    return (f"prepare: the stage folder {prepared['plan'].folder('prepare')} is damaged (train/shard-00000.arrow "
            f"has {len(good) // 2} bytes, the manifest recorded {len(good)}); rebuilding it")


def assert_rebuilt(prepared, proc, warning: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "ArrowInvalid" not in out
    assert warning in " ".join(out.split()), out[-3000:]  # the log line, however the console wrapped it
    assert prepared["shard"].read_bytes() == prepared["good"]  # rebuilt byte for byte
    with pa.memory_map(str(prepared["shard"])) as f:
        assert pa.ipc.open_file(f).read_all().num_rows > 0
    assert prepared["plan"].status("prepare") == "complete"


def test_show_reports_a_damaged_prepare_folder_and_its_memory_plan(prepared):
    truncate(prepared)
    p, tmp, path = prepared["plan"], prepared["tmp"], str(prepared["path"])
    assert p.status("prepare") == "damaged"
    proc = sftflow("show", "-c", path, cwd=tmp, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("│ prepare "))
    assert " damaged " in row and str(p.folder("prepare")) in row
    # the plan that can't use the prepared lengths uses the config's bound
    assert "memory plan per rank" in proc.stdout and "bound: actor.micro_batch_size x data.max_length" in proc.stdout
    proc = sftflow("show", "--json", "-c", path, cwd=tmp, timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout)["stages"]["prepare"]["status"] == "damaged"
    proc = sftflow("show", "--preview", "1", "-c", path, cwd=tmp, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "1 sample(s) from the first rows, prepared on the fly" in " ".join(proc.stdout.split())
    assert prepared["shard"].stat().st_size == len(prepared["good"]) // 2  # show changes nothing


def test_run_rebuilds_a_damaged_prepare_folder(prepared, prefect_api):
    warning = truncate(prepared)
    proc = sftflow("run", "-c", str(prepared["path"]), "runner.max_steps=2", cwd=prepared["tmp"])
    assert_rebuilt(prepared, proc, warning)
    assert "registered model version" in proc.stdout


def test_stage_train_with_upstream_rebuilds_a_damaged_prepare_folder(prepared, prefect_api):
    warning = truncate(prepared)
    # another step count than the `run` test's: a complete train folder would skip the launch check
    proc = sftflow("stage", "train", "--with-upstream", "-c", str(prepared["path"]), "runner.max_steps=1",
                   cwd=prepared["tmp"])
    assert_rebuilt(prepared, proc, warning)
    p = plan(load_config(prepared["path"], ["runner.max_steps=1"]))
    assert p.status("train") == "complete"
