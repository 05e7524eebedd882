"""Supported decoder families: tiny random-init Hugging Face folders of every family of
tests/dist/families_check.py (one tokenizer, the builtin's), walked in ONE torchrun launch of 2
processes through sftflow's own paths, each checked against an independent reference:

  * packing: the worker's decision (packed, or the padded fallback, logged), and the micro-batch it
    collates (samples longer than the family's sliding window) giving each sample's own unpacked logits
    (plain transformers, eager attention, no FSDP);
  * FSDP2 over 2 ranks gives one plain process's gradients on the same global batch;
  * `actor.lora.target_modules: all-linear` finds targets and trains, or stops with one line;
  * export -> reload (`generation.load`) gives the sharded model's logits, LoRA merged included;
  * batched generation (`generation.generate`, left-padded) equals one prompt at a time.

docs/models.md holds the table this run renders (`render_table`); the test fails when it differs.
Regenerate it with `SFTFLOW_FAMILIES_DOC=docs/models.md .venv/bin/python -m pytest -m slow tests/test_families.py`
after adding a family or when a result changes.

Tolerances (fp32 throughout, on CPU):
  * logits, packed/padded vs alone: LOGITS_TOL = 1e-4 absolute, on logits of magnitude up to ~10:
    different kernels (sdpa or eager, one row or one per sample) round differently, up to ~1e-5 here; a
    sample seeing its neighbour or past its window moves logits by > 1e-2 (asserted per family through
    `window_effect`; gpt_oss's `packed_gap` shows a leak's size);
  * gradients: |g - ref| <= 1e-5 + 1e-4 |ref| per element (the suite's other gradient checks'): the two
    sides sum the same terms in another order (two ranks' reduce-scatter, packed rows, chunked head);
    a wrong normalization (world size, token count) is off by a factor, a leak by the logits' own gap;
  * export: 1e-5 absolute -- the same weights through the same kernel, fp32 saved and reloaded; the
    trained model is > 1e-3 away from the init, so exporting the initial weights fails it. LoRA's merged
    export: 1e-4 -- W + s BA rounded into one fp32 matrix against x W + s (x A) B, ~1e-5 on these logits;
    lost or twice-merged adapters move them by the adapters' whole effect (`lora_moved`, asserted > 1e-3);
  * generation: exact -- greedy token ids, on logits spread enough (weights drawn with std 0.2, gemma2/3
    0.02: see families_check.py) that rounding of ~1e-5 does not flip an argmax, while a padding bug
    changes tokens; the prompts must get different replies, or the check would be blind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, base_model, tiny_config_dict, write_config

LOGITS_TOL, EXPORT_TOL, LORA_EXPORT_TOL = 1e-4, 1e-5, 1e-4
DOC = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- families table: begin (tests/test_families.py renders it) -->", "<!-- families table: end -->"

# family -> (packed micro-batches?, LoRA all-linear trains?): what sftflow does today on each
EXPECTED = {
    "llama": (True, True), "mistral": (True, True), "qwen2": (True, True), "qwen3": (True, True),
    "gemma": (True, True), "gemma2": (True, True), "gemma3_text": (True, True), "phi3": (True, True),
    "olmo2": (True, True), "granite": (True, True), "smollm3": (True, True), "gpt_neox": (True, True),
    "starcoder2": (True, True), "stablelm": (True, True), "cohere": (True, True), "glm4": (True, True),
    "qwen3_moe": (True, True), "mixtral": (True, True), "gpt_oss": (False, True),
}


def run_families(tmp: Path, families: list[str] | None = None) -> dict:
    """The tiny demo data prepared with the builtin tokenizer, then the walk; its JSON."""
    from stages.core.config import load_config
    from stages.pipeline import plan, run_stage
    from stages.launch.launcher import worker_env
    from stages.runtime.worker import WorkerSpec
    raw = tiny_config_dict(tmp, n_train=32, n_val=4,
                           actor={"nproc_per_node": 2, "micro_batch_size": 2, "global_batch_size": 8,
                                  "precision": "fp32", "optim": {"lr": 1e-3, "warmup": 0}},
                           runner={"max_steps": 1, "seed": 7})
    raw["data"]["max_length"] = 96
    cfg = load_config(write_config(tmp, raw))
    p = plan(cfg)
    run_stage(p, "prepare")
    spec = WorkerSpec(config=cfg, model_path=base_model(cfg), out_dir=str(tmp / "unused"),
                      train_dir=str(p.folder("prepare") / "train"), val_dir=None)
    spec_path = spec.write(tmp / "spec.json")
    out = tmp / "families.json"
    cmd = [sys.executable, "-m", "stages.launch.local_torchrun", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist" / "families_check.py"), str(out), str(tmp / "work"), str(spec_path),
           *(families or [])]
    env = worker_env(2) | {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


# what the table says beside the checks (facts of the family or of its transformers code, not measured)
NOTES = {
    "qwen2": "window optional (`use_sliding_window`), on here for layer 2",
    "qwen3": "window optional, on here for layer 2",
    "gemma2": "eager attention (transformers' default for it); attention and final-logit softcapping",
    "gemma3_text": "`layer_types` set to one windowed, one global layer (the default windows 5 of every 6)",
    "granite": "`logits_scaling` 4 (loss.py's output transform)",
    "smollm3": "layer 2 without RoPE and windowed",
    "cohere": "`logit_scale` (loss.py's output transform)",
    "qwen3_moe": "MoE, 4 experts, 2 active; window optional, on here for every layer",
    "mixtral": "MoE, 4 experts, 2 active",
    "gpt_oss": ("MoE, 4 experts, 2 active; eager attention (sinks). Its model builds the attention masks without "
                "`position_ids` (transformers 5.24), so packed samples would see each other: the packing probe "
                "sees it and training falls back to padded micro-batches"),
}


def mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def render_table(results: dict) -> str:
    """docs/models.md's table: qualitative cells only (no measured numbers), so it is the same on every run."""
    head = ("| family | model class | attention | sliding window | micro-batches | collated = unpacked "
            "| FSDP2 = 1 process | loss head | export → reload | batched = one by one | LoRA `all-linear` | notes |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for family, r in results.items():
        if not r.get("available", False):
            rows.append(f"| {family} | not in this transformers | | | | | | | | | | {r.get('error', '')} |")
            continue
        if "full_error" in r:
            rows.append(f"| {family} | {r['architecture']} | error: {r['full_error']} | | | | | | | | | |")
            continue
        layers = r.get("layer_types")
        window = f"{r['window']} (" + (", ".join(t.split("_")[0] for t in layers) if layers else "every layer") + ")"
        batches = "packed" if r["packing"] else "padded (fallback, logged)" if r["fallback_logged"] else "padded"
        if r.get("lora") == "trains":
            lora = f"✓ {', '.join(r['lora_targets'])}; merged export {mark(r['lora_export_gap'] <= LORA_EXPORT_TOL)}"
        else:
            lora = f"refused: {r.get('lora_error')}"
        rows.append(
            f"| {family} | {r['architecture']} | {r['attention']} | {window if r['window'] else '—'} | {batches} "
            f"| {mark(r['collate_gap'] <= LOGITS_TOL)} | {mark(r['grad_error'] <= 1)} | {r['loss_path']} "
            f"| {mark(r['export_gap'] <= EXPORT_TOL)} | {mark(r['generation_equal'])} | {lora} "
            f"| {NOTES.get(family, '')} |")
    return head + "\n".join(rows) + "\n"


def doc_table() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n") + "\n"


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    results = run_families(tmp_path_factory.mktemp("families"))
    target = os.environ.get("SFTFLOW_FAMILIES_DOC")
    if target:  # regenerate the table in docs/models.md (between its markers)
        path = Path(target)
        text = path.read_text()
        path.write_text(text[:text.index(BEGIN) + len(BEGIN)] + "\n" + render_table(results) + text[text.index(END):])
    if os.environ.get("SFTFLOW_FAMILIES_JSON"):  # the measured numbers, for the doc's prose
        Path(os.environ["SFTFLOW_FAMILIES_JSON"]).write_text(json.dumps(results, indent=1))
    return results


def family_problems(family: str, r: dict, packed: bool, lora_trains: bool) -> list[str]:
    """What is wrong with one family's results (nothing: [])."""
    if not r.get("available"):
        return [f"{family}: not available in this transformers: {r.get('error')}"]
    if "full_error" in r:
        return [f"{family}: {r['full_error']}"]
    shown = {k: v for k, v in r.items() if k not in ("layer_types", "lora_targets")}
    checks = [
        (r["fsdp"], "not sharded"),
        # packing: the decision, the fallback logged, and the collated batch equal to each sample alone
        (r["packing"] == packed, f"packing {r['packing']}, expected {packed}"),
        (r["packing"] or r["fallback_logged"], "padded fallback not logged"),
        (r["collate_gap"] <= LOGITS_TOL, f"collated logits differ from unpacked by {r['collate_gap']}"),
        # the fallback is needed: packed rows would be wrong
        (r["packing"] or r["packed_gap"] > LOGITS_TOL, f"padded, though packed rows match ({r['packed_gap']})"),
        # the samples reach past the window, and the window changes their logits
        (not r["window"] or (min(r["sample_lengths"]) > r["window"] and r["window_effect"] > 1e-2),
         f"the check does not reach past the window (effect {r.get('window_effect')})"),
        # FSDP2 over 2 ranks == one process
        (r["grad_error"] <= 1 and not r["grad_one_sided"] and r["tokens_match"] and r["loss_gap"] < 1e-5,
         f"gradients differ from one process ({r['grad_error']}x the tolerance)"),
        (r["micro_batches"] == 2, "not 2 micro-batches per rank"),
        (r["loss_path"] in ("chunked", "full logits"), "the loss path was not logged"),
        # export -> reload, batched generation
        (r["export_gap"] <= EXPORT_TOL and r["trained_moved"] > 1e-3, f"export gap {r['export_gap']}"),
        (r["generation_equal"], f"batched generation differs: {r.get('generation_diff')}"),
        (r["generation_distinct"] >= 2, "every prompt got the same reply: the generation check is blind"),
    ]
    if lora_trains:
        checks.append((r.get("lora") == "trains" and bool(r.get("lora_targets")) and r.get("lora_adapter_saved", False)
                       and r.get("lora_export_gap", 1.0) <= LORA_EXPORT_TOL and r.get("lora_moved", 0.0) > 1e-3,
                       f"LoRA all-linear does not train and export: {r.get('lora_error')}"))
    else:
        checks.append((r.get("lora") == "refused" and r.get("lora_one_line", False),
                       f"LoRA all-linear not refused in one line: {r.get('lora_error')}"))
    return [f"{family}: {what} ({shown})" for ok, what in checks if not ok]


@pytest.mark.slow
def test_every_family_trains_packs_shards_exports_and_generates(families):
    assert list(families) == list(EXPECTED)
    problems = [p for family, (packed, lora) in EXPECTED.items() for p in family_problems(family, families[family],
                                                                                           packed, lora)]
    assert not problems, "\n".join(problems)
    assert doc_table() == render_table(families), (
        "docs/models.md's table is not this run's: SFTFLOW_FAMILIES_DOC=docs/models.md regenerates it")
