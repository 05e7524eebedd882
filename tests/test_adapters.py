"""LoRA versions are stored as adapters: train/<fp>/ and the registered version hold the adapter and a
reference to the base (by content, stored once), not a merged copy; every loader merges through
`inference.weights.load_merged`, which equals peft's own merge done independently; a registered version
loads through `models:/` on a fresh machine that has only the MLflow store; a warm start from a LoRA
version trains over it merged, and its adapter names that version's node; retention keeps a base while
a kept version names it. Stages run through `run_stage` (no Prefect)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import demo_rows, tiny_config_dict, write_config, write_jsonl
from stages.core.cache import bases

slow = pytest.mark.slow

LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}


def run_all(cfg_path, overrides=()):
    from stages.core.config import load_config
    from stages.pipeline import plan, run_stage
    p = plan(load_config(cfg_path, list(overrides)))
    return p, {s: run_stage(p, s, on_line=lambda _: None) for s in p.stages}


def size(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def version_files(cfg, name: str, version: str) -> Path:
    from mlflow.tracking import MlflowClient

    from stages.retention import _model_files
    client = MlflowClient(cfg.resolved_tracking_uri)
    return _model_files(client, client.get_model_version(name, version))


@pytest.fixture(scope="module")
def day1(tmp_path_factory):
    from stages.core.config import load_config
    tmp = tmp_path_factory.mktemp("adapters")
    raw = tiny_config_dict(tmp, registry={"promote": "always"})
    raw["actor"].update(lora=LORA, init_from="champion", model={"corpus_paths": list(raw["data"]["train_data_paths"])})
    cfg_path = write_config(tmp, raw)
    p, results = run_all(cfg_path)
    return {"tmp": tmp, "raw": raw, "cfg_path": cfg_path, "cfg": load_config(cfg_path), "plan": p,
            "results": results, "train": Path(results["train"].path)}


@slow
def test_a_lora_training_keeps_its_adapter_and_a_reference_not_a_merged_copy(day1):
    train, cfg = day1["train"], day1["cfg"]
    base_dir = Path(json.loads((train / "spec.json").read_text())["model_path"])
    base_weights = (base_dir / "model.safetensors").stat().st_size
    assert not (train / "model").exists()
    adapter = train / "adapter"
    assert {"adapter_model.safetensors", "adapter_config.json", "base.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= {f.name for f in adapter.iterdir()}
    ref = bases.read_ref(adapter)
    assert ref["quantize"] is None
    # the base is named by its content and stored once: its weights in artifacts/bases/ are the same file
    assert ref["base"] == bases.node_digest(base_dir)
    stored = cfg.artifacts_path / "bases" / ref["base"]
    assert os.path.samefile(stored / "model.safetensors", base_dir / "model.safetensors")
    # train/<fp>/ (its checkpoints aside: retention drops them) and the registered version's files: each a
    # fraction of the model
    kept = size(train) - size(train / "checkpoints")
    assert kept < base_weights / 4, (kept, base_weights)
    files = version_files(cfg, "test-model", "1")
    assert size(files) < base_weights / 4, (size(files), base_weights)
    assert not list(files.rglob("model.safetensors"))
    # the store holds the base once, as a run of its own that the version's tag names
    from mlflow.tracking import MlflowClient
    client = MlflowClient(cfg.resolved_tracking_uri)
    run = bases.find_run(client, ref["base"])
    assert run is not None and client.get_model_version("test-model", "1").tags[bases.CHAIN_TAG] == ref["base"]
    # a local file store holds it as hard links of the base model's files: on disk once
    logged = bases._local_artifacts(run.info.artifact_uri) / bases.ARTIFACT / "model.safetensors"
    assert os.path.samefile(logged, base_dir / "model.safetensors")


def peft_merged(base_dir, adapter):
    """The merged model by peft alone, from the base folder and the adapter folder (no sftflow code)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().eval()


@slow
def test_the_one_loader_equals_peft_s_merge_of_base_and_adapter(day1):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from stages.inference.weights import load_merged
    train = day1["train"]
    base_dir = json.loads((train / "spec.json").read_text())["model_path"]
    got = load_merged(train / "adapter", roots=(day1["cfg"].artifacts_path,)).eval()
    want = peft_merged(base_dir, train / "adapter")
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids = torch.randint(0, got.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    unmerged = PeftModel.from_pretrained(base, str(train / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=ids).logits, unmerged(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)(input_ids=ids).logits
        assert (got(input_ids=ids).logits - plain).abs().max() > 1e-4  # the adapter changed something


@slow
def test_evaluate_scored_the_adapter_merged(day1):
    """evaluate loaded the LoRA folder (kind `adapter`) and its replies are those of peft's merged model."""
    from stages.inference.generation import generate
    manifest = json.loads((Path(day1["results"]["evaluate"].path) / "manifest.json").read_text())
    assert manifest["model_kind"] == "adapter" and manifest["model_dir"].endswith("adapter")
    from transformers import AutoTokenizer
    train = day1["train"]
    model = peft_merged(json.loads((train / "spec.json").read_text())["model_path"], train / "adapter")
    tok = AutoTokenizer.from_pretrained(str(train / "adapter"))
    rows = [json.loads(line) for line in
            (Path(day1["results"]["evaluate"].path) / "predictions.jsonl").read_text().splitlines()]
    prompts = [r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}]
               for r in rows[:4]]
    want = [r["text"] for r in generate(model, tok, prompts, day1["cfg"].eval.max_new_tokens, batch_size=4)]
    assert [r["prediction"] for r in rows[:4]] == want


