"""A team's setup, for real: `python -m flows.servers.team up` (PostgreSQL holding Prefect's and MLflow's stores,
`prefect server start`, `mlflow server`, a work pool, two `prefect worker start --limit 1` in working
folders of their own, one shared artifacts folder), the demo config deployed with `sftflow deploy --pool
--on-data`, two deployment runs, a run `sftflow notify` starts and a sweep on this machine, all at once,
and what they leave: every flow run Completed, each stage computed once, versions without gaps or
duplicates, and the champion alias where the promotion rules put it. Skips, saying why, where
PostgreSQL's binaries, its drivers or the `postgres` user are missing."""

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, sftflow

from flows.servers.team import ZOMBIE_AUTOMATION, missing

pytestmark = pytest.mark.slow
LRS = ("3e-3", "6e-3", "1e-2")
# the demo config, shortened: 24 steps in one process, short replies (what is shared and what is not
# does not depend on how long each trains)
SHORT = ["runner.max_steps=24", "actor.nproc_per_node=1", "eval.max_new_tokens=12"]


def api_call(api: str, path: str, body: dict | None = None):
    req = urllib.request.Request(f"{api}{path}", method="POST" if body is not None else "GET",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def team():
    lacking = missing()
    if lacking:
        pytest.skip("a team's setup needs " + "; ".join(lacking))
    # Not pytest's tmp_path: its folders are 0700, which the `postgres` user (PostgreSQL's, as root) can't enter
    root = Path(tempfile.mkdtemp(prefix="sftflow-team-"))
    root.chmod(0o755)
    up = subprocess.run([sys.executable, "-m", "flows.servers.team", "up", "--root", str(root), "--workers", "2",
                         "--pool", "team-test"], cwd=ROOT, capture_output=True, text=True, timeout=400)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield json.loads((root / "team.json").read_text())
    finally:
        down = subprocess.run([sys.executable, "-m", "flows.servers.team", "down", "--root", str(root)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        again = subprocess.run([sys.executable, "-m", "flows.servers.team", "down", "--root", str(root)], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)
    assert down.returncode == 0 and "PostgreSQL" in down.stdout, down.stdout + down.stderr
    assert again.returncode == 0 and "nothing was running" in again.stdout, again.stdout  # idempotent


def wait_final(api: str, ids: list[str], seconds: float) -> dict[str, str]:
    deadline = time.time() + seconds
    while True:
        states = {i: api_call(api, f"/flow_runs/{i}")["state"]["type"] for i in ids}
        if all(s in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for s in states.values()):
            return states
        if time.time() > deadline:
            raise AssertionError(f"flow runs not final after {seconds:g} s: {states}")
        time.sleep(2)


def champion_chain(artifacts: Path, client, versions: list) -> tuple[list[str], dict]:
    """The versions that took the alias, in order, checked: registers promote one at a time, so they form
    a chain (the first found no champion, each later one was compared with the one before it), the alias
    is on its last, and every other version was held back as challenger."""
    decisions = {}
    for manifest in (artifacts / "register").glob("*/manifest.json"):
        m = json.loads(manifest.read_text())["metrics"]
        compared = {c["version"] for c in (m.get("vs_champion") or {}).values()}
        decisions[str(m["version"])] = (m["alias_decision"], m["alias_reason"], compared)
    assert sorted(decisions) == sorted(v.version for v in versions), decisions
    took = {v for v, d in decisions.items() if d[0] == "champion"}
    first = [v for v in took if decisions[v][1] == "no champion yet"]
    assert len(first) == 1, decisions
    chain = first
    while nxt := [v for v in took if decisions[v][2] == {chain[-1]}]:
        assert len(nxt) == 1, decisions
        chain.append(nxt[0])
    assert set(chain) == took, decisions
    assert all(d[0] == "challenger" for v, d in decisions.items() if v not in took), decisions
    aliases = client.get_registered_model("tiny-chat-sft").aliases
    assert aliases["champion"] == chain[-1], (aliases, decisions)
    return chain, decisions


def test_deployment_runs_a_notify_and_a_sweep_at_once_on_two_workers(team):
    """Two deployment runs (lr 3e-3, 1e-2), a run the arrival event of `sftflow notify` starts (the config's
    lr, 6e-3) on the two workers, and on this machine, at the same time, a sweep of lr 3e-3 and 6e-3 two at
    a time: trainings the others already do are waited for and reused, never computed twice."""
    root, api, mlflow_url = Path(team["root"]), team["prefect"]["api"], team["mlflow"]["url"]
    env = {"PREFECT_API_URL": api, "PREFECT_HOME": str(root / "deployer")}
    t0 = time.time()
    deployed = sftflow("deploy", "-c", team["config"], *SHORT, "--pool", team["pool"], "--name", "team",
                       "--on-data", cwd=ROOT, env=env, fresh=True)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    deployment = api_call(api, "/deployments/name/sft_pipeline/team")["id"]
    # a flow run whose worker dies is set Crashed by the first (bench/team_faults.py, scenario kill); the
    # second is the deployment's --on-data trigger
    assert sorted(a["name"] for a in api_call(api, "/automations/filter", {})) == \
        sorted([ZOMBIE_AUTOMATION, "new data for tiny-chat-sft"])
    ids = [api_call(api, f"/deployments/{deployment}/create_flow_run",
                    {"parameters": {"overrides": [f"actor.optim.lr={lr}", *SHORT]}})["id"] for lr in ("3e-3", "1e-2")]
    told = sftflow("notify", "-c", team["config"], cwd=ROOT, env=env)
    assert told.returncode == 0, told.stdout + told.stderr
    sweep = sftflow("sweep", "-c", team["config"], "actor.optim.lr=3e-3,6e-3", *SHORT, "--max-parallel", "2",
                    cwd=ROOT, env={**env, "PREFECT_HOME": str(root / "sweeper")}, timeout=900)
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    deadline = time.time() + 120
    while len(runs := api_call(api, "/flow_runs/filter",
                               {"deployments": {"id": {"any_": [deployment]}}})) < 3 and time.time() < deadline:
        time.sleep(2)
    started = [r for r in runs if r["id"] not in ids]
    assert len(started) == 1, [(r["name"], r["parameters"]) for r in runs]  # the event's run, one
    assert started[0]["parameters"]["overrides"] == SHORT  # the deployment's own parameters
    ids.append(started[0]["id"])
    states = wait_final(api, ids, 600)
    elapsed = time.time() - t0
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((root / "logs").glob("worker-*.log")))
    assert set(states.values()) == {"COMPLETED"}, (states, logs)
    # both workers took runs (each one at a time: --limit 1). Both may try to claim the same run; the one
    # that loses logs "Aborted submission of flow run '<id>'" (Prefect's workers/base.py), which is not a take
    took_runs = []
    for log in sorted((root / "logs").glob("worker-*.log")):
        text = log.read_text()
        took_runs.append({i for i in ids if i in text and f"Aborted submission of flow run '{i}'" not in text})
    assert len(took_runs) == 2 and all(took_runs) and set().union(*took_runs) == set(ids), took_runs

    # every stage computed once: one data preparation, one baseline, one training per learning rate (five
    # runs asked for four trainings of two learning rates and one each of the third), nothing half-built
    artifacts = root / "artifacts"
    for stage, n in (("prepare", 1), ("baseline", 1), ("train", 3)):
        done = [d for d in (artifacts / stage).iterdir() if (d / "manifest.json").is_file()]
        assert len(done) == n, (stage, done)
        assert not list((artifacts / stage).glob(".*.partial")), stage
    for folder in (artifacts / "train").glob("[!.]*"):
        log = (folder / "train.log").read_text()
        assert log.count("resumed from") == 0 and len(re.findall(r"training \d+ steps", log)) <= 1, folder

    from mlflow.tracking import MlflowClient
    client = MlflowClient(mlflow_url)
    versions = client.search_model_versions("name='tiny-chat-sft'")
    numbers = sorted(int(v.version) for v in versions)
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 3, numbers  # no gap, no duplicate
    lrs = [float(client.get_run(v.run_id).data.params["actor.optim.lr"]) for v in versions]
    assert len({v.run_id for v in versions}) == len(versions) and set(lrs) == {3e-3, 1e-2, 6e-3}, lrs
    chain, decisions = champion_chain(artifacts, client, versions)
    assert not client.search_registered_models("name LIKE '%promotion-lock%'")  # every lock released
    print(f"2 deployment runs + 1 notify run on 2 workers and a 2-trial sweep here: {elapsed:.0f} s after deploy; "
          f"versions {numbers}; champion chain {chain}; {decisions}")
