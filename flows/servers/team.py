"""A team's setup on one machine, up and down with one command: PostgreSQL holding Prefect's and
MLflow's stores, `prefect server start` and `mlflow server` on it, a `process` work pool and N
`prefect worker start --limit 1`, each in a working folder of its own, all sharing one artifacts folder.

    python -m flows.servers.team up   --root DIR [--workers N] [--pool NAME] [--config configs/default.yaml]
    python -m flows.servers.team down --root DIR      # stops everything `up` started; idempotent
    python -m flows.servers.team status --root DIR    # what runs, its URLs

`up` lays out DIR as

    DIR/postgres/data     the cluster (initdb once; `up` after `down` starts it again, history kept)
    DIR/prefect/home      the Prefect server's home (its database is PostgreSQL's `prefect`)
    DIR/mlartifacts       what the MLflow server stores for runs and models (`--artifacts-destination`)
    DIR/artifacts         the stage folders every worker shares (the config's `artifacts_dir`)
    DIR/workers/wK        worker K's working folder and Prefect home
    DIR/logs/*.log        one log per process
    DIR/team.yaml         the config given (`--config`) with artifacts_dir and registry.tracking_uri set
    DIR/env.sh            `source` it: PREFECT_API_URL and MLFLOW_TRACKING_URI of this setup
    DIR/team.json         the URLs, ports and processes (pid, start time); readable by the owner only

Workers send a heartbeat per flow run every 30 s, and `up` installs a Prefect automation that sets Crashed a
flow run that sent none for 90 s (its worker or machine died: SIGKILL leaves nobody to report a state), so a
new run of the config can resume its training (bench/team_faults.py measures it). `restart_mlflow`,
`restart_postgres` and `start_worker_again` are the fault helpers of that bench.

Every server listens on `--host` (127.0.0.1 unless told), PostgreSQL on 127.0.0.1 with a password
generated at initdb. Each process runs in a session (process group) of its own, so it outlives `up`
and `down` stops it whole. As root, PostgreSQL runs as the `postgres` user (initdb refuses root),
which must be able to enter DIR.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

from flows.servers.prefect_server import free_port, healthy, listening_port

ROOT = Path(__file__).resolve().parents[2]
DB_USER = "sftflow"
DATABASES = ("prefect", "mlflow")
STATE = "team.json"
START_TIMEOUT_S = 240.0  # Prefect's first start migrates a fresh database: ~1 min on 2 busy cores
# A flow run whose machine dies (its worker and every process under it SIGKILLed) sends no final state:
# without more it stays Running forever. Each flow run sends a heartbeat event every HEARTBEAT_S
# (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, set on every worker: Prefect's minimum, 30 s; its default is 180),
# and `up` installs the automation Prefect documents for zombie flow runs: a run that sent a heartbeat
# and then neither another one nor a final state within ZOMBIE_AFTER_S is set Crashed.
HEARTBEAT_S = 30
ZOMBIE_AFTER_S = 90
ZOMBIE_AUTOMATION = "sftflow: crash flow runs that stopped sending heartbeats"


class TeamError(RuntimeError):
    """Something `up` needs is missing or did not start; the message says what to do."""


# --------------------------------------------------------------------------- what the machine has


def postgres_bin() -> Path | None:
    """The folder with initdb and pg_ctl: $SFTFLOW_PG_BIN, else PATH, else Debian's /usr/lib/postgresql/*/bin
    (the newest)."""
    if os.environ.get("SFTFLOW_PG_BIN"):
        return Path(os.environ["SFTFLOW_PG_BIN"])
    found = shutil.which("initdb")
    if found:  # a link to the real folder (/usr/local/bin/initdb -> /usr/lib/postgresql/15/bin/initdb)
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                      key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(versions[-1]).parent if versions else None


def missing() -> list[str]:
    """What `up` needs and this machine lacks, one line each ([] when nothing)."""
    import importlib.util
    out = []
    if postgres_bin() is None:
        out.append("PostgreSQL's server binaries (initdb, pg_ctl): `apt-get install postgresql` or set SFTFLOW_PG_BIN")
    for module, why in (("psycopg", "MLflow's PostgreSQL driver"), ("asyncpg", "Prefect's PostgreSQL driver")):
        if importlib.util.find_spec(module) is None:
            out.append(f"{module} ({why}): `pip install -e '.[team]'`")
    if os.geteuid() == 0:
        try:
            import pwd
            pwd.getpwnam("postgres")
        except KeyError:
            out.append("a `postgres` user: as root, PostgreSQL runs as it (initdb refuses root)")
    return out


def _as_db_owner(cmd: list[str]) -> list[str]:
    """`cmd` as the user PostgreSQL runs as: `postgres` when this is root, else this user."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _chown_db(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


