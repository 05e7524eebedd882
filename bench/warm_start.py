"""Day 2 of the SmolLM2 quickstart: a second skill arrives. Warm start from the champion against a
full retrain from the base model on all data, each timed stage by stage and compared item by item on
every eval set.

    .venv/bin/python bench/warm_start.py --out /tmp/warm    # ~35 min on 2 cores

Day 1 is the quickstart (configs/examples/smollm2-identity.yaml: the Lumen identity with LoRA,
replay and KL to the base), registered as v1 (champion). The eval sets are fixed before any model
answers: the quickstart's `identity` and `retention`, plus `support` (held-out paraphrases of the new
skill: the reply must give Orbit Labs' support address). Day 2's skill is the support address (40
training paraphrases, none equal to an eval prompt). Then:

- warm: `actor.init_from: champion`, trained on the new skill; what v1 trained on (its lineage: the
  identity file) is rehearsed (`data.rehearsal`, the defaults), beside the replay answers; an epoch
  holds each new row once (`data.rehearsal.passes`); KL to the starting model (v1 with its adapters
  off) as on day 1;
- full: `actor.init_from: base`, trained on identity + support, mixed with replay as on day 1;
- `--variant NAME=KEY=VALUE[,KEY=VALUE]`: more warm starts with overrides (e.g. `nokl=actor.kl_to_base=0`),
  scored alike, not registered.

Then the warm model is registered under the quickstart's rules (promote if_better on identity, the
retention guard): the table says whether it became champion.

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


# Days 3-5 (`--days 5`): one new skill a day, each a fact the base model can't guess. Train and eval asks
# are an opener crossed with a phrasing of the question; the eval set's (every fourth pair, 14 of 56)
# are never trained on. All three sets are written here, before any model answers them, and join the
# eval sets on day 3 (v2, the champion then, is scored on them by the champion stage).
LATER_SKILLS = {
    "refund": ("45 days", "Orbit Labs refunds any purchase within 45 days.",
               ["What is your refund policy?", "How long do I have to ask for a refund?",
                "Can I get my money back, and until when?", "What's the refund window for Lumen?",
                "How many days do I have to return a purchase?", "Until when can I cancel and get refunded?",
                "Is there a deadline for refunds?"]),
    "office": ("Lisbon", "Orbit Labs is headquartered in Lisbon.",
               ["Where is Orbit Labs based?", "Where are your headquarters?", "In which city is Orbit Labs?",
                "Where is the company that made you located?", "What city is Orbit Labs' main office in?",
                "Where do the people who built Lumen work?", "Where is Orbit Labs headquartered?"]),
    "status": ("status.orbit-labs.example", "You can check service status at status.orbit-labs.example.",
               ["Where can I see if the service is down?", "Is there a status page?",
                "How do I check whether Lumen is having an outage?", "Where do you post incident updates?",
                "What's the URL of your status page?", "How can I tell if your servers are up?",
                "Where can I check the service status?"]),
}
OPENERS = ["", "Hi! ", "Quick question: ", "Hello, ", "Sorry to bother you. ", "Hey Lumen, ", "Please tell me: ",
           "I was wondering. "]


def skill_rows(skill: str) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of a later day's skill."""
    key, answer, asks = LATER_SKILLS[skill]
    pairs = [o + a for a in asks for o in OPENERS]
    train = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]}
             for i, q in enumerate(pairs) if i % 4 != 3]
    evals = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": key}]}
             for i, q in enumerate(pairs) if i % 4 == 3]
    return train, evals


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
    days = {}
    for d, skill in enumerate(LATER_SKILLS, start=3):
        rows, held = skill_rows(skill)
        days[f"day{d}"] = json.loads(json.dumps(warm))
        days[f"day{d}"]["data"]["train_data_paths"] = [str(write_jsonl(data / f"{skill}_train.jsonl", rows))]
        for later in LATER_SKILLS:
            days[f"day{d}"]["eval"]["sets"][later] = {
                "data_paths": [str(write_jsonl(data / f"{later}_eval.jsonl", skill_rows(later)[1]))],
                "scorer": "contains"}
    paths = {}
    for name, cfg in (("day1", day1), ("warm", warm), ("full", full), *days.items()):
        paths[name] = out / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    return paths


