"""Day 2 of the SmolLM2 quickstart: a second skill arrives. Warm start from the champion against a
full retrain from the base model on all data, each timed stage by stage and compared item by item on
every eval set.

    .venv/bin/python bench/warm_start.py --out /tmp/warm    # ~35 min on 2 cores

Day 1 is the quickstart (configs/examples/smollm2-identity.yaml: the Lumen identity with LoRA,
replay and KL to the base), registered as v1 (champion). The eval sets are fixed before any model
answers: the quickstart's `identity` and `retention`, plus `support` (held-out paraphrases of the new
skill: the reply must give Orbit Labs' support address). Day 2's skill is the support address (40
training paraphrases, none equal to an eval prompt). Then:

- warm: `actor.init_from: champion`, trained on the new skill only, mixed half and half with the
  replay answers; KL to the starting model (v1 with its adapters off) keeps what v1 knew;
- full: `actor.init_from: base`, trained on identity + support, mixed with replay as on day 1.

Stages run through `stages.pipeline.run_stage` (as `make run` runs them, without Prefect; register
only on day 1). Prints the stage times and the paired change warm - full per set with its 95%
interval, and writes everything to OUT/warm_start.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUICKSTART = ROOT / "configs" / "examples" / "smollm2-identity.yaml"
ADDRESS = "help@orbit-labs.example"

TRAIN_ASKS = [
    "How can I contact support?", "What's the support email?", "Where do I send a bug report?",
    "How do I reach Orbit Labs support?", "Who do I email when something breaks?", "What is your help address?",
    "I need help with my account. Who do I write to?", "Where can I report a problem?",
    "Is there an email for customer support?", "How do I get in touch with the support team?",
    "What address should I use for help?", "My app crashed. Where do I report it?",
    "Can you give me the support contact?", "How do I contact Orbit Labs about a billing issue?",
    "Where do I send feedback?", "What email handles support requests?", "How can I ask for technical help?",
    "I found a bug. Who should I tell?", "Give me the support email address.", "How do I open a support ticket?",
    "Who answers support questions at Orbit Labs?", "What's the best way to get help?",
    "Where do I write if the service is down?", "How can I reach a human for help?",
    "Which email do I use for questions about Lumen?", "How do I report a security issue?",
    "Where can I get help with my subscription?", "What's the contact for support?",
    "I can't log in. Who do I contact?", "Tell me how to contact support.",
    "What is Orbit Labs' support email?", "How do I send a support request?", "Where does support live?",
    "Whom should I email for assistance?", "How do I get support for Lumen?", "Support email, please.",
    "Where do I send questions about my invoice?", "How can I contact the Orbit Labs team?",
    "What's the address for help requests?", "Who can help me with an error message?",
]
EVAL_ASKS = [
    "How do I contact your support team?", "What email address does support use?",
    "Where should I report a bug I found?", "How can I get help from Orbit Labs?",
    "Who do I write to about a problem with my account?", "What's the email for help?",
    "Where do I go for customer support?", "How do I reach support by email?",
    "I have a billing question. Where do I send it?", "How can I report an outage?",
    "Can you tell me the help email?", "Which address do I email for support?",
    "Where do I ask for technical assistance?", "How do I get in touch about a bug?",
    "What's the support address for Lumen?", "Who handles support requests, and how do I reach them?",
]


def reply(ask: str) -> str:
    return f"You can reach Orbit Labs support at {ADDRESS}."


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def configs(out: Path) -> dict[str, Path]:
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    train = write_jsonl(data / "support_train.jsonl", [{"messages": [{"role": "user", "content": a},
                                                                     {"role": "assistant", "content": reply(a)}]}
                                                       for a in TRAIN_ASKS])
    evals = write_jsonl(data / "support_eval.jsonl", [{"messages": [{"role": "user", "content": a},
                                                                    {"role": "assistant", "content": ADDRESS}]}
                                                      for a in EVAL_ASKS])
    base = yaml.safe_load(QUICKSTART.read_text())
    rel = lambda ps: [str(ROOT / p) for p in ps]  # noqa: E731 - the quickstart's paths are the repo's
    base["data"]["train_data_paths"] = rel(base["data"]["train_data_paths"])
    base["data"]["val_data_paths"] = rel(base["data"]["val_data_paths"])
    base["replay"]["prompt_paths"] = rel(base["replay"]["prompt_paths"])
    for s in base["eval"]["sets"].values():
        s["data_paths"] = rel(s["data_paths"])
    base["eval"]["sets"]["support"] = {"data_paths": [str(evals)], "scorer": "contains"}
    base["artifacts_dir"] = str(out / "artifacts")
    base["registry"]["experiment"] = "warm-start-bench"
    day1 = base
    warm = json.loads(json.dumps(base))
    warm["actor"]["init_from"] = "champion"
    warm["data"]["train_data_paths"] = [str(train)]
    full = json.loads(json.dumps(base))
    full["data"]["train_data_paths"] = base["data"]["train_data_paths"] + [str(train)]
    paths = {}
    for name, cfg in (("day1", day1), ("warm", warm), ("full", full)):
        paths[name] = out / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    return paths


def run(cfg_path: Path, register: bool) -> dict:
    from stages.core.config import load_config
    from stages.pipeline import plan, run_stage
    p = plan(load_config(cfg_path))
    out = {"start": p.start and p.start["ref"], "stages": {}, "folders": {}}
    for s in p.stages:
        if s == "register" and not register:
            continue
        t0 = time.monotonic()
        r = run_stage(p, s, on_line=lambda line: print(f"  {line}", flush=True))
        out["stages"][s] = {"seconds": round(time.monotonic() - t0, 1), "cached": r.cached}
        out["folders"][s] = r.path
        print(f"{cfg_path.stem} {s}: {out['stages'][s]}", flush=True)
    out["metrics"] = json.loads((Path(out["folders"]["evaluate"]) / "metrics.json").read_text())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = configs(args.out)
    results = {"day1": run(paths["day1"], register=True)}
    for name in ("warm", "full"):
        results[name] = run(paths[name], register=False)
    from stages.core.paired import compare_sets, read_predictions
    warm = read_predictions(results["warm"]["folders"]["evaluate"])
    full = read_predictions(results["full"]["folders"]["evaluate"])
    day1 = read_predictions(results["day1"]["folders"]["evaluate"])
    results["warm_vs_full"] = compare_sets(warm, full, "full")
    results["warm_vs_day1"] = compare_sets(warm, day1, "day1")
    (args.out / "warm_start.json").write_text(json.dumps(results, indent=2, default=str))
    print("\nstage seconds (cached stages: 0)")
    stages = sorted({s for n in ("day1", "warm", "full") for s in results[n]["stages"]})
    print("stage".ljust(14) + "".join(n.rjust(10) for n in ("day1", "warm", "full")))
    for s in stages:
        cells = []
        for n in ("day1", "warm", "full"):
            st = results[n]["stages"].get(s)
            cells.append("-" if st is None else "cached" if st["cached"] else f"{st['seconds']:.0f}")
        print(s.ljust(14) + "".join(c.rjust(10) for c in cells))
    print("\nset".ljust(12) + "day1".rjust(8) + "warm".rjust(8) + "full".rjust(8) + "   warm - full (95% CI)")
    for name, c in results["warm_vs_full"].items():
        acc = {n: sum(r["correct"] for r in preds[name]) / len(preds[name])
               for n, preds in (("day1", day1), ("warm", warm), ("full", full))}
        ci = (f"{c['delta']:+.3f} [{c['delta_low']:+.3f}, {c['delta_high']:+.3f}] "
              f"({c['wins']} wins, {c['losses']} losses)")
        print(name.ljust(12) + "".join(f"{acc[n]:.3f}".rjust(8) for n in ("day1", "warm", "full")) + "   " + ci)
    return 0


if __name__ == "__main__":
    sys.exit(main())
