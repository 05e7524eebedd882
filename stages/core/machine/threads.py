"""How a waiting OpenMP thread behaves, in every process sftflow starts.

libgomp's default lets a thread that has run out of work spin about 300,000 times before it
sleeps. On an idle machine that costs nothing; on one another job shares, the spinning threads take
the cores that job's threads need, and each waits on the other: generating with SmolLM2 on 2 cores
beside one competing torch job took 3.7x its idle time with the default, 2.0x with 1,000 spins and
1.7x with no spinning (`OMP_WAIT_POLICY=PASSIVE`), which costs ~6% on an idle machine where 1,000
spins cost nothing measurable (bench/shared_machine.py; docs/benchmarks.md "A shared machine").
OpenMP reads this when torch loads, so it is set before that, with the rest of a process's defaults
(core/machine/process_env.py): at the CLI's entry, at a flow run's start, and in every torchrun worker's
environment (launch/launcher.py). A user's own `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` wins."""

from __future__ import annotations

from typing import MutableMapping

__fingerprint__ = False  # how threads wait never changes a result

SPIN_COUNT = "1000"


def wait_policy(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return env