@slow
def test_a_registered_lora_version_loads_offline_on_a_fresh_machine(day1, tmp_path):
    """Only the MLflow store travels: a new HOME (empty cache), another working folder, no artifacts/bases
    and no base model folder; `models:/` loads the version (the base fetched from the store by content)
    and it answers as peft's merged model does."""
    cfg, train = day1["cfg"], day1["train"]
    store = tmp_path / "store"
    shutil.copytree(cfg.artifacts_path / "mlartifacts", store / "mlartifacts")
    shutil.copy(cfg.artifacts_path / "mlflow.db", store / "mlflow.db")
    _repoint(store / "mlflow.db", str(cfg.artifacts_path / "mlartifacts"), str(store / "mlartifacts"))
    home = tmp_path / "home"
    code = ("import json, sys, mlflow\n"
            "sys.modules['stages'] = None  # no sftflow installed: the model's shipped code alone\n"
            "m = mlflow.pyfunc.load_model('models:/test-model/1')\n"
            "print(json.dumps(m.predict(['Who are you?', 'Name a color.'], params={'max_new_tokens': 8})))\n")
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}", "PYTHONPATH": ""}
    hidden = cfg.artifacts_path.with_name("artifacts-hidden")
    os.replace(cfg.artifacts_path, hidden)  # nothing of the project's artifacts folder can be read
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
    finally:
        os.replace(hidden, cfg.artifacts_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list((home / ".cache" / "sftflow" / "bases").iterdir())  # fetched from the store into the cache
    from transformers import AutoTokenizer

    from stages.inference.generation import generate
    model = peft_merged(json.loads((train / "spec.json").read_text())["model_path"], train / "adapter")
    tok = AutoTokenizer.from_pretrained(str(train / "adapter"))
    want = [r["text"] for r in generate(model, tok, [[{"role": "user", "content": q}] for q in
                                                      ("Who are you?", "Name a color.")], 8, batch_size=8)]
    assert got == want


def _repoint(db: Path, old: str, new: str) -> None:
    """The copied store's artifact locations moved with it (as a store moved to another machine is)."""
    import sqlite3
    con = sqlite3.connect(db)
    for table, col in (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                       ("model_versions", "storage_location"), ("logged_models", "artifact_location")):
        try:
            con.execute(f"UPDATE {table} SET {col} = REPLACE({col}, ?, ?)", (old, new))
        except sqlite3.OperationalError:
            pass
    con.commit()
    con.close()


@slow
def test_chat_answers_with_the_lora_version(day1):
    from conftest import sftflow
    out = sftflow("chat", "-c", str(day1["cfg_path"]), "--max-new-tokens", "8", "Who are you?", cwd=day1["tmp"])
    assert out.returncode == 0, out.stderr[-2000:]
    from transformers import AutoTokenizer

    from stages.inference.generation import generate
    train = day1["train"]
    model = peft_merged(json.loads((train / "spec.json").read_text())["model_path"], train / "adapter")
    tok = AutoTokenizer.from_pretrained(str(train / "adapter"))
    want = generate(model, tok, [[{"role": "user", "content": "Who are you?"}]], 8, batch_size=1)[0]["text"]
    assert out.stdout.strip() == want.strip()


@slow
def test_a_warm_start_from_a_lora_version_trains_over_it_merged_and_names_its_node(day1):
    """Day 2 starts from v1 (champion): training builds from v1 merged (as the merged copy held it), and
    v2's adapter names v1's adapter node, whose own base is the base model: loading v2 merges the chain."""
    from stages.inference.weights import load_merged
    tmp, raw, cfg = day1["tmp"], day1["raw"], day1["cfg"]
    extra = write_jsonl(tmp / "more.jsonl", demo_rows("train.jsonl", 16))
    raw = json.loads(json.dumps(raw))
    raw["data"]["train_data_paths"].append(str(extra))
    cfg_path = write_config(tmp, raw, "day2.yaml")
    p2, r2 = run_all(cfg_path)
    assert p2.start["ref"] == "models:/test-model/1" and r2["register"].metrics["version"] == 2
    t1, t2 = day1["train"], Path(r2["train"].path)
    start = Path(json.loads((t2 / "spec.json").read_text())["model_path"])
    v1_node = bases.node_digest(t1 / "adapter")
    assert bases.read_ref(t2 / "adapter")["base"] == v1_node
    assert json.loads((start.parent / bases.START_NODE).read_text())["digest"] == v1_node
    # v1's node is the files of v1's train folder (hard links), not a third copy of its adapter
    assert os.path.samefile(cfg.artifacts_path / "bases" / v1_node / "adapter_model.safetensors",
                            t1 / "adapter" / "adapter_model.safetensors")
    base_dir = json.loads((t1 / "spec.json").read_text())["model_path"]
    v1 = peft_merged(base_dir, t1 / "adapter")
    started = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(start / "model.safetensors"))
    for k, v in started.items():  # the folder training built from is v1 merged
        assert torch.equal(v, v1.state_dict()[k]), k
    from peft import PeftModel
    want = PeftModel.from_pretrained(v1, str(t2 / "adapter")).merge_and_unload().state_dict()
    got = load_merged(t2 / "adapter", roots=(cfg.artifacts_path,)).state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    from mlflow.tracking import MlflowClient
    tags = MlflowClient(cfg.resolved_tracking_uri).get_model_version("test-model", "2").tags
    assert tags[bases.CHAIN_TAG].split(",") == [v1_node, bases.read_ref(t1 / "adapter")["base"]]


