"""The Prefect API a CLI call runs its flow on: `prefect_api(home)`, a context manager that yields
its URL. PREFECT_API_URL, when set, is used as it is; otherwise, in order of preference:

  * a server already running on the same Prefect home: `serve --start-server` (`make serve`),
    or one kept from an earlier call;
  * a kept server: started in the background for this call and for the calls that follow it,
    stopping by itself after `SFTFLOW_KEEP_SERVER` seconds (default 600) in which no CLI call
    used it. Starting a server is most of a cached run's wall time (~4 s of ~8 s), so the
    second and later calls of a session of work skip it;
  * with `SFTFLOW_KEEP_SERVER=0`: a temporary server that lives exactly as long as the call.

A kept server is told apart from a user's by its marker (`server.json` in the Prefect home,
`"kind": "kept"`). Every CLI call holds a shared lock on `server.lease` while it runs; the
keeper (`python -m flows.servers.prefect_server keep`, the server's parent) stops the server once it
has been able to take that lock exclusively for the idle time, after removing the marker, so a
call that comes after finds no marker and starts a server of its own. The keeper also stops
when the Prefect home is deleted, and its server dies with it (parent-death signal).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager, nullcontext
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Iterator

import psutil
from filelock import FileLock

from flows.servers import prefect_database

KEEP_ENV = "SFTFLOW_KEEP_SERVER"
DEFAULT_KEEP_S = 600.0
# Set by the CLI around a server that has no UI (a temporary one): links to its pages would be dead.
TEMPORARY_SERVER_ENV = "SFTFLOW_TEMPORARY_PREFECT"
RUNNING_SERVER = "server.json"  # in the Prefect home: a long-lived server (`serve --start-server`, kept)
LEASE = "server.lease"          # in the Prefect home: shared-locked by every CLI call while it runs
KEPT_LOG = "kept-server.log"


class ServerDidNotStart(RuntimeError):
    """`prefect server start` exited or never answered its health check; its log says why."""


class KeepSettingError(ValueError):
    """`SFTFLOW_KEEP_SERVER` is not a number of seconds."""


def healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a server that must be told its port before it starts (the kept one: its
    UI is given its API URL at start). Another process may take it before the server binds it, so
    prefer `--port 0` and `listening_port` wherever the URL can be learnt after the start."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def listening_port(pid: int, host: str = "127.0.0.1") -> int | None:
    """The TCP port that process `pid` (or a process it started) listens on at `host`; None while
    none does. For a server started with `--port 0`: the kernel picks the port as the server binds
    it, so nothing can take it in between, as it can a number picked beforehand (`free_port`)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.ip == host:
                    return conn.laddr.port
        except psutil.Error:  # it ended meanwhile
            continue
    return None


