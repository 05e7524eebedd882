"""`sftflow models`, the month at a glance: per version its aliases as MLflow's registry (and UI) holds
them, the version it continued from, the day, the training files it added, the tokens it trained, the
accuracy, the disk its train stage folder takes and why its aliases are what they are. The registry is
written here as register leaves it (no training: the table only reads it)."""

from __future__ import annotations

import json
import time

from rich.cells import cell_len

from conftest import sftflow, tiny_config_dict, write_config
from test_cli_tables import check_whole, tables


def registry_as_register_leaves_it(tmp):
    """Two versions of `daily`: v1 from the base model, v2 continued from v1 on one new file (and v1's file
    rehearsed), trained 3 steps of 100 + 120 + 130 tokens; champion on v2, challenger on v1."""
    from mlflow.tracking import MlflowClient
    artifacts = tmp / "artifacts"
    artifacts.mkdir()
    client = MlflowClient(f"sqlite:///{artifacts / 'mlflow.db'}")
    exp = client.create_experiment("sftflow", artifact_location=(artifacts / "mlartifacts").as_uri())
    client.create_registered_model("daily")
    for n, fp, tokens in ((1, "a" * 16, [80]), (2, "b" * 16, [100, 120, 130])):
        run = client.create_run(exp).info.run_id
        for step, t in enumerate(tokens, start=1):
            client.log_metric(run, "train/tokens", t, step=step)
        v = client.create_model_version("daily", f"runs:/{run}/model", run_id=run).version
        trained_on = [{"ref": f"drops/day{k}.jsonl", "digest": "0" * 16, "format": "messages", "columns": None,
                       "source": "train" if k == n else "earlier"} for k in range(1, n + 1)]
        tags = {"train_fingerprint": fp, "eval_accuracy": "0.75" if n == 2 else "0.5",
                "alias_reason": "better than the champion" if n == 2 else "first version",
                "parent_version": "1" if n == 2 else "", "trained_on": json.dumps(trained_on)}
        for k, value in tags.items():
            client.set_model_version_tag("daily", v, f"sftflow.{k}", value)
    client.set_registered_model_alias("daily", "challenger", "1")
    client.set_registered_model_alias("daily", "champion", "2")
    folder = artifacts / "train" / ("b" * 16) / "model"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 2500)  # v1's folder is gone (collected): "-"
    return write_config(tmp, tiny_config_dict(tmp, registry={"model_name": "daily"}))


def test_models_shows_the_registrys_aliases_lineage_tokens_and_disk(tmp_path):
    cfg = registry_as_register_leaves_it(tmp_path)
    proc = sftflow("models", "-c", str(cfg), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (table,) = tables(proc.stdout)
    header, rows = check_whole(table)
    assert header == ["version", "aliases", "from", "registered", "data", "tokens", "accuracy", "disk", "why"]
    today = time.strftime("%Y-%m-%d")
    assert rows == [["2", "champion", "v1", today, "2 files (1 new)", "350", "0.750", "2.4 KiB",
                     "better than the champion"],
                    ["1", "challenger", "-", today, "1 file", "80", "0.500", "-", "first version"]]

    narrow = sftflow("models", "-c", str(cfg), cwd=tmp_path, env={"COLUMNS": "100"})
    assert narrow.returncode == 0, narrow.stderr[-3000:]
    assert max(cell_len(line) for line in narrow.stdout.splitlines()) <= 100, narrow.stdout
    assert "champion" in narrow.stdout and "…" not in narrow.stdout, narrow.stdout


def test_an_alias_where_a_version_goes_gets_the_alias_form(tmp_path):
    """`models:/name/champion`: MLflow says only "Parameter 'version' must be an integer"; the line adds
    the form that works, wherever a model reference is resolved (a config key, `-m`)."""
    import pytest

    from stages.core.errors import ConfigError
    from stages.tracking.registry import alias_hint, registry_version
    registry_as_register_leaves_it(tmp_path)
    uri = f"sqlite:///{tmp_path / 'artifacts' / 'mlflow.db'}"
    with pytest.raises(ConfigError, match=r"^eval.model: models:/daily/champion: .*; the alias form is "
                                          r"models:/daily@champion$"):
        registry_version("models:/daily/champion", uri)
    assert registry_version("models:/daily@champion", uri) == ("daily", "2")
    assert alias_hint("models:/daily/2") == alias_hint("models:/daily@champion") == alias_hint("./folder") == ""
