"""The month, measured: five days of the skills panel through the event path a team leaves running.

    .venv/bin/python bench/month.py --out /tmp/month                      # SmolLM2, the dev halves
    .venv/bin/python bench/month.py --out /tmp/month --split test --full-retrain   # the report, once
    .venv/bin/python bench/month.py --out /tmp/month-tiny --model tiny    # a smoke run on the builtin model

A project folder (OUT/project) gets a copy of the quickstart's data and the panel's files
(bench/panel/make_panel.py: one skill a day, nova, orders, privacy, reset_zh). `sftflow serve --on-data
--start-server` serves its config; then, day by day:

  day 1   the quickstart (configs/examples/smollm2-identity.yaml): the identity file dropped into drops/
  day 2-5 the day's panel file dropped into drops/; the config (the same path, re-read by every run) gains
          the day's eval set and keeps every earlier one; `actor.init_from: champion`, so the day trains
          from yesterday's champion on its new file and rehearses what that version learned

Each drop is announced with `sftflow notify -c CONFIG -f drops/<file>` (a Prefect event the served
deployment's trigger runs on), and the bench waits for that flow run to finish. What a day records comes
from what the run wrote, not from code of its own: the new version and its alias (MLflow's registry),
the trained tokens (the train folder's metrics.jsonl), each set's score (the evaluate folder's
metrics.json), the paired change against the champion before it with its 95% interval (the register
folder's `vs_champion`: register computed it, item by item, to decide the alias; day 1 against the base
model, evaluate's `vs_base`), and the disk (every file under artifacts/, the MLflow store included).

`--full-retrain`: after the chain, for each day N >= 2 a training from the base model on days 1..N's
files (mixed with replay as day 1), scored on day N's sets and not registered (stages.pipeline.run_stage),
for the tokens and the new skill's score the warm start is held to. `--split dev` (the default) scores
the panel's dev halves and retention_dev (choose settings there, with `--set KEY=VALUE` for days 2-5);
`--split test` the held-out halves and retention_test, to report once. An OUT that holds an earlier
run goes on from its last recorded day (day 1 is not trained again); its records are OUT/month.json, the
table OUT/month.md.

`--model tiny`: the builtin tiny model (configs/default.yaml's) with its tokenizer's corpus pinned to
every day's file, a few steps a day, no replay, `registry.tolerance: 1` (it learns no skill in a few
steps, and a tie at zero would hold every day back): a check that the machinery runs, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.panel.make_panel import DAYS, SCORERS  # noqa: E402

QUICKSTART = ROOT / "configs" / "examples" / "smollm2-identity.yaml"
IDENTITY = "data/smollm2-identity"
MODEL_NAME = "panel-month"


def set_key(cfg: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for k in path:
        cfg = cfg.setdefault(k, {})
    cfg[last] = value


def project(out: Path, model: str) -> Path:
    """OUT/project with the quickstart's data and the panel (copies: the bench never writes the repo)."""
    proj = out / "project"
    if not (proj / IDENTITY).is_dir():
        shutil.copytree(ROOT / IDENTITY, proj / IDENTITY, ignore=shutil.ignore_patterns("harness", "*.py"))
        for skill in DAYS.values():
            shutil.copytree(ROOT / "bench" / "panel" / skill, proj / "panel" / skill)
        (proj / "drops").mkdir(parents=True)
    if model == "tiny" and not (proj / "corpus.jsonl").exists():  # the builtin tokenizer's corpus: every day's file
        files = [proj / IDENTITY / "train.jsonl"] + [proj / "panel" / s / "train.jsonl" for s in DAYS.values()]
        (proj / "corpus.jsonl").write_text("".join(f.read_text(encoding="utf-8") for f in files), encoding="utf-8")
    return proj


def day_files(day: int) -> list[tuple[str, str]]:
    """(source in the project, name in drops/) of days 1..day."""
    out = [(f"{IDENTITY}/train.jsonl", "day1-identity.jsonl")]
    return out + [(f"panel/{DAYS[d]}/train.jsonl", f"day{d}-{DAYS[d]}.jsonl") for d in range(2, day + 1)]


