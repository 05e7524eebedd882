"""`actor.init_from`: training starts from the champion (or a version, or a folder), the fingerprint
names that start, a retrain on unchanged data after the champion moved to its own result is a cache
hit, and the version records its parent. Stages run through `run_stage` (no Prefect)."""

import json

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import demo_rows, tiny_config_dict, write_config, write_jsonl
from stages.core.chat import model_card

pytestmark = pytest.mark.slow


def run_all(cfg_path, overrides=()):
    from stages.core.config import load_config
    from stages.pipeline import plan, run_stage
    p = plan(load_config(cfg_path, list(overrides)))
    results = {s: run_stage(p, s, on_line=lambda _: None) for s in p.stages}
    return p, results


def weights(folder):
    return load_file(str(folder / "model" / "model.safetensors"))


def test_training_continues_from_the_champion_and_names_it(tmp_path):
    from mlflow.tracking import MlflowClient

    from stages.core.config import load_config
    from stages.core.errors import ConfigError
    from stages.pipeline import plan
    raw = tiny_config_dict(tmp_path, registry={"promote": "always"})
    # the builtin model's tokenizer is trained on its corpus: pinned, so new data keeps the base model
    raw["actor"].update(init_from="champion", model={"corpus_paths": list(raw["data"]["train_data_paths"])})
    cfg_path = write_config(tmp_path, raw)

    # day 1: no champion yet, so the base model; the plan says so
    p1, r1 = run_all(cfg_path)
    assert p1.start is None and "no champion yet" in p1.start_note
    assert r1["register"].metrics["version"] == 1
    base_fp = plan(load_config(cfg_path, ["actor.init_from=base"])).fingerprints["train"]
    assert p1.fingerprints["train"] == base_fp  # `champion` with none is exactly `base`

    # day 1 again: v1 is champion now and is this training: a cache hit, not a training from v1
    again = plan(load_config(cfg_path))
    assert again.fingerprints["train"] == p1.fingerprints["train"] and again.start is None

    # day 2: new rows -> starts from v1
    extra = write_jsonl(tmp_path / "more.jsonl", demo_rows("train.jsonl", 16))
    raw["data"]["train_data_paths"].append(str(extra))
    write_config(tmp_path, raw)
    # unpinned, the new data would make another base model, whose tokens v1 does not know: refused
    with pytest.raises(ConfigError, match=r"actor.init_from=champion: test-model v1 was trained from another base "
                                          r"model .*built from data.train_data_paths=\[.*more.jsonl'\] "
                                          r"\(actor.model.corpus_paths is unset\), "
                                          r"which changes with each new file: set actor.model.corpus_paths to the "
                                          r"files v1's tokenizer was built from, e.g. \['.*train.jsonl'\]"):
        plan(load_config(cfg_path, ["actor.model.corpus_paths=[]"]))
    p2 = plan(load_config(cfg_path))
    assert p2.start["ref"] == "models:/test-model/1" and p2.start["parent_version"] == "1"
    from_base = plan(load_config(cfg_path, ["actor.init_from=base"])).fingerprints["train"]
    assert p2.fingerprints["train"] != from_base
    p2, r2 = run_all(cfg_path)
    assert r2["register"].metrics["version"] == 2
    # what v1 trained on (its lineage) is rehearsed; only the new file is `train`, and the epoch is sized by it
    first = raw["data"]["train_data_paths"][0]
    assert [e["ref"] for e in p2.rehearsal] == [str(Path(first).resolve())]
    assert [Path(ref).name for ref, _ in p2.inputs["train"]] == ["more.jsonl"]
    mixture = {m["source"]: m for m in json.loads((Path(r2["train"].path) / "manifest.json").read_text())["mixture"]}
    assert mixture["train"]["rows"] == 16 and mixture["train"]["per_epoch"] == 16  # each new row once
    assert mixture["rehearse"]["per_epoch"] == 16  # data.rehearsal.weight 1: one earlier sample per new one

    # what the workers loaded (spec.json's model_path) holds exactly v1's exported weights, not the base
    # model's: compared tensor by tensor with v1's train folder (an AdamW-step bound on v2 - v1 would hang
    # on the optimizer's trajectory, which another CPU's rounding changes)
    loaded = Path(json.loads((Path(r2["train"].path) / "spec.json").read_text())["model_path"])
    assert loaded.is_relative_to(tmp_path / "artifacts" / "models" / "start")
    v1, started = weights(Path(r1["train"].path)), load_file(str(loaded / "model.safetensors"))
    base = load_file(str(next((tmp_path / "artifacts" / "models").glob("[!.]*/model.safetensors"))))
    assert v1.keys() == started.keys() and all(torch.equal(v1[k], started[k]) for k in v1)
    assert any(not torch.equal(v1[k], base[k]) for k in v1 if k in base)
    # the registered version carries a Hugging Face model card: the Hub's front matter, v1's own scores
    card = model_card.read(loaded)
    assert card["library_name"] == "transformers" and card["base_model"] == p2.cfg.actor.model.model_path
    scored = {r["dataset"]["name"]: r["metrics"][0]["value"] for r in card["model-index"][0]["results"]}
    assert scored == {s: round(m["accuracy"], 4) for s, m in r1["evaluate"].metrics["sets"].items()}
    # train's own card (no scores yet) is as train wrote it: register's went into its logged copy only
    assert "model-index" not in model_card.read(Path(r1["train"].path) / "model")

    client = MlflowClient(p2.cfg.resolved_tracking_uri)
    v = client.get_model_version("test-model", "2")
    assert v.tags["sftflow.parent_version"] == "1" and "continued from test-model v1" in v.description
    assert json.loads(v.tags["sftflow.start"])["ref"] == "models:/test-model/1"
    run = client.get_run(v.run_id)
    assert run.data.tags["sftflow.start"] == "models:/test-model/1"
    assert "Started from: `models:/test-model/1` (continues v1)" in run.data.tags["mlflow.note.content"]
    assert client.get_model_version("test-model", "1").tags["sftflow.start"] == ""
    learned = json.loads(v.tags["sftflow.trained_on"])
    assert sorted((Path(e["ref"]).name, e["source"]) for e in learned) == [("more.jsonl", "train"),
                                                                           (Path(first).name, "rehearse")]
    assert [e["ref"] for e in json.loads(v.tags["sftflow.rehearsed"])] == [str(Path(first).resolve())]

    # day 2 again: v2 (the champion) is caught up: no third training
    again = plan(load_config(cfg_path))
    assert again.fingerprints["train"] == p2.fingerprints["train"]
    assert again.start["ref"] == "models:/test-model/1" and again.start["note"].startswith(
        "starting from models:/test-model/1, rehearsing the 1 training file(s)")

    # day 3: a third file; v2's lineage names both earlier files, so both are rehearsed
    third = write_jsonl(tmp_path / "third.jsonl", demo_rows("train.jsonl", 8))
    raw["data"]["train_data_paths"].append(str(third))
    write_config(tmp_path, raw)
    p3 = plan(load_config(cfg_path))
    assert p3.start["ref"] == "models:/test-model/2"
    assert sorted(Path(e["ref"]).name for e in p3.rehearsal) == sorted([Path(first).name, "more.jsonl"])
    assert [Path(ref).name for ref, _ in p3.inputs["train"]] == ["third.jsonl"]
    # a file the lineage names that has changed since is one line naming it; weight 0 trains everything as new
    Path(extra).write_text(Path(extra).read_text() + Path(extra).read_text().splitlines(True)[0])
    with pytest.raises(ConfigError, match=r"data.rehearsal: models:/test-model/2 trained on .*more.jsonl, which has "
                                          r"changed since; put that file back, or set data.rehearsal.weight=0"):
        plan(load_config(cfg_path))
    plain = plan(load_config(cfg_path, ["data.rehearsal.weight=0"]))
    assert plain.rehearsal is None and len(plain.inputs["train"]) == 3