def _bin_path() -> str:
    """PATH with this interpreter's folder first: servers and workers start their own tools by name."""
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


# --------------------------------------------------------------------------- state


def _read_state(root: Path) -> dict | None:
    try:
        return json.loads((root / STATE).read_text())
    except (OSError, ValueError):
        return None


def _write_state(root: Path, state: dict) -> None:
    tmp = root / f".{STATE}.tmp"
    tmp.touch(mode=0o600)
    tmp.chmod(0o600)  # it holds the database password
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(root / STATE)


def _proc_record(proc: subprocess.Popen, log: Path) -> dict:
    return {"pid": proc.pid, "started": psutil.Process(proc.pid).create_time(), "log": str(log)}


def _alive(record: dict | None) -> bool:
    """The process `record` names runs still (the same one: a reused pid has another start time)."""
    if not record or not record.get("pid"):
        return False
    try:
        p = psutil.Process(int(record["pid"]))
        return p.status() != psutil.STATUS_ZOMBIE and abs(p.create_time() - float(record["started"])) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def _spawn(cmd: list[str], log: Path, env: dict, cwd: Path) -> subprocess.Popen:
    """`cmd` in a session of its own (it outlives `up`; `down` signals its process group), output to `log`."""
    with open(log, "a") as out:
        return subprocess.Popen(cmd, env=env, cwd=str(cwd), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _wait(what: str, ready, proc: subprocess.Popen | None, log: Path, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.time() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise TeamError(f"{what} exited (code {proc.returncode}); its log: {log}\n{_tail(log)}")
        if time.time() > deadline:
            raise TeamError(f"{what} did not answer within {timeout:g} s; its log: {log}\n{_tail(log)}")
        time.sleep(0.5)


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------- PostgreSQL


def _pg_conf(port: int) -> str:
    return ("# written by `python -m flows.servers.team up` at every start\n"
            "listen_addresses = '127.0.0.1'\n"
            f"port = {port}\n"
            "unix_socket_directories = ''\n"  # TCP only: no socket folder to own (/var/run/postgresql)
            "max_connections = 200\n")  # two servers' pools, each flow run's clients


def _run(cmd: list[str], what: str, env: dict | None = None) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise TeamError(f"{what} failed ({' '.join(cmd[:6])} ...): {(proc.stderr or proc.stdout).strip()[-800:]}")
    return proc.stdout


def start_postgres(root: Path, say) -> dict:
    """Initializes the cluster under root/postgres/data once, starts it on a free loopback port and creates
    the `prefect` and `mlflow` databases if missing; returns {"port", "password", "data", "pid", ...}."""
    pg = postgres_bin()
    assert pg is not None
    home = root / "postgres"
    data, secret = home / "data", home / "password"
    home.mkdir(parents=True, exist_ok=True)
    _chown_db(home)
    home.chmod(0o700)
    if not (data / "PG_VERSION").is_file():
        password = secrets.token_urlsafe(18)
        secret.write_text(password + "\n")
        secret.chmod(0o600)
        _chown_db(secret)
        say(f"initdb {data}")
        try:
            _run(_as_db_owner([str(pg / "initdb"), "-D", str(data), "-U", DB_USER, "--auth=scram-sha-256",
                               f"--pwfile={secret}", "-E", "UTF8", "--locale=C", "--no-instructions"]), "initdb")
        except TeamError as e:
            if os.geteuid() == 0 and "ermission denied" in str(e):
                raise TeamError(f"{e}\nas root, PostgreSQL runs as the `postgres` user, which must be able to enter "
                                f"every folder above {root} (chmod o+x, or pick a root under /tmp or /srv)") from None
            raise
        with open(data / "postgresql.conf", "a") as conf:
            conf.write("\ninclude_if_exists = 'sftflow.conf'\n")
    password = secret.read_text().strip()
    log = root / "logs" / "postgres.log"
    log.touch()
    _chown_db(log)
    for attempt in range(3):  # a port picked free may be taken before PostgreSQL binds it
        port = free_port()
        (data / "sftflow.conf").write_text(_pg_conf(port))
        _chown_db(data / "sftflow.conf")
        proc = subprocess.run(_as_db_owner([str(pg / "pg_ctl"), "start", "-w", "-t", "120", "-D", str(data),
                                            "-l", str(log)]), capture_output=True, text=True)
        if proc.returncode == 0:
            break
        if attempt == 2 or "already in use" not in _tail(log, 5):
            raise TeamError(f"PostgreSQL did not start: {(proc.stderr or proc.stdout).strip()[-400:]}; "
                            f"its log: {log}\n{_tail(log)}")
    pid = int((data / "postmaster.pid").read_text().split()[0])
    env = {**os.environ, "PGPASSWORD": password}
    have = _run([str(pg / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", DB_USER, "-d", "postgres", "-tAc",
                 "SELECT datname FROM pg_database"], "listing databases", env).split()
    for db in DATABASES:
        if db not in have:
            _run([str(pg / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", DB_USER, db], f"createdb {db}", env)
    return {"port": port, "password": password, "data": str(data), "bin": str(pg), "pid": pid,
            "started": psutil.Process(pid).create_time(), "log": str(log)}


def stop_postgres(root: Path, record: dict | None) -> bool:
    data = root / "postgres" / "data"
    if not (data / "postmaster.pid").is_file():
        return False
    pg = Path(record["bin"]) if record and record.get("bin") else postgres_bin()
    subprocess.run(_as_db_owner([str(pg / "pg_ctl"), "stop", "-w", "-t", "60", "-m", "fast", "-D", str(data)]),
                   capture_output=True, text=True)
    return True


def db_url(pg: dict, db: str, driver: str) -> str:
    return f"postgresql+{driver}://{DB_USER}:{pg['password']}@127.0.0.1:{pg['port']}/{db}"


# --------------------------------------------------------------------------- the servers and workers


def _base_env(root: Path) -> dict:
    return {**os.environ, "PATH": _bin_path(), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}


def start_prefect(root: Path, pg: dict, host: str) -> tuple[subprocess.Popen, str]:
    port = free_port(host if host != "0.0.0.0" else "127.0.0.1")
    api = f"http://{_public(host)}:{port}/api"
    home = root / "prefect" / "home"
    home.mkdir(parents=True, exist_ok=True)
    env = {**_base_env(root), "PREFECT_HOME": str(home), "PREFECT_API_DATABASE_CONNECTION_URL": db_url(pg, "prefect",
                                                                                                       "asyncpg"),
           "PREFECT_UI_API_URL": api, "PREFECT_SERVER_API_HOST": host, "PREFECT_SERVER_API_PORT": str(port)}
    env.pop("PREFECT_API_URL", None)
    cmd = [str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", host, "--port", str(port)]
    return _spawn(cmd, root / "logs" / "prefect-server.log", env, root / "prefect"), api


def start_mlflow(root: Path, pg: dict, host: str, workers: int, port: int = 0) -> subprocess.Popen:
    """`mlflow server` on `port`; 0: the kernel picks it as the server binds it (read back by `listening_port`)."""
    store = root / "mlartifacts"
    store.mkdir(exist_ok=True)
    cmd = [str(Path(sys.executable).with_name("mlflow")), "server",
           "--backend-store-uri", db_url(pg, "mlflow", "psycopg"), "--artifacts-destination",
           str(store), "--host", host, "--port", str(port), "--workers", str(workers)]
    env = {**_base_env(root), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner processes
    return _spawn(cmd, root / "logs" / "mlflow-server.log", env, root)


def _public(host: str) -> str:
    """The host others reach a server on: the machine's name when it listens on every address."""
    import socket
    return socket.gethostname() if host in ("0.0.0.0", "::") else host


def ensure_pool(api: str, pool: str) -> None:
    """The work pool (type process), created unless it exists: `prefect work-pool create` against `api`."""
    env = {**os.environ, "PREFECT_API_URL": api, "PATH": _bin_path()}
    prefect = str(Path(sys.executable).with_name("prefect"))
    if subprocess.run([prefect, "work-pool", "inspect", pool], env=env, capture_output=True).returncode == 0:
        return
    _run([prefect, "work-pool", "create", pool, "--type", "process"], f"creating work pool {pool}", env)


def ensure_zombie_automation(api: str) -> None:
    """The automation that sets Crashed a flow run whose heartbeats stopped (see ZOMBIE_AFTER_S), created
    unless one of its name exists."""
    def call(path: str, body: dict) -> object:
        req = urllib.request.Request(f"{api}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)
    if call("/automations/filter", {"automations": {"name": {"any_": [ZOMBIE_AUTOMATION]}}}):
        return
    final = [f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")]
    call("/automations/", {
        "name": ZOMBIE_AUTOMATION, "enabled": True,
        "description": f"a flow run that sent a heartbeat (every {HEARTBEAT_S} s) and then neither another one nor "
                       f"a final state within {ZOMBIE_AFTER_S} s: its worker or machine died "
                       "(python -m flows.servers.team)",
        "trigger": {"type": "event", "posture": "Proactive", "match": {"prefect.resource.id": "prefect.flow-run.*"},
                    "after": ["prefect.flow-run.heartbeat"], "expect": ["prefect.flow-run.heartbeat", *final],
                    "for_each": ["prefect.resource.id"], "threshold": 1, "within": ZOMBIE_AFTER_S},
        "actions": [{"type": "change-flow-run-state", "state": "CRASHED", "force": True,
                     "message": f"no heartbeat for {ZOMBIE_AFTER_S} s: the worker running it (or its machine) died"}]})


def start_worker(root: Path, api: str, pool: str, k: int) -> tuple[subprocess.Popen, dict]:
    cwd = root / "workers" / f"w{k}"
    (cwd / ".prefect").mkdir(parents=True, exist_ok=True)
    env = {**_base_env(root), "PREFECT_API_URL": api, "PREFECT_HOME": str(cwd / ".prefect"),
           "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}  # its flow runs inherit it
    name = f"{pool}-w{k}"
    cmd = [str(Path(sys.executable).with_name("prefect")), "worker", "start", "--pool", pool, "--type", "process",
           "--limit", "1", "--name", name]
    log = root / "logs" / f"worker-{k}.log"
    proc = _spawn(cmd, log, env, cwd)
    return proc, {**_proc_record(proc, log), "name": name, "cwd": str(cwd)}


def online_workers(api: str, pool: str) -> set[str]:
    """The names of the pool's workers the server has heard from (a heartbeat) and counts as online."""
    req = urllib.request.Request(f"{api}/work_pools/{pool}/workers/filter", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return {w["name"] for w in json.load(r) if w.get("status") == "ONLINE"}
    except (OSError, ValueError):
        return set()


def write_team_config(root: Path, config: Path, mlflow_url: str) -> Path:
    """root/team.yaml: `config` with artifacts_dir (root/artifacts) and registry.tracking_uri (the MLflow
    server) set. Its other relative paths (data) start from the folder `sftflow deploy` runs in."""
    raw = yaml.safe_load(config.read_text()) or {}
    raw["artifacts_dir"] = str(root / "artifacts")
    raw.setdefault("registry", {})["tracking_uri"] = mlflow_url
    out = root / "team.yaml"
    out.write_text(f"# {config.resolve()} for the team's setup in {root} "
                   "(written by `python -m flows.servers.team up`);\n"
                   "# relative paths start from the folder `sftflow deploy` runs in\n"
                   + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    (root / "artifacts").mkdir(exist_ok=True)
    return out


# --------------------------------------------------------------------------- up, down, status


def up(root: Path, workers: int = 2, pool: str = "team", config: Path = ROOT / "configs" / "default.yaml",
       host: str = "127.0.0.1", mlflow_workers: int = 2, say=print) -> dict:
    """Brings the setup up under `root`; returns what team.json holds. Already up: returns that, starting
    nothing. A start that fails stops what it had started."""
    root = root.resolve()
    state = _read_state(root)
    if state and status(root)["all_alive"]:
        say(f"already up: {root / STATE}")
        return state
    if state:
        raise TeamError(f"{root / STATE} names processes that are not all running: `python -m flows.servers.team down "
                        f"--root {root}` first")
    lacking = missing()
    if lacking:
        raise TeamError("this machine lacks: " + "; ".join(lacking))
    if not config.is_file():
        raise TeamError(f"--config {config}: no such file")
    t0 = time.time()
    (root / "logs").mkdir(parents=True, exist_ok=True)
    state = {"root": str(root), "pool": pool, "host": host}
    try:
        state["postgres"] = start_postgres(root, say)
        _write_state(root, state)
        say(f"PostgreSQL on 127.0.0.1:{state['postgres']['port']} (databases {', '.join(DATABASES)})")
        prefect, api = start_prefect(root, state["postgres"], host)
        state["prefect"] = {**_proc_record(prefect, root / "logs" / "prefect-server.log"), "api": api}
        mlflow = start_mlflow(root, state["postgres"], host, mlflow_workers)
        state["mlflow"] = _proc_record(mlflow, root / "logs" / "mlflow-server.log")
        _write_state(root, state)
        local_api = api.replace(_public(host), "127.0.0.1", 1) if host in ("0.0.0.0", "::") else api
        _wait("the Prefect server", lambda: healthy(local_api), prefect, root / "logs" / "prefect-server.log")
        say(f"Prefect server {api} (UI {api.removesuffix('/api')})")
        ports: list[int] = []
        _wait("the MLflow server to listen", lambda: ports.append(listening_port(mlflow.pid, host) or 0) or ports[-1],
              mlflow, root / "logs" / "mlflow-server.log")
        url, local_url = f"http://{_public(host)}:{ports[-1]}", f"http://127.0.0.1:{ports[-1]}"
        state["mlflow"]["url"] = url
        _wait("the MLflow server", lambda: healthy(local_url), mlflow, root / "logs" / "mlflow-server.log")
        say(f"MLflow server {url} (artifacts in {root / 'mlartifacts'})")
        ensure_pool(local_api, pool)
        ensure_zombie_automation(local_api)
        state["workers"] = []
        procs = []
        for k in range(1, workers + 1):
            proc, record = start_worker(root, api, pool, k)
            procs.append(proc)
            state["workers"].append(record)
        _write_state(root, state)
        names = {w["name"] for w in state["workers"]}

        def all_online() -> bool:
            for proc, w in zip(procs, state["workers"]):
                if proc.poll() is not None:
                    raise TeamError(f"worker {w['name']} exited; its log: {w['log']}\n{_tail(Path(w['log']))}")
            return names <= online_workers(local_api, pool)
        _wait(f"{workers} worker(s) on pool {pool}", all_online, None, root / "logs")
        say(f"{workers} worker(s) on work pool '{pool}' (--limit 1 each), in {root / 'workers'}")
        cfg = write_team_config(root, config, url)
        state.update({"config": str(cfg), "artifacts": str(root / "artifacts"),
                      "up_seconds": round(time.time() - t0, 1)})
        (root / "env.sh").write_text(f"export PREFECT_API_URL={api}\nexport MLFLOW_TRACKING_URI={url}\n")
        _write_state(root, state)
    except BaseException:
        say("stopping what started")
        down(root, say=lambda _: None)
        raise
    say(f"up in {state['up_seconds']:g} s; config {cfg}; `source {root / 'env.sh'}` sets PREFECT_API_URL and "
        "MLFLOW_TRACKING_URI")
    return state


def _stop_groups(records: list[dict], sig: signal.Signals, grace: float) -> list[dict]:
    """`sig` to the process group of each process `records` name (each in a session of its own: pgid = pid), all
    at once; after `grace` seconds SIGKILL to what is left of each group and of each one's process tree (a
    worker's flow runs start sessions of their own). Returns the records of those that were running."""
    running = [r for r in records if _alive(r)]
    trees = {}
    for r in running:
        try:  # taken before the signal: children reparent once their parent is gone
            trees[r["pid"]] = psutil.Process(int(r["pid"])).children(recursive=True)
        except psutil.Error:
            trees[r["pid"]] = []
        try:
            os.killpg(int(r["pid"]), sig)
        except ProcessLookupError:
            pass
    deadline = time.time() + grace
    while any(_alive(r) for r in running) and time.time() < deadline:
        time.sleep(0.2)
    for r in running:
        try:
            os.killpg(int(r["pid"]), signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in trees[r["pid"]]:
            try:
                p.kill()
            except psutil.Error:
                pass
    return running


def down(root: Path, say=print) -> list[str]:
    """Stops what `up` started under `root` (workers first, with the flow runs they run; the servers; then
    PostgreSQL) and removes team.json; returns what was stopped. Nothing running: does nothing."""
    root = root.resolve()
    state = _read_state(root) or {}
    stopped = []
    # SIGINT: a Prefect worker takes ~30 s over a SIGTERM; the flow runs it runs go with it
    stopped += [f"worker {w.get('name')}" for w in _stop_groups(state.get("workers", []), signal.SIGINT, 10)]
    servers = [{**state[k], "what": f"{k} server"} for k in ("mlflow", "prefect") if state.get(k)]
    stopped += [r["what"] for r in _stop_groups(servers, signal.SIGTERM, 20)]
    if stop_postgres(root, state.get("postgres")):
        stopped.append("PostgreSQL")
    (root / STATE).unlink(missing_ok=True)
    say(f"stopped: {', '.join(stopped)}" if stopped else f"nothing was running under {root}")
    return stopped


def restart_mlflow(root: Path, down_s: float = 0.0, say=print) -> float:
    """Stops the MLflow server, waits `down_s`, starts it again on the same port (clients keep their URL);
    returns the seconds it was unreachable. team.json names the new process."""
    root = root.resolve()
    state = _read_state(root) or {}
    if not state.get("mlflow"):
        raise TeamError(f"no MLflow server in {root / STATE}")
    url = state["mlflow"]["url"]
    port = int(url.rsplit(":", 1)[1])
    local = f"http://127.0.0.1:{port}"
    t0 = time.time()
    _stop_groups([state["mlflow"]], signal.SIGTERM, 20)
    time.sleep(max(0.0, down_s - (time.time() - t0)))
    log = root / "logs" / "mlflow-server.log"
    for attempt in range(20):  # the port may linger a moment after the old server let it go
        proc = start_mlflow(root, state["postgres"], state.get("host", "127.0.0.1"), 2, port)
        try:
            _wait("the MLflow server", lambda: healthy(local), proc, log, timeout=120)
            break
        except TeamError:
            if attempt == 19 or "already in use" not in _tail(log, 10).lower():
                raise
            time.sleep(1)
    state["mlflow"] = {**_proc_record(proc, log), "url": url}
    _write_state(root, state)
    say(f"MLflow server {url} again ({time.time() - t0:.0f} s unreachable)")
    return time.time() - t0


def restart_postgres(root: Path) -> float:
    """`pg_ctl restart -m fast` (every connection dropped); returns its seconds. team.json names the new
    postmaster."""
    root = root.resolve()
    state = _read_state(root) or {}
    pg = state["postgres"]
    data = Path(pg["data"])
    t0 = time.time()
    _run(_as_db_owner([str(Path(pg["bin"]) / "pg_ctl"), "restart", "-w", "-t", "120", "-m", "fast", "-D", str(data),
                       "-l", pg["log"]]), "pg_ctl restart")
    pid = int((data / "postmaster.pid").read_text().split()[0])
    state["postgres"] = {**pg, "pid": pid, "started": psutil.Process(pid).create_time()}
    _write_state(root, state)
    return time.time() - t0


def start_worker_again(root: Path, k: int) -> dict:
    """Worker k (1-based) started anew after it died, in its own folder; team.json names the new process."""
    root = root.resolve()
    state = _read_state(root) or {}
    proc, record = start_worker(root, state["prefect"]["api"], state["pool"], k)
    state["workers"][k - 1] = record
    _write_state(root, state)
    return record


def status(root: Path) -> dict:
    state = _read_state(root.resolve()) or {}
    alive = {"postgres": _alive(state.get("postgres")), "prefect": _alive(state.get("prefect")),
             "mlflow": _alive(state.get("mlflow")),
             "workers": [_alive(w) for w in state.get("workers", [])]}
    return {"state": state, "alive": alive,
            "all_alive": bool(state) and alive["postgres"] and alive["prefect"] and alive["mlflow"]
            and bool(alive["workers"]) and all(alive["workers"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.servers.team", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start PostgreSQL, the Prefect and MLflow servers, a work pool and its workers")
    u.add_argument("--root", type=Path, required=True, help="the folder everything lives in")
    u.add_argument("--workers", type=int, default=2, help="workers (each `--limit 1`: runs one flow run at a time)")
    u.add_argument("--pool", default="team", help="the work pool's name (type process; created if missing)")
    u.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml",
                   help="the config root/team.yaml is made from")
    u.add_argument("--host", default="127.0.0.1", help="where the Prefect and MLflow servers listen "
                   "(0.0.0.0: every address, for workers on other machines)")
    u.add_argument("--mlflow-workers", type=int, default=2, help="the MLflow server's worker processes")
    for name, what in (("down", "stop everything `up` started"), ("status", "what runs, and its URLs")):
        sub.add_parser(name, help=what).add_argument("--root", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "up":
            if args.workers < 1:
                raise TeamError("--workers must be at least 1")
            up(args.root, args.workers, args.pool, args.config, args.host, args.mlflow_workers)
        elif args.cmd == "down":
            down(args.root)
        else:
            found = status(args.root)
            s = found["state"]
            if not s:
                print(f"nothing is up under {args.root.resolve()}")
                return 1
            print(json.dumps({"prefect_api": s.get("prefect", {}).get("api"), "mlflow": s.get("mlflow", {}).get("url"),
                              "pool": s.get("pool"), "config": s.get("config"), "alive": found["alive"]}, indent=2))
            return 0 if found["all_alive"] else 1
    except TeamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
