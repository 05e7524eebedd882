"""The CLI's tables in a file or a pipe (CI logs, `make run > log`): every column and every cell
whole, one line per row, valid UTF-8, however wide (rich's default there is 80 columns, which
wrapped and clipped cells); an explicit COLUMNS still decides."""

import json
import os
import subprocess
import sys

from rich.cells import cell_len

from conftest import ROOT, tiny_config_dict, write_config


def tables(text: str) -> list[list[str]]:
    """The box-drawn tables of `text`, each as its lines from the top border to the bottom one."""
    found, current = [], None
    for line in text.splitlines():
        if line.startswith("┏"):
            current = [line]
        elif current is not None:
            current.append(line)
            if line.startswith("└"):
                found.append(current)
                current = None
    return found


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("┃│").split("┃" if "┃" in line else "│")]


def check_whole(table: list[str]) -> tuple[list[str], list[list[str]]]:
    """(header cells, rows) of a table with one line per header and per row: same width everywhere,
    every row with the header's number of cells, none clipped with an ellipsis."""
    assert len({cell_len(line) for line in table}) == 1, table  # display width: 北 takes two cells
    header, *rest = [line for line in table if line[0] in "┃│"]
    rows = [cells(line) for line in rest]
    assert all(len(r) == len(cells(header)) for r in rows), table
    assert not any("…" in c for r in rows for c in r), table
    return cells(header), rows


def run_to_file(args: list[str], out, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in {**os.environ, "COLUMNS": None, **(env or {})}.items() if v is not None}
    with open(out, "wb") as f:
        return subprocess.run([sys.executable, *args], cwd=cwd, stdout=f, stderr=subprocess.PIPE, text=True,
                              env=environ, stdin=subprocess.DEVNULL, timeout=300)


def test_show_keeps_every_column_in_a_file(tmp_path):
    deep = tmp_path / "a-rather-long-folder-name-for-artifacts" / "北京-ありがとう-Bogotá" / "artifacts"
    path = write_config(tmp_path, tiny_config_dict(tmp_path, artifacts_dir=str(deep)))
    out = tmp_path / "show.txt"
    proc = run_to_file(["-m", "flows.cli", "show", "-c", str(path)], out, tmp_path,
                       env={"PREFECT_HOME": str(tmp_path / ".prefect")})
    assert proc.returncode == 0, proc.stderr
    text = out.read_bytes().decode("utf-8")  # strict: no character cut in half
    stages_table = next(t for t in tables(text) if "fingerprint" in t[1] and "path" in t[1])
    header, rows = check_whole(stages_table)
    assert header == ["stage", "fingerprint", "status", "reads", "path"]
    assert max(cell_len(line) for line in stages_table) > 80  # wider than rich's default for a file
    reads = {}
    for stage, fp, status, after, folder in rows:
        assert status == "missing" and folder == str(deep / stage / fp)
        reads[stage] = after
    assert reads["prepare"] == "-" and "train" in reads["evaluate"]
    config_table = next(t for t in tables(text) if cells(t[1]) == ["key", "value"])
    _, kv = check_whole(config_table)
    assert dict(kv)["artifacts_dir"] == str(deep)
    assert dict(kv)["data.train_data_paths"] == str([str(tmp_path / "train.jsonl")])
    memory = next(t for t in tables(text) if cells(t[1]) == ["term", "estimate", "note"])
    _, terms = check_whole(memory)
    assert [r[0] for r in terms][:3] == ["parameters", "gradients", "optimizer"]
    assert len(tables(text)) == 3

    # an explicit COLUMNS is what the user asked for: tables fit it
    proc = run_to_file(["-m", "flows.cli", "show", "-c", str(path)], out, tmp_path,
                       env={"PREFECT_HOME": str(tmp_path / ".prefect"), "COLUMNS": "60"})
    assert proc.returncode == 0, proc.stderr
    assert max(cell_len(line) for line in out.read_bytes().decode("utf-8").splitlines()) <= 60


def test_the_eval_table_keeps_every_column_in_a_file(tmp_path):
    """The summary `run` prints, with the widest cells a run has (a champion comparison, a failed
    guard on the interval, a non-ASCII set name), through a pipe-less file descriptor."""
    per_set = {
        "identity": {"total": 60, "accuracy": 0.95, "base_accuracy": 0.5,
                     "vs_base": {"delta": 0.45, "delta_low": 0.31, "delta_high": 0.57}},
        "retention-日本語": {"total": 200, "accuracy": 0.9, "base_accuracy": 0.96, "guard_ok": False,
                           "max_drop": 0.05, "decided_on": "interval",
                           "vs_base": {"delta": -0.06, "delta_low": -0.094, "delta_high": -0.034,
                                       "both_right": 180, "reference_right": 192, "kept": 180 / 192}}}
    results = [
        {"stage": "prepare", "fingerprint": "59c6985c1ab4da16", "cached": True, "seconds": 0.0,
         "metrics": {"train_rows_kept": 2670}},
        {"stage": "evaluate", "fingerprint": "6546800e58656933", "cached": False, "seconds": 12.5,
         "metrics": {"accuracy": 0.95, "sets": per_set}},
        {"stage": "register", "fingerprint": "b977ff51d37d28dd", "cached": False, "seconds": 3.25,
         "metrics": {"version": 12, "aliases": ["challenger"], "alias_reason": "the guard failed",
                     "vs_champion": {s: {"version": 11, "accuracy": 0.93, "delta": -0.03, "delta_low": -0.06,
                                         "delta_high": 0.001} for s in per_set}}}]
    out = tmp_path / "summary.txt"
    code = f"import json, flows.cli as c; c._summary(json.loads({json.dumps(json.dumps(results))}))"
    proc = run_to_file(["-c", code], out, ROOT, env={"PREFECT_HOME": str(tmp_path / ".prefect")})
    assert proc.returncode == 0, proc.stderr
    text = out.read_bytes().decode("utf-8")
    summary, evals = tables(text)
    header, rows = check_whole(summary)
    assert header == ["stage", "fingerprint", "cached", "seconds", "key metric"]
    assert rows[1] == ["evaluate", "6546800e58656933", "no", "12.5", "accuracy 0.950"]
    header, rows = check_whole(evals)
    assert header == ["set", "samples", "base", "tuned", "change (95% CI)", "vs champion (95% CI)", "guard",
                      "kept of base-right"]
    assert rows == [
        ["identity", "60", "0.500", "0.950", "+0.450 [+0.310, +0.570]", "v11 0.930: -0.030 [-0.060, +0.001]", "", ""],
        ["retention-日本語", "200", "0.960", "0.900", "-0.060 [-0.094, -0.034]", "v11 0.930: -0.030 [-0.060, +0.001]",
         "failed (max drop 0.05 on the 95% lower bound)", "180/192 (0.938)"]]
    assert "registered model version 12 (challenger): the guard failed" in text