def _alive(pid: int) -> bool:
    """Running (a zombie is not: a keeper this process started stays one until it is waited for)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _marker(home: Path) -> dict | None:
    try:
        found = json.loads((home / RUNNING_SERVER).read_text())
        return found if isinstance(found, dict) and {"api", "pid"} <= found.keys() else None
    except (OSError, ValueError):
        return None


def running_server(home: Path) -> dict | None:
    """The marker of a long-lived local server on this Prefect home (same database) that answers:
    CLI runs use it (`["api"]`) instead of starting one, and their runs stay visible in its UI (both
    `serve --start-server`'s and a kept one, `"kind": "kept"`, serve it). A kept server of another
    Prefect version (an upgrade since it started) is not used."""
    found = _marker(home)
    if found is None or found.get("prefect", version("prefect")) != version("prefect"):
        return None
    # a marker left by a killed serve: its server died with it, and the port may serve another home now
    return found if _alive(int(found["pid"])) and healthy(found["api"]) else None


def keep_seconds() -> float:
    raw = os.environ.get(KEEP_ENV, "").strip()
    try:
        return float(raw) if raw else DEFAULT_KEEP_S
    except ValueError:
        raise KeepSettingError(f"{KEEP_ENV}={raw!r}: expected seconds (0: a temporary server per call)") from None


def _server_command(host: str, port: int, home: Path, ui: bool) -> tuple[list[str], dict]:
    """`prefect server start` through the orphan guard (it dies with the process that starts it).
    Port 0: the kernel picks one as the server binds it (`listening_port` reads it back)."""
    if ui and not port:
        raise ValueError("a Prefect server that serves the UI needs its port before it starts (the UI's API URL)")
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "true" if ui else "false",
           "PREFECT_SERVER_API_HOST": host, "PREFECT_SERVER_API_PORT": str(port)}
    if ui:  # the UI calls the API it was served with, not 4200 (its default): on another port it
        # would show "can't connect", or another server's runs
        env["PREFECT_UI_API_URL"] = f"http://{host}:{port}/api"
    env.pop("PREFECT_API_URL", None)
    prefect = Path(sys.executable).with_name("prefect")
    return [sys.executable, "-m", "stages.launch.orphan_guard", str(prefect), "server", "start",
            "--host", host, "--port", str(port)], env


def _wait_listening(host: str, proc: subprocess.Popen, deadline: float, log_path: Path) -> str:
    """The API URL of a server started on port 0, once it listens."""
    while (port := listening_port(proc.pid, host)) is None:
        if proc.poll() is not None or time.time() > deadline:
            raise ServerDidNotStart(f"prefect server did not start; see {log_path}")
        time.sleep(0.3)
    return f"http://{host}:{port}/api"


def _wait_healthy(api: str, proc: subprocess.Popen, deadline: float, log_path: Path) -> None:
    while not healthy(api):
        if proc.poll() is not None or time.time() > deadline:
            raise ServerDidNotStart(f"prefect server did not start; see {log_path}")
        time.sleep(0.3)


@contextmanager
def local_server(host: str, port: int, home: Path, log_path: Path, timeout: float = 180,
                 ui: bool = True, shared: bool = False, meanwhile: Callable[[], object] | None = None) -> Iterator[str]:
    """`prefect server start` on host:port for the duration of the block; yields the API URL.
    Port 0 (a server without the UI): the kernel picks a free port, read back once it listens.
    `meanwhile` runs while a server it starts comes up (the caller's own imports take seconds too).

    The server runs in a session of its own, so a Ctrl-C to the terminal's process group reaches
    the CLI (which then stops cleanly, reporting to this server) and not the server; and it asks
    for a parent-death signal (`stages.launch.orphan_guard`), so a SIGKILLed CLI leaves no server
    behind. Servers sharing one Prefect home start one at a time: the first one migrates the
    database, and two migrations at once fail."""
    api = f"http://{host}:{port}/api"
    if port and healthy(api):  # already running (e.g. a second `make serve`): share it
        yield api
        return
    home.mkdir(parents=True, exist_ok=True)
    cmd, env = _server_command(host, port, home, ui)
    with FileLock(str(home / "server-start.lock")):
        # a new home starts from the database an earlier server of this Prefect version built (its
        # migrations are most of a first call's server start); a server that builds one leaves it
        building = not (home / prefect_database.DATABASE).exists() and not prefect_database.seed(home, env)
        with open(log_path, "a") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=str(Path(__file__).resolve().parents[2]))
        try:
            deadline = time.time() + timeout
            if meanwhile is not None:
                meanwhile()
            if not port:
                api = _wait_listening(host, proc, deadline, log_path)
            _wait_healthy(api, proc, deadline, log_path)
        except BaseException:
            _stop(proc)
            raise
        if building:
            prefect_database.keep_template(home, env)
    marker = home / RUNNING_SERVER
    before = _marker(home) if shared else None  # a kept server's, announced again once this one stops
    ours = {"api": api, "pid": proc.pid}
    if shared:  # announced for other CLI calls on this home; a temporary server dies with its CLI
        marker.write_text(json.dumps(ours))
    try:
        yield api
    finally:
        if shared and _marker(home) == ours:
            if before is not None and before.get("kind") == "kept" and _alive(int(before["pid"])):
                marker.write_text(json.dumps(before))
            else:
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
    """A Prefect server for one CLI call (what Prefect's own temporary server does, but surviving a
    Ctrl-C to the terminal and dying with the CLI)."""
    with local_server("127.0.0.1", 0, home, home / "temporary-server.log", ui=False, meanwhile=meanwhile) as api:
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


# --------------------------------------------------------------------------- the kept server


@contextmanager
def lease(home: Path) -> Iterator[None]:
    """Held (shared) for a whole CLI call: a kept server does not stop while any call holds it.
    Blocks for the moment a keeper that is stopping holds it exclusively."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / LEASE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def start_kept_server(home: Path, keep_s: float, meanwhile: Callable[[], object] | None = None,
                      timeout: float = 180) -> str:
    """Starts a keeper (detached, in a session of its own: it outlives this process) and waits for
    its server; returns the API URL. Call it holding the `lease`, else the server may be gone
    before it is used. Another call on this home may have started one meanwhile: that one is used."""
    home.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home / "server-start.lock")):
        found = running_server(home)
        if found:
            return found["api"]
        log_path = home / KEPT_LOG
        with open(log_path, "a") as log:
            proc = subprocess.Popen([sys.executable, "-m", "flows.servers.prefect_server", "keep", "--home", str(home),
                                     "--port", str(free_port()), "--idle", str(keep_s)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=str(Path(__file__).resolve().parents[2]))
        if meanwhile is not None:
            meanwhile()
        deadline = time.time() + timeout
        while True:
            found = _marker(home)
            if found is not None and int(found["pid"]) == proc.pid and healthy(found["api"]):
                return found["api"]
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise ServerDidNotStart(f"prefect server did not start; see {log_path}")
            time.sleep(0.2)


def _keepers(home: Path) -> list[int]:
    """The pids of the keepers running on this Prefect home, found by their command line
    (`python -m flows.servers.prefect_server keep --home HOME ...`), whatever the marker says now."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info["cmdline"] or []
        if "flows.servers.prefect_server" not in argv:
            continue
        rest = argv[argv.index("flows.servers.prefect_server") + 1:]
        if rest[:1] != ["keep"] or "--home" not in rest[:-1]:
            continue
        try:
            theirs = Path(proc.cwd()) / rest[rest.index("--home") + 1]  # a relative home is the keeper's cwd's
        except psutil.Error:  # it ended meanwhile, or is another user's
            continue
        if theirs.resolve() == home.resolve() and _alive(proc.info["pid"]):
            found.append(proc.info["pid"])
    return found


def stop_kept_server(home: Path, timeout: float = 60) -> str | None:
    """Stops the kept server on this home now (SIGTERM to its keeper, which stops the server and
    removes its marker); returns its API URL, or None when none runs. The keeper is found by its
    process, not by the marker alone: a `serve --start-server` on the same home writes its own marker
    over the kept server's and removes it when it stops, while the kept server goes on listening.
    A `serve --start-server` server is not a kept one and is left alone."""
    found = _marker(home)
    if found is not None and found.get("kind") == "kept" and _alive(int(found["pid"])):
        keepers = {int(found["pid"]): found["api"]}
    else:
        keepers = {}
    for pid in _keepers(home):
        if pid not in keepers:
            port = listening_port(pid)
            keepers[pid] = f"http://127.0.0.1:{port}/api" if port else f"(keeper pid {pid})"
    if not keepers:
        return None
    for pid in keepers:
        os.kill(pid, signal.SIGTERM)
    deadline = time.time() + timeout
    while any(_alive(pid) for pid in keepers) and time.time() < deadline:
        time.sleep(0.2)
    left = [pid for pid in keepers if _alive(pid)]
    if left:
        raise RuntimeError(f"the kept server's keeper (pid {left[0]}) did not stop within {timeout:g} s")
    return ", ".join(keepers.values())


def keep(home: Path, port: int, idle_s: float) -> int:
    """The keeper: runs a server until nobody has held the lease for `idle_s` seconds, the Prefect
    home is gone, or it is told to stop (SIGTERM/SIGINT)."""
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stopping.append(True))
    marker = home / RUNNING_SERVER
    ours: dict = {}
    proc = None
    try:
        proc, api = _start_ui_server(home, port, time.time() + 180)
        ours = {"api": api, "pid": os.getpid(), "kind": "kept", "prefect": version("prefect"), "idle_s": idle_s}
        tmp = home / f".{RUNNING_SERVER}.{os.getpid()}"
        tmp.write_text(json.dumps(ours))
        tmp.replace(marker)
        print(f"kept server {api} up; stops after {idle_s:g} s without a CLI call", flush=True)
        last_used = time.monotonic()
        with open(home / LEASE, "a+") as f:
            while not stopping and proc.poll() is None and home.is_dir():
                time.sleep(1)
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a CLI call is running on it
                    last_used = time.monotonic()
                    continue
                try:
                    if time.monotonic() - last_used >= idle_s:
                        _forget(marker, ours)  # under the lock: a call that comes next starts its own
                        print(f"idle for {idle_s:g} s: stopping", flush=True)
                        break
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
    except ServerDidNotStart as e:
        print(e, flush=True)
        return 1
    finally:
        if ours:
            _forget(marker, ours)
        if proc is not None and proc.poll() is None:
            _stop(proc)
    return 0


def _start_ui_server(home: Path, port: int, deadline: float, tries: int = 3) -> tuple[subprocess.Popen, str]:
    """The keeper's server, which serves the UI (the "View at" links of the runs on it, and `sftflow
    ui`, open while it runs), and its API URL. The UI is given that URL when it starts, so the port
    is picked before (not `--port 0`), and another process may take it first: the server then exits
    at once ("Port N is already in use") and is started again on another free port."""
    # start_kept_server holds the home's start lock meanwhile: seeding it is as safe as in local_server
    building = not (home / prefect_database.DATABASE).exists() and not prefect_database.seed(home, os.environ)
    for attempt in range(tries):
        api = f"http://127.0.0.1:{port}/api"
        cmd, env = _server_command("127.0.0.1", port, home, ui=True)
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        try:
            _wait_healthy(api, proc, deadline, home / KEPT_LOG)
        except ServerDidNotStart:
            if proc.poll() is None:  # still starting at the deadline
                _stop(proc)
                raise
            if attempt == tries - 1 or not port_taken(port):
                raise
        else:
            if listening_port(proc.pid) == port:  # not another process's server answering on it
                if building:
                    prefect_database.keep_template(home, env)
                return proc, api
            _stop(proc)
            if attempt == tries - 1:
                raise ServerDidNotStart(f"port {port} is another server's; see {home / KEPT_LOG}")
        print(f"port {port} was taken before the server bound it: trying another", flush=True)
        port = free_port()
    raise AssertionError("unreachable")


def _forget(marker: Path, ours: dict) -> None:
    """Removes the marker if it still names this keeper (a `serve --start-server` may own it now)."""
    if _marker(marker.parent) == ours:
        marker.unlink(missing_ok=True)


# --------------------------------------------------------------------------- a CLI call's server


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def prefect_api(home: Path, meanwhile: Callable[[], object] | None = None,
                say: Callable[[str], None] = _to_stderr) -> Iterator[str]:
    """The Prefect API a CLI call runs its flow on, for the whole block; yields its URL.

    PREFECT_API_URL, when set, is used as it is: nothing is started, held or changed. Otherwise,
    holding the `lease` on the Prefect home `home` for the whole block: a server already running
    on it (`running_server`), else a kept one (`start_kept_server`; `say` tells where and for how
    long), else, with `SFTFLOW_KEEP_SERVER=0`, a `temporary_server`. Inside the block
    PREFECT_API_URL names it, in the environment (child processes) and in Prefect's settings
    (already loaded), and TEMPORARY_SERVER_ENV is set when it serves no UI (no links to pages
    nobody serves); both are restored when the server is done. `meanwhile` runs while a server
    starts (the caller's imports of Prefect and the flow take seconds too).

    Raises KeepSettingError (a bad SFTFLOW_KEEP_SERVER, before anything starts) and
    ServerDidNotStart."""
    preset = os.environ.get("PREFECT_API_URL")
    if preset:
        yield preset
        return
    keep_s = keep_seconds()
    with lease(home):  # a kept server stays up while this call runs
        found = running_server(home)
        if found:
            say(f"using the running Prefect server at {found['api']}")
            server = nullcontext(found["api"])
        elif keep_s > 0:
            api = start_kept_server(home, keep_s, meanwhile=meanwhile)
            say(f"started a Prefect server at {api} for this and later runs; it stops after "
                f"{keep_s:g} s unused ({KEEP_ENV}=0: a temporary server per call)")
            server = nullcontext(api)
        else:
            server = temporary_server(home, meanwhile=meanwhile)
        ui = found is not None or keep_s > 0  # a running or kept server serves the UI, a temporary one none
        saved = {name: os.environ.get(name) for name in ("PREFECT_API_URL", "PREFECT_UI_URL", TEMPORARY_SERVER_ENV)}
        try:
            with server as api:
                from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings
                os.environ["PREFECT_API_URL"] = api
                updates = {PREFECT_API_URL: api}
                if not ui:  # no "View at" links (Prefect prints none with an empty UI URL) to pages nobody serves
                    os.environ[TEMPORARY_SERVER_ENV] = "1"
                    os.environ["PREFECT_UI_URL"] = ""
                    updates[PREFECT_UI_URL] = ""
                with temporary_settings(updates=updates):
                    yield api
        finally:  # after the server is done: a temporary one drains Prefect's queues to it first
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.servers.prefect_server",
                                 description="internal: the kept server's keeper")
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("keep")
    k.add_argument("--home", type=Path, required=True)
    k.add_argument("--port", type=int, required=True)
    k.add_argument("--idle", type=float, required=True)
    args = ap.parse_args()
    return keep(args.home, args.port, args.idle)


if __name__ == "__main__":
    sys.exit(main())
