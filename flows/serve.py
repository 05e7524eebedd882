"""Scheduled retraining: serve `sft_pipeline` as a Prefect deployment with a cron or interval
schedule, optionally starting a local Prefect server (home under artifacts/) first.

Every scheduled run is the ordinary flow: with unchanged data every stage is a cache hit
and no model version is added; new or edited data changes the fingerprints, trains, and
registers a new version, which becomes `champion` only if it is better (`if_better`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class ServerDidNotStart(RuntimeError):
    """`prefect server start` exited or never answered its health check; its log says why."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Set by the CLI around its temporary Prefect server: it has no UI and is gone after the run, so
# links to its pages would be dead.
TEMPORARY_SERVER_ENV = "SFTFLOW_TEMPORARY_PREFECT"
RUNNING_SERVER = "server.json"  # in the Prefect home: the long-lived server `serve --start-server` runs


def running_server(home: Path) -> str | None:
    """The API URL of a long-lived local server on this Prefect home (same database), if it answers:
    CLI runs use it instead of starting a temporary server, and their runs stay visible in its UI."""
    try:
        found = json.loads((home / RUNNING_SERVER).read_text())
        api, pid = found["api"], int(found["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # a marker left by a killed serve: its server died with it, and the port may serve another home now
    return api if _alive(pid) and _healthy(api) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def local_server(host: str, port: int, home: Path, log_path: Path, timeout: float = 180,
                 ui: bool = True, shared: bool = False, meanwhile: Callable[[], object] | None = None) -> Iterator[str]:
    """`prefect server start` on host:port for the duration of the block; yields the API URL.
    `meanwhile` runs while a server it starts comes up (the caller's own imports take seconds too).

    The server runs in a session of its own, so a Ctrl-C to the terminal's process group reaches
    the CLI (which then stops cleanly, reporting to this server) and not the server; and it asks
    for a parent-death signal (`stages.runtime.orphan_guard`), so a SIGKILLed CLI leaves no server
    behind. Servers sharing one Prefect home start one at a time: the first one migrates the
    database, and two migrations at once fail."""
    api = f"http://{host}:{port}/api"
    if _healthy(api):  # already running (e.g. a second `make serve`): share it
        yield api
        return
    home.mkdir(parents=True, exist_ok=True)
    # the UI calls the API it was served with, not 4200 (its default): on another port it would
    # show "can't connect", or another server's runs
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "true" if ui else "false", "PREFECT_UI_API_URL": api,
           "PREFECT_SERVER_API_HOST": host, "PREFECT_SERVER_API_PORT": str(port)}
    env.pop("PREFECT_API_URL", None)
    prefect = Path(sys.executable).with_name("prefect")
    cmd = [sys.executable, "-m", "stages.runtime.orphan_guard", str(prefect), "server", "start",
           "--host", host, "--port", str(port)]
    with FileLock(str(home / "server-start.lock")):
        with open(log_path, "a") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=str(Path(__file__).resolve().parents[1]))
        try:
            if meanwhile is not None:
                meanwhile()
            deadline = time.time() + timeout
            while not _healthy(api):
                if proc.poll() is not None or time.time() > deadline:
                    raise ServerDidNotStart(f"prefect server did not start; see {log_path}")
                time.sleep(0.3)
        except BaseException:
            _stop(proc)
            raise
    marker = home / RUNNING_SERVER
    if shared:  # announced for other CLI calls on this home; a temporary server dies with its CLI
        marker.write_text(json.dumps({"api": api, "pid": proc.pid}))
    try:
        yield api
    finally:
        if shared:
            marker.unlink(missing_ok=True)
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def temporary_server(home: Path, meanwhile: Callable[[], object] | None = None) -> Iterator[str]:
    """A Prefect server for one CLI call when no PREFECT_API_URL is set (what Prefect's own
    temporary server does, but surviving a Ctrl-C to the terminal and dying with the CLI)."""
    with local_server("127.0.0.1", free_port(), home, home / "temporary-server.log", ui=False,
                      meanwhile=meanwhile) as api:
        try:
            yield api
        finally:
            _drain_prefect_clients()


def _drain_prefect_clients(timeout: float = 15) -> None:
    """Send the logs and events Prefect still queues while their server is up: after it stops, the
    client would retry them for minutes before the process could exit."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    for service in (APILogWorker, EventsWorker):
        try:
            service.drain_all(timeout=timeout)
        except Exception:  # noqa: BLE001 - best effort: the run's outcome is already decided
            pass


def serve(config_path: str, overrides: list[str], name: str, cron: str | None, interval: float | None,
          allow_overrides: list[str] | None = None) -> None:
    """Blocks, running the deployment's scheduled (and UI-triggered) runs one at a time. Runs started
    through the Prefect API use this config and can't override `SERVE_PROTECTED` keys beyond
    `allow_overrides`: the variables that say so live in this process, out of the API's reach."""
    from stages.core.config import SERVE_PROTECTED

    from flows.sft import PROTECTED_ENV, SERVED_CONFIG_ENV, sft_pipeline
    os.environ[SERVED_CONFIG_ENV] = str(Path(config_path).resolve())
    os.environ[PROTECTED_ENV] = ",".join(k for k in SERVE_PROTECTED if k not in (allow_overrides or []))
    try:
        sft_pipeline.serve(
            name=name, cron=cron, interval=interval, limit=1, paused=False,
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