def test_a_folder_start_is_fingerprinted_by_content(tmp_path):
    from stages.core.config import load_config
    from stages.core.errors import ConfigError
    from stages.pipeline import plan
    raw = tiny_config_dict(tmp_path)
    cfg_path = write_config(tmp_path, raw)
    p, r = run_all(cfg_path)
    folder = r["train"].path
    started = plan(load_config(cfg_path, [f"actor.init_from={folder}"]))
    assert started.start["ref"] == str((Path(r["train"].path) / "model").resolve())
    assert started.fingerprints["train"] != p.fingerprints["train"]
    # the same files elsewhere: the same fingerprint; a changed file: another
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(Path(r["train"].path) / "model", copy)
    assert plan(load_config(cfg_path, [f"actor.init_from={copy}"])).fingerprints["train"] == \
        started.fingerprints["train"]
    (copy / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    assert plan(load_config(cfg_path, [f"actor.init_from={copy}"])).fingerprints["train"] != \
        started.fingerprints["train"]
    with pytest.raises(ConfigError, match=r"actor.init_from: '.*nowhere' is not a Hugging Face model folder"):
        plan(load_config(cfg_path, [f"actor.init_from={tmp_path / 'nowhere'}"]))
    with pytest.raises(ConfigError, match="actor.init_from: models:/test-model/9"):
        plan(load_config(cfg_path, ["actor.init_from=models:/test-model/9"]))
