"""QLoRA on the SmolLM2 quickstart (issue 70): the quickstart with `actor.lora.quantize: nf4` and with
`q4_1` against the same quickstart with LoRA, each through its stages (as `make run` runs them,
without Prefect), in one artifacts folder under --out: the stages they share (the converted model,
prepare, replay, baseline) run once.

    .venv/bin/python bench/qlora.py --out /tmp/qlora                 # all three: ~40 min on 2 idle cores
    .venv/bin/python bench/qlora.py --out /tmp/qlora --only nf4,lora # some of them
    .venv/bin/python bench/qlora.py --out /tmp/qlora --start         # and each 4-bit base before training
    .venv/bin/python bench/qlora.py --out /tmp/qlora --steps 3       # the train stage alone, 3 steps each

With --steps N only the train stage runs, N steps, on the quickstart's identity rows without the
replay mixture (no generation): the quick measure of tokens/s, peak RSS and the base's bytes.

Each quantized run is registered under a model name of its own (it must become the champion of its
own registry: identity >= 0.9 and the retention guard); the LoRA run is scored, not registered.
Prints, beside each other: identity and retention accuracy, the paired change quantized - LoRA per
eval set with its 95% interval (same items, item by item), each run's paired change against the base
model, the train stage's trained tokens/s (mean over its steps after the first), the peak RSS of the
train stage's process tree (getrusage of its children, in a subprocess of its own), and the bytes
the base weights occupy in the training rank (measured there: train.log's "QLoRA:" line).
With --start each quantized run has a twin that scores its 4-bit base itself: one step at lr 1e-30
(the adapters' B starts at zero, so the merged model is the base's 4-bit round trip to fp32's
resolution): what quantizing the base costs before the adapters learn anything. Writes OUT/qlora.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUICKSTART = ROOT / "configs" / "examples" / "smollm2-identity.yaml"

# a stage in a process of its own: its children's peak RSS is the train stage's torchrun tree alone
STAGE = """
import json, resource, sys, time
from stages.core.config import load_config
from stages.pipeline import plan, run_stage
p = plan(load_config(sys.argv[1], sys.argv[3:]))
t0 = time.monotonic()
r = run_stage(p, sys.argv[2], on_line=lambda line: print("  " + line, flush=True))
print(json.dumps({"path": r.path, "cached": r.cached, "seconds": round(time.monotonic() - t0, 1),
                  "children_max_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def train_only(out: Path, steps: int) -> dict:
    """Both runs' train stage alone, `steps` steps, sharing one artifacts folder (prepare and the model's
    conversion once)."""
    cfg = yaml.safe_load(config(out, "short").read_text())
    cfg["data"].pop("mix", None)
    cfg.pop("replay", None)
    cfg["artifacts_dir"] = str(out / "artifacts")  # the full runs', when there: its converted model
    cfg["runner"].update(max_steps=steps, save_interval=0, val_check_interval=0)
    path = out / "short.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    results = {}
    for name, overrides in (("nf4", ["actor.lora.quantize=nf4"]), ("q4_1", ["actor.lora.quantize=q4_1"]),
                            ("lora", [])):
        r: dict = {"stages": {}, "folders": {}}
        for s in ("prepare", "train"):
            _stage(path, s, overrides, name, r)
        r["losses"] = _read_train(Path(r["folders"]["train"]), r)
        results[name] = r
    return results


def config(out: Path, name: str) -> Path:
    """The quickstart with its paths made absolute and its artifacts (and registry) under `out/artifacts`."""
    cfg = yaml.safe_load(QUICKSTART.read_text())
    rel = lambda ps: [str(ROOT / p) for p in ps]  # noqa: E731 - the quickstart's paths are the repo's
    cfg["data"]["train_data_paths"] = rel(cfg["data"]["train_data_paths"])
    cfg["data"]["val_data_paths"] = rel(cfg["data"]["val_data_paths"])
    cfg["replay"]["prompt_paths"] = rel(cfg["replay"]["prompt_paths"])
    for s in cfg["eval"]["sets"].values():
        s["data_paths"] = rel(s["data_paths"])
    cfg["artifacts_dir"] = str(out / "artifacts")
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    return path


def _stage(cfg_path: Path, stage: str, overrides: list[str], label: str, into: dict) -> None:
    """One stage in a fresh process (its peak RSS is its own), its seconds and folder recorded `into`."""
    proc = subprocess.run([sys.executable, "-c", STAGE, str(cfg_path), stage, *overrides], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{label} {stage} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    into["stages"][stage], into["folders"][stage] = {"seconds": got["seconds"], "cached": got["cached"]}, got["path"]
    if stage == "train":
        into["train_peak_rss"] = got["children_max_rss"]
    print(f"{label} {stage}: {into['stages'][stage]}", flush=True)


def _read_train(train: Path, into: dict) -> list:
    """The train folder's tokens/s (the first step's compile and warm-up left out) and the rank's measured
    base bytes line, recorded `into`; the losses."""
    rows = [json.loads(line) for line in (train / "metrics.jsonl").read_text().splitlines()]
    speeds = [x["tokens_per_s"] for x in rows[1:] if "tokens_per_s" in x]
    into["tokens_per_s"] = sum(speeds) / len(speeds) if speeds else None
    into["base_bytes"] = next((m.group(0) for m in re.finditer(r"QLoRA: .*", (train / "train.log").read_text())),
                              None)
    return [x.get("loss") for x in rows]


def run(cfg_path: Path, overrides: list[str], register: bool) -> dict:
    from stages.core.config import load_config
    from stages.pipeline import plan
    p = plan(load_config(cfg_path, overrides))
    out: dict = {"stages": {}, "folders": {}}
    for s in p.stages:
        if s == "register" and not register:
            continue
        _stage(cfg_path, s, overrides, cfg_path.stem, out)
    _read_train(Path(out["folders"]["train"]), out)
    out["metrics"] = json.loads((Path(out["folders"]["evaluate"]) / "metrics.json").read_text())
    if "register" in out["folders"]:
        out["register"] = json.loads((Path(out["folders"]["register"]) / "manifest.json").read_text())["metrics"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default=None, help="a comma list of the runs: nf4, q4_1, lora (default: all three)")
    ap.add_argument("--steps", type=int, default=0, help="> 0: the train stage alone, this many steps each")
    ap.add_argument("--start", action="store_true", help="also score the 4-bit base before training")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.steps > 0:
        results = train_only(args.out, args.steps)
        (args.out / "qlora_steps.json").write_text(json.dumps(results, indent=2, default=str))
        for name, r in results.items():
            rss = r.get("train_peak_rss")
            print(f"{name}: train {r['stages']['train']['seconds']} s for {len(r['losses'])} steps, "
                  f"{r['tokens_per_s'] or 0:.0f} tokens/s (steps after the first), peak RSS of the train tree "
                  f"{rss / 2 ** 20:.0f} MiB, losses {r['losses']}")
            if r.get("base_bytes"):
                print(f"  {r['base_bytes']}")
        return 0
    results = {}
    only = set(args.only.split(",")) if args.only else {"nf4", "q4_1", "lora"}
    for kind in ("nf4", "q4_1"):  # each quantized run registers under a model name of its own
        if kind in only:
            quantized = [f"actor.lora.quantize={kind}", f"registry.model_name=smollm2-identity-{kind.replace('_', '')}"]
            results[kind] = run(config(args.out, kind), quantized, register=True)
            if args.start:
                results[f"{kind}_start"] = run(config(args.out, f"{kind}_start"),
                                               [*quantized, "runner.max_steps=1", "actor.optim.lr=1e-30"],
                                               register=False)
    if "lora" in only:
        results["lora"] = run(config(args.out, "lora"), [], register=False)
    from stages.core.stats.paired import compare_sets, read_predictions
    for kind in ("nf4", "q4_1"):
        if kind in results and "lora" in results:
            results[f"{kind}_vs_lora"] = compare_sets(read_predictions(results[kind]["folders"]["evaluate"]),
                                                      read_predictions(results["lora"]["folders"]["evaluate"]), "lora")
    (args.out / "qlora.json").write_text(json.dumps(results, indent=2, default=str))
    for name, r in results.items():
        if name.endswith("_vs_lora"):
            continue
        sets = r["metrics"].get("sets", {})
        accs = ", ".join(f"{s} {m['accuracy']:.3f}" for s, m in sets.items())
        rss = r.get("train_peak_rss")
        speed = f"{r['tokens_per_s']:.0f} tokens/s" if r.get("tokens_per_s") else "tokens/s not logged"
        print(f"{name}: {accs}; train {r['stages']['train']['seconds']} s, {speed}, "
              + (f"peak RSS {rss / 2 ** 20:.0f} MiB" if rss else "peak RSS not measured"))
        if r.get("base_bytes"):
            print(f"  {r['base_bytes']}")
        if r.get("register"):
            reg = r["register"]
            print(f"  registered v{reg.get('version')} {reg.get('aliases')} ({reg.get('alias_reason')})")
    for name, r in results.items():
        for s, m in (r.get("metrics", {}).get("sets", {})).items():
            c = m.get("vs_base") or {}
            if c.get("delta_low") is not None:
                print(f"{name} - base model on {s}: {c['delta']:+.3f} [{c['delta_low']:+.3f}, {c['delta_high']:+.3f}]")
    for kind in ("nf4", "q4_1"):
        for s, c in (results.get(f"{kind}_vs_lora") or {}).items():
            if c:
                print(f"{kind} - lora on {s}: {c['delta']:+.3f} [{c['delta_low']:+.3f}, {c['delta_high']:+.3f}] "
                      f"({c['wins']} wins, {c['losses']} losses of {c['n']})")
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    code = main()
    print(f"bench/qlora.py: {time.monotonic() - t0:.0f} s")
    sys.exit(code)
