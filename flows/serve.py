"""Retraining you can leave running: serve `sft_pipeline` as a Prefect deployment started by a cron
or interval schedule and/or by new-data events (flows/events.py), optionally starting a local
Prefect server (home under artifacts/) first.

Every scheduled run is the ordinary flow: with unchanged data every stage is a cache hit
and no model version is added; new or edited data changes the fingerprints, trains, and
registers a new version, which becomes `champion` only if it is better (`if_better`).
"""

from __future__ import annotations

import os
from pathlib import Path


def serve(config_path: str, overrides: list[str], name: str, cron: str | None, interval: float | None,
          allow_overrides: list[str] | None = None, on_data: str | None = None, within_s: float = 60) -> None:
    """Blocks, running the deployment's scheduled (and UI-triggered) runs one at a time. Runs started
    through the Prefect API use this config and can't override `SERVE_PROTECTED` keys beyond
    `allow_overrides`: the variables that say so live in this process, out of the API's reach.
    `on_data` (a registered model's name): runs start on its `sftflow.data.arrived` events too
    (flows/events.py), one per `within_s` seconds at most."""
    from stages.core.config import SERVE_PROTECTED

    from flows.sft import PROTECTED_ENV, SERVED_CONFIG_ENV, sft_pipeline
    os.environ[SERVED_CONFIG_ENV] = str(Path(config_path).resolve())
    os.environ[PROTECTED_ENV] = ",".join(k for k in SERVE_PROTECTED if k not in (allow_overrides or []))
    from flows.events import arrival_trigger
    triggers = [arrival_trigger(on_data, within_s)] if on_data else None
    try:
        sft_pipeline.serve(
            name=name, cron=cron, interval=interval, limit=1, paused=False, triggers=triggers,
            parameters={"config_path": str(Path(config_path).resolve()), "overrides": overrides},
            description="sftflow: prepare -> train -> evaluate -> register; cached stages are skipped",
        )
    finally:
        _pause(f"{sft_pipeline.name}/{name}")


def _pause(deployment: str) -> None:
    """Nothing serves the deployment once `serve` stops: pause it, so the UI says so (the server only
    marks it not ready a minute after its last poll) and its schedule queues no runs that nobody runs.
    The next `serve` resumes it."""
    from prefect.client.orchestration import get_client
    try:
        with get_client(sync_client=True) as client:
            client.pause_deployment(client.read_deployment_by_name(deployment).id)
        print(f"paused deployment '{deployment}' (nothing serves it now)", flush=True)
    except Exception as e:  # noqa: BLE001 - the server may be gone too
        print(f"could not pause deployment '{deployment}': {e}", flush=True)
