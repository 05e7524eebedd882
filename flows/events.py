"""Retraining on arrival: the Prefect event that says new data arrived, and the deployment trigger
that turns it into a flow run (`sftflow notify`, `sftflow serve --on-data`).

The event is `sftflow.data.arrived` on the resource `sftflow.data.<registry.model_name>` (one stream
of arrivals per registered model); its related resources and payload name the files. Whoever writes
a drop calls `sftflow notify` once the files are in place (or emits the same event with Prefect's
own `emit_event`, or a webhook). The trigger is reactive with threshold 1 over `within` seconds: the
first event of a burst starts a run, the rest of that window's events start nothing (Prefect's
buckets), and the served runner runs one flow at a time, so an event after the window while a run is
going queues one run that plans after it, sees every file, and trains only if something changed.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

DATA_ARRIVED = "sftflow.data.arrived"


def resource_id(model_name: str) -> str:
    return f"sftflow.data.{model_name}"


def arrival_trigger(model_name: str, within_s: float):
    """The deployment trigger of `sftflow serve --on-data`."""
    from prefect.events import DeploymentEventTrigger
    return DeploymentEventTrigger(
        name=f"new data for {model_name}", expect={DATA_ARRIVED},
        match={"prefect.resource.id": resource_id(model_name)}, threshold=1, within=timedelta(seconds=within_s))


def arrival_event(model_name: str, files: list[Path], config: Path):
    from prefect.events import Event
    return Event(event=DATA_ARRIVED,
                 resource={"prefect.resource.id": resource_id(model_name), "prefect.resource.name": model_name},
                 related=[{"prefect.resource.id": f"sftflow.file.{f}", "prefect.resource.role": "data-file",
                           "prefect.resource.name": f.name} for f in files],
                 payload={"files": [str(f) for f in files], "config": str(config)})


def emit_arrival(model_name: str, files: list[Path], config: Path) -> str:
    """Sends the event to the Prefect API (PREFECT_API_URL) and waits until it is sent; its id."""
    from prefect.events.clients import get_events_client
    event = arrival_event(model_name, files, config)

    async def send() -> None:
        async with get_events_client(reconnection_attempts=2) as client:
            await client.emit(event)
    asyncio.run(send())
    return str(event.id)