def config(proj: Path, model: str, day: int, split: str, sets: list[str], full: bool = False) -> dict:
    """Day `day`'s config: the quickstart's (or the tiny model's), from the champion, the drops folder as
    its data, identity and retention and the panel sets of days 2..day. `full`: from the base model on
    days 1..day's files instead (not from drops/: a full retrain is not an arrival)."""
    cfg = yaml.safe_load(QUICKSTART.read_text())
    retention = f"{IDENTITY}/retention_{split}.jsonl"
    cfg["eval"]["sets"]["retention"]["data_paths"] = [retention]
    if model == "tiny":
        cfg["runner"] = {"max_epochs": 1, "max_steps": 4, "val_check_interval": 0, "save_interval": 0,
                         "log_interval": 1, "seed": 1234}
        cfg["actor"] = {"nproc_per_node": 1, "micro_batch_size": 8, "global_batch_size": 8, "precision": "fp32",
                        "model": {"model_path": "builtin:tiny-chat", "corpus_paths": ["corpus.jsonl"]},
                        "optim": {"lr": 6.0e-3, "warmup": 0}}
        cfg["data"].pop("mix")
        cfg["data"]["rehearsal"] = {}
        cfg.pop("replay")
        cfg["eval"].update(max_new_tokens=8, batch_size=32, precision="fp32")
        cfg["registry"]["tolerance"] = 1.0
    cfg["artifacts_dir"] = str(proj / "artifacts")
    cfg["actor"]["init_from"] = "base" if full else "champion"
    cfg["data"]["train_data_paths"] = [src for src, _ in day_files(day)] if full else ["drops/*.jsonl"]
    for d in range(2, day + 1):
        skill = DAYS[d]
        cfg["eval"]["sets"][skill] = {"data_paths": [f"panel/{skill}/{split}.jsonl"], "scorer": SCORERS[skill]}
    cfg["registry"].update(experiment="month-bench", model_name=MODEL_NAME)
    if day >= 2 and not full:
        for kv in sets:
            key, _, value = kv.partition("=")
            set_key(cfg, key, yaml.safe_load(value))
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(proj: Path) -> dict:
    """The subprocesses' environment: this checkout's code (and bench.panel.score, the panel's scorer) first,
    no Prefect server or home of the caller's: notify finds the one serve started on the project's artifacts."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "2"
    return env


def cli(proj: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=proj, env=env_for(proj),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


class Server:
    """`sftflow serve --on-data --start-server` on the project's config, its output in OUT/serve.log."""

    def __init__(self, proj: Path, cfg_path: Path, log: Path, name: str = "month-bench"):
        self.port, self.name = free_port(), name
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.log = open(log, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "-c", str(cfg_path), "--on-data",
                                      "--start-server", "--port", str(self.port), "--within", "5", "--name", name],
                                     cwd=proj, env=env_for(proj), stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        os.environ["PREFECT_API_URL"] = self.api  # this process reads the runs from it, with a home of its own
        os.environ["PREFECT_HOME"] = str(Path(log).parent / ".prefect-client")
        self.wait(self.served, 300, "the served deployment")
        time.sleep(3)  # the trigger's automation is made with the deployment; the runner starts polling

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"sftflow serve exited ({self.proc.returncode}) while waiting for {what}; "
                                 f"see {self.log.name}")
            try:
                got = predicate()
            except Exception:  # noqa: BLE001 - the server is still starting
                got = None
            if got:
                return got
            time.sleep(2)
        raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}; see {self.log.name}")

    def served(self) -> bool:
        from prefect.client.orchestration import get_client
        with get_client(sync_client=True) as client:
            return bool(client.read_deployment_by_name(f"sft_pipeline/{self.name}"))

    def runs(self) -> list:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
        with get_client(sync_client=True) as client:
            ours = DeploymentFilter(name=DeploymentFilterName(any_=[self.name]))
            runs = client.read_flow_runs(deployment_filter=ours)
        return sorted(runs, key=lambda r: r.created)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: serve, and the Prefect server it started
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


@contextlib.contextmanager
def in_project(proj: Path):
    """The config's paths are the project's, as for the served runs: load and plan it from there."""
    cwd = os.getcwd()
    os.chdir(proj)
    try:
        yield
    finally:
        os.chdir(cwd)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def tokens(train_dir: Path) -> int:
    rows = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sum(r.get("tokens", 0) for r in rows)


def scores(eval_metrics: dict) -> dict:
    return {name: {"accuracy": m["accuracy"], "correct": m["correct"], "total": m["total"]}
            for name, m in eval_metrics["sets"].items()}


