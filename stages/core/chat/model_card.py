"""A Hugging Face model card (`README.md`): the Hub's YAML front matter (base_model, library_name, tags,
the eval results as `model-index`) and a page a person reads: where training started, what it trained
on, how it scored against the base model. Register puts one in every logged model's Hugging Face folder,
so a downloaded version, a served model and an export carry it (TRL and Axolotl write the same kind);
train writes one without scores in the folder it exports. It formats what the stages recorded (the
prepare manifest, evaluate's metrics), it computes nothing."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..cache.artifacts import read_manifest
from ..config import REHEARSE, SFTConfig
from ..cache.lineage_paths import project_ref

CARD = "README.md"


def trained_on(cfg: SFTConfig, prepare_dir: str, inputs: dict[str, list]) -> list[dict]:
    """What the version trained on, as the next warm start rehearses it (models/start.py `rehearsal`): each
    training file of the prepare folder (train, the mixture's own files, what it rehearsed itself; not the
    replay stage's answers, which every run makes anew), once, with its content digest and the format and
    columns it was read with. Paths are relative to the project (core/cache/lineage_paths.py), so a moved or cloned
    project still finds them."""
    digest = {str(ref): d for items in inputs.values() for ref, d in items}
    rehearsed = {e["ref"]: e.get("columns") for e in cfg.rehearsal_files}
    out, seen = [], set()
    for src in read_manifest(Path(prepare_dir)).get("sources", []):
        mix = src.get("mix", "train")
        d = digest.get(src["ref"])
        if src["split"] not in ("train", "auto") or mix == "replay" or d is None or d in seen:
            continue
        seen.add(d)
        own = cfg.data.mix[mix].columns if mix in cfg.data.mix else None
        columns = rehearsed.get(src["ref"]) if mix == REHEARSE else own if own is not None else cfg.data.columns
        out.append({"ref": project_ref(src["ref"]), "digest": d, "format": src["format"], "columns": columns or {},
                    "source": mix})
    return out


def front_matter(name: str, base_model: str, metrics: dict, tags: list[str], datasets: list[str]) -> dict:
    """The card's metadata as the Hub reads it; `metrics`: evaluate's manifest metrics (per named set,
    else the val split)."""
    sets = metrics.get("sets") or {}
    results = [{"task": {"type": "text-generation", "name": "Text Generation"},
                "dataset": {"name": s, "type": s},
                "metrics": [{"type": "accuracy", "value": round(float(m["accuracy"]), 4), "name": f"{s} accuracy"}]}
               for s, m in sets.items() if isinstance(m.get("accuracy"), (int, float))]
    meta = {"base_model": base_model, "library_name": "transformers", "pipeline_tag": "text-generation",
            "tags": tags}
    if datasets:
        meta["datasets"] = datasets
    if results:
        meta["model-index"] = [{"name": name, "results": results}]
    return meta


def describe_quantized(record: dict) -> str:
    if "scaler_block_size" not in record:  # q4_1: GGUF's blocks, a minimum and a step per 32 weights
        return f"{record['kind']}, block {record['block_size']}"
    return f"{record['kind']}, block {record['block_size']}, scaler block {record['scaler_block_size']}"


def render(name: str, base_model: str, metrics: dict, started: str, trained_on: list[dict], lora: bool,
           run_url: str = "", quantized: dict | None = None) -> str:
    """The card's text. `started`: where training started (a sentence), `trained_on`: the training
    files ({ref, source}) as register tags them; `quantized`: the base's 4-bit record
    (core/nf4.quantize_record), None for a base trained in full precision."""
    tags = ["sftflow", "sft"] + (["lora"] if lora else []) + (["qlora"] if quantized else [])
    datasets = sorted({Path(e["ref"]).name for e in trained_on})
    meta = front_matter(name, base_model, metrics, tags, datasets)
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", "",
             f"# {name}", "", f"Fine-tuned from `{base_model}` with sftflow (supervised fine-tuning, "
             f"{'LoRA merged into the weights' if lora else 'full weights'}). {started}", ""]
    if quantized:
        # the merge is into the dequantized base (core/nf4.py): these weights are not the original's
        lines += [f"The base trained quantized ({describe_quantized(quantized)}): the adapters are merged into "
                  "its dequantized weights, so a weight of the base differs from the original by its 4-bit "
                  "rounding (by nothing where the base already was that 4-bit grid: a Q4_1 GGUF under q4_1).", ""]
    if trained_on:
        lines += ["## Training data", "", "| file | source |", "|---|---|"]
        lines += [f"| `{e['ref']}` | {e.get('source', 'train')} |" for e in trained_on]
        lines.append("")
    sets = metrics.get("sets") or {}
    if sets:
        lines += ["## Evaluation", "", "| set | accuracy | base model | change |", "|---|---:|---:|---:|"]
        for s, m in sets.items():
            base = m.get("base_accuracy")
            shown, change = ("", "") if base is None else (f"{base:.3f}", f"{m['accuracy'] - base:+.3f}")
            lines.append(f"| {s} | {m['accuracy']:.3f} | {shown} | {change} |")
        lines.append("")
    if run_url:
        lines += [f"The run, its metrics and predictions: {run_url}", ""]
    return "\n".join(lines)


def read(folder: Path) -> dict | None:
    """The front matter of the card in `folder`, or None without one."""
    path = Path(folder) / CARD
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    if not text.startswith("---\n"):
        return None
    return yaml.safe_load(text.split("---\n", 2)[1])
