"""The train stage under torchrun, checked against single-process references."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, tiny_config_dict, write_config
from stages.core.config import load_config
from stages.pipeline import plan, run_stage
from stages.chatdata.shards import read_shards
from stages.launch.launcher import worker_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    cfg = load_config(write_config(tmp, tiny_config_dict(tmp)))
    p = plan(cfg)
    run_stage(p, "prepare")
    return tmp, cfg, p


@pytest.mark.parametrize("n_samples", [16, 3])
def test_grads_equal_one_big_batch(prepared, tmp_path, n_samples):
    """World 2 x accumulation 2, unequal lengths: same gradient as one process on the whole batch;
    also for an epoch's short last batch (3 samples: one rank runs only zero-weight micro-batches)."""
    tmp, cfg, p = prepared
    from conftest import base_model
    model_path = base_model(cfg)
    spec = {"config": cfg.model_dump(mode="json"), "model_path": model_path, "out_dir": str(tmp_path),
            "train_dir": str(p.folder("prepare") / "train"), "val_dir": None}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    out = tmp_path / "grads.pt"
    # samples spread over the whole length range, so micro-batches and ranks get very unequal lengths
    lengths = read_shards(p.folder("prepare") / "train", ["length"]).column("length").to_numpy()
    order = lengths.argsort(kind="stable")
    chosen = order[[round(k * (len(order) - 1) / (n_samples - 1)) for k in range(n_samples)]]
    cmd = [sys.executable, "-m", "stages.launch.local_torchrun", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist" / "grad_check.py"), str(spec_path), str(out), ",".join(map(str, chosen))]
    proc = subprocess.run(cmd, env=worker_env(2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out)
    assert cfg.actor.global_batch_size // (cfg.actor.micro_batch_size * 2) == 2  # really accumulates

    # Reference: plain model, one sample at a time (no padding, no FSDP), token-weighted over the batch.
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    table = read_shards(p.folder("prepare") / "train").to_pylist()
    rows = [table[i] for i in got["batch"]]
    sizes = [len(r["input_ids"]) for r in rows]
    assert max(sizes) >= 2 * min(sizes), "the batch should mix very different lengths"
    total = sum(sum(r["loss_mask"]) for r in rows)
    for r in rows:
        ids = torch.tensor([r["input_ids"]])
        labels = torch.tensor([[t if m else -100 for t, m in zip(r["input_ids"], r["loss_mask"])]])
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum") / total
        loss.backward()
    ref = {n: prm.grad for n, prm in model.named_parameters() if prm.grad is not None}
    assert set(got["grads"]) == set(ref)
    for name, g in got["grads"].items():
        torch.testing.assert_close(g, ref[name], atol=1e-5, rtol=1e-4, msg=name)
    assert got["stats"]["trainable_tokens"] == total


def test_two_process_training_writes_metrics_checkpoints_and_a_loadable_model(prepared):
    tmp, cfg, p = prepared
    result = run_stage(p, "train", on_line=lambda line: None)
    folder = Path(result.path)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"loss", "grad_norm", "lr", "tokens_per_s", "trainable_tokens"} <= set(r)
        assert r["loss"] > 0 and r["grad_norm"] > 0
    assert "val_loss" in rows[1] and "val_loss" in rows[3]
    ckpts = sorted((folder / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_00000002", "step_00000004"]
    assert all((c / "COMPLETE").is_file() for c in ckpts)
    assert (folder / "manifest.json").is_file()

    # The exported folder is an ordinary HF model, and training moved it away from the base.
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tuned = AutoModelForCausalLM.from_pretrained(folder / "model")
    tok = AutoTokenizer.from_pretrained(folder / "model")
    base = AutoModelForCausalLM.from_pretrained(p.cfg.artifacts_path / "models" / next(
        d.name for d in (p.cfg.artifacts_path / "models").iterdir() if not d.name.startswith(".")))
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    delta = max((a - b).abs().max().item() for a, b in zip(tuned.state_dict().values(), base.state_dict().values()))
    assert delta > 0
    # Re-running the stage is a cache hit.
    assert run_stage(p, "train").cached