def record_version(proj: Path, cfg_path: Path, before: int) -> dict:
    """What the run that just finished registered: the version, its alias and why, its tokens, scores and
    paired changes (register's against the champion before it; day 1: evaluate's against the base model)."""
    from mlflow.tracking import MlflowClient
    from stages.core.config import load_config
    from stages.retention import disk_usage
    with in_project(proj):
        cfg = load_config(cfg_path)
    client = MlflowClient(cfg.resolved_tracking_uri)
    versions = client.search_model_versions(f"name='{MODEL_NAME}'")
    newest = max(versions, key=lambda v: int(v.version), default=None)
    if newest is None or int(newest.version) <= before:
        raise SystemExit(f"the run registered no new version (newest: {newest and newest.version}); "
                         "see the serve log")
    art = Path(cfg.artifacts_dir)
    tags = newest.tags
    regs = [read_json(m)["metrics"] for m in (art / "register").glob("*/manifest.json")
            if read_json(m).get("version") == int(newest.version)]
    if not regs:
        raise SystemExit(f"no register folder under {art / 'register'} records v{newest.version}")
    reg = regs[0]
    ev = read_json(art / "evaluate" / tags["sftflow.evaluate_fingerprint"] / "metrics.json")
    train = art / "train" / tags["sftflow.train_fingerprint"]
    paired = {}
    for name, m in ev["sets"].items():
        if reg.get("vs_champion"):
            vs, against = reg["vs_champion"][name], f"v{reg['vs_champion'][name]['version']}"
        else:
            vs, against = m["vs_base"], "base"
        paired[name] = {k: vs.get(k) for k in ("accuracy", "delta", "delta_low", "delta_high", "wins", "losses")}
        paired[name]["against"] = against
        if against == "base":
            paired[name]["accuracy"] = m["base_accuracy"]
    return {"version": int(newest.version), "parent": tags.get("sftflow.parent_version", ""),
            "aliases": sorted(client.get_model_version(MODEL_NAME, newest.version).aliases),
            "alias_decision": reg["alias_decision"], "alias_reason": reg["alias_reason"],
            "tokens": tokens(train), "train": str(train), "scores": scores(ev), "paired": paired,
            "disk_mb": round(disk_usage(art) / 1e6, 1)}


def run_day(server: Server, proj: Path, cfg_path: Path, day: int, before: int, timeout: float) -> dict:
    src, name = day_files(day)[-1]
    shutil.copyfile(proj / src, proj / "drops" / name)
    done = len([r for r in server.runs() if r.state and r.state.is_final()])
    t0 = time.time()
    out = cli(proj, "notify", "-c", str(cfg_path), "-f", f"drops/{name}")
    if out.returncode != 0:
        raise SystemExit(f"day {day}: sftflow notify failed: {out.stderr.strip()}")
    print(f"day {day}: {out.stdout.strip()}", flush=True)
    run = server.wait(lambda: ([r for r in server.runs() if r.state and r.state.is_final()][done:] or [None])[0],
                      timeout, f"day {day}'s flow run")
    seconds = round(time.time() - t0)
    if not run.state.is_completed():
        raise SystemExit(f"day {day}: flow run {run.name} ended {run.state.type.value}: {run.state.message}")
    rec = {"day": day, "skill": DAYS.get(day, "identity"), "drop": name, "flow_run": run.name, "seconds": seconds,
           **record_version(proj, cfg_path, before)}
    print(f"day {day}: v{rec['version']} {rec['aliases']} ({rec['alias_reason']}); {rec['tokens']} tokens, "
          f"{seconds} s, {rec['disk_mb']} MB", flush=True)
    return rec


def full_retrain(proj: Path, model: str, day: int, split: str) -> dict:
    """Days 1..day's files from the base model, scored on day `day`'s sets; not registered."""
    from stages.core.config import load_config
    from stages.pipeline import plan, run_stage
    cfg_path = write_config(proj / f"full-day{day}.yaml", config(proj, model, day, split, [], full=True))
    with in_project(proj):
        p = plan(load_config(cfg_path))
        # scored, not compared with the champion nor registered: it is the yardstick, not a candidate
        folders = {s: Path(run_stage(p, s, on_line=lambda line: None).path) for s in p.stages
                   if s not in ("champion", "register")}
    ev = read_json(folders["evaluate"] / "metrics.json")
    return {"day": day, "tokens": tokens(folders["train"]), "scores": scores(ev), "evaluate": str(folders["evaluate"])}


def cell(rec: dict, name: str) -> str:
    s, p = rec["scores"].get(name), rec["paired"].get(name)
    if s is None:
        return ""
    text = f"{s['accuracy']:.3f}"
    if p and p.get("delta_low") is not None:
        text += f" ({p['delta']:+.3f} [{p['delta_low']:+.3f}, {p['delta_high']:+.3f}] vs {p['against']})"
    return text


