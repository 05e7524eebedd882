"""Scheduled retraining: serve `sft_pipeline` as a Prefect deployment with a cron or interval
schedule, optionally starting a local Prefect server (home under artifacts/) first.

Every scheduled run is the ordinary flow: with unchanged data every stage is a cache hit
and no model version is added; new or edited data changes the fingerprints, trains, and
registers a new version, which becomes `champion` only if it is better (`if_better`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def local_server(host: str, port: int, home: Path, log_path: Path, timeout: float = 180) -> Iterator[str]:
    """`prefect server start` on host:port for the duration of the block; yields the API URL."""
    api = f"http://{host}:{port}/api"
    if _healthy(api):  # already running (e.g. a second `make serve`): share it
        yield api
        return
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    prefect = Path(sys.executable).with_name("prefect")
    with open(log_path, "a") as log:
        proc = subprocess.Popen([str(prefect), "server", "start", "--host", host, "--port", str(port)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + timeout
        while not _healthy(api):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"prefect server did not start; see {log_path}")
            time.sleep(0.5)
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def serve(config_path: str, overrides: list[str], name: str, cron: str | None, interval: float | None) -> None:
    """Blocks, running the deployment's scheduled (and UI-triggered) runs one at a time."""
    from flows.sft import sft_pipeline
    sft_pipeline.serve(
        name=name, cron=cron, interval=interval, limit=1,
        parameters={"config_path": str(Path(config_path).resolve()), "overrides": overrides},
        description="sftflow: prepare -> train -> evaluate -> register; cached stages are skipped",
    )
