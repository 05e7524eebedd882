"""`sftflow deploy`: `sft_pipeline` as a deployment of a Prefect work pool, so that any
`prefect worker start --pool NAME` on a machine with the project installed (and the artifacts
storage mounted at the same path) runs it.

The deployment's code is this project folder (`from_source`: workers load `flows/sft.py` from it);
its parameters are the config's absolute path, the overrides and the folder relative paths were
written against (`workdir`). The served-deployment protections (`SFTFLOW_SERVED_CONFIG`,
`SFTFLOW_PROTECTED_KEYS`) travel as job variables: they hold against parameters sent through the
API, but whoever may also override a run's job variables can lift them.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/sft.py:sft_pipeline"


def ensure_work_pool(name: str) -> bool:
    """Creates a `process` work pool called `name` unless one exists; True when it was created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            return True


def deploy(config_path: str, overrides: list[str], name: str, pool: str, cron: str | None = None,
           interval: float | None = None, allow_overrides: list[str] | None = None,
           on_data: str | None = None, within_s: float = 60) -> str:
    """Deploys the flow to `pool` (created as a `process` pool if missing); returns `<flow>/<name>`.
    `on_data`: a model name whose arrivals (`sftflow notify`, flows/events.py) also start a run, as
    `serve --on-data` does for a served deployment."""
    from flows.events import arrival_trigger
    from prefect import flow as load_flow

    from stages.core.config import SERVE_PROTECTED

    from flows.sft import PROTECTED_ENV, SERVED_CONFIG_ENV
    config = str(Path(config_path).resolve())
    protected = ",".join(k for k in SERVE_PROTECTED if k not in (allow_overrides or []))
    remote = load_flow.from_source(source=str(ROOT), entrypoint=ENTRYPOINT)
    remote.deploy(
        name=name, work_pool_name=pool, build=False, push=False, cron=cron, interval=interval,
        parameters={"config_path": config, "overrides": overrides, "workdir": os.getcwd()},
        job_variables={"env": {SERVED_CONFIG_ENV: config, PROTECTED_ENV: protected}},
        description="sftflow: prepare -> train -> evaluate -> register; cached stages are skipped",
        triggers=[arrival_trigger(on_data, within_s)] if on_data else None, print_next_steps=False)
    return f"{remote.name}/{name}"
