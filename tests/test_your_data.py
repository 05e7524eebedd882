"""docs/your-data.md, run as written: its config block is saved where the page says, two files of
the kinds it names are written (an Alpaca JSONL with a few bad rows, a prompt/completion CSV), and
every command of its bash blocks runs from the folder the page runs them from."""

from __future__ import annotations

import csv
import json
import re
import shlex

import pytest

from conftest import ROOT, demo_rows, sftflow

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]

PAGE = ROOT / "docs" / "your-data.md"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), re.S)


def commands() -> list[list[str]]:
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line:
                argv = shlex.split(line)
                assert argv[0] == "sftflow", line
                out.append(argv[1:])
    return out


def test_the_page_runs_as_written(tmp_path):
    mine = tmp_path / "mydata"
    mine.mkdir()
    (config,) = blocks("yaml")
    (mine / "config.yaml").write_text(config)
    rows = demo_rows("train.jsonl", 150)
    lines = [json.dumps({"instruction": r["messages"][-2]["content"], "input": "",
                         "output": r["messages"][-1]["content"]}, ensure_ascii=False) for r in rows]
    lines[40:40] = ['{"instruction": "Who are you?",, "output": "x"}',
                    json.dumps({"instruction": "Hello", "input": ""}), json.dumps({"instruction": "Hi", "input": ""})]
    (mine / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with open(mine / "eval.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion"])
        for r in demo_rows("eval.jsonl", 30):
            w.writerow([r["messages"][-2]["content"], r["messages"][-1]["content"]])

    ran = []
    for argv in commands():
        proc = sftflow(*argv, cwd=tmp_path, timeout=1200)
        assert proc.returncode == 0, (argv, proc.stdout[-3000:], proc.stderr[-3000:])
        ran.append((argv[0], proc.stdout))
    assert [a for a, _ in ran] == ["show", "run", "models", "chat", "chat", "sweep"]
    show, run = ran[0][1], ran[1][1]
    assert "[[" in show and "[[ ]] = trained" in show
    prepared = next((tmp_path / "artifacts" / "prepare").glob("[!.]*"))
    assert (f"prepare: 3 rows quarantined (missing_column 2, malformed_json 1): {prepared / 'quarantine.jsonl'}"
            in run), run[-3000:]
    assert re.search(r"│ val\s+│ 30\s+│", run) and "registered model version 1" in run
    assert "│ 1 " in ran[2][1] and "champion" in ran[2][1]
    assert ran[3][1].strip()  # the champion answered
    sweep = ran[5][1]
    assert "1e-3" in sweep or "0.001" in sweep, sweep[-3000:]
