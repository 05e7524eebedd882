"""A reference stage re-scores only what changed: adding a set to `eval.sets` scores that set alone,
and the assembled baseline (its predictions, its numbers, and evaluate's paired comparisons with
it) is the same as a from-scratch run that scored every set."""

import json
from pathlib import Path

import torch

from conftest import base_model, demo_rows, noisy_model, tiny_config_dict, write_config, write_jsonl
from stages.core.config import load_config
from stages.pipeline import plan, run_stage


def _models(tmp: Path) -> tuple[Path, Path]:
    """Two different small models that answer differently per prompt: the base and the one scored."""
    (tmp / "seed").mkdir()
    seed_cfg = load_config(write_config(tmp / "seed", tiny_config_dict(tmp / "seed")))
    noisy_model(base_model(seed_cfg), tmp / "base")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    other = AutoModelForCausalLM.from_pretrained(tmp / "base", dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in other.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    other.save_pretrained(tmp / "tuned")
    AutoTokenizer.from_pretrained(tmp / "base").save_pretrained(tmp / "tuned")
    return tmp / "base", tmp / "tuned"


def _config(tmp: Path, artifacts: str, sets: list[str], base: Path, tuned: Path):
    files = {"a": write_jsonl(tmp / "a.jsonl", demo_rows("eval.jsonl", 12)[:6]),
             "b": write_jsonl(tmp / "b.jsonl", demo_rows("eval.jsonl", 12)[6:])}
    d = tiny_config_dict(tmp, n_train=20, n_val=4)
    d["artifacts_dir"] = str(tmp / artifacts)
    d["actor"]["model"] = {"model_path": str(base)}
    d["eval"] = {"max_new_tokens": 6, "batch_size": 4, "model": str(tuned),
                 "sets": {n: {"data_paths": [str(files[n])], "scorer": "contains" if n == "b" else None}
                          for n in sets}}
    d["eval"]["sets"] = {n: {k: v for k, v in s.items() if v is not None} for n, s in d["eval"]["sets"].items()}
    return load_config(write_config(tmp, d, f"{artifacts}-{''.join(sets)}.yaml"))


def _run(cfg, stages=("prepare_eval", "baseline", "evaluate")):
    p = plan(cfg)
    lines: list[str] = []
    return {s: run_stage(p, s, on_line=lines.append) for s in stages}, lines


def test_adding_a_set_scores_that_set_alone_and_matches_a_run_from_scratch(tmp_path):
    base, tuned = _models(tmp_path)
    first, _ = _run(_config(tmp_path, "grown", ["a"], base, tuned), ("prepare_eval", "baseline"))
    piece_a = next((tmp_path / "grown" / "baseline_sets").iterdir())
    stamp = (piece_a / "manifest.json").stat().st_mtime_ns

    grown, lines = _run(_config(tmp_path, "grown", ["a", "b"], base, tuned))
    folder = Path(grown["baseline"].path)
    assert not grown["baseline"].cached and folder != Path(first["baseline"].path)
    assert (piece_a / "manifest.json").stat().st_mtime_ns == stamp  # a's piece was read, not rewritten
    scored = json.loads((folder / "spec.json").read_text())["config"]["eval"]["sets"]
    assert list(scored) == ["b"]  # the model was run on the new set only
    assert any("scoring b" in line for line in lines), lines
    pieces = sorted(p.name for p in (tmp_path / "grown" / "baseline_sets").iterdir() if not p.name.startswith("."))
    assert len(pieces) == 2

    scratch, _ = _run(_config(tmp_path, "scratch", ["a", "b"], base, tuned))
    ref = Path(scratch["baseline"].path)
    assert json.loads((ref / "spec.json").read_text())["config"]["eval"]["sets"].keys() == {"a", "b"}
    assert (folder / "predictions.jsonl").read_bytes() == (ref / "predictions.jsonl").read_bytes()
    rows = [json.loads(line) for line in (ref / "predictions.jsonl").read_text().splitlines()]
    assert [r["set"] for r in rows] == ["a"] * 6 + ["b"] * 6
    assert len({r["prediction"] for r in rows}) > 3  # the base model answers differently per prompt
    assert grown["baseline"].metrics == scratch["baseline"].metrics
    # evaluate's paired comparison with the assembled baseline is the from-scratch one, item by item
    for name in ("a", "b"):
        mine, theirs = grown["evaluate"].metrics["sets"][name], scratch["evaluate"].metrics["sets"][name]
        assert mine["vs_base"] == theirs["vs_base"] and mine["delta"] == theirs["delta"]
        assert mine["delta_low"] == theirs["delta_low"] and mine["delta_high"] == theirs["delta_high"]


def test_a_reference_without_named_sets_keeps_no_pieces(tmp_path):
    d = tiny_config_dict(tmp_path, n_train=20, n_val=4, eval={"max_new_tokens": 4})
    p = plan(load_config(write_config(tmp_path, d)))
    for s in ("prepare", "baseline"):
        run_stage(p, s, on_line=lambda _: None)
    assert not (tmp_path / "artifacts" / "baseline_sets").exists()
