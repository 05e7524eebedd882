"""A team's setup under faults and load: `python -m flows.servers.team up` in a temporary root (PostgreSQL, the
Prefect and MLflow servers, 2 workers), the demo config shortened and deployed, then each scenario:

  kill      a worker SIGKILLed mid-train with every process under it (a machine dying), after a
            checkpoint: the flow run must end Crashed (the heartbeat automation `up` installs), the train
            folder must not be taken as complete, and a new run of the same config on the other worker
            resumes from the checkpoint to weights equal (torch.equal) to an uninterrupted run's
            (`sftflow stage train` in a separate artifacts folder, SQLite tracking)
  mlflow    the MLflow server stopped mid-train for --mlflow-down seconds, started again on its port
  postgres  `pg_ctl restart -m fast` between train and evaluate
  load      --runs queued runs of one cached config (run once first) drain through the 2 workers;
            the seconds per run against a lone cached run's

    .venv/bin/python bench/team_faults.py                         # every scenario, a table
    .venv/bin/python bench/team_faults.py --scenarios kill,load --runs 10 --json
    .venv/bin/python bench/team_faults.py --root /tmp/team --keep # reuse / keep a setup (debugging)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows.servers import team  # noqa: E402

SCENARIOS = ("kill", "mlflow", "postgres", "load")
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
# the demo config, short: one process, 60 steps, a checkpoint every 10, short replies
SHORT = {"runner": {"max_epochs": 6, "max_steps": 60, "save_interval": 10, "keep_checkpoints": 2,
                    "val_check_interval": 1000, "log_interval": 5},
         "actor": {"nproc_per_node": 1}, "eval": {"max_new_tokens": 12}}
# each scenario its own training (a fingerprint of its own): the learning rate
LR = {"kill": "5e-3", "mlflow": "4e-3", "postgres": "7e-3", "load": "8e-3"}


def say(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def api_call(api: str, path: str, body: dict | None = None, method: str | None = None):
    req = urllib.request.Request(f"{api}{path}", method=method or ("POST" if body is not None else "GET"),
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r) if r.status != 204 else None


class Team:
    def __init__(self, root: Path, state: dict):
        self.root, self.state = root, state
        self.api = state["prefect"]["api"]
        self.artifacts = Path(state["artifacts"])
        self.deployment = None
        self.seed = 1234

    def refresh(self) -> None:
        self.state = json.loads((self.root / "team.json").read_text())

    def deploy(self) -> None:
        env = {**os.environ, "PREFECT_API_URL": self.api, "PREFECT_HOME": str(self.root / "deployer")}
        proc = subprocess.run([str(ROOT / ".venv/bin/sftflow"), "deploy", "-c", self.state["config"], "--pool",
                               self.state["pool"], "--name", "faults"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"sftflow deploy failed: {proc.stdout}{proc.stderr}")
        self.deployment = api_call(self.api, "/deployments/name/sft_pipeline/faults")["id"]

    def submit(self, lr: str) -> str:
        return api_call(self.api, f"/deployments/{self.deployment}/create_flow_run",
                        {"parameters": {"overrides": [f"actor.optim.lr={lr}", f"runner.seed={self.seed}"]}})["id"]

    def state_of(self, run: str) -> dict:
        return api_call(self.api, f"/flow_runs/{run}")["state"]

    def wait_final(self, runs: list[str], seconds: float) -> dict[str, dict]:
        deadline = time.time() + seconds
        while True:
            try:
                states = {r: self.state_of(r) for r in runs}
            except OSError:  # the server busy or restarting: ask again
                time.sleep(2)
                continue
            if all(s["type"] in FINAL for s in states.values()) or time.time() > deadline:
                return states
            time.sleep(1)

    def tasks(self, run: str) -> dict[str, str]:
        """{task name: its last state's name} of a flow run (Cached, Completed, Failed...)."""
        deadline = time.time() + 20  # the server records task states from events, a moment later
        while True:
            rows = api_call(self.api, "/task_runs/filter",
                            {"flow_runs": {"id": {"any_": [run]}}, "sort": "EXPECTED_START_TIME_ASC"})
            if time.time() > deadline or all((t["state"] or {}).get("type") in FINAL for t in rows):
                break
            time.sleep(1)
        return {re.sub(r"-\w+$", "", t["name"]): (t["state"] or {}).get("name") for t in rows}

    def worker_of(self, run: str) -> int | None:
        """Which worker (1-based) took `run`: its log names the flow run."""
        for k, w in enumerate(self.state["workers"], 1):
            try:
                if run in Path(w["log"]).read_text(errors="replace"):
                    return k
            except OSError:
                pass
        return None

    def train_folders(self) -> tuple[set[str], set[str]]:
        """(complete train fingerprints, partial ones)."""
        d = self.artifacts / "train"
        if not d.is_dir():
            return set(), set()
        done = {p.name for p in d.iterdir() if (p / "manifest.json").is_file() and not p.name.startswith(".")}
        partial = {m.group(1) for p in d.iterdir() if (m := re.fullmatch(r"\.(\w+)\.partial", p.name))}
        return done, partial

    def registered(self) -> int:
        return len(list((self.artifacts / "register").glob("*/manifest.json")))


def complete_checkpoints(partial: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (partial / "checkpoints").glob("step_*")
                  if (p / "COMPLETE").exists())


def kill_tree(pid: int) -> int:
    """SIGKILL `pid` and every process under it (a machine dying: nothing gets to say goodbye)."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGSTOP)  # freeze first: nothing forks or reacts while the tree dies
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    return len(procs)


def reference_train(workdir: Path, base_cfg: dict, lr: str, seed: int) -> subprocess.Popen:
    """The uninterrupted training of the kill scenario's config, in an artifacts folder of its own."""
    cfg = merge(base_cfg, {"artifacts_dir": str(workdir / "artifacts"), "registry": {"tracking_uri": None}})
    path = workdir / "reference.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = open(workdir / "reference.log", "w")
    return subprocess.Popen(["nice", "-n", "5", str(ROOT / ".venv/bin/sftflow"), "stage", "train", "--with-upstream",
                             "-c", str(path), f"actor.optim.lr={lr}", f"runner.seed={seed}"], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)


def tensors_equal(a: Path, b: Path) -> tuple[bool, int]:
    import torch
    from safetensors.torch import load_file
    x, y = load_file(str(a)), load_file(str(b))
    same = x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    return same, len(x)


def wait_for(what: str, cond, seconds: float, every: float = 0.3):
    deadline = time.time() + seconds
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {seconds:g} s")


# --------------------------------------------------------------------------- the scenarios


def scenario_kill(t: Team, ref: subprocess.Popen, ref_dir: Path) -> dict:
    lr = LR["kill"]
    _, partial0 = t.train_folders()
    run = t.submit(lr)
    say(f"kill: flow run {run} submitted")

    def checkpointed():
        _, partial = t.train_folders()
        for fp in partial - partial0:
            steps = complete_checkpoints(t.artifacts / "train" / f".{fp}.partial")
            if steps:
                return fp, steps
        return None
    fp, steps = wait_for("a complete checkpoint", checkpointed, 900)
    k = t.worker_of(run)
    rows = (t.artifacts / "train" / f".{fp}.partial" / "metrics.jsonl").read_text(errors="replace").splitlines()
    at_step = max([json.loads(r)["step"] for r in rows if r.strip().startswith("{")] or [0])
    killed = kill_tree(int(t.state["workers"][k - 1]["pid"]))
    t_kill = time.time()
    say(f"kill: worker {k} and its {killed - 1} descendants SIGKILLed at step ~{at_step} (checkpoints {steps})")
    states = t.wait_final([run], 600)
    s = states[run]
    crashed_after = time.time() - t_kill
    say(f"kill: flow run {s['type']} after {crashed_after:.0f} s: {s.get('message')}")
    done, partial = t.train_folders()
    not_complete = fp not in done and fp in partial
    ckpts_left = complete_checkpoints(t.artifacts / "train" / f".{fp}.partial")
    # the same config again: the surviving worker takes it (the killed one is started again afterwards)
    t0 = time.time()
    again = t.submit(lr)
    wait_for("the other worker taking the run", lambda: t.worker_of(again), 300, every=1)
    taken_by = t.worker_of(again)
    rec = team.start_worker_again(t.root, k)
    t.refresh()
    say(f"kill: run {again} on worker {taken_by}; worker {k} started again (pid {rec['pid']})")
    s2 = t.wait_final([again], 900)[again]
    rerun_s = time.time() - t0
    log = (t.artifacts / "train" / fp / "train.log").read_text(errors="replace") if fp in t.train_folders()[0] else ""
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    ref.wait(timeout=1200)
    ref_model = ref_dir / "artifacts" / "train" / fp / "model" / "model.safetensors"
    equal, n = (tensors_equal(t.artifacts / "train" / fp / "model" / "model.safetensors", ref_model)
                if ref_model.is_file() and fp in t.train_folders()[0] else (False, 0))
    ok = (s["type"] == "CRASHED" and not_complete and s2["type"] == "COMPLETED" and resumed is not None and equal
          and taken_by != k)
    return {"scenario": "kill", "ok": ok,
            "injected": f"SIGKILL worker {k} + {killed - 1} descendants at step ~{at_step}/60 (checkpoint {steps[-1]})",
            "happened": f"flow run {s['type']} after {crashed_after:.0f} s; train folder complete: {not not_complete}, "
                        f"checkpoints left {ckpts_left}; rerun on worker {taken_by}: {s2['type']}, "
                        f"resumed at step {resumed.group(1) if resumed else None}; weights equal to the "
                        f"uninterrupted run: {equal} ({n} tensors)" + ("" if ref_model.is_file() else
                                                                      f" (no reference: {ref_dir}/reference.log)"),
            "seconds": {"kill_to_crashed": round(crashed_after, 1), "rerun": round(rerun_s, 1)},
            "flow_runs": [run, again], "fingerprint": fp}


def training_started(t: Team, done0: set[str]):
    def cond():
        done, partial = t.train_folders()
        for fp in partial - done0:
            metrics = t.artifacts / "train" / f".{fp}.partial" / "metrics.jsonl"  # a row per step
            if metrics.is_file() and metrics.stat().st_size > 0:
                return fp
        return None
    return cond


def scenario_mlflow(t: Team, down_s: float) -> dict:
    done0, _ = t.train_folders()
    regs0 = t.registered()
    run = t.submit(LR["mlflow"])
    say(f"mlflow: flow run {run} submitted")
    fp = wait_for("training to start", training_started(t, done0), 900)
    unreachable = team.restart_mlflow(t.root, down_s, say=say)
    t.refresh()
    s = t.wait_final([run], 900)[run]
    tasks = t.tasks(run)
    out = {"scenario": "mlflow", "injected": f"MLflow server stopped mid-train, started again on its port after "
                                             f"{unreachable:.0f} s", "flow_runs": [run], "fingerprint": fp}
    if s["type"] == "COMPLETED":
        folder = t.artifacts / "train" / fp  # the last step's row, then the stage done: MLflow's wait between
        waited = (folder / "manifest.json").stat().st_mtime - (folder / "metrics.jsonl").stat().st_mtime
        out.update(ok=t.registered() == regs0 + 1, happened=f"flow run COMPLETED ({tasks}); registered: "
                                                           f"{t.registered() - regs0} new version",
                   seconds={"down": round(unreachable, 1), "train_end_to_stage_done": round(waited, 1)})
        return out
    msg = (s.get("message") or "").splitlines()
    say(f"mlflow: {s['type']}: {msg}")
    t0 = time.time()
    again = t.submit(LR["mlflow"])
    s2 = t.wait_final([again], 900)[again]
    tasks2 = t.tasks(again)
    out.update(ok=s2["type"] == "COMPLETED" and tasks2.get("train") == "Cached" and t.registered() == regs0 + 1,
               happened=f"flow run {s['type']} ({tasks}; {msg[:1]}); re-run {s2['type']} ({tasks2}), registered: "
                        f"{t.registered() - regs0}",
               seconds={"down": round(unreachable, 1), "rerun": round(time.time() - t0, 1)}, flow_runs=[run, again])
    return out


def scenario_postgres(t: Team) -> dict:
    done0, _ = t.train_folders()
    regs0 = t.registered()
    run = t.submit(LR["postgres"])
    say(f"postgres: flow run {run} submitted")
    fp = wait_for("the train folder to complete", lambda: next(iter(t.train_folders()[0] - done0), None), 900, 0.2)
    restart = team.restart_postgres(t.root)
    t.refresh()
    say(f"postgres: restarted in {restart:.1f} s right after train {fp} completed")
    s = t.wait_final([run], 900)[run]
    tasks = t.tasks(run)
    alive = team.status(t.root)["alive"]
    return {"scenario": "postgres", "ok": s["type"] == "COMPLETED" and t.registered() == regs0 + 1,
            "injected": "pg_ctl restart -m fast right after train completed",
            "happened": f"flow run {s['type']} ({tasks}; {(s.get('message') or '').splitlines()[:1]}); registered: "
                        f"{t.registered() - regs0}; processes alive {alive}",
            "seconds": {"restart": round(restart, 1)}, "flow_runs": [run], "fingerprint": fp}


def scenario_load(t: Team, n: int) -> dict:
    lr = LR["load"]
    warm = t.submit(lr)
    s = t.wait_final([warm], 1200)[warm]
    if s["type"] != "COMPLETED":
        return {"scenario": "load", "ok": False, "injected": "the config's first run", "happened": f"{s['type']}: "
                f"{s.get('message')}", "seconds": {}}
    t0 = time.time()
    lone = t.submit(lr)
    s = t.wait_final([lone], 600)[lone]
    lone_s = time.time() - t0
    lone_tasks = t.tasks(lone)
    say(f"load: a lone cached run {s['type']} in {lone_s:.1f} s ({lone_tasks})")
    t0 = time.time()
    runs = [t.submit(lr) for _ in range(n)]
    states = t.wait_final(runs, 300 + 120 * n)
    total = time.time() - t0
    kinds = {}
    for st in states.values():
        kinds[st["type"]] = kinds.get(st["type"], 0) + 1
    by_worker = {}
    for r in runs:
        k = t.worker_of(r)
        by_worker[k] = by_worker.get(k, 0) + 1
    cached = sum(all(v == "Cached" for v in t.tasks(r).values()) for r in runs[:3])
    from datetime import datetime

    def secs(a: str, b: str) -> float:
        return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()
    infos = [api_call(t.api, f"/flow_runs/{r}") for r in runs + [lone]]
    # in its process: the flow's own run (state Running to final); the rest of a run's turn is the worker's
    # poll, the process start (imports) and its exit
    running = [secs(i["start_time"], i["end_time"]) for i in infos if i.get("start_time") and i.get("end_time")]
    return {"scenario": "load", "ok": kinds == {"COMPLETED": n},
            "injected": f"{n} runs of one cached config queued at once, 2 workers",
            "happened": f"{kinds}; per worker {by_worker}; every stage Cached in {cached}/3 checked",
            "seconds": {"lone_run": round(lone_s, 1), "all": round(total, 1), "per_run": round(total / n, 1),
                        "per_run_per_worker": round(total / n * 2, 1),
                        "flow_running_mean": round(sum(running[:-1]) / max(1, len(running) - 1), 1),
                        "flow_running_lone": round(running[-1], 1) if running else None}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--runs", type=int, default=20, help="load: queued runs")
    ap.add_argument("--mlflow-down", type=float, default=30.0, help="mlflow: seconds the server is down")
    ap.add_argument("--root", type=Path, help="the setup's root (default: a new temporary folder); reused if up")
    ap.add_argument("--keep", action="store_true", help="leave the setup up (default: `down`, the folder removed)")
    ap.add_argument("--seed", type=int, default=1234, help="runner.seed of every run (another: nothing cached)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if unknown := set(chosen) - set(SCENARIOS):
        ap.error(f"unknown scenarios {sorted(unknown)}")
    if lacking := team.missing():
        print("this machine lacks: " + "; ".join(lacking), file=sys.stderr)
        return 2
    root = (args.root or Path(tempfile.mkdtemp(prefix="sftflow-faults-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # PostgreSQL's user (as root) must enter it
    base = merge(yaml.safe_load((ROOT / "configs" / "default.yaml").read_text()), SHORT)
    base["data"]["train_data_paths"] = [str(ROOT / p) for p in base["data"]["train_data_paths"]]
    base["data"]["val_data_paths"] = [str(ROOT / p) for p in base["data"]["val_data_paths"]]
    (root / "base.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    ref = None
    ref_dir = root / "reference"
    if "kill" in chosen:  # the uninterrupted run, while the setup comes up
        shutil.rmtree(ref_dir, ignore_errors=True)
        ref_dir.mkdir()
        ref = reference_train(ref_dir, base, LR["kill"], args.seed)
    results = []
    t_up = time.time()
    try:
        state = team.up(root, workers=2, pool="faults", config=root / "base.yaml", say=say)
        up_s = time.time() - t_up
        t = Team(root, state)
        t.seed = args.seed
        t.deploy()
        for name in chosen:
            say(f"--- {name}")
            t0 = time.time()
            try:
                r = (scenario_kill(t, ref, ref_dir) if name == "kill" else
                     scenario_mlflow(t, args.mlflow_down) if name == "mlflow" else
                     scenario_postgres(t) if name == "postgres" else scenario_load(t, args.runs))
            except Exception as e:  # noqa: BLE001 - one scenario's failure is a row of the table
                r = {"scenario": name, "ok": False, "injected": "", "happened": f"{type(e).__name__}: {e}",
                     "seconds": {}}
            r["wall_s"] = round(time.time() - t0, 1)
            say(json.dumps(r))
            results.append(r)
    finally:
        if ref is not None and ref.poll() is None:
            ref.kill()
        if not args.keep:
            team.down(root, say=say)
            shutil.rmtree(root, ignore_errors=True)
    out = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "up_s": round(up_s, 1), "root": str(root),
           "results": results}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{'scenario':9} {'ok':5} {'injected':60} happened / seconds")
        for r in results:
            print(f"{r['scenario']:9} {str(r['ok']):5} {r['injected'][:60]:60} {r['happened']} {r['seconds']}")
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