def table(state: dict) -> str:
    days = [state["days"][k] for k in sorted(state["days"], key=int)]
    sets = list(dict.fromkeys(n for r in days for n in r["scores"]))
    full = state.get("full", {})
    head = ["day", "version", "tokens", *sets, "alias", "disk (MB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in days:
        f = full.get(str(r["day"]))
        tok = f"{r['tokens'] / 1000:.1f}k" + (f" ({r['tokens'] / f['tokens']:.2f}x full)" if f else "")
        alias = ", ".join(r["aliases"]) or r["alias_decision"] or "none"
        lines.append("| " + " | ".join([f"{r['day']} {r['skill']}", f"v{r['version']}", tok,
                                        *[cell(r, n) for n in sets], alias, str(r["disk_mb"])]) + " |")
    for d in sorted(full, key=int):
        f = full[d]
        lines.append("| " + " | ".join([f"{d} full retrain", "-", f"{f['tokens'] / 1000:.1f}k",
                                        *[f"{f['scores'][n]['accuracy']:.3f}" if n in f["scores"] else ""
                                          for n in sets], "not registered", ""]) + " |")
    return "\n".join(lines)


def verdicts(state: dict) -> list[str]:
    """The issue's bar per day 2-5: new skill >= 0.75 and >= the full retrain's; identity and every earlier
    panel set at most one item below the champion before; retention's lower bound >= -0.05 against it;
    <= 0.6x the full retrain's tokens; champion."""
    out = []
    for key in sorted(state["days"], key=int):
        r = state["days"][key]
        if r["day"] < 2:
            continue
        f = state.get("full", {}).get(key)
        new = r["scores"][r["skill"]]["accuracy"]
        checks = {f"{r['skill']} {new:.3f} >= 0.75": new >= 0.75}
        if f:
            checks[f"{r['skill']} >= the full retrain's {f['scores'][r['skill']]['accuracy']:.3f}"] = \
                new >= f["scores"][r["skill"]]["accuracy"]
            checks[f"tokens {r['tokens'] / f['tokens']:.2f}x <= 0.6x"] = r["tokens"] <= 0.6 * f["tokens"]
        for name, p in r["paired"].items():
            if name == r["skill"]:
                continue
            lost = round(-p["delta"] * r["scores"][name]["total"]) if p.get("delta") is not None else None
            if name == "retention":
                checks[f"retention lower bound {p['delta_low']:+.3f} >= -0.05"] = p["delta_low"] >= -0.05
            else:
                checks[f"{name} {lost:+d} items lost"] = lost <= 1
        checks["champion"] = "champion" in r["aliases"]
        missed = [k for k, ok in checks.items() if not ok]
        out.append(f"day {r['day']} ({r['skill']}): " + ("met" if not missed else "missed: " + "; ".join(missed)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--days", type=int, default=5, choices=range(1, 6), help="run up to this day")
    ap.add_argument("--split", choices=("dev", "test"), default="dev",
                    help="the panel's half and retention's set that score (dev: for choosing settings)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config key for days 2-5 (a setting being chosen on dev); repeatable")
    ap.add_argument("--full-retrain", action="store_true", help="also train from the base model on days 1..N, "
                    "N = 2..--days, for the tokens and scores the warm start is held to")
    ap.add_argument("--only-full-retrain", action="store_true", help="run the full retrains alone (they do not "
                    "depend on the days' settings: a call while settings are still chosen on dev); a later call "
                    "with the same OUT runs the days")
    ap.add_argument("--day-timeout", type=float, default=4 * 3600, help="seconds to wait for a day's run")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    state_path = args.out / "month.json"
    state = read_json(state_path) if state_path.exists() else {"days": {}, "full": {}}
    if state.get("model", args.model) != args.model or state.get("split", args.split) != args.split:
        raise SystemExit(f"{state_path} holds a {state['model']} run on the {state['split']} split: use another --out")
    state.update(model=args.model, split=args.split)
    if not args.only_full_retrain:
        state["sets"] = args.sets
    proj = project(args.out, args.model)
    cfg_path = proj / "month.yaml"
    todo = [] if args.only_full_retrain else [d for d in range(1, args.days + 1) if str(d) not in state["days"]]
    if todo:
        last = max(map(int, state["days"]), default=0)
        write_config(cfg_path, config(proj, args.model, todo[0], args.split, args.sets))
        # serve refuses a config whose data glob matches nothing: the first drop lands before it starts
        # (the notify that announces it still starts the run)
        src, name = day_files(todo[0])[-1]
        shutil.copyfile(proj / src, proj / "drops" / name)
        server = Server(proj, cfg_path, args.out / "serve.log")
        try:
            for day in todo:
                write_config(cfg_path, config(proj, args.model, day, args.split, args.sets))
                before = state["days"][str(last)]["version"] if last else 0
                state["days"][str(day)] = run_day(server, proj, cfg_path, day, before, args.day_timeout)
                last = day
                state_path.write_text(json.dumps(state, indent=2, ensure_ascii=False))
        finally:
            server.stop()
    if args.full_retrain or args.only_full_retrain:
        for day in range(2, args.days + 1):
            if str(day) not in state["full"]:
                state["full"][str(day)] = full_retrain(proj, args.model, day, args.split)
                print(f"full retrain, days 1-{day}: {state['full'][str(day)]['tokens']} tokens", flush=True)
                state_path.write_text(json.dumps(state, indent=2, ensure_ascii=False))
    report = table(state) + "\n\n" + "\n".join(verdicts(state))
    (args.out / "month.md").write_text(report + "\n", encoding="utf-8")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
