"""A team's setup, for real: `python -m flows.team up` (PostgreSQL holding Prefect's and MLflow's stores,
`prefect server start`, `mlflow server`, a work pool, two `prefect worker start --limit 1` in working
folders of their own, one shared artifacts folder), the demo config deployed with `sftflow deploy --pool`,
three runs with different learning rates started at once, and what they leave: every flow run Completed,
one prepare folder, three MLflow runs and versions 1-3, and the champion alias where the promotion rules
put it. Skips, saying why, where PostgreSQL's binaries, its drivers or the `postgres` user are missing."""

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, sftflow

from flows.team import ZOMBIE_AUTOMATION, missing

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
    up = subprocess.run([sys.executable, "-m", "flows.team", "up", "--root", str(root), "--workers", "2",
                         "--pool", "team-test"], cwd=ROOT, capture_output=True, text=True, timeout=400)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield json.loads((root / "team.json").read_text())
    finally:
        down = subprocess.run([sys.executable, "-m", "flows.team", "down", "--root", str(root)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        again = subprocess.run([sys.executable, "-m", "flows.team", "down", "--root", str(root)], cwd=ROOT,
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


def test_three_runs_at_once_on_two_workers(team):
    root, api, mlflow_url = Path(team["root"]), team["prefect"]["api"], team["mlflow"]["url"]
    t0 = time.time()
    deployed = sftflow("deploy", "-c", team["config"], "--pool", team["pool"], "--name", "team", cwd=ROOT,
                       env={"PREFECT_API_URL": api, "PREFECT_HOME": str(root / "deployer")}, fresh=True)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    deployment = api_call(api, "/deployments/name/sft_pipeline/team")["id"]
    # a flow run whose worker dies is set Crashed by this automation (bench/team_faults.py, scenario kill)
    assert [a["name"] for a in api_call(api, "/automations/filter", {})] == [ZOMBIE_AUTOMATION]
    ids = [api_call(api, f"/deployments/{deployment}/create_flow_run",
                    {"parameters": {"overrides": [f"actor.optim.lr={lr}", *SHORT]}})["id"] for lr in LRS]
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

    artifacts = root / "artifacts"
    prepared = [d for d in (artifacts / "prepare").iterdir() if (d / "manifest.json").is_file()]
    assert len(prepared) == 1, prepared  # three runs, one data preparation
    assert len([d for d in (artifacts / "train").iterdir() if (d / "manifest.json").is_file()]) == 3

    from mlflow.tracking import MlflowClient
    client = MlflowClient(mlflow_url)
    versions = client.search_model_versions("name='tiny-chat-sft'")
    assert sorted(int(v.version) for v in versions) == [1, 2, 3]  # no gap, no duplicate
    lrs = {client.get_run(v.run_id).data.params["actor.optim.lr"] for v in versions}
    assert len({v.run_id for v in versions}) == 3 and {float(x) for x in lrs} == {float(x) for x in LRS}, lrs

    # The champion where the rules put it: registers promote one at a time, so the versions that took the alias
    # form a chain: the first found no champion, each later one was compared with the one before it; the
    # alias is on the chain's last; every other version was held back as challenger.
    decisions = {}
    for manifest in (artifacts / "register").glob("*/manifest.json"):
        m = json.loads(manifest.read_text())["metrics"]
        compared = {c["version"] for c in (m.get("vs_champion") or {}).values()}
        decisions[str(m["version"])] = (m["alias_decision"], m["alias_reason"], compared)
    assert sorted(decisions) == ["1", "2", "3"], decisions
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
    assert not client.search_registered_models("name LIKE '%promotion-lock%'")  # every lock released
    print(f"3 runs on 2 workers: {elapsed:.0f} s after deploy; champion chain {chain}; {decisions}")