def test_the_loader_refuses_a_quantize_record_it_cannot_apply(tmp_path):
    from stages.inference.weights import _apply_base_transform
    _apply_base_transform(torch.nn.Linear(2, 2), None)  # no record: nothing to do
    with pytest.raises(ValueError, match="unknown base quantization 'int3'"):
        _apply_base_transform(torch.nn.Linear(2, 2), {"kind": "int3", "block_size": 64, "scaler_block_size": 256})


def test_a_base_reference_that_names_nothing_is_one_line(tmp_path, monkeypatch):
    from stages.inference.weights import load_merged
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    bases.write_ref(folder, "0" * 64, None)
    with pytest.raises(bases.BaseNotFound, match="base model 000000000000: not stored locally"):
        load_merged(folder, tracking_uri=f"sqlite:///{tmp_path / 'none.db'}")
    (folder / "base.json").write_text("{}")
    with pytest.raises(ValueError, match="base.json: not a base reference"):
        load_merged(folder)



@slow
def test_export_merges_a_lora_folder_into_the_gguf_peft_s_merge_gives(day1, tmp_path):
    """`export_gguf` of a LoRA train folder equals the export of the folder peft's merge writes."""
    import gguf
    from transformers import AutoTokenizer

    from stages.export.gguf import export_gguf
    train = day1["train"]
    merged = tmp_path / "merged" / "model"
    peft_merged(json.loads((train / "spec.json").read_text())["model_path"], train / "adapter").save_pretrained(merged)
    AutoTokenizer.from_pretrained(str(train / "adapter")).save_pretrained(merged)
    got = export_gguf(train, tmp_path / "got", "f32")
    want = export_gguf(merged, tmp_path / "want", "f32", name=train.name)
    assert got.gguf.name == want.gguf.name == f"{train.name}-F32.gguf"
    a, b = ({t.name: t.data.copy() for t in gguf.GGUFReader(str(e.gguf)).tensors} for e in (got, want))
    assert a.keys() == b.keys() and a
    for k in a:
        assert (a[k] == b[k]).all(), k


@slow
def test_sftflow_models_shows_each_lora_version_s_size_and_its_base_once(day1):
    from conftest import sftflow
    out = sftflow("models", "-c", str(day1["cfg_path"]), cwd=day1["tmp"])
    assert out.returncode == 0, out.stderr[-2000:]
    base = bases.read_ref(day1["train"] / "adapter")["base"]
    notes = [line for line in out.stdout.splitlines() if line.startswith("base ")]
    assert len(notes) == 1 and notes[0].startswith(f"base {base[:12]} (") and "stored once" in notes[0], out.stdout
    assert "v1" in notes[0]


@slow
def test_gc_keeps_a_base_while_a_version_names_it_and_frees_it_when_none_does(day1, tmp_path):
    from mlflow.tracking import MlflowClient

    from stages.core.config import load_config
    from stages.retention import collect
    cfg = load_config(day1["cfg_path"], ["retention.keep_days=0"])
    base = bases.read_ref(day1["train"] / "adapter")["base"]
    folder = cfg.artifacts_path / "bases" / base
    report = collect(cfg, delete=True, on_line=lambda _: None)
    assert folder.is_dir() and str(folder) in report.kept
    client = MlflowClient(cfg.resolved_tracking_uri)
    assert bases.find_run(client, base) is not None
    # no version names it any more (the registered model deleted; its train folders unused): freed
    for v in client.search_model_versions("name = 'test-model'"):
        client.delete_registered_model_alias("test-model", "champion") if v.aliases else None
    client.delete_registered_model("test-model")
    report = collect(cfg, delete=True, on_line=lambda _: None)
    assert not folder.exists()
    assert bases.find_run(client, base) is None
    assert any("bases" in str(d.path) and d.done for d in report.drops)
