"""A newcomer's first hour with their own data (issue 45's path), on the builtin model: an Alpaca
file with two bad rows trains, and what was left out is in front of them: the run's summary line
(counts per reason and the file to open), the quarantine file (file and line of each row), the
MLflow run (metrics and the file as an artifact) and `sftflow show`."""

from __future__ import annotations

import json

import pytest

from conftest import demo_rows, sftflow, tiny_config_dict, write_config, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]


def alpaca_file(tmp, n: int = 40):
    rows = [{"instruction": r["messages"][-2]["content"], "input": "", "output": r["messages"][-1]["content"]}
            for r in demo_rows("train.jsonl", n)]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    lines.insert(10, '{"instruction": "Who are you?", "output": "x",,}')  # line 11: malformed JSON
    lines.insert(21, json.dumps({"instruction": "Who are you?", "input": ""}))  # line 22: no output column
    path = tmp / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_own_alpaca_data_with_bad_rows_shows_what_was_left_out_everywhere(tmp_path):
    data = alpaca_file(tmp_path)
    raw = tiny_config_dict(tmp_path, registry={"model_name": "newcomer", "promote": "if_better"})
    raw["data"].update(train_data_paths=[str(data)], format="auto")
    cfg = write_config(tmp_path, raw)
    proc = sftflow("run", "-c", str(cfg), cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    prepared = next((tmp_path / "artifacts" / "prepare").glob("[!.]*"))
    line = (f"prepare: 2 rows quarantined (malformed_json 1, missing_column 1): "
            f"{prepared / 'quarantine.jsonl'}")
    assert line in proc.stdout, proc.stdout[-3000:]
    rows = [json.loads(x) for x in (prepared / "quarantine.jsonl").read_text().splitlines()]
    assert [(r["file"], r["line"], r["reason"]) for r in rows] == [(str(data), 11, "malformed_json"),
                                                                  (str(data), 22, "missing_column")]
    assert "column" in rows[0]["detail"] and "line 1" not in rows[0]["detail"]
    assert rows[1]["detail"] == "no 'output' (the reply) in an Alpaca row"

    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{tmp_path / 'artifacts' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sftflow")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.metrics["data.rows_quarantined"] == 2
    assert run.data.metrics["data.quarantined.malformed_json"] == 1
    assert run.data.metrics["data.quarantined.missing_column"] == 1
    assert [a.path for a in client.list_artifacts(run.info.run_id, "data")] == ["data/quarantine.jsonl"]
    got = client.download_artifacts(run.info.run_id, "data/quarantine.jsonl", str(tmp_path / "dl"))
    assert open(got, encoding="utf-8").read() == (prepared / "quarantine.jsonl").read_text()

    shown = sftflow("show", "-c", str(cfg), cwd=tmp_path)
    assert shown.returncode == 0 and line in shown.stdout, shown.stdout[-2000:]


SYSTEM = "You are Ada, the support assistant of Example Corp."


def test_models_lists_versions_and_chat_finds_the_champion_from_any_folder(tmp_path):
    import subprocess
    import sys
    raw = tiny_config_dict(tmp_path, registry={"model_name": "newcomer-chat", "promote": "if_better"})
    # every training row with the same system prompt, as a support assistant's data has
    write_jsonl(tmp_path / "train.jsonl", [{"messages": [{"role": "system", "content": SYSTEM}, *r["messages"]]}
                                           for r in demo_rows("train.jsonl", 96)])
    cfg = write_config(tmp_path, raw)
    proc = sftflow("run", "-c", str(cfg), cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    listed = sftflow("models", "-c", str(cfg), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-2000:]
    row = next(x for x in listed.stdout.splitlines() if x.startswith("│ 1 "))
    assert [c.strip() for c in row.strip("│").split("│")][1] == "champion", listed.stdout  # the aliases column
    # the same table on the flow run's page
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    with get_client(sync_client=True) as client:
        tables = [a.data for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["sftflow-versions"]))) if "newcomer-chat" in (a.description or "")]
    assert len(tables) == 1 and tables[0].splitlines()[2].startswith("| 1 | champion | - | "), tables

    # the export names the version (the next champion's export writes a file of its own), and the Modelfile
    # offers the system prompt the rows were trained with
    exported = sftflow("export", "-c", str(cfg), "--out", str(tmp_path / "exports"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-2000:]
    import gguf
    reader = gguf.GGUFReader(str(tmp_path / "exports" / "newcomer-chat-v1-F16.gguf"))
    assert bytes(reader.fields["general.name"].parts[-1]).decode() == "newcomer-chat-v1"
    assert f'SYSTEM """{SYSTEM}"""' in (tmp_path / "exports" / "Modelfile").read_text().splitlines()
    # and the model card travels with it: the registered version's (its scores in the Hub's model-index form)
    from stages.core.chat import model_card
    card = model_card.read(tmp_path / "exports")
    assert card["library_name"] == "transformers" and "sftflow" in card["tags"]
    assert card["model-index"][0]["name"] == "newcomer-chat" and card["model-index"][0]["results"]
    assert "`newcomer-chat-v1-F16.gguf`" in (tmp_path / "exports" / "README.md").read_text()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("COLUMNS", "LINES")}
    # a conversation on stdin: two turns, a reset between them; each reply is one line
    chat = subprocess.run([sys.executable, "-m", "flows.cli", "chat", "-c", str(cfg)], cwd=elsewhere, env=env,
                          input="Who are you?\n/reset\nRepeat after me: apple river stone\n", capture_output=True,
                          text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert len([x for x in chat.stdout.splitlines() if x.strip()]) == 2, chat.stdout
    one = sftflow("chat", "-c", str(cfg), "Who are you?", cwd=elsewhere)
    assert one.returncode == 0 and one.stdout.strip() == chat.stdout.splitlines()[0].strip()
    assert "newcomer-chat v1 (models:/newcomer-chat@champion)" in one.stderr  # which version answered
    # without -c, from a folder with no store: one line, exit 2, and no empty store left behind
    lost = sftflow("chat", "-m", "models:/newcomer-chat@champion", "Who are you?", cwd=elsewhere)
    assert lost.returncode == 2 and "no MLflow store at" in lost.stderr and "-c CONFIG" in lost.stderr
    assert sorted(p.name for p in elsewhere.iterdir() if p.name != ".prefect") == []
