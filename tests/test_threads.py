"""Every process sftflow starts waits for OpenMP work the way stages/core/threads.py says (1,000
spins, then sleep), unless the user set a policy: the CLI's and the flow's own process (set at
`import flows`, before torch loads) and each torchrun worker (its environment)."""

import os
import subprocess
import sys

from conftest import ROOT
from stages.core.threads import SPIN_COUNT
from stages.runtime.launcher import worker_env

PROBE = "import flows.cli, os, torch; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


def _probe(**extra) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_WAIT", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, **extra}, cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return out.split()


def test_the_cli_process_spins_briefly_unless_the_user_chose():
    assert _probe() == [SPIN_COUNT, "None"]
    assert _probe(OMP_WAIT_POLICY="PASSIVE") == ["None", "PASSIVE"]
    assert _probe(GOMP_SPINCOUNT="5") == ["5", "None"]


def test_torchrun_workers_get_the_same_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert worker_env(2)["GOMP_SPINCOUNT"] == SPIN_COUNT
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    env = worker_env(2)
    assert "GOMP_SPINCOUNT" not in env and env["OMP_WAIT_POLICY"] == "ACTIVE"