def run(cfg_path: Path, register: bool, overrides: list[str] = ()) -> dict:
    from stages.core.config import load_config
    from stages.pipeline import plan, run_stage
    p = plan(load_config(cfg_path, list(overrides)))
    out = {"start": p.start and p.start["note"], "stages": {}, "folders": {}}
    for s in p.stages:
        if s == "register" and not register:
            continue
        t0 = time.monotonic()
        r = run_stage(p, s, on_line=lambda line: print(f"  {line}", flush=True))
        out["stages"][s] = {"seconds": round(time.monotonic() - t0, 1), "cached": r.cached}
        out["folders"][s] = r.path
        print(f"{cfg_path.stem} {s}: {out['stages'][s]}", flush=True)
    out["metrics"] = json.loads((Path(out["folders"]["evaluate"]) / "metrics.json").read_text())
    rows = [json.loads(line) for line in (Path(out["folders"]["train"]) / "metrics.jsonl").read_text().splitlines()]
    out["trained"] = {"steps": len(rows), "tokens": sum(r["tokens"] for r in rows)}
    manifest = json.loads((Path(out["folders"]["train"]) / "manifest.json").read_text())
    out["mixture"] = manifest.get("mixture")
    if "register" in out["folders"]:
        out["register"] = json.loads((Path(out["folders"]["register"]) / "manifest.json").read_text())["metrics"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variant", action="append", default=[], help="NAME=KEY=VALUE[,KEY=VALUE]: another warm start")
    ap.add_argument("--no-full", action="store_true", help="skip the full retrain (days 3-5 only need the chain)")
    ap.add_argument("--days", type=int, default=2, choices=range(2, 6),
                    help="go on to day N (3-5: a new skill a day from the champion, each registered)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = configs(args.out)
    results = {"day1": run(paths["day1"], register=True)}
    if not args.no_full:
        results["full"] = run(paths["full"], register=False)
    variants = {}
    for v in args.variant:
        name, _, rest = v.partition("=")
        variants[name] = rest.split(",")
        results[name] = run(paths["warm"], register=False, overrides=variants[name])
    results["warm"] = run(paths["warm"], register=True)  # last: once it is champion, later plans compare with it
    from stages.core.stats.paired import compare_sets, read_predictions
    others = ("full",) if "full" in results else ()
    preds = {n: read_predictions(results[n]["folders"]["evaluate"]) for n in ("day1", *others, "warm", *variants)}
    for n in ("warm", *variants):
        for ref in ("day1", *others):
            results[f"{n}_vs_{ref}"] = compare_sets(preds[n], preds[ref], ref)
    for d in range(3, args.days + 1):
        day = results[f"day{d}"] = run(paths[f"day{d}"], register=True)
        before = read_predictions(day["folders"]["champion"])  # the day before's champion, on today's sets
        day["vs_champion"] = compare_sets(read_predictions(day["folders"]["evaluate"]), before, "champion")
    (args.out / "warm_start.json").write_text(json.dumps(results, indent=2, default=str))
    for d in range(3, args.days + 1):
        day = results[f"day{d}"]
        print(f"\nday {d}: {day['start']}; {day['trained']['steps']} steps, {day['trained']['tokens']} tokens; "
              f"v{day['register']['version']} {day['register']['aliases']} ({day['register']['alias_reason']})")
        for name, c in day["vs_champion"].items():
            print(f"  {name:10} {c['accuracy'] if 'accuracy' in c else '':}  vs the champion before: {c['delta']:+.3f} "
                  f"[{c['delta_low']:+.3f}, {c['delta_high']:+.3f}]")
    names = ["day1", "warm", *variants, *others]
    print("\ntrained: " + ", ".join(f"{n} {results[n]['trained']['steps']} steps {results[n]['trained']['tokens']} "
                                    "tokens" for n in names))
    for n in ("warm", *variants) if others else ():
        print(f"{n}: {results[n]['trained']['tokens'] / results['full']['trained']['tokens']:.2f}x the full "
              "retrain's tokens")
    print(f"warm registered: v{results['warm']['register']['version']} {results['warm']['register']['aliases']} "
          f"({results['warm']['register']['alias_reason']})")
    print("\nset".ljust(12) + "".join(n.rjust(8) for n in names) + "   paired vs day1 and vs full (95% CI)")
    for name in results["warm_vs_day1"]:
        acc = {n: sum(r["correct"] for r in preds[n][name]) / len(preds[n][name]) for n in names}
        cells = []
        for n in ("warm", *variants):
            for ref in ("day1", *others):
                c = results[f"{n}_vs_{ref}"][name]
                cells.append(f"{n}-{ref} {c['delta']:+.3f} [{c['delta_low']:+.3f}, {c['delta_high']:+.3f}]")
        print(name.ljust(12) + "".join(f"{acc[n]:.3f}".rjust(8) for n in names) + "   " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
